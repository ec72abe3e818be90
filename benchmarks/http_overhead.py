"""What the OpenAI-compatible HTTP API costs: the same closed-loop load sent to one deployment through gRPC straight
to its balancer and through the balancer's HTTP API (/v1/completions, streamed server-sent events), in interleaved
runs so machine noise hits both paths alike; medians over repeats and medians of the per-repeat differences.

    python -m fastgen.benchmarks.http_overhead --workload 300x64 --clients 1,2,4 --repeats 3 \\
        --json benchmarks/results/http_overhead.json
    python -m fastgen.benchmarks.http_overhead --grpc 127.0.0.1:50050 --http http://127.0.0.1:8000 ...  # running

Without --grpc/--http it starts its own deployment (`fastgen-deploy start --http-port ...`, one replica, a private
FASTGEN_HOME, free ports) and stops it afterwards. Both paths send the same kind of request: the prompt as token
ids, fixed lengths (every prompt exactly PROMPT tokens of real text, every generation exactly GEN tokens: greedy,
ignore_eos), fresh prompts for every run (a header naming path, repeat and client count opens each prompt, so a
prefix cache never serves one run from another). gRPC goes through the load generator's FastGenBackend (one
HTTP/2 channel), HTTP through its OpenAIBackend (the standard library's http.client, one thread per request in
flight, by default one kept-alive connection per client as the openai SDK pools them; `--http-connection new`
opens one per request). What HTTP adds is then: JSON in and out, the SSE framing, text (not ids) per event, and
that client's own cost (threads instead of the event loop), measured together, as a user of the API pays them.

Per run (path x clients x repeat): TTFT p50, end-to-end p50, inter-token p50, throughput (completed requests /
span). Reported per path and client count: the median over repeats (with its range); and paired, per repeat:
HTTP minus gRPC at p50 (ms) and the throughput ratio HTTP / gRPC, medians over repeats. --json writes that summary
with the command, commit, date, machine and load (benchmarks/provenance.py); every run's per-request records go
to --raw (default benchmarks/out/http_overhead/<the summary's name>, ignored by git).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .backends import FastGenBackend, OpenAIBackend, served_models
from .loadgen import closed_loop, fixed_requests
from .provenance import RAW_DIR, run_info
from .serving import CpuMeter, cpu_count, free_base_port, interrupt, wait_quiet
from .stats import SLA, summarize
from .workload import parse_workload

PATHS = ("grpc", "http")
METRICS = ("ttft_p50_ms", "e2e_p50_ms", "itl_p50_ms", "throughput")
API_KEY_ENV = "FASTGEN_API_KEY"


@dataclass
class Run:
    path: str
    clients: int
    repeat: int
    requests: int
    failed: int
    ttft_p50_ms: float
    e2e_p50_ms: float
    itl_p50_ms: float
    throughput: float  # completed requests / s
    token_throughput: float  # generated tokens / s
    cpu: dict = field(default_factory=dict)  # cores busy during the run: everyone's, ours, others'
    errors: list[str] = field(default_factory=list)  # the first few, for the log
    records: list[dict] = field(default_factory=list, repr=False)  # raw: every request's token times


def run_of(path: str, clients: int, repeat: int, records, cpu: dict | None = None) -> Run:
    """A run's figures from its RequestRecords (stats.summarize: the same percentiles as every other benchmark)."""
    s = summarize(records, SLA())
    return Run(
        path,
        clients,
        repeat,
        s.requests,
        s.failed,
        s.ttft["p50"] * 1e3,
        s.latency["p50"] * 1e3,
        s.inter_token["p50"] * 1e3,
        s.throughput,
        s.token_throughput,
        cpu or {},
        sorted({r.error for r in records if r.error})[:3],
        [r.to_json() for r in records],
    )


def requests_for(args: argparse.Namespace, clients: int) -> int:
    return args.requests if args.requests else 2 * clients + 8


