"""Failover: streams and unary calls through the balancer while one of two replicas is killed (or stopped) mid-way.

    python -m fastgen.benchmarks.failover --streams 40 --unary 20 --fail kill [--json benchmarks/results/failover.json]

It starts two replicas (SmolLM2-135M, the embedded default, unless --model says otherwise; `--model tiny` takes the
tests' tiny random model) and a balancer, runs every request once without a failure (the reference), then again
all at once and hits the replica serving the first stream once that stream has sent --fail-after chunks: SIGKILL
(`kill`) or SIGSTOP (`stop`: a hung replica that only health checks reveal). Half the requests are greedy, half
sampled with a seed; with --n, one sampled request in two asks for that many completions (compared one by one).
Reported: requests completed, streams and answers identical to the reference (token ids and text), streams that
moved, and the stall a move adds to a stream: the gap at the seam (the old replica's last chunk to the new one's
first: detection, re-prefill of prompt + delivered tokens, the first new token) beside the usual gap between chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from .stats import percentile

PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List five uses for a paperclip.",
    "Describe the water cycle to a child.",
)


def request_params(i: int, max_new_tokens: int, n: int = 1) -> dict:
    params = dict(max_new_tokens=max_new_tokens, ignore_eos=True)
    if i % 2:
        params.update(temperature=0.8, top_p=0.95, seed=1000 + i)
    if i % 4 == 1 and n > 1:  # one sampled request in two asks for several completions
        params["n"] = n
    return params


def start(args, log_dir: Path):
    from ..testing import cached_tiny_model, start_server, wait_grpc_serving

    model = [] if args.model is None else ["--model", str(cached_tiny_model()) if args.model == "tiny" else args.model]
    replica_args = [*model, "--dtype", args.dtype, "--threads", str(args.threads)]

    def trace(i: int) -> list[str]:
        return ["--step-trace", str(args.step_traces / f"r{i}.csv")] if args.step_traces else []

    replicas = [
        start_server("replica", f"r{i}", ["--replica-id", f"r{i}", *replica_args, *trace(i)], log_dir) for i in range(2)
    ]
    for r in replicas:
        wait_grpc_serving(r, args.start_timeout)
    balancer_args = [f"--replica={r.name}={r.address}" for r in replicas] + ["--health-interval", "0.2"]
    balancer = start_server("balancer", "balancer", balancer_args, log_dir)
    wait_grpc_serving(balancer, args.start_timeout)
    return {r.name: r for r in replicas}, balancer


async def run_all(address: str, args, fail=None) -> list:
    """Every request at once: streams as (chunks, arrival times), unary calls as results. `fail(replica)` is called
    once, when the first stream has sent args.fail_after chunks."""
    from ..server import AsyncClient

    hit = asyncio.Event()

    async def streamed(c, i):
        chunks, times = [], []
        async for chunk in c.stream_chunks(PROMPTS[i % len(PROMPTS)], **request_params(i, args.max_new_tokens, args.n)):
            chunks.append(chunk)
            times.append(time.monotonic())
            if fail is not None and not hit.is_set() and len(chunks) == args.fail_after:
                hit.set()
                fail(chunk.replica)
        return chunks, times

    async def unary(c, i):
        return await c.generate(PROMPTS[i % len(PROMPTS)], **request_params(i, args.max_new_tokens, args.n))

    async with AsyncClient(address, timeout=args.timeout) as c:
        calls = [streamed(c, i) for i in range(args.streams)]
        calls += [unary(c, i) for i in range(args.streams, args.streams + args.unary)]
        return await asyncio.gather(*calls, return_exceptions=True)


def per_completion(chunks) -> dict[int, tuple[list[int], str]]:
    """Each completion's token ids and text, by index."""
    return {
        j: ([t for c in chunks if c.index == j for t in c.token_ids], "".join(c.text for c in chunks if c.index == j))
        for j in sorted({c.index for c in chunks})
    }


