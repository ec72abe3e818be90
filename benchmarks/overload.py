"""Overload: an open-loop burst at many times what the deployment can serve, between two phases of light load.

    python -m fastgen.benchmarks.overload --replicas 2 --burst-s 20 --json benchmarks/results/overload.json

It starts its own replicas (the tests' tiny random model unless --model says otherwise) and a balancer, measures
what they serve with a short closed loop (the capacity), then offers light load (--light-factor of the capacity),
the burst (--burst-factor of it) and light load again, each request a unary Generate with a deadline. The excess of
a burst must be refused with RESOURCE_EXHAUSTED (carrying the retry-after-ms hint) within its deadline: the replicas'
bounded queues (--max-queue-requests, --max-queue-tokens) are what keeps each process's memory bounded, and every
process must stay alive. Reported per phase: offered and served rates, answers by status code, latency p50/p99 of
the served requests, the peak RSS of each process, and when the latency after the burst was back near its level
before it. --json writes that with the command, commit, date and machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc

from ..proto import fastgen_pb2 as pb
from ..proto import fastgen_pb2_grpc
from ..server.errors import retry_after_ms
from ..server.grpc_server import CHANNEL_OPTIONS
from .stats import percentile

PHASES = ("before", "burst", "after")
# A call gRPC's own HTTP/2 transport refused before the service saw it: an overloaded server's event loop falls
# behind accepting calls and its transport cancels some, with no message (reproduced with a bare grpc.aio server
# whose loop is busy; the server options for pending calls and stream limits do not change it). The request never
# entered the deployment, so nothing of it is lost; it is counted apart from a CANCELLED the service sent.
TRANSPORT_CANCELLED = "CANCELLED_BY_TRANSPORT"
EXPECTED = frozenset({"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", TRANSPORT_CANCELLED})  # a deadline can pass


@dataclass
class Record:
    phase: str
    start: float
    end: float
    code: str
    retry_hint_ms: int | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


# ---- load -----------------------------------------------------------------------------------------------------------
def make_request(rng: random.Random, i: int, args) -> pb.GenerateRequest:
    # Random ids: no two prompts share a prefix, so a prefix cache does not make the burst cheaper.
    ids = [rng.randrange(3, 49152) for _ in range(args.prompt_tokens)]
    params = pb.SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    return pb.GenerateRequest(request_id=f"overload-{i}", token_ids=pb.TokenIds(ids=ids), params=params)


async def one_call(stub, request, phase: str, deadline_s: float, records: list[Record]) -> None:
    start = time.monotonic()
    try:
        await stub.Generate(request, timeout=deadline_s)
        records.append(Record(phase, start, time.monotonic(), "OK"))
    except grpc.aio.AioRpcError as e:
        hint = retry_after_ms(e.trailing_metadata())
        records.append(Record(phase, start, time.monotonic(), code_name(e), hint))


def code_name(e: grpc.aio.AioRpcError) -> str:
    """The call's status code; TRANSPORT_CANCELLED for gRPC's bare CANCELLED (our services always say why)."""
    if e.code() == grpc.StatusCode.CANCELLED and e.details() == "CANCELLED":
        return TRANSPORT_CANCELLED
    return e.code().name


async def open_loop(stub, phase: str, rate: float, seconds: float, args, rng, records, counter) -> None:
    """Sends requests at `rate` per second for `seconds`, each on schedule whatever the answers (open loop)."""
    tasks = []
    start = time.monotonic()
    sent = 0
    while (now := time.monotonic()) < start + seconds:
        due = int((now - start) * rate) + 1
        while sent < due:
            request = make_request(rng, next(counter), args)
            tasks.append(asyncio.ensure_future(one_call(stub, request, phase, args.deadline_s, records)))
            sent += 1
        await asyncio.sleep(min(0.005, 1.0 / rate))
    await asyncio.gather(*tasks)


async def capacity(stub, args, rng, counter) -> float:
    """Requests per second the deployment serves with --calibrate-concurrency requests always in flight."""
    done = 0
    stop_at = time.monotonic() + args.calibrate_s

    async def client() -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await stub.Generate(make_request(rng, next(counter), args), timeout=120)
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(args.calibrate_concurrency)))
    return done / (time.monotonic() - started)


async def drive(address: str, args, mark=lambda phase: None) -> tuple[float, list[Record], dict[str, float]]:
    """Calibrates, then runs the three phases, calling mark(phase) as each starts; returns the capacity, every record
    and each phase's start time."""
    rng = random.Random(args.seed)
    counter = iter(range(10**9))
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = fastgen_pb2_grpc.GenerationStub(channel)
        mark("calibrate")
        await stub.Generate(make_request(rng, next(counter), args), timeout=120)  # warm the path
        cap = await capacity(stub, args, rng, counter)
        records: list[Record] = []
        starts = {}
        rates = {"before": args.light_factor, "burst": args.burst_factor, "after": args.light_factor}
        durations = {"before": args.phase_s, "burst": args.burst_s, "after": args.phase_s}
        for phase in PHASES:
            starts[phase] = time.monotonic()
            mark(phase)
            await open_loop(stub, phase, max(rates[phase] * cap, 0.5), durations[phase], args, rng, records, counter)
        starts["end"] = time.monotonic()
        mark("final")
        final = []  # after everything: one more request, which must be served
        await one_call(stub, make_request(rng, next(counter), args), "final", 120.0, final)
    return cap, records + final, starts


