"""Where served time goes: a deployment under closed-loop load through its OpenAI streaming API while py-spy samples
the replica and the balancer, each sample charged to the part of the serving path it is in.

    python -m fastgen.benchmarks.time_split --clients 4,16 --json benchmarks/results/time_split/NAME.json \\
        [--flamegraphs docs/flamegraphs]    # also an SVG flame graph of each process at each load
    python -m fastgen.benchmarks.time_split --deploy-args '--max-batch-tokens 256' ...

One deployment (`fastgen-deploy` with its defaults and its HTTP API; --deploy-args go to `fastgen-deploy start`),
warmed, then per client count one closed loop of fresh prompts (real text, lengths uniform in --prompt-len, --gen
tokens out, ignore_eos) and, once it is under way, py-spy (`record --nonblocking`, --rate samples a second) on the
balancer and one replica (of several, the last `fastgen-deploy status` lists, whose metrics give the steps) for
--seconds. A sample is charged to the part of its stack nearest the leaf that this module knows (PARTS: the
model's forward and the kernels, sampling, scheduling, batch building, detokenization, the engine loop, the gRPC
service; the balancer's HTTP/SSE, relay, journal, routing, tokenization), or to "other" (the interpreter's event
loop, logging, ...). py-spy counts a thread blocked in epoll as active, so those samples are
shown as "waiting (epoll)" and left out of the work. Reported per process: cores busy working (samples / rate /
seconds) and each part's share, in ms per engine step and per request (steps from the replica's
fastgen_forward_seconds, requests completed in the window), beside the replica's own forward time per step. Python
threads only: the forward's OpenMP workers are native threads, seen as the engine thread's time in the forward.
With --flamegraphs, a second window of --seconds per client count (not measured: py-spy itself takes CPU) records
an SVG flame graph of each process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .against_vllm import System, fastgen_server, prompts
from .backends import OpenAIBackend
from .loadgen import closed_loop
from .provenance import RAW_DIR, run_info
from .serving import interrupt, wait_quiet
from .stats import summarize

WAITING = "waiting (epoll)"
# (a path inside the checkout, the part it is charged to), by process role; the first match from the leaf decides
PARTS = {
    "replica": (
        ("replica/models/", "forward"),
        ("kernels/", "forward"),
        ("replica/model_runner.py", "forward"),
        ("replica/tp_worker.py", "forward"),
        ("replica/sampler.py", "sampling"),
        ("replica/constraints.py", "sampling"),
        ("replica/detokenizer.py", "detokenization"),
        ("replica/slo_scheduler.py", "scheduling"),
        ("replica/scheduler.py", "scheduling"),
        ("replica/step_model.py", "scheduling"),
        ("replica/block_allocator.py", "scheduling"),
        ("replica/prefix_cache.py", "scheduling"),
        ("replica/builder.py", "batch building"),
        ("replica/batch.py", "batch building"),
        ("replica/step_lists.py", "batch building"),
        ("replica/kv_cache.py", "batch building"),
        ("replica/engine.py", "engine loop"),
        ("replica/engine_loop.py", "engine loop"),
        ("replica/outputs.py", "engine loop"),
        ("replica/service.py", "gRPC service"),
        ("selectors.py", WAITING),
        ("server/", "gRPC service"),
        ("grpc/", "gRPC service"),
        ("prometheus_client/", "metrics"),
    ),
    "balancer": (
        ("balancer/openai_api.py", "HTTP/SSE"),
        ("aiohttp/", "HTTP/SSE"),
        ("balancer/openai_protocol.py", "HTTP/SSE"),
        ("balancer/structured.py", "HTTP/SSE"),
        ("balancer/tools.py", "HTTP/SSE"),
        ("balancer/journal.py", "journal"),
        ("balancer/policy.py", "routing"),
        ("balancer/pool.py", "routing"),
        ("balancer/prefix_index.py", "routing"),
        ("balancer/tokenizer.py", "tokenization"),
        ("tokenizers/", "tokenization"),
        ("balancer/service.py", "gRPC relay"),
        ("selectors.py", WAITING),
        ("server/", "gRPC relay"),
        ("grpc/", "gRPC relay"),
        ("prometheus_client/", "metrics"),
    ),
}


def part_of(stack: str, parts: tuple[tuple[str, str], ...]) -> str:
    """The part a collapsed py-spy stack ("fn (file:line);fn (file:line);...", root first) is charged to. py-spy
    names a file by its path under the sys.path entry it was imported from (replica/engine.py, grpc/aio/_call.py)."""
    for frame in reversed(stack.split(";")):
        where = frame[frame.rfind("(") + 1 :]
        for path, part in parts:
            if where.startswith(path):
                return part
    return "other"


def split_samples(raw: str, parts: tuple[tuple[str, str], ...]) -> Counter:
    """Samples per part from py-spy's raw output (a collapsed stack and a count per line)."""
    out: Counter = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out[part_of(stack, parts)] += int(count)
    return out