def compare(refs: list, results: list, streams: int) -> dict:
    completed = identical = moved = moved_several = 0
    seams, gaps, errors = [], [], []
    for i, (ref, got) in enumerate(zip(refs, results)):
        if isinstance(got, BaseException):
            errors.append(f"request {i}: {got}")
            continue
        completed += 1
        if i >= streams:
            identical += [(c.token_ids, c.text) for c in got.completions()] == [
                (c.token_ids, c.text) for c in ref.completions()
            ]
            continue
        (chunks, times), (ref_chunks, _) = got, ref
        identical += per_completion(chunks) == per_completion(ref_chunks)  # n > 1: their chunks interleave anyhow
        seam = [k for k in range(1, len(chunks)) if chunks[k].replica != chunks[k - 1].replica]
        moved += bool(seam)
        moved_several += bool(seam) and len({c.index for c in chunks}) > 1
        seams += [times[k] - times[k - 1] for k in seam]
        gaps += [times[k] - times[k - 1] for k in range(1, len(chunks)) if k not in seam]
    ms = lambda xs, q: round(1000 * percentile(xs, q), 1) if xs else None  # noqa: E731
    return {
        "requests": len(refs),
        "completed": completed,
        "identical": identical,
        "streams_moved": moved,
        "streams_moved_with_several_completions": moved_several,
        "seam_gap_ms": {"p50": ms(seams, 50), "p99": ms(seams, 99), "max": ms(seams, 100)},
        "chunk_gap_ms": {"p50": ms(gaps, 50), "p99": ms(gaps, 99)},
        "errors": errors[:10],
    }


def balancer_migrations(metrics_port: int) -> dict:
    """What the balancer saw of the moves: how many, and the time from each failure to the first new token from the
    replica that resumed it (its own clock, free of the client's lag in reading 60 streams), as a mean and the upper
    bound of the histogram bucket that holds the slowest."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    samples = [s for f in text_string_to_metric_families(body) for s in f.samples]
    histogram = {s.name: s for s in samples if s.name.startswith("fastgen_balancer_migration_seconds")}
    count = int(histogram["fastgen_balancer_migration_seconds_count"].value)
    buckets = sorted(
        (float(s.labels["le"]), s.value) for s in samples if s.name == "fastgen_balancer_migration_seconds_bucket"
    )
    return {
        "moves": count,
        "resume_s_mean": round(histogram["fastgen_balancer_migration_seconds_sum"].value / count, 3) if count else None,
        "resume_s_max_within": next((le for le, n in buckets if n >= count), None) if count else None,
    }


def run(args) -> dict:
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="fastgen-failover-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    replicas, balancer = start(args, log_dir)
    victims = []

    def fail(name: str) -> None:
        victims.append(replicas[name])
        replicas[name].popen.send_signal(signal.SIGKILL if args.fail == "kill" else signal.SIGSTOP)

    try:
        refs = asyncio.run(run_all(balancer.address, args))
        started = time.monotonic()
        results = asyncio.run(run_all(balancer.address, args, fail))
        wall = time.monotonic() - started
        moves = balancer_migrations(balancer.metrics_port)
    finally:
        for v in victims:
            v.popen.send_signal(signal.SIGCONT)
        for s in (*replicas.values(), balancer):
            s.stop()
    summary = compare(refs, results, args.streams)
    summary["balancer_migrations"] = moves
    summary.update(n=args.n, fail=args.fail, failed_replica=victims[0].name if victims else None, wall_s=round(wall, 2))
    summary["logs"] = str(log_dir)
    return summary


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.failover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M; 'tiny': the tests' model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="threads per replica")
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--unary", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--n", type=int, default=1, help="completions asked for by one sampled request in two")
    p.add_argument("--fail", choices=("kill", "stop"), default="kill")
    p.add_argument("--fail-after", type=int, default=8, help="chunks of the first stream before the failure")
    p.add_argument("--timeout", type=float, default=600.0, help="each request's deadline (s)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--logs", type=Path, default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument("--step-traces", type=Path, default=None, help="each replica's steps to DIR/r<i>.csv")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from .provenance import run_info

    args = parse_args(argv)
    summary = run(args)
    print(json.dumps(summary, indent=1))
    ok = summary["completed"] == summary["identical"] == summary["requests"]
    print(f"failover: {'PASS' if ok else 'FAIL'}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = run_info("failover", argv) | {"args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps({"meta": meta, **summary, "pass": ok}, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
