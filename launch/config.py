"""What a deployment is: its settings, their validation, its port layout and the command of every process.

Pure: no sockets, no processes, no torch (the CLI must answer instantly). The engine's settings, flags and defaults
are fastgen.replica.engine_args.EngineArgs (no torch either), which DeployConfig extends and a replica's command line
is written from.

Port layout of a deployment with N replicas (documented in the CLI's help):
    balancer   gRPC --port          metrics --metrics-port          HTTP (OpenAI API) --http-port (0: none)
    replica i  gRPC --port + 1 + i  metrics --metrics-port + 1 + i
With --tp K, rank 0 of replica i holds these ports; its other ranks listen on none, and meet rank 0 on a free
MASTER_PORT that the supervisor picks at every (re)start of the group.

On CUDA every replica process (every rank with --tp) gets a GPU of its own: R replicas x K ranks take R*K GPUs,
replica i rank r the (i*K + r)-th, through CUDA_VISIBLE_DEVICES, so each process sees one device, cuda:0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..replica.config import (
    ADMISSIONS,
    DEVICES,
    DTYPES,
    KERNEL_BACKENDS,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SCHEDULERS,
    LoraConfig,
    default_max_batch_tokens,
    parse_lora_module,
    parse_speculative_config,
    preset_path,
)
from ..replica.engine_args import EngineArgs, to_argv
from ..server.tls import TlsFiles

POLICIES = ("round_robin", "least_loaded", "prefix_aware")
# The balancer's (balancer/tools.py, balancer/reasoning.py; a test keeps them equal): the launcher imports no balancer.
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen3", "llama3_json", "mistral")
REASONING_PARSERS = ("", "deepseek_r1", "qwen3")  # "": off
DEFAULT_MODEL = EngineArgs.model
DEFAULT_HTTP_PORT = 8000  # vLLM's and the OpenAI clients' customary port
# The OpenAI API's key travels to the balancer in its environment, never on a command line (which `ps` shows) nor in
# config.json; the balancer (balancer/openai_api.py) reads the same variable.
API_KEY_ENV = "FASTGEN_API_KEY"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class DeployConfig(EngineArgs):
    """A deployment's settings: every replica's engine (EngineArgs, the flags python -m fastgen.replica takes too),
    and what only the deployment has."""

    name: str = "default"
    replicas: int = 2
    # least_loaded beat prefix_aware in every chat run that measured both (benchmarks/RESULTS.md, "Prefix caching")
    policy: str = "least_loaded"
    host: str = "127.0.0.1"
    port: int = 50050
    metrics_port: int = 9400
    http_port: int = DEFAULT_HTTP_PORT  # the balancer's OpenAI-compatible API; 0: none
    tool_call_parser: str = "auto"  # how the HTTP API finds tool calls with tool_choice auto: the model's family
    reasoning_parser: str = ""  # splits a reasoning model's <think> block into reasoning_content; "": off
    device: str = "auto"  # auto | cpu | cuda (the replica's default is cpu); start resolves auto to what it finds
    gpus: tuple[str, ...] = ()  # on CUDA, one per replica process in plan order, chosen by start (place)
    step_trace_dir: str | None = None  # each replica appends its steps' predicted and measured times to DIR/<id>.csv
    timeout: float = 600.0  # seconds for every process to become SERVING
    # Security (launch/certs.py): the internal token's file (start generates one into the state directory) and the
    # TLS files; with tls_ca the balancer and the replicas speak mutual TLS. Paths only: no secret in config.json.
    auth_token_file: str | None = None
    # One client API key a line: with several, each key is a tenant with a prefix cache of its own (balancer).
    api_keys_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    @property
    def batch_tokens(self) -> int:
        """The tokens of one pass each replica is given: --max-batch-tokens, else its scheduler's default."""
        return self.max_batch_tokens if self.max_batch_tokens is not None else default_max_batch_tokens(self.scheduler)


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a deployment. A replica is one process, or with tensor parallelism a group of `tp` processes
    that share `replica` and differ in `rank`: rank 0 ("replica") serves, the others ("tp_rank") listen on no port."""

    id: str  # unique in the deployment; names the log file: "balancer", "replica-0", "replica-0-rank-1"
    role: str  # "balancer" | "replica" | "tp_rank"
    port: int | None
    metrics_port: int | None
    argv: list[str] = field(default_factory=list)
    replica: str | None = None
    rank: int | None = None
    gpu: str | None = None  # its CUDA_VISIBLE_DEVICES entry on CUDA; None on CPU and for the balancer
    http_port: int | None = None  # the balancer's OpenAI-compatible API, when it serves one


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def default_threads(cores: int, replicas: int) -> int:
    return max(1, cores // max(1, replicas))


def grpc_ports(config: DeployConfig) -> list[int]:
    """Balancer first, then replica 0..N-1."""
    return [config.port + i for i in range(config.replicas + 1)]


def metrics_ports(config: DeployConfig) -> list[int]:
    return [config.metrics_port + i for i in range(config.replicas + 1)]


def http_ports(config: DeployConfig) -> list[int]:
    """The balancer's HTTP port, when it serves the OpenAI API."""
    return [config.http_port] if config.http_port else []


