"""The schedules on a simulated engine: closed-loop clients against the schedulers themselves, every step taking
exactly what a fixed step-time model says, so that schedules compare in seconds of CPU and free of a host's drift.

    python -m fastgen.benchmarks.schedule_sim --clients 8,16,32,48 \\
        --systems slo-b2048,splitfuse-b128,splitfuse-b256,splitfuse-b512,prefill_first \\
        --coefficients 0.0917,1.99e-3,0,1.79e-5,2.64e-6
    python -m fastgen.benchmarks.schedule_sim --fit benchmarks/out/serving/slo/C1/slo-b2048/c48-0.steps.csv ...

Requests have the workload's lengths (C1: prompts ~600, generations ~60 tokens, 30% spread), 4 x clients + 16 of
them times --requests-scale, as in the serving benchmark; each client sends its next request the moment its last
one ended, the first ones all at once. A request meets its SLA as the serving benchmark and the replicas score it
(fastgen.server.sla). The coefficients are the step-time model's (FEATURES of fastgen.replica.step_model); `--fit`
takes them from a replica's step trace, as its own model would have them after those steps. The engine takes what
the model predicts, or with `--step-noise S` that times a random factor (log-normal, S its standard deviation in
log terms, one draw per step, seeded): the step model's error, which the scheduler does not see coming. What this
leaves out: every cost outside the steps.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import statistics
import sys
from dataclasses import dataclass

from ..replica.block_allocator import BlockAllocator
from ..replica.config import SchedulerConfig, SloConfig
from ..replica.request import Sequence
from ..replica.scheduler import Scheduler
from ..replica.slo_scheduler import SloScheduler
from ..replica.step_model import FEATURES, StepModel, StepShape, batch_shape
from ..server.sla import meets_sla
from .serving import System, parse_system
from .workload import Workload, parse_workload, sample_length


@dataclass
class SimResult:
    requests: int
    met: int  # requests that met the SLA at the floor R
    duration_s: float  # first arrival to last token
    max_ttft_s: float

    @property
    def effective(self) -> float:
        return self.met / self.duration_s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(system: System, coefficients: list[float], prompt_rate: float, token_rate: float, clock: Clock):
    budget = system.budget or 512
    config = SchedulerConfig(
        budget, min(64, budget), system.scheduler, max_model_len=10**6, slo=SloConfig(prompt_rate, token_rate)
    )
    allocator = BlockAllocator(20000, 16)
    if system.scheduler == "slo":
        return SloScheduler(config, allocator, StepModel(coefficients, learn=False), clock)
    return Scheduler(config, allocator)


def simulate(
    system: System,
    workload: Workload,
    clients: int,
    requests: int,
    coefficients: list[float],
    seed: int = 0,
    prompt_rate: float = 100.0,
    token_rate: float = 2.0,
    step_noise: float = 0.0,
) -> SimResult:
    """One closed-loop run: `clients` clients, `requests` requests in all; each step takes the model's time times
    exp(N(0, step_noise))."""
    rng = random.Random(f"{seed}-{workload.name}")
    noise = random.Random(f"{seed}-noise")
    lengths = [
        (sample_length(rng, workload.prompt_mean), sample_length(rng, workload.gen_mean)) for _ in range(requests)
    ]
    engine = StepModel(coefficients, learn=False)
    clock = Clock()
    sched = make_scheduler(system, coefficients, prompt_rate, token_rate, clock)
    seqs: dict[int, Sequence] = {}
    arrival: dict[int, float] = {}
    tokens: dict[int, list[float]] = {}

    def send() -> None:
        i = len(seqs)
        prompt, gen = lengths[i]
        # Distinct ids (i in the high bits): no two prompts share a cached prefix.
        seqs[i] = Sequence(i, [(i << 16) + j for j in range(prompt)], prompt, gen)
        arrival[i], tokens[i] = clock.now, []
        sched.add(seqs[i])

    for _ in range(min(clients, requests)):
        send()
    while sched.has_work():
        batch = sched.schedule()
        clock.now += engine.predict(batch_shape(batch)) * (math.exp(noise.gauss(0.0, step_noise)) if step_noise else 1)
        for s in batch.seqs:
            if not s.sample:
                continue
            seq = seqs[s.seq_id]
            seq.token_ids.append(0)
            tokens[s.seq_id].append(clock.now)
            if seq.num_generated >= seq.max_new_tokens:
                sched.finish(seq)
                if len(seqs) < requests:
                    send()
        sched.observe(batch)
    met = sum(
        meets_sla(seqs[i].num_prompt_tokens, t[0] - arrival[i], t, prompt_rate, token_rate) for i, t in tokens.items()
    )
    return SimResult(
        requests, met, max(t[-1] for t in tokens.values()), max(t[0] - arrival[i] for i, t in tokens.items())
    )


def fit(trace: str) -> list[float]:
    """The coefficients a replica's own step-time model holds after learning the steps of `trace` (a --step-trace
    CSV with the shape columns; steps of a fixed-budget schedule have no context and are skipped)."""
    model = StepModel()
    with open(trace) as f:
        for row in csv.DictReader(f):
            if row["decode_context"] == "":
                continue
            shape = StepShape(
                *(int(row[k]) for k in ("prompt_tokens", "decode_seqs", "decode_context", "prompt_context"))
            )
            model.observe(shape, float(row["measured_s"]))
    if not model.ready:
        raise SystemExit(f"{trace}: too few steps with a shape to fit the model")
    return model.coefficients


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.schedule_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", default="C1")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 48])
    p.add_argument(
        "--systems",
        type=lambda s: [parse_system(x) for x in s.split(",")],
        default=[
            parse_system(x) for x in "slo-b2048,splitfuse-b128,splitfuse-b256,splitfuse-b512,prefill_first".split(",")
        ],
    )
    p.add_argument("--requests-scale", type=float, default=0.35, help="of 4 x clients + 16 (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=3, help="runs per point, each with its own lengths (default: 3)")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--coefficients",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0917, 1.99e-3, 0.0, 1.79e-5, 2.64e-6],
        help=f"the step-time model's {', '.join(FEATURES)} (default: a 2-core AMD EPYC Zen 3, float32 SmolLM2-135M)",
    )
    source.add_argument("--fit", default=None, help="take the coefficients from this step trace (CSV)")
    p.add_argument("--prompt-rate", type=float, default=100.0, help="SLA P (default: %(default)g)")
    p.add_argument("--token-rate", type=float, default=2.0, help="SLA R, also the slo floor (default: %(default)g)")
    p.add_argument(
        "--step-noise",
        type=float,
        default=0.0,
        help="standard deviation of log(actual / predicted) step time (default: %(default)g, steps as predicted)",
    )
    args = p.parse_args(argv)
    coefficients = fit(args.fit) if args.fit else args.coefficients
    workload = parse_workload(args.workload)
    print(f"step model: {', '.join(f'{k} {c:.4g}' for k, c in zip(FEATURES, coefficients))}")
    print("| clients | system | met (per seed) | effective R req/s, median (min-max) | longest first-token wait (s) |")
    print("|---|---|---|---|---|")
    for clients in args.clients:
        n = max(1, round((4 * clients + 16) * args.requests_scale))
        for system in args.systems:
            runs = [
                simulate(
                    system, workload, clients, n, coefficients, seed, args.prompt_rate, args.token_rate, args.step_noise
                )
                for seed in range(args.seeds)
            ]
            eff = [r.effective for r in runs]
            print(
                f"| {clients} | {system.label} | {', '.join(f'{r.met}/{n}' for r in runs)} | "
                f"{statistics.median(eff):.4f} ({min(eff):.4f}-{max(eff):.4f}) | "
                f"{statistics.median(r.max_ttft_s for r in runs):.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