# ---- memory ----------------------------------------------------------------------------------------------------------
class PeakRss:
    """Samples each process's resident memory on a thread; peak per process and phase."""

    def __init__(self, servers, interval: float = 0.1):
        self.servers = servers
        self.interval = interval
        self.phase = "start"
        self.peaks: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for s in self.servers:
                per_phase = self.peaks.setdefault(s.name, {})
                per_phase[self.phase] = max(per_phase.get(self.phase, 0), s.rss_bytes())


# ---- the summary -----------------------------------------------------------------------------------------------------
def phase_summary(records: list[Record], seconds: float, deadline_s: float) -> dict:
    codes = Counter(r.code for r in records)
    served = [r.latency * 1e3 for r in records if r.code == "OK"]
    refused = [r for r in records if r.code == "RESOURCE_EXHAUSTED"]
    return {
        "offered_rps": len(records) / seconds,
        "served_rps": len(served) / seconds,
        "codes": dict(codes),
        "p50_ms": _or_none(percentile(served, 50)),
        "p99_ms": _or_none(percentile(served, 99)),
        "refused_p99_ms": _or_none(percentile([r.latency * 1e3 for r in refused], 99)),
        "refused_with_retry_hint": sum(r.retry_hint_ms is not None for r in refused),
        "refused_within_deadline": sum(r.latency <= deadline_s for r in refused),
    }


def _or_none(x: float) -> float | None:
    return None if math.isnan(x) else x  # JSON has no NaN


def recovery_s(records: list[Record], burst_end: float, before_p50_s: float, window_s: float = 1.0) -> float | None:
    """Seconds from the burst's end until the served requests sent in a window have a median latency within twice
    the light-load median (None: never within the after phase)."""
    after = sorted((r for r in records if r.phase == "after" and r.code == "OK"), key=lambda r: r.start)
    t = burst_end
    while after and t <= after[-1].start:
        window = [r.latency for r in after if t <= r.start < t + window_s]
        if window and before_p50_s is not None and percentile(window, 50) <= 2 * before_p50_s:
            return t - burst_end
        t += window_s / 2
    return None


def summarize(cap: float, records: list[Record], starts: dict, peaks: dict, alive: dict, args) -> dict:
    bounds = {"before": ("before", "burst"), "burst": ("burst", "after"), "after": ("after", "end")}
    phases = {
        p: phase_summary([r for r in records if r.phase == p], starts[b] - starts[a], args.deadline_s)
        for p, (a, b) in bounds.items()
    }
    final = [r for r in records if r.phase == "final"]
    unexpected = sorted({r.code for r in records if r.phase in PHASES} - EXPECTED)
    return {
        "capacity_rps": cap,
        "phases": phases,
        "peak_rss_mib": {name: {p: round(v / 2**20, 1) for p, v in ps.items()} for name, ps in peaks.items()},
        "alive": alive,
        "unexpected_codes": unexpected,
        "final_request": final[0].code if final else "not sent",
        "recovery_s": recovery_s(records, starts["after"], _seconds(phases["before"]["p50_ms"])),
    }