def looks_like_path(model: str) -> bool:
    return "/" in model or model.startswith(("~", ".")) or model.endswith(".gguf")


def validate(config: DeployConfig) -> list[str]:
    """Every problem with the settings, each saying what to change; empty when they are fine."""
    problems = _name_problems(config.name) + _count_problems(config) + _choice_problems(config)
    problems += _engine_problems(config) + _port_problems(config) + _sla_problems(config) + _lora_problems(config)
    problems += TlsFiles(config.tls_cert, config.tls_key, config.tls_ca).problems("server")
    if preset_path(config.model) is not None and config.load_format != "dummy":
        problems.append(
            f"--model {config.model} is a preset: its architecture ships without weights; pass --load-format dummy "
            "for random weights, or --model a Hugging Face folder with its weights"
        )
    if looks_like_path(config.model) and not Path(config.model).expanduser().exists():
        problems.append(
            f"--model {config.model}: no such file or folder; pass {DEFAULT_MODEL!r}, a Hugging Face folder "
            "(config.json + *.safetensors) or a .gguf file"
        )
    return problems


def _lora_problems(c: DeployConfig) -> list[str]:
    try:
        LoraConfig(c.enable_lora, tuple(map(parse_lora_module, c.lora_modules)), c.max_loras, c.max_lora_rank)
    except ValueError as exc:
        return [str(exc)]
    return []


def _name_problems(name: str) -> list[str]:
    if _NAME.match(name):
        return []
    return [
        f"--name {name!r}: use 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit "
        "(it names a folder)"
    ]


def _count_problems(c: DeployConfig) -> list[str]:
    checks = [
        (c.replicas >= 1, f"--replicas must be at least 1, got {c.replicas}"),
        (c.tp >= 1, f"--tp must be at least 1, got {c.tp}"),
        (c.threads >= 1, f"--threads must be at least 1, got {c.threads}"),
        (c.timeout > 0, f"--timeout must be positive seconds, got {c.timeout}"),
    ]
    return [message for ok, message in checks if not ok]


def _choice_problems(c: DeployConfig) -> list[str]:
    checks = [
        ("--policy", c.policy, POLICIES),
        ("--tool-call-parser", c.tool_call_parser, TOOL_CALL_PARSERS),
        ("--reasoning-parser", c.reasoning_parser, REASONING_PARSERS),
        ("--dtype", c.dtype, DTYPES),
        ("--scheduler", c.scheduler, SCHEDULERS),
        ("--admission", c.admission, ADMISSIONS),
        ("--device", c.device, DEVICES),
        ("--kernels", c.kernels, KERNEL_BACKENDS),
        ("--load-format", c.load_format, LOAD_FORMATS),
        ("--quantization", c.quantization, QUANTIZATIONS),
    ]
    return [f"{flag} {value!r}: use one of {', '.join(ok)}" for flag, value, ok in checks if value not in ok]


def _engine_problems(c: DeployConfig) -> list[str]:
    checks = [
        (c.batch_tokens >= 1, f"--max-batch-tokens must be at least 1, got {c.max_batch_tokens}"),
        (c.max_seqs >= 1, f"--max-seqs must be at least 1, got {c.max_seqs}"),
        (c.block_size >= 1, f"--block-size must be at least 1, got {c.block_size}"),
        (c.num_blocks is None or c.num_blocks >= 1, f"--num-blocks must be at least 1, got {c.num_blocks}"),
        (
            c.kv_cache_memory is None or c.kv_cache_memory >= 1,
            f"--kv-cache-memory must be positive, got {c.kv_cache_memory}",
        ),
        (
            0 < c.gpu_memory_utilization <= 1,
            f"--gpu-memory-utilization is a share of the device in (0, 1], got {c.gpu_memory_utilization}",
        ),
        (c.max_model_len is None or c.max_model_len >= 2, f"--max-model-len must be at least 2, got {c.max_model_len}"),
    ]
    problems = [message for ok, message in checks if not ok]
    try:
        parse_speculative_config(c.speculative_config)
    except ValueError as exc:
        problems.append(f"--speculative-config: {exc}")
    if 1 <= c.batch_tokens < c.max_seqs:
        # The engine refuses this too, but only after the model has loaded.
        problems.append(
            f"--max-seqs ({c.max_seqs}) exceeds --max-batch-tokens ({c.batch_tokens}): every decoding sequence "
            "needs one token of the budget; lower --max-seqs or raise --max-batch-tokens"
        )
    return problems


