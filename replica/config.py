"""Engine settings: small frozen dataclasses, validated once at start-up (no torch).

The one home of the engine's names and defaults. Its flags, which the replica and `fastgen-deploy start` share, are
declared once in engine_args.py (EngineArgs), which builds these from them."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SCHEDULERS = ("splitfuse", "prefill_first", "static", "slo")
# What the slo scheduler does with new requests while even a decode-only step would break the token-rate floors:
# keep: admit them and carry on; refuse: answer RESOURCE_EXHAUSTED with a retry hint until the overload clears.
ADMISSIONS = ("keep", "refuse")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 where the hardware has it, else float32
DEVICES = ("auto", "cpu", "cuda")  # auto: cuda where a GPU is found, else cpu (a replica also takes cuda:N)
KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")  # auto: triton on CUDA, cpu elsewhere
LOAD_FORMATS = ("auto", "dummy")  # vLLM's names; dummy: random weights on the device, no checkpoint read
# vLLM's flag. auto: a checkpoint served in the format it ships in (a GGUF's block types on the CPU kernels, AWQ/GPTQ
# int4); none: dequantized to the dtype; int8: weight-only int8 of a float checkpoint; fp8: E4M3 weights and per-token
# activations (CUDA; the torch kernels on a CPU); awq, gptq: auto for a checkpoint that must be in that format (vLLM's
# names for them).
QUANTIZATIONS = ("auto", "none", "int8", "fp8", "awq", "gptq")
# Real-size architectures shipped as config.json only (no weights): `--model llama-3-8b --load-format dummy`.
PRESETS_DIR = Path(__file__).parent / "presets"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
# Bare K/M/G are binary, as in most serving tools' memory flags; KB/MB/GB are decimal.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


# A replica's watchdog and limits on what its streams and tensor-parallel peers may hold up (python -m fastgen.replica).
MAX_UNSENT_OUTPUTS = 1024  # outputs per completion a stream's reader may leave unsent before it is cancelled
STALL_TIMEOUT_S = 60.0  # requests waiting and no step completed for this long: health NOT_SERVING
MAX_FAILED_STEPS = 3  # engine steps failed in a row before the process exits for its supervisor to restart it
# A collective waiting for a tensor-parallel peer longer than this fails (the group restarts). Ranks > 0 still wait
# for rank 0's next batch without a deadline: an idle replica sends nothing for hours.
TP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SloConfig:
    """The service level the slo scheduler plans for, per request unless the request brings its own (request.Slo):
    the first token within prompt_tokens / prompt_rate seconds of arrival, and tokens at no less than token_rate per
    second (every span-16 moving average of inter-token gaps at most 1 / token_rate, as fastgen.server.sla scores)."""

    prompt_rate: float = 100.0  # P, prompt tokens/s (BENCHMARKS.md's CPU profile; the paper's GPUs: 512)
    token_rate: float = 4.0  # R, tokens/s: the floor every stream is held to
    admission: str = "keep"  # keep | refuse (ADMISSIONS)
    # A request's own Slo may only loosen these (a lower rate, a later first token) unless this is set: one stream
    # asking for 1e9 tokens/s would otherwise hold the replica overloaded and starve every other request's prompt.
    # Who may ask for more is the balancer's policy (per key); a replica behind one that decides it may turn this on.
    allow_client_tightening: bool = False

    def __post_init__(self) -> None:
        for name in ("prompt_rate", "token_rate"):
            value = getattr(self, name)
            if not 0.0 < value < float("inf"):
                raise ValueError(f"slo {name} must be a positive number, got {value}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"unknown admission {self.admission!r}: use one of {', '.join(ADMISSIONS)}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 512  # token budget of one forward pass
    max_seqs: int = 64  # sequences in one forward pass
    policy: str = "splitfuse"  # splitfuse | prefill_first | static | slo
    max_model_len: int = 2048  # prompt + generated tokens of one sequence
    # How many later requests may be admitted ahead of a waiting request that does not fit yet. Past this the queue
    # stops overtaking it, running sequences drain, and it gets its blocks: no starvation.
    max_overtakes: int = 16
    # Share of the KV pool that admission keeps free (at least one block) for running sequences to decode into, so
    # that admitting a prompt does not preempt a decode at the next step. Not applied when nothing runs.
    watermark: float = 0.01
    # The slo policy's targets; max_batch_tokens is then its cap on the tokens of one pass.
    slo: SloConfig = SloConfig()
    # (experts, experts per token) of a mixture-of-experts model, set from the model: the slo policy's step-time
    # model then counts the experts a step reads (replica/step_model.py); None: a dense model.
    moe_routing: tuple[int, int] | None = None
    # The longest attention window of the model's layers when every layer has one (Mistral v0.1), set from the model:
    # KV blocks wholly behind it are given back as sequences advance, so a sequence runs past its window in bounded
    # memory. None: some layer attends to the whole sequence (or a draft model reads every block).
    kv_window: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.policy!r}: use one of {', '.join(SCHEDULERS)}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {self.max_batch_tokens}")
        if self.max_seqs < 1:
            raise ValueError(f"max_seqs must be at least 1, got {self.max_seqs}")
        if self.max_seqs > self.max_batch_tokens:
            raise ValueError(
                f"max_seqs ({self.max_seqs}) exceeds max_batch_tokens ({self.max_batch_tokens}): every decoding "
                "sequence needs one token of the budget; lower max_seqs or raise max_batch_tokens"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_overtakes < 0:
            raise ValueError(f"max_overtakes must be >= 0, got {self.max_overtakes}")
        if self.kv_window is not None and self.kv_window < 1:
            raise ValueError(f"kv_window must be at least 1 token, got {self.kv_window}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark is a share of the KV pool in [0, 1), got {self.watermark}")


# A deployment's scheduler where none is named (fastgen-deploy, python -m fastgen.replica): slo, whose effective
# throughput held at or above every fixed budget's under load (benchmarks/RESULTS.md, section 12). An engine built in
# process (pipeline) keeps SchedulerConfig's splitfuse: nothing calibrates a step-time model there.
DEPLOYMENT_SCHEDULER = "slo"
# The slo scheduler's default cap on one pass: room for a whole prompt when no stream is short of time (under load
# the least slack keeps its steps far below it). A fixed schedule's default budget is SchedulerConfig's.
SLO_MAX_BATCH_TOKENS = 2048


def default_max_batch_tokens(policy: str) -> int:
    """--max-batch-tokens where none is given: the slo scheduler's cap, or a fixed schedule's budget."""
    return SLO_MAX_BATCH_TOKENS if policy == "slo" else SchedulerConfig.max_batch_tokens


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # exact pool size; None: derive from memory_bytes or device memory
    memory_bytes: int = 1 << 30  # KV pool budget when num_blocks is None and the pool is not sized from the device
    # On CUDA, with num_blocks None: the share of the device's total memory that weights, activations and the KV
    # pool may take together (vLLM's --gpu-memory-utilization); the pool gets what is left after a profiling pass.
    # None: memory_bytes. Ignored on CPU.
    gpu_memory_utilization: float | None = None
    # Automatic prefix caching: full KV blocks are kept by content after their sequence ends, and a request whose
    # prompt starts with cached blocks prefills only the rest (vLLM's --enable-prefix-caching, on by default there).
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.memory_bytes < 1:
            raise ValueError(f"kv cache memory must be positive, got {self.memory_bytes}")
        u = self.gpu_memory_utilization
        if u is not None and not 0.0 < u <= 1.0:
            raise ValueError(f"gpu memory utilization is a share of device memory in (0, 1], got {u}")


# Speculative decoding (vLLM's `speculative_config`), e.g.
#     {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# A speculating decode proposes up to num_speculative_tokens tokens (replica/ngram.py, replica/draft_model.py) and
# the next pass verifies them with the decode's own token, as a chunk of 1 + k tokens (docs/speculative.md).
# disable_by_batch_size (vLLM's key) turns proposals off for a step once that many sequences run: verifying then
# costs the batch more than it saves.
# ngram: proposals from the sequence's own tokens; draft_model: from a smaller model with the same vocabulary.
METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # rows of logits a decode may ask for in one pass
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: tokens proposed (and verified) per decode step at most
    prompt_lookup_max: int = 4  # the longest suffix of the sequence looked up earlier in it
    prompt_lookup_min: int = 1  # the shortest
    disable_by_batch_size: int | None = None  # no proposals in a step with at least this many sequences running
    model: str | None = None  # draft_model: the draft (an alias, Hugging Face folder or .gguf file, as --model)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config method draft_model needs a model: the draft's alias, folder or file")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config model is the draft of method draft_model: ngram takes none")
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_max", 1), ("prompt_lookup_min", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"speculative_config {name} must be an integer >= {low}, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max}): lower the min or raise the max"
            )
        off = self.disable_by_batch_size
        if off is not None and (not isinstance(off, int) or isinstance(off, bool) or off < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be an integer >= 1, got {off!r}")

    def speculates(self, running: int) -> bool:
        """Whether a step with `running` sequences proposes at all."""
        return self.disable_by_batch_size is None or running < self.disable_by_batch_size


def parse_speculative_config(value: str | Mapping | None) -> SpeculativeConfig | None:
    """A SpeculativeConfig from JSON text or a dict with vLLM's keys; None for None or "". Raises ValueError naming
    the key or value to change."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = [k for k in value if k not in _KEYS]
    if unknown:
        raise ValueError(f"unknown speculative_config key {unknown[0]!r}: use {', '.join(_KEYS)}")
    if "method" not in value:
        raise ValueError(f"speculative_config needs a method: one of {', '.join(METHODS)}")
    return SpeculativeConfig(**value)


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving (vLLM's flags): adapters in PEFT's format, chosen per request by name (docs/lora.md)."""

    enable_lora: bool = False
    # (name, folder) of the adapters known at start (--lora-modules name=path); more may be loaded at run time
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1  # adapters resident at once (weight slots); beyond it the least recently used is evicted
    max_lora_rank: int = 16  # the largest adapter rank a slot holds; an adapter of higher rank is refused

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names must be unique, got {', '.join(names)}")


def parse_lora_module(text: str) -> tuple[str, str]:
    """'name=path' (--lora-modules) -> (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path, got {text!r}")
    return name, path


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"  # alias, Hugging Face folder or .gguf file
    dtype: str | None = None  # float32 | bfloat16 | float16; None: bfloat16 where the hardware has it
    device: str = "cpu"
    kernels: str = "auto"  # auto | torch | cpu | triton
    load_format: str = "auto"  # auto: the checkpoint | dummy: random weights (any model, presets too)
    quantization: str = "auto"  # QUANTIZATIONS
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    max_model_len: int | None = None  # None: the model's own context
    default_max_new_tokens: int = 256  # used when a request leaves max_new_tokens at 0
    progress: bool = True  # show weight-loading progress
    # vLLM's name: no CUDA graphs. Otherwise, with graph-safe kernels (Triton), decode-only steps run over static
    # buffers padded to batch-size buckets, replayed from graphs captured at start-up on CUDA.
    enforce_eager: bool = False
    # vLLM's name: a mixture of experts' layers split by whole experts over the --tp ranks, not by each expert's
    # intermediate rows (replica/models/moe.py); dense models ignore it.
    enable_expert_parallel: bool = False
    # vLLM's name: speculative decoding (replica/speculative.py); None: off.
    speculative_config: SpeculativeConfig | None = None
    lora: LoraConfig = LoraConfig()  # multi-LoRA serving; off by default


def preset_path(model: str) -> Path | None:
    """The shipped config.json folder of a preset name such as 'llama-3-8b', or None."""
    folder = PRESETS_DIR / model
    return folder if model and "/" not in model and (folder / "config.json").is_file() else None


def parse_size(text: str) -> int:
    """Bytes in '512MiB', '2GiB', '1.5G', '1073741824'."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 512MiB, 2GiB or a number of bytes")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"size {text!r} is zero: give a positive size such as 512MiB")
    return value
