"""Random sweep of the CPU backend's attention: fresh cases for as long as asked, each checked against dense torch
attention and for results that do not depend on the thread count; prints the seed and parameters of any failure.

    python -m fastgen.benchmarks.kernel_sweep --seconds 60 [--threads 2,3,4] [--seed S]

The test suite runs fixed seeds (tests/test_kernels_torch.py); this finds new ones. A failing case replays with
`fastgen.testing.cpu_attention_case(seed, dtype, block_size, kv_heads, head_dim, group)`, or add its seed to the
test's list. Exits with status 1 if any case failed, 2 where the C kernels are not available."""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

import torch

from fastgen.kernels import cpu
from fastgen.testing import cpu_attention_case, dense_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Case:
    seed: int
    dtype: str
    block_size: int
    kv_heads: int
    head_dim: int
    group: int

    def __str__(self) -> str:
        return (
            f"seed={self.seed} dtype={self.dtype} block_size={self.block_size} kv_heads={self.kv_heads} "
            f"head_dim={self.head_dim} group={self.group}"
        )


def draw_case(rng: random.Random) -> Case:
    """Shapes the kernels take on every path: head dims that are and are not multiples of 16 and 32, GQA groups up
    to 9, the block sizes a deployment uses and 1."""
    return Case(
        seed=rng.randrange(10**6),
        dtype=rng.choice(list(DTYPES)),
        block_size=rng.choice([1, 8, 16, 32, 64]),
        kv_heads=rng.choice([1, 2, 3, 4]),
        head_dim=rng.choice([32, 40, 48, 64, 80, 96, 128]),
        group=rng.choice([1, 2, 3, 4, 7, 9]),
    )


def in_threads(threads: int, fn, *args):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


def check(case: Case, thread_counts: list[int]) -> list[str]:
    """What is wrong with the backend's attention on this case: empty when it agrees with dense attention on one
    thread and gives that thread's result bit for bit on every other count."""
    dtype = DTYPES[case.dtype]
    batch = cpu_attention_case(case.seed, dtype, case.block_size, case.kv_heads, case.head_dim, case.group)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.meta, case.head_dim**-0.5)
    one = in_threads(1, cpu.paged_attention_cpu, *args)
    problems = []
    ref = dense_attention(batch, case.head_dim**-0.5)
    tol = TOLERANCE[dtype]
    if not torch.allclose(one.float(), ref, atol=tol, rtol=tol):
        problems.append(f"differs from dense attention by {(one.float() - ref).abs().max().item():.3g}")
    for threads in thread_counts:
        other = in_threads(threads, cpu.paged_attention_cpu, *args)
        if not torch.equal(other, one):
            rows = (other != one).flatten(1).any(1).nonzero().flatten().tolist()
            problems.append(f"{threads} threads differ from one in rows {rows}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="how long to draw cases")
    p.add_argument("--threads", default="2,3", help="thread counts compared with one thread, comma-separated")
    p.add_argument("--seed", type=int, default=None, help="seed of the sweep itself (default: fresh)")
    args = p.parse_args(argv)
    if cpu.load_library() is None:
        print("no C compiler: the CPU kernels are not built here, nothing to sweep", file=sys.stderr)
        return 2
    sweep_seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(sweep_seed)
    thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    print(f"sweep seed {sweep_seed}; comparing 1 thread with {thread_counts}")
    deadline = time.monotonic() + args.seconds
    cases = failures = 0
    while time.monotonic() < deadline:
        case = draw_case(rng)
        cases += 1
        for problem in check(case, thread_counts):
            failures += 1
            print(f"FAIL {case}: {problem}", flush=True)
    print(f"{cases} cases, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
