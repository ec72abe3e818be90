"""What the load balancer costs: the same closed-loop load straight to a replica and through the balancer in front
of that same replica, in alternating rounds so machine noise hits both paths alike; medians over rounds.

    python -m fastgen.benchmarks.balancer_overhead --rounds 20 --concurrency 4 --requests 32 --workload 16x2

One deployment (`fastgen-deploy`, 1 replica) serves both paths: its balancer and its replica's own port. Short
generations keep the engine's time per request small, so the balancer's per-request cost (an extra gRPC hop and
a routing decision per request, a forwarded message per chunk) is as visible as it gets. Floors (issue #3): at
most 5% lower throughput and at most 2 ms added p50 latency per request through the balancer.

--json writes the summary (medians over rounds with their range, paired medians, the verdict, the command, commit,
date and machine); every round's own figures go to --raw (default benchmarks/out/balancer_overhead/<the summary's
name>, ignored by git).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .backends import FastGenBackend, deployment_credentials
from .loadgen import closed_loop
from .provenance import default_raw, run_info
from .serving import System, cpu_count, fastgen_deployment, tokenizer_dir, wait_quiet
from .stats import percentile
from .workload import make_requests, parse_workload

PATHS = ("direct", "balancer")


@dataclass
class Round:
    path: str
    index: int
    throughput: float  # requests/s
    p50_ms: float  # end-to-end latency
    p99_ms: float
    failed: int


async def one_round(backend, requests, concurrency: int, path: str, index: int) -> Round:
    records = await closed_loop(backend, requests, [], concurrency)
    done = [r for r in records if r.ok]
    span = max(r.end for r in done) - min(r.start for r in done)
    lat = [r.latency * 1e3 for r in done]
    return Round(path, index, len(done) / span, percentile(lat, 50), percentile(lat, 99), len(records) - len(done))


async def measure(addresses: dict[str, str], args: argparse.Namespace) -> list[Round]:
    backends = {p: FastGenBackend(a, **args.credentials) for p, a in addresses.items()}
    for b in backends.values():
        await b.open()
    tok = tokenizer_dir(args)
    workload = parse_workload(args.workload)
    rounds = []
    try:
        for p in PATHS:  # warm both paths (channels, the replica's first batches); not recorded
            await one_round(
                backends[p], make_requests(workload, args.concurrency * 2, tok, 99, "warm"), args.concurrency, p, -1
            )
        for i in range(args.rounds):
            order = PATHS if i % 2 == 0 else PATHS[::-1]  # ABBA: neither path always goes first
            for p in order:
                reqs = make_requests(workload, args.requests, tok, args.seed + i, f"r{i}")  # same prompts both paths
                r = await one_round(backends[p], reqs, args.concurrency, p, i)
                rounds.append(r)
                print(
                    f"round {i} {p:<8}: {r.throughput:.2f} req/s, p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for b in backends.values():
            await b.close()
    return rounds


def medians(rounds: list[Round]) -> dict[str, dict[str, float]]:
    out = {}
    for p in PATHS:
        mine = [r for r in rounds if r.path == p]
        out[p] = {k: statistics.median(getattr(r, k) for r in mine) for k in ("throughput", "p50_ms", "p99_ms")}
        out[p] |= {f"{k}_min": min(getattr(r, k) for r in mine) for k in ("throughput", "p50_ms", "p99_ms")}
        out[p] |= {f"{k}_max": max(getattr(r, k) for r in mine) for k in ("throughput", "p50_ms", "p99_ms")}
    return out


def paired(rounds: list[Round]) -> dict[str, float]:
    """Medians over rounds of balancer minus direct within the same round: slow drifts of the machine (a
    neighbour's job starting) cancel out, which differences of the two medians do not do."""
    by_round = {}
    for r in rounds:
        by_round.setdefault(r.index, {})[r.path] = r
    pairs = [p for p in by_round.values() if len(p) == 2]
    return {
        "throughput_ratio": statistics.median(p["balancer"].throughput / p["direct"].throughput for p in pairs),
        "p50_added_ms": statistics.median(p["balancer"].p50_ms - p["direct"].p50_ms for p in pairs),
        "p99_added_ms": statistics.median(p["balancer"].p99_ms - p["direct"].p99_ms for p in pairs),
    }


def verdict(m: dict[str, dict[str, float]], pair: dict[str, float] | None = None) -> dict[str, float | bool]:
    drop = 1 - m["balancer"]["throughput"] / m["direct"]["throughput"]
    added = m["balancer"]["p50_ms"] - m["direct"]["p50_ms"]
    v = {
        "throughput_drop": drop,
        "p50_added_ms": added,
        "p99_added_ms": m["balancer"]["p99_ms"] - m["direct"]["p99_ms"],
        "throughput_floor_met": drop <= 0.05,
        "p50_floor_met": added <= 2.0,
    }
    if pair is not None:
        v |= {f"paired_{k}": x for k, x in pair.items()}
    return v


def markdown(m: dict, v: dict) -> str:
    lines = ["| path | throughput (req/s) | p50 latency (ms) | p99 latency (ms) |", "|---|---|---|---|"]
    for p in PATHS:
        x = m[p]
        lines.append(
            f"| {p} | {x['throughput']:.2f} ({x['throughput_min']:.2f}–{x['throughput_max']:.2f}) | "
            f"{x['p50_ms']:.1f} ({x['p50_ms_min']:.1f}–{x['p50_ms_max']:.1f}) | "
            f"{x['p99_ms']:.1f} ({x['p99_ms_min']:.1f}–{x['p99_ms_max']:.1f}) |"
        )
    lines.append(
        f"\nThrough the balancer: throughput {-v['throughput_drop']:+.1%} (floor: at most 5% lower, "
        f"{'met' if v['throughput_floor_met'] else 'NOT met'}); p50 {v['p50_added_ms']:+.1f} ms (floor: at "
        f"most +2 ms, {'met' if v['p50_floor_met'] else 'NOT met'}); p99 {v['p99_added_ms']:+.1f} ms."
    )
    if "paired_p50_added_ms" in v:
        lines.append(
            f"Paired by round (median of per-round differences): throughput ×{v['paired_throughput_ratio']:.3f}, "
            f"p50 {v['paired_p50_added_ms']:+.1f} ms, p99 {v['paired_p99_added_ms']:+.1f} ms."
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.balancer_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="replica threads (default: cores / 2, leaving the rest to the balancer and the load generator)",
    )
    p.add_argument("--workload", default="16x2", help="PROMPTxGEN means (default: 16x2)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=32, help="requests per round and path")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-cores", type=float, default=0.7, help="wait until fewer cores are busy (0: don't wait)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here (e.g. benchmarks/results/NAME.json)")
    p.add_argument("--raw", type=Path, default=None, help="every round's figures (default: benchmarks/out/...)")
    args = p.parse_args(argv)
    args.argv = argv
    # fastgen_deployment's settings for a one-replica splitfuse deployment
    args.max_batch_tokens, args.max_seqs, args.direct, args.start_timeout = 512, 64, False, 600.0
    args.threads = args.threads or max(1, cpu_count() // 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    with fastgen_deployment(System("overhead", "fastgen", "splitfuse", 1), args) as (balancer, config, _pids):
        replica = f"127.0.0.1:{config.port + 1}"
        args.credentials = deployment_credentials(config.name)  # the internal token: the replica takes no other
        busy = wait_quiet(args.quiet_cores, 1200.0)
        started = time.monotonic()
        rounds = asyncio.run(measure({"direct": replica, "balancer": balancer}, args))
    m = medians(rounds)
    v = verdict(m, paired(rounds))
    print(markdown(m, v))
    if args.json:
        meta = run_info("balancer_overhead", args.argv) | {
            "args": {
                k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("json", "argv")
            },
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "busy_cores_before": busy,
            "wall_s": time.monotonic() - started,
        }
        raw = args.raw or default_raw(args.json, "balancer_overhead")
        meta["raw"] = str(raw)
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps({"meta": meta, "rounds": [asdict(r) for r in rounds]}, indent=1))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "medians": m, "verdict": v}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
