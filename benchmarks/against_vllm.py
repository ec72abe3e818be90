"""FastGen against vLLM's CPU build, served: the same OpenAI streaming client, the same prompts, both servers on this
machine, closed loops at a few client counts, interleaved repeats.

    python -m fastgen.benchmarks.against_vllm --vllm-python ~/venv-vllm/bin/python --clients 1,4,16,64 \\
        --repeats 3 --json benchmarks/results/against_vllm/NAME.json
    python -m fastgen.benchmarks.against_vllm ... --system fastgen --system vllm \\
        --system 'fastgen-b256=--max-batch-tokens 256' --system 'vllm-b512=--max-num-batched-tokens 512'

A system is NAME[=EXTRA ARGS]: a NAME starting with `fastgen` is a `fastgen-deploy` deployment with its HTTP API
(its defaults: two replicas, the cores shared out between them; the extra arguments go to `fastgen-deploy start`,
e.g. `--replicas 1` for one replica on every core), one starting with `vllm` is vLLM's OpenAI api_server from
--vllm-python (vLLM's CPU build in its own environment, docs/benchmarking.md says how; the extra
arguments go to the api_server). Without extra arguments each runs its defaults, the row users meet first; FastGen's
default model is the embedded GGUF served in its own block types, vLLM's the Hugging Face folder FastGen converts
from it (the same weights, dequantized), in bfloat16.

Every system is started once and stays up; the runs go to one system at a time, in an order that rotates between
repeats and client counts so no system always runs first or after the same neighbour, each after the CPUs are quiet.
Each run's cores busy in the other servers' processes are recorded with it (an idle server should show none).
Every run sends fresh prompts (a header naming the repeat, the client count and the request, so no prefix cache
serves one run from another): real text, lengths uniform in --prompt-len, --gen tokens out (ignore_eos, min_tokens,
greedy), streamed, token counts corrected from the usage block.

Per run: requests/s, the paper's effective throughput (requests/s meeting the SLA: first token within
prompt_tokens / --prompt-rate s, then a span-16 moving average of at least --token-rate tokens/s, the paper's
figures scaled to a CPU), TTFT p50/p95 and inter-token p50/p95/p99. Reported: medians over repeats per system and
client count, and each FastGen system over each vLLM system, medians of the ratios within a repeat. --json writes
that summary with the command, commit, date and machine; every run's per-request records go to --raw
(benchmarks/out/...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..launch import processes
from .backends import OpenAIBackend, served_models
from .http_overhead import deploy_cli
from .loadgen import closed_loop
from .provenance import RAW_DIR, run_info
from .serving import CpuMeter, cpu_count, free_base_port, interrupt, process_cpu_seconds, wait_quiet
from .stats import SLA, summarize
from .workload import BenchRequest, corpus_ids, load_tokenizer

METRICS = ("throughput", "effective", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms")
SERVED_NAME = "smollm2-135m"
NAN = float("nan")
MAX_REPLICAS = 7  # ports are set aside for up to this many replicas (a system's --replicas)


@dataclass(frozen=True)
class System:
    name: str
    extra: tuple[str, ...]  # arguments beyond the defaults

    @property
    def kind(self) -> str:
        return "fastgen" if self.name.startswith("fastgen") else "vllm"


def parse_system(text: str) -> System:
    name, _, extra = text.partition("=")
    if not name.startswith(("fastgen", "vllm")):
        raise argparse.ArgumentTypeError(f"system {name!r}: its name starts with fastgen or vllm (e.g. fastgen-b256)")
    return System(name, tuple(shlex.split(extra)))


@dataclass
class Run:
    system: str
    clients: int
    repeat: int
    requests: int
    failed: int
    throughput: float  # completed requests / s
    effective: float  # requests / s meeting the SLA
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_p50_ms: float
    itl_p95_ms: float
    itl_p99_ms: float  # a schedule that stalls every stream now and then shows it here, not at p95
    token_throughput: float
    cpu: dict = field(default_factory=dict)  # cores busy: everyone's, this system's, the rest's
    errors: list[str] = field(default_factory=list)


# ---- the servers ----
@dataclass
class Server:
    system: System
    url: str
    pids: list[int]  # the server's processes (children included), for its CPU time
    model: str = SERVED_NAME  # the name requests carry
    rows: list[dict] = field(default_factory=list)  # FastGen's: `fastgen-deploy status --json`, a process each


def process_tree(pids: list[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out += [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    return out


@contextlib.contextmanager
def fastgen_server(system: System, args, home: Path) -> Iterator[Server]:
    name = f"{system.name}-{os.getpid()}"
    base = free_base_port(2 * MAX_REPLICAS + 1)  # the balancer and its replicas, their metrics ports, the HTTP API
    metrics, http = base + MAX_REPLICAS, base + 2 * MAX_REPLICAS
    start = ["start", "--name", name, "--model", args.model, "--port", str(base), "--metrics-port", str(metrics)]
    start += ["--http-port", str(http), *system.extra]
    try:
        done = deploy_cli(home, *start, timeout=args.start_timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{system.name}: fastgen-deploy start failed:\n{done.stdout}{done.stderr}")
        status = deploy_cli(home, "status", "--name", name, "--json")
        rows = json.loads(status.stdout)
        pids = [r["pid"] for r in rows if r.get("pid")]
        url = f"http://127.0.0.1:{http}"
        yield Server(system, url, process_tree(pids), served_models(url)[0], rows)
    finally:
        deploy_cli(home, "stop", "--name", name, "--timeout", "30")


@contextlib.contextmanager
def vllm_server(system: System, args, logs: Path) -> Iterator[Server]:
    """vLLM's api_server as docs/benchmarking.md starts it: tcmalloc and its bundled libiomp5 preloaded, OpenMP
    threads bound to every core, --kv-cache-gib of KV cache, prefix caching off unless the extra arguments say."""
    from ..replica.weights import resolve_model

    venv = Path(args.vllm_python).parent.parent
    preload = [p for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),) if p.exists()]
    preload += sorted(venv.rglob("libiomp5.so"))[:1]
    env = dict(os.environ) | {
        "LD_PRELOAD": ":".join(map(str, preload)),
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cpu_count() - 1}",
    }
    port = free_base_port(1)
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model(args.model))]
    argv += ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
    argv += ["--max-model-len", "2048"]
    argv += [] if "--enable-prefix-caching" in system.extra else ["--no-enable-prefix-caching"]
    log = logs / f"{system.name}.log"
    # From its environment's folder: in a FastGen checkout the kernels/ folder would shadow a package vLLM imports.
    proc = processes.start(system.name, [*argv, *system.extra], log, env=env, cwd=venv, new_session=True)
    with proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(lambda: lists_models(url), args.start_timeout, what="serving", interval=1.0)
        yield Server(system, url, process_tree([proc.pid]))


def lists_models(url: str) -> bool:
    try:
        return bool(served_models(url, timeout=2.0))
    except OSError:  # not listening yet
        return False


# ---- the runs ----
def prompts(args, n: int, tag: str) -> list[BenchRequest]:
    """n prompts of real text, lengths uniform in --prompt-len, each opened by a header naming tag and request."""
    ids, tok = corpus_ids(args.tokenizer), load_tokenizer(args.tokenizer)
    lo, hi = args.prompt_len
    rng = random.Random(f"{args.seed}-{tag}")
    out = []
    for i in range(n):
        header = tok.encode(f"[{tag} #{i}] ", add_special_tokens=False)
        start, length = rng.randrange(len(ids)), rng.randint(lo, hi)
        body = [ids[(start + j) % len(ids)] for j in range(length - len(header))]
        out.append(BenchRequest(i, header + body, args.gen))
    return out


def run_of(system: str, clients: int, repeat: int, records, sla: SLA, cpu: dict) -> Run:
    s = summarize(records, sla)
    ms = 1e3
    return Run(
        system,
        clients,
        repeat,
        s.requests,
        s.failed,
        s.throughput,
        s.effective[next(iter(s.effective))],
        s.ttft["p50"] * ms,
        s.ttft["p95"] * ms,
        s.inter_token["p50"] * ms,
        s.inter_token["p95"] * ms,
        s.inter_token["p99"] * ms,
        s.token_throughput,
        cpu,
        sorted({r.error for r in records if r.error})[:3],
    )


async def measure(servers: list[Server], args, raw: Path) -> list[Run]:
    sla = SLA(args.prompt_rate, (args.token_rate,))
    backends = {s.system.name: OpenAIBackend(s.url, s.model, max(args.clients), keepalive=True) for s in servers}
    runs: list[Run] = []
    try:
        for s in servers:  # warm every server (first batches, connections); not recorded
            await closed_loop(backends[s.system.name], prompts(args, 8, f"warm-{s.system.name}"), [], 4)
        for r in range(args.repeats):
            for i, clients in enumerate(args.clients):
                shift = (r + i) % len(servers)
                for server in servers[shift:] + servers[:shift]:
                    name = server.system.name
                    tag = f"{name}-r{r}-c{clients}"
                    n = args.requests_per_client * clients + args.requests_extra
                    wait_quiet(args.quiet_cores, 300.0)
                    others = [p for s in servers if s is not server for p in s.pids]
                    t0, others0 = time.monotonic(), process_cpu_seconds(others)
                    with CpuMeter(server.pids) as meter:
                        records = await closed_loop(
                            backends[name], prompts(args, n, tag), prompts(args, clients, tag + "-w"), clients
                        )
                    idle = (process_cpu_seconds(others) - others0) / (time.monotonic() - t0)
                    cpu = meter.result | {"other_servers_cores": idle}
                    run = run_of(name, clients, r, records, sla, cpu)
                    runs.append(run)
                    (raw / f"{tag}.json").write_text(json.dumps([x.to_json() for x in records]))
                    print(
                        f"repeat {r} clients {clients:>3} {name:<12} {run.throughput:.3f} req/s, effective "
                        f"{run.effective:.3f}, TTFT p50/p95 {run.ttft_p50_ms:.0f}/{run.ttft_p95_ms:.0f} ms, "
                        f"inter-token p50/p95/p99 {run.itl_p50_ms:.0f}/{run.itl_p95_ms:.0f}/{run.itl_p99_ms:.0f} ms, "
                        f"{run.failed} failed" + (f" ({run.errors[0]})" if run.errors else ""),
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for b in backends.values():
            await b.close()
    return runs


# ---- the figures ----
def medians(runs: list[Run]) -> dict[str, dict[str, dict[str, float]]]:
    """system -> clients -> each metric's median over repeats."""
    cells: dict[str, dict[str, list[Run]]] = {}
    for run in runs:
        cells.setdefault(run.system, {}).setdefault(str(run.clients), []).append(run)
    return {
        system: {
            c: {k: statistics.median(getattr(x, k) for x in rs) for k in METRICS}
            | {"repeats": len(rs), "failed": sum(x.failed for x in rs)}
            for c, rs in by_clients.items()
        }
        for system, by_clients in cells.items()
    }