def _sla_problems(c: DeployConfig) -> list[str]:
    problems = [] if c.sla_prompt_rate > 0 else [f"--sla-prompt-rate must be positive, got {c.sla_prompt_rate}"]
    if not c.sla_token_rates or min(c.sla_token_rates) <= 0:
        problems.append(f"--sla-token-rate needs positive rates, got {' '.join(map(str, c.sla_token_rates))}")
    return problems


def _port_problems(c: DeployConfig) -> list[str]:
    n = max(1, c.replicas)
    problems = []
    for flag, base in (("--port", c.port), ("--metrics-port", c.metrics_port)):
        if base < 1 or base + n > 65535:
            problems.append(
                f"{flag} {base}: the deployment needs ports {base}..{base + n} (balancer + {n} replicas), "
                "which must lie within 1..65535"
            )
    overlap = set(grpc_ports(c)) & set(metrics_ports(c))
    if overlap:
        problems.append(
            f"--port {c.port} and --metrics-port {c.metrics_port} overlap (both need {min(overlap)}): the gRPC ports "
            f"are {c.port}..{c.port + n} and the metrics ports {c.metrics_port}..{c.metrics_port + n}"
        )
    if not 0 <= c.http_port <= 65535:
        problems.append(f"--http-port {c.http_port}: use a port in 1..65535, or 0 for no HTTP API")
    elif c.http_port in grpc_ports(c) + metrics_ports(c):
        problems.append(
            f"--http-port {c.http_port} is one of the deployment's other ports (gRPC {c.port}..{c.port + n}, metrics "
            f"{c.metrics_port}..{c.metrics_port + n}): choose another"
        )
    return problems


def gpus_needed(c: DeployConfig) -> int:
    return max(1, c.replicas) * max(1, c.tp)


def device_problems(c: DeployConfig, found: Sequence[str]) -> list[str]:
    """What stops the deployment from running on its device, given the GPUs found; each says what to change."""
    device = resolved_device(c, found)
    if device == "cpu":
        return []
    need = gpus_needed(c)
    processes = f"{c.replicas} replica(s) x --tp {c.tp}" if c.tp > 1 else f"{c.replicas} replica(s)"
    if not found:
        return [
            "--device cuda: no GPU found (nvidia-smi lists none, no /proc/driver/nvidia/gpus, or CUDA_VISIBLE_DEVICES "
            "is empty); use --device cpu, or --device auto to take GPUs where there are some"
        ]
    problems = []
    if need > len(found):
        problems.append(
            f"{processes} need {need} GPUs, one per process, and {len(found)} found ({', '.join(found)}): "
            f"lower --replicas or --tp so that replicas x tp <= {len(found)}, or use --device cpu"
        )
    if c.kernels == "cpu":
        problems.append("--kernels cpu runs on CPUs only: use --kernels auto, triton or torch on CUDA")
    return problems


def resolved_device(c: DeployConfig, found: Sequence[str]) -> str:
    return ("cuda" if found else "cpu") if c.device == "auto" else c.device


def place(c: DeployConfig, found: Sequence[str]) -> DeployConfig:
    """The settings with --device resolved and, on CUDA, the first replicas x tp GPUs found taken (device_problems
    must be empty)."""
    device = resolved_device(c, found)
    return replace(c, device=device, gpus=tuple(found[: gpus_needed(c)]) if device == "cuda" else ())


def connect_host(host: str) -> str:
    """Where a local client reaches a server bound to host (a wildcard bind is reached on loopback)."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)


def address(host: str, port: int) -> str:
    host = connect_host(host)
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def plan(config: DeployConfig, python: str) -> list[ProcessSpec]:
    """The balancer followed by the replicas (each rank of each, with --tp), with their commands."""
    groups = [replica_group(config, python, i) for i in range(config.replicas)]
    return [balancer_spec(config, python, [g[0] for g in groups])] + [spec for g in groups for spec in g]


def replica_group(c: DeployConfig, python: str, index: int) -> list[ProcessSpec]:
    """Replica i's processes: one, or with --tp K, K ranks with the same command (as torchrun runs them); rank 0
    serves on the replica's ports, the others only compute."""
    head = replace(replica_spec(c, python, index), gpu=gpu_of(c, index, 0))
    if c.tp == 1:
        return [head]
    ranks = [
        replace(
            head,
            id=f"{head.id}-rank-{r}",
            role="tp_rank",
            port=None,
            metrics_port=None,
            rank=r,
            gpu=gpu_of(c, index, r),
        )
        for r in range(1, c.tp)
    ]
    return [replace(head, rank=0)] + ranks