@dataclass
class Split:
    clients: int
    seconds: float  # the sampled window
    steps: int  # engine steps in it
    forward_s: float  # the replica's own fastgen_forward_seconds in it
    requests: int  # requests completed in it
    throughput: float  # of the whole run, requests / s
    itl_p95_ms: float
    samples: dict = field(default_factory=dict)  # role -> part -> samples

    def work(self, role: str) -> int:
        """Samples of the role's process that were not waiting."""
        return sum(n for part, n in self.samples[role].items() if part != WAITING)

    def cores(self, role: str, rate: int) -> float:
        return self.work(role) / rate / self.seconds


def scrape(url: str) -> dict[str, float]:
    """fastgen_forward_seconds' count and sum from a replica's /metrics."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("fastgen_forward_seconds_count", "fastgen_forward_seconds_sum")):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def py_spy(pid: int, seconds: float, rate: int, out: Path, fmt: str) -> subprocess.Popen:
    argv = ["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--duration", str(int(seconds))]
    argv += ["--format", fmt, "--nonblocking", "-o", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


async def load_until(backend, args, clients: int, tag: str, stop: asyncio.Event) -> list:
    """Closed-loop clients sending fresh prompts until `stop` is set; their requests' records."""
    records = []

    async def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            (request,) = prompts(args, 1, f"{tag}-{i}-{k}")
            records.append(await backend.run(request, i))
            k += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return records


async def waited(spies: dict[str, subprocess.Popen]) -> list[int]:
    return await asyncio.get_running_loop().run_in_executor(None, lambda: [p.wait() for p in spies.values()])


async def measure_one(server, rows: dict, args, clients: int, raw: Path) -> Split:
    backend = OpenAIBackend(server.url, server.model, clients, keepalive=True)
    metrics = f"http://127.0.0.1:{rows['replica']['metrics_port']}/metrics"
    stop = asyncio.Event()
    try:
        wait_quiet(args.quiet_cores, 300.0)
        load = asyncio.create_task(load_until(backend, args, clients, f"split-c{clients}", stop))
        await asyncio.sleep(args.settle)  # into the steady state
        before, t0 = scrape(metrics), time.perf_counter()  # the load generator's clock
        spies = {
            r: py_spy(row["pid"], args.seconds, args.rate, raw / f"{r}-c{clients}.txt", "raw")
            for r, row in rows.items()
        }
        ended = await waited(spies)
        after, seconds = scrape(metrics), time.perf_counter() - t0
        if args.flamegraphs and not any(ended):
            svgs = {r: args.flamegraphs / f"{r}-c{clients}.svg" for r in rows}
            spies = {r: py_spy(row["pid"], args.seconds, args.rate, svgs[r], "flamegraph") for r, row in rows.items()}
            ended = await waited(spies)
        stop.set()
        records = await load
    finally:
        stop.set()
        await backend.close()
    if any(ended):
        errors = "; ".join(p.stderr.read().strip()[-300:] for p in spies.values() if p.returncode)
        raise RuntimeError(f"py-spy failed: {errors}")
    s = summarize(records)
    return Split(
        clients,
        seconds,
        int(after["fastgen_forward_seconds_count"] - before["fastgen_forward_seconds_count"]),
        after["fastgen_forward_seconds_sum"] - before["fastgen_forward_seconds_sum"],
        sum(1 for r in records if r.ok and t0 <= r.end <= t0 + seconds),
        s.throughput,
        s.inter_token["p95"] * 1e3,
        {role: dict(split_samples((raw / f"{role}-c{clients}.txt").read_text(), PARTS[role])) for role in rows},
    )