def ratios(runs: list[Run]) -> dict[str, dict[str, dict[str, float]]]:
    """ "FASTGEN/VLLM" -> clients -> per metric, the median over repeats of FastGen's figure over vLLM's in the same
    repeat (above 1 is better for FastGen on throughputs, below 1 on times)."""
    by: dict[tuple[str, int, int], Run] = {(r.system, r.clients, r.repeat): r for r in runs}
    systems = sorted({r.system for r in runs})
    out: dict = {}
    for f in (s for s in systems if s.startswith("fastgen")):
        for v in (s for s in systems if s.startswith("vllm")):
            pair = out.setdefault(f"{f}/{v}", {})
            for clients in sorted({r.clients for r in runs}):
                cells = [
                    (by[f, clients, r], by[v, clients, r])
                    for r in sorted({r.repeat for r in runs})
                    if (f, clients, r) in by and (v, clients, r) in by
                ]
                if cells:
                    pair[str(clients)] = {
                        k: statistics.median(getattr(a, k) / getattr(b, k) if getattr(b, k) else NAN for a, b in cells)
                        for k in METRICS
                    }
    return out


def markdown(m: dict, rat: dict) -> str:
    lines = [
        "| clients | system | req/s | effective req/s | TTFT p50 / p95 (ms) | inter-token p50 / p95 / p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for clients in sorted({c for by in m.values() for c in by}, key=int):
        for system, by in m.items():
            x = by.get(clients)
            if x is None:
                continue
            failed = f" ({x['failed']} failed)" if x["failed"] else ""
            lines.append(
                f"| {clients} | {system}{failed} | {x['throughput']:.3f} | {x['effective']:.3f} | "
                f"{x['ttft_p50_ms']:.0f} / {x['ttft_p95_ms']:.0f} | "
                f"{x['itl_p50_ms']:.0f} / {x['itl_p95_ms']:.0f} / {x['itl_p99_ms']:.0f} |"
            )
    lines += [
        "",
        "| pair | clients | req/s | effective | TTFT p50 | TTFT p95 | inter-token p50 | p95 | p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pair, by in rat.items():
        for clients, x in by.items():
            lines.append(f"| {pair} | {clients} | " + " | ".join(f"{x[k]:.2f}×" for k in METRICS) + " |")
    return "\n".join(lines)


# ---- command line ----
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.against_vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--system",
        type=parse_system,
        action="append",
        default=None,
        help="NAME[=EXTRA ARGS], repeatable (default: fastgen and vllm, each with its defaults)",
    )
    p.add_argument("--vllm-python", default=str(Path.home() / "venv-vllm" / "bin" / "python"))
    p.add_argument("--model", default="smollm2-135m", help="FastGen's --model; vLLM gets its Hugging Face folder")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 4, 16, 64])
    p.add_argument("--requests-per-client", type=int, default=4, help="requests per run: this x clients + extra")
    p.add_argument("--requests-extra", type=int, default=16)
    p.add_argument("--prompt-len", type=lambda s: tuple(int(x) for x in s.split("-")), default=(250, 450))
    p.add_argument("--gen", type=int, default=64, help="tokens out per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-rate", type=float, default=100.0, help="SLA: prompt tokens/s to the first token")
    p.add_argument("--token-rate", type=float, default=2.0, help="SLA: tokens/s after it")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--quiet-cores", type=float, default=0.7, help="wait until fewer cores are busy (0: don't)")
    p.add_argument("--json", type=Path, default=None, help="the summary (e.g. benchmarks/results/against_vllm/X.json)")
    p.add_argument("--raw", type=Path, default=None, help="every run's records (default: benchmarks/out/...)")
    args = p.parse_args(argv)
    args.argv = argv
    args.system = args.system or [System("fastgen", ()), System("vllm", ())]
    if any(s.kind == "vllm" for s in args.system) and not Path(args.vllm_python).exists():
        p.error(f"--vllm-python {args.vllm_python} does not exist (docs/benchmarking.md installs vLLM's CPU build)")
    from ..replica.weights import resolve_model

    args.tokenizer = str(resolve_model(args.model))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)  # unwinds through the servers' context managers, which stop them
    raw = args.raw or RAW_DIR / "against_vllm" / (args.json.stem if args.json else time.strftime("%Y%m%d-%H%M%S"))
    raw.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="fastgen-against-vllm-"))
    with contextlib.ExitStack() as stack:
        servers = []
        for system in args.system:
            started = time.monotonic()
            make = fastgen_server(system, args, home) if system.kind == "fastgen" else vllm_server(system, args, raw)
            servers.append(stack.enter_context(make))
            print(f"{system.name} up in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        started = time.monotonic()
        runs = asyncio.run(measure(servers, args, raw))
        wall = time.monotonic() - started
    m, rat = medians(runs), ratios(runs)
    print(markdown(m, rat))
    if args.json:
        meta = run_info("against_vllm", args.argv) | {
            "systems": {s.name: list(s.extra) for s in args.system},
            "settings": {
                k: v
                for k, v in vars(args).items()
                if k in ("clients", "requests_per_client", "requests_extra", "prompt_len", "gen", "repeats", "seed")
                or k in ("prompt_rate", "token_rate", "kv_cache_gib", "model")
            },
            "wall_s": wall,
            "raw": str(raw.relative_to(Path.cwd())) if raw.is_relative_to(Path.cwd()) else raw.name,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {"meta": meta, "medians": m, "ratios": rat, "runs": [asdict(r) for r in runs]}
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if all(r.failed == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