# ---- the deployment ----
def deploy_cli(home: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`fastgen-deploy ARGS` as its own process against the private FASTGEN_HOME; the deployment gets no API key
    (an open API), whatever this shell has set."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | {"FASTGEN_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "fastgen.launch", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@contextlib.contextmanager
def deployment(args: argparse.Namespace):
    """A one-replica deployment with the HTTP API; yields (gRPC address, HTTP base URL, pids). Its state and logs
    stay in the private FASTGEN_HOME when something failed (the path is printed), and are removed otherwise."""
    home = Path(tempfile.mkdtemp(prefix="fastgen-http-overhead-"))
    name = f"http-overhead-{os.getpid()}"
    base = free_base_port(5)  # balancer, replica, their metrics ports, the HTTP API
    start = ["start", "--name", name, "--model", args.model, "--replicas", "1", "--dtype", args.dtype]
    start += ["--port", str(base), "--metrics-port", str(base + 2), "--http-port", str(base + 4)]
    start += ["--threads", str(args.threads), "--max-batch-tokens", str(args.max_batch_tokens)]
    start += ["--max-seqs", str(min(args.max_seqs, args.max_batch_tokens)), "--timeout", str(args.start_timeout)]
    if args.kv_cache_memory:
        start += ["--kv-cache-memory", args.kv_cache_memory]
    started = time.monotonic()
    try:
        done = deploy_cli(home, *start, timeout=args.start_timeout + 60)
    except BaseException:  # interrupted or timed out half-way: what did start goes
        deploy_cli(home, "stop", "--name", name, "--timeout", "10")
        raise
    if done.returncode != 0:
        deploy_cli(home, "stop", "--name", name, "--timeout", "10")
        raise RuntimeError(f"fastgen-deploy start failed (state and logs in {home}):\n{done.stdout}{done.stderr}")
    ok = False
    try:
        status = deploy_cli(home, "status", "--name", name, "--json")
        pids = [r["pid"] for r in json.loads(status.stdout) if r.get("pid")] if status.returncode == 0 else []
        print(
            f"deployment up in {time.monotonic() - started:.0f} s: gRPC 127.0.0.1:{base}, HTTP "
            f"http://127.0.0.1:{base + 4}/v1 ({args.threads} replica threads)",
            file=sys.stderr,
            flush=True,
        )
        yield f"127.0.0.1:{base}", f"http://127.0.0.1:{base + 4}", pids
        ok = True
    finally:
        stopped = deploy_cli(home, "stop", "--name", name, "--timeout", "30")
        if ok and stopped.returncode == 0:
            shutil.rmtree(home, ignore_errors=True)
        else:
            print(f"deployment state and logs kept in {home}", file=sys.stderr)


# ---- the measurement ----
async def measure(grpc: str, http: str, model: str, api_key: str | None, args, pids: list[int]) -> list[Run]:
    tok = args.tokenizer
    workload = parse_workload(args.workload)
    most = max(args.clients)
    backends = {
        "grpc": FastGenBackend(grpc),
        "http": OpenAIBackend(http, model, max(most, 8), api_key=api_key, keepalive=args.http_connection == "keep"),
    }
    for b in backends.values():
        await b.open()
    runs: list[Run] = []
    try:
        for p in PATHS:  # warm both paths (channels, connections, the replica's first batches); not recorded
            warm = fixed_requests(workload, 2 * most, tok, args.seed, f"warm-{p}")
            await closed_loop(backends[p], warm, [], most)
        for r in range(args.repeats):
            for i, clients in enumerate(args.clients):
                order = PATHS if (r + i) % 2 == 0 else PATHS[::-1]  # neither path always goes first
                for p in order:
                    tag = f"{p}-r{r}-c{clients}"  # fresh prompts: no prefix shared with any other run
                    reqs = fixed_requests(workload, requests_for(args, clients), tok, args.seed + r, tag)
                    warmups = fixed_requests(workload, clients, tok, args.seed + r, tag + "-w", 10**6)
                    with CpuMeter(pids) as meter:
                        records = await closed_loop(backends[p], reqs, warmups, clients)
                    run = run_of(p, clients, r, records, meter.result)
                    runs.append(run)
                    print(
                        f"repeat {r} clients {clients} {p:<4}: {run.throughput:.3f} req/s, TTFT p50 "
                        f"{run.ttft_p50_ms:.1f} ms, e2e p50 {run.e2e_p50_ms:.1f} ms, inter-token p50 "
                        f"{run.itl_p50_ms:.1f} ms, {run.failed} failed, others' cores "
                        f"{run.cpu.get('others_cores', float('nan')):.2f}"
                        + (f" ({run.errors[0]})" if run.errors else ""),
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for b in backends.values():
            await b.close()
    return runs


# ---- the figures ----
def medians(runs: list[Run]) -> dict[str, dict[str, dict[str, float]]]:
    """path -> clients -> each metric's median over repeats, with _min and _max."""
    out: dict = {}
    for run in runs:
        out.setdefault(run.path, {}).setdefault(str(run.clients), []).append(run)
    for by_clients in out.values():
        for clients, mine in by_clients.items():
            m = {k: statistics.median(getattr(x, k) for x in mine) for k in METRICS}
            m |= {f"{k}_min": min(getattr(x, k) for x in mine) for k in METRICS}
            m |= {f"{k}_max": max(getattr(x, k) for x in mine) for k in METRICS}
            m |= {"repeats": len(mine), "failed": sum(x.failed for x in mine)}
            by_clients[clients] = m
    return out


def paired(runs: list[Run]) -> dict[str, dict[str, float]]:
    """clients -> medians over repeats of HTTP minus gRPC within the same repeat (slow drifts of the machine cancel
    out, which a difference of two medians does not do); "all": the same over every client count's pairs."""
    cells: dict[tuple[int, int], dict[str, Run]] = {}
    for run in runs:
        cells.setdefault((run.clients, run.repeat), {})[run.path] = run
    pairs: dict[str, list[dict[str, Run]]] = {}
    for (clients, _), cell in sorted(cells.items()):
        if len(cell) == 2:
            pairs.setdefault(str(clients), []).append(cell)
            pairs.setdefault("all", []).append(cell)

    def diffs(cells: list[dict[str, Run]]) -> dict[str, float]:
        def med(f):
            return statistics.median(f(c["http"], c["grpc"]) for c in cells)

        return {
            "ttft_p50_added_ms": med(lambda h, g: h.ttft_p50_ms - g.ttft_p50_ms),
            "e2e_p50_added_ms": med(lambda h, g: h.e2e_p50_ms - g.e2e_p50_ms),
            "itl_p50_added_ms": med(lambda h, g: h.itl_p50_ms - g.itl_p50_ms),
            "throughput_ratio": med(lambda h, g: h.throughput / g.throughput if g.throughput else float("nan")),
            "pairs": len(cells),
        }

    return {k: diffs(v) for k, v in pairs.items()}


def markdown(m: dict, pair: dict) -> str:
    def rng(x: dict, k: str, fmt: str) -> str:
        return f"{x[k]:{fmt}} ({x[k + '_min']:{fmt}}–{x[k + '_max']:{fmt}})"

    lines = [
        "| clients | path | TTFT p50 (ms) | end-to-end p50 (ms) | inter-token p50 (ms) | throughput (req/s) |",
        "|---|---|---|---|---|---|",
    ]
    for clients in sorted(m.get("grpc", {}), key=int):
        for p in PATHS:
            x = m.get(p, {}).get(clients)
            if x is None:
                continue
            failed = f" ({x['failed']} failed)" if x["failed"] else ""
            lines.append(
                f"| {clients} | {p}{failed} | {rng(x, 'ttft_p50_ms', '.1f')} | {rng(x, 'e2e_p50_ms', '.1f')} | "
                f"{rng(x, 'itl_p50_ms', '.2f')} | {rng(x, 'throughput', '.3f')} |"
            )
    lines += [
        "",
        "HTTP minus gRPC, paired by repeat (median of the per-repeat differences):",
        "",
        "| clients | TTFT p50 (ms) | end-to-end p50 (ms) | inter-token p50 (ms) | throughput HTTP / gRPC | pairs |",
        "|---|---|---|---|---|---|",
    ]
    for clients in sorted(pair, key=lambda c: (c == "all", int(c) if c != "all" else 0)):
        d = pair[clients]
        lines.append(
            f"| {clients} | {d['ttft_p50_added_ms']:+.1f} | {d['e2e_p50_added_ms']:+.1f} | "
            f"{d['itl_p50_added_ms']:+.2f} | ×{d['throughput_ratio']:.3f} | {d['pairs']} |"
        )
    return "\n".join(lines)


# ---- command line ----
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.http_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--grpc", default=None, help="host:port of a running deployment's balancer (with --http)")
    p.add_argument("--http", default=None, help="base URL of the same deployment's HTTP API (with --grpc)")
    p.add_argument("--served-model", default=None, help="model name for HTTP requests (default: GET /v1/models)")
    p.add_argument("--api-key", default=None, help=f"for --http (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--model", default="smollm2-135m", help="model of the deployment started (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="the served model's Hugging Face folder (default: --model's)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--threads", type=int, default=None, help="replica threads (default: cores / 2)")
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", default=None, help="KV pool of the replica, e.g. 512MiB (default: its own)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--workload", default="300x64", help="PROMPTxGEN, exact lengths (default: %(default)s)")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 2, 4])
    p.add_argument("--requests", type=int, default=None, help="per run (default: 2 x clients + 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--http-connection",
        choices=["keep", "new"],
        default="keep",
        help="keep: one kept-alive connection per client; new: a connection per request (default: keep)",
    )
    p.add_argument("--quiet-cores", type=float, default=0.7, help="wait until fewer cores are busy (0: don't wait)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here (e.g. benchmarks/results/NAME.json)")
    p.add_argument("--raw", type=Path, default=None, help="every run's records (default: benchmarks/out/...)")
    args = p.parse_args(argv)
    if (args.grpc is None) != (args.http is None):
        p.error("--grpc and --http go together (a running deployment), or neither (start one)")
    args.argv = argv
    args.threads = args.threads or max(1, cpu_count() // 2)
    if args.tokenizer is None:
        from ..replica.weights import resolve_model

        args.tokenizer = str(resolve_model(args.model))
    return args


def served_name(http: str, api_key: str | None, wanted: str | None, patience: float = 60.0) -> str:
    """The name HTTP requests carry: --served-model, else the first the server lists (once a replica reported)."""
    if wanted:
        return wanted
    deadline = time.monotonic() + patience
    while True:
        names = [n for n in served_models(http, api_key) if n]
        if names or time.monotonic() > deadline:
            break
        time.sleep(1)
    if not names:
        raise RuntimeError(f"{http} lists no model; give --served-model")
    return names[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)  # unwinds through the deployment's context manager, which stops it
    load_before = os.getloadavg()
    api_key = (args.api_key or os.environ.get(API_KEY_ENV)) if args.http else None  # a started one has none
    with contextlib.ExitStack() as stack:
        if args.http:
            grpc, http, pids = args.grpc, args.http, []
        else:
            grpc, http, pids = stack.enter_context(deployment(args))
        model = served_name(http, api_key, args.served_model)
        busy = wait_quiet(args.quiet_cores, 1200.0)
        started = time.monotonic()
        runs = asyncio.run(measure(grpc, http, model, api_key, args, pids))
        wall = time.monotonic() - started
    m, pair = medians(runs), paired(runs)
    print(markdown(m, pair))
    if args.json:
        meta = run_info("http_overhead", args.argv) | {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("argv",)},
            "served_model": model,
            "deployment": "started" if not args.http else "given",
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "busy_cores_before": busy,
            "wall_s": wall,
        }
        raw = args.raw or RAW_DIR / "http_overhead" / args.json.name
        meta["raw"] = str(raw)
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]}))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {"meta": meta, "medians": m, "paired": pair, "runs": [run_row(r) for r in runs]}
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if all(r.failed == 0 for r in runs) else 1


def run_row(run: Run) -> dict:
    """A run's figures for the summary: no per-request records."""
    row = {k: v for k, v in asdict(run).items() if k not in ("errors", "records")}
    return row | ({"errors": run.errors} if run.errors else {})


if __name__ == "__main__":
    sys.exit(main())