def _ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.0f}"


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def table(s: dict) -> str:
    lines = [
        "| phase | offered (req/s) | served (req/s) | answers | p50 (ms) | p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for p in PHASES:
        x = s["phases"][p]
        codes = ", ".join(f"{k} {v}" for k, v in sorted(x["codes"].items()))
        lines.append(
            f"| {p} | {x['offered_rps']:.1f} | {x['served_rps']:.1f} | {codes} | {_ms(x['p50_ms'])} | "
            f"{_ms(x['p99_ms'])} |"
        )
    rss = "; ".join(f"{n}: " + ", ".join(f"{p} {v}" for p, v in ps.items()) for n, ps in s["peak_rss_mib"].items())
    lines.append(f"\ncapacity {s['capacity_rps']:.1f} req/s; peak RSS (MiB) {rss}")
    lines.append(f"alive {s['alive']}; final request {s['final_request']}; recovery {s['recovery_s']} s")
    return "\n".join(lines)


# ---- the command -----------------------------------------------------------------------------------------------------
def start_deployment(args, log_dir: Path):
    from ..testing import cached_tiny_model, start_server, wait_grpc_serving

    model = str(args.model or cached_tiny_model())
    replica_args = ["--model", model, "--dtype", args.dtype, "--threads", str(args.threads)]
    replica_args += ["--max-batch-tokens", str(args.max_batch_tokens), "--max-seqs", str(args.max_seqs)]
    replica_args += ["--max-queue-requests", str(args.max_queue_requests)]
    replica_args += ["--max-queue-tokens", str(args.max_queue_tokens)]
    replicas = []
    for i in range(args.replicas):
        replicas.append(start_server("replica", f"r{i}", ["--replica-id", f"r{i}", *replica_args], log_dir))
    for r in replicas:
        wait_grpc_serving(r, args.start_timeout)
    balancer = start_server("balancer", "balancer", [f"--replica={r.name}={r.address}" for r in replicas], log_dir)
    wait_grpc_serving(balancer, args.start_timeout)
    return replicas, balancer


def run(args) -> dict:
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="fastgen-overload-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    replicas, balancer = start_deployment(args, log_dir)
    servers = [*replicas, balancer]
    try:
        with PeakRss(servers) as rss:
            # The sampler labels its samples with the phase the load is in.
            loop_result = asyncio.run(drive(balancer.address, args, lambda phase: setattr(rss, "phase", phase)))
        alive = {s.name: s.alive() for s in servers}
    finally:
        for s in servers:
            s.stop()
    summary = summarize(*loop_result, rss.peaks, alive, args)
    summary["logs"] = str(log_dir)
    return summary


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.overload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="model to serve (default: the tests' tiny random model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="threads per replica")
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--max-queue-requests", type=int, default=32, help="each replica's queue (requests)")
    p.add_argument("--max-queue-tokens", type=int, default=262144, help="each replica's queue (prompt tokens)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--calibrate-s", type=float, default=5.0, help="closed loop that measures the capacity")
    p.add_argument("--calibrate-concurrency", type=int, default=16)
    p.add_argument("--light-factor", type=float, default=0.3, help="light load, as a share of the capacity")
    p.add_argument("--burst-factor", type=float, default=10.0, help="the burst, as a multiple of the capacity")
    p.add_argument("--phase-s", type=float, default=10.0, help="each light phase")
    p.add_argument("--burst-s", type=float, default=20.0)
    p.add_argument("--deadline-s", type=float, default=5.0, help="every request's deadline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--logs", type=Path, default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    return p.parse_args(argv)


def passed(summary: dict) -> bool:
    """The functional properties: every process alive, only the expected codes, and a request served after."""
    return all(summary["alive"].values()) and not summary["unexpected_codes"] and summary["final_request"] == "OK"


def main(argv=None) -> int:
    from .provenance import run_info

    args = parse_args(argv)
    summary = run(args)
    print(table(summary))
    ok = passed(summary)
    print(f"overload: {'PASS' if ok else 'FAIL'}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = run_info("overload", argv) | {"args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps({"meta": meta, **summary, "pass": ok}, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