def markdown(splits: list[Split], rate: int) -> str:
    lines = []
    for sp in splits:
        lines += [
            f"{sp.clients} clients: {sp.throughput:.2f} req/s, inter-token p95 {sp.itl_p95_ms:.0f} ms; in "
            f"{sp.seconds:.0f} s sampled, {sp.steps} steps, {sp.requests} requests done; the replica's forward "
            f"{1e3 * sp.forward_s / max(sp.steps, 1):.1f} ms a step ({sp.forward_s / sp.seconds:.2f} of the time)",
            "",
            "| process | part | cores | share | ms / step | ms / request |",
            "|---|---|---|---|---|---|",
        ]
        for role, parts in sp.samples.items():
            total = sp.work(role) or 1
            lines.append(f"| {role} | all work | {sp.cores(role, rate):.2f} | 100% | | |")
            for part, n in sorted(parts.items(), key=lambda kv: -kv[1]):
                if part == WAITING:
                    continue
                s = n / rate
                lines.append(
                    f"| {role} | {part} | {s / sp.seconds:.2f} | {100 * n / total:.0f}% | "
                    f"{1e3 * s / max(sp.steps, 1):.2f} | {1e3 * s / max(sp.requests, 1):.1f} |"
                )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.time_split",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--deploy-args", default="", help="extra arguments to fastgen-deploy start, one string")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",") if x], default=[4, 16])
    p.add_argument("--prompt-len", type=lambda s: tuple(int(x) for x in s.split("-")), default=(250, 450))
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=8.0, help="seconds of load before sampling starts")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds sampled per client count")
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second (default: %(default)s)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--quiet-cores", type=float, default=0.7)
    p.add_argument("--flamegraphs", type=Path, default=None, help="also write SVG flame graphs into this folder")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--raw", type=Path, default=None, help="py-spy's samples (default: benchmarks/out/...)")
    args = p.parse_args(argv)
    args.argv = argv
    from ..replica.weights import resolve_model

    args.tokenizer = str(resolve_model(args.model))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    raw = args.raw or RAW_DIR / "time_split" / (args.json.stem if args.json else time.strftime("%Y%m%d-%H%M%S"))
    raw.mkdir(parents=True, exist_ok=True)
    if args.flamegraphs:
        args.flamegraphs.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="fastgen-time-split-"))
    system = System("fastgen", tuple(shlex.split(args.deploy_args)))
    with fastgen_server(system, args, home) as server:
        rows = {row["role"]: row for row in server.rows if row["role"] in PARTS}
        asyncio.run(warm(server, args))
        splits = [asyncio.run(measure_one(server, rows, args, c, raw)) for c in args.clients]
    print(markdown(splits, args.rate))
    if args.json:
        meta = run_info("time_split", args.argv) | {"deploy_args": args.deploy_args, "rate": args.rate}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "splits": [asdict(s) for s in splits]}, indent=1))
    return 0


async def warm(server, args) -> None:
    backend = OpenAIBackend(server.url, server.model, 4, keepalive=True)
    try:
        await closed_loop(backend, prompts(args, 8, "warm"), [], 4)
    finally:
        await backend.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