def gpu_of(c: DeployConfig, replica: int, rank: int) -> str | None:
    return c.gpus[replica * c.tp + rank] if c.gpus else None


def http_url(host: str, port: int) -> str:
    """Where clients reach the OpenAI-compatible API (the base URL the openai SDK takes)."""
    return f"http://{address(host, port)}/v1"


def device_env(spec: ProcessSpec) -> dict[str, str]:
    """The one GPU a process sees; nothing for a process without one."""
    return {} if spec.gpu is None else {"CUDA_VISIBLE_DEVICES": spec.gpu}


def rank_env(spec: ProcessSpec, tp: int, host: str, master_port: int) -> dict[str, str]:
    """torchrun's variables for one rank of a replica on this host; rank 0 hosts the rendezvous on master_port.
    A rank takes the visible device of its LOCAL_RANK (replica/tp_worker.py, rank_device); a rank with a GPU of its
    own sees only that one, so its LOCAL_RANK is 0."""
    return {
        "RANK": str(spec.rank),
        "WORLD_SIZE": str(tp),
        "LOCAL_RANK": "0" if spec.gpu is not None else str(spec.rank),
        "MASTER_ADDR": connect_host(host),
        "MASTER_PORT": str(master_port),
    }


# Engine settings every replica's command line spells out even at the replica's default, so that `ps`, the logs and
# the Kubernetes manifests show what a replica runs; the others appear only where they differ from it.
PINNED = (
    "model",
    "device",
    "kernels",
    "load_format",
    "quantization",
    "max_batch_tokens",
    "max_seqs",
    "block_size",
    "gpu_memory_utilization",
    "scheduler",
    "threads",
    "sla_prompt_rate",
    "sla_token_rates",
)


def replica_spec(c: DeployConfig, python: str, index: int) -> ProcessSpec:
    rid = f"replica-{index}"
    port, metrics_port = c.port + 1 + index, c.metrics_port + 1 + index
    argv = [python, "-m", "fastgen.replica", "--host", c.host, "--port", str(port), "--metrics-port", str(metrics_port)]
    argv += ["--replica-id", rid]
    if c.step_trace_dir is not None:
        argv += ["--step-trace", str(Path(c.step_trace_dir) / f"{rid}.csv")]
    # The budget as validated, rather than the replica's own resolution of None.
    argv += to_argv(replace(c, max_batch_tokens=c.batch_tokens), PINNED)
    argv += security_args(c, "replica")
    return ProcessSpec(id=rid, role="replica", port=port, metrics_port=metrics_port, argv=argv, replica=rid)


def balancer_spec(c: DeployConfig, python: str, replicas: list[ProcessSpec]) -> ProcessSpec:
    argv = [python, "-m", "fastgen.balancer", "--host", c.host, "--port", str(c.port)]
    argv += ["--metrics-port", str(c.metrics_port)]
    for r in replicas:
        argv += ["--replica", f"{r.replica}={address(c.host, r.port)}"]
    argv += ["--policy", c.policy]
    if c.max_model_len is not None:  # the balancer refuses longer prompts before it tokenizes them
        argv += ["--max-model-len", str(c.max_model_len)]
    if c.api_keys_file:
        argv += ["--api-keys-file", c.api_keys_file]
    if c.http_port:  # the API key, if any, comes through the environment (API_KEY_ENV)
        argv += ["--http-port", str(c.http_port), "--served-model-name", c.model]
        argv += ["--tool-call-parser", c.tool_call_parser]
        argv += ["--reasoning-parser", c.reasoning_parser] if c.reasoning_parser else []
    argv += security_args(c, "balancer")
    return ProcessSpec(
        id="balancer",
        role="balancer",
        port=c.port,
        metrics_port=c.metrics_port,
        argv=argv,
        http_port=c.http_port or None,
    )


def security_args(c: DeployConfig, role: str) -> list[str]:
    """The token's file (never the token: a command line shows in ps) and the TLS files. The balancer serves TLS
    whenever there is a certificate; the replicas only with a CA, which makes their calls mutual TLS."""
    argv = ["--auth-token-file", c.auth_token_file] if c.auth_token_file else []
    if c.tls_cert and (role == "balancer" or c.tls_ca):
        argv += ["--tls-cert", c.tls_cert, "--tls-key", c.tls_key]
    if c.tls_ca:
        argv += ["--tls-ca", c.tls_ca]
    return argv
