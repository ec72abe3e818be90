"""The paper's serving comparison on this machine: FastGen's Dynamic SplitFuse against the prefill-first and static
schedules of the same engine, transformers `generate`, and (when running) vLLM, on the same workloads.

    python -m fastgen.benchmarks.serving run --workloads C1,C2 --clients 1,2,4,8 \\
        --systems splitfuse,prefill_first,static,hf --out benchmarks/results/serving
    python -m fastgen.benchmarks.serving run --workloads C1 --systems splitfuse,splitfuse-r2   # replica scaling
    python -m fastgen.benchmarks.serving run --systems vllm --vllm-url http://127.0.0.1:8000  # vLLM baseline
    python -m fastgen.benchmarks.serving report --out benchmarks/results/serving            # tables + PNGs
    python -m fastgen.benchmarks.serving run --workloads C1 --clients 1,4,8,16,32,48 --repeats 3 --token-rates 2,4 \
        --systems slo-b2048,splitfuse-b128,splitfuse-b256,splitfuse-b512,prefill_first --out benchmarks/results/slo
    python -m fastgen.benchmarks.serving steps --out benchmarks/results/slo   # the step-time model's error + plot

Systems: a FastGen scheduler (`splitfuse`, `prefill_first`, `static`, `slo`), optionally `-bN` for a token budget
(--max-batch-tokens) of N, `-tR` for the token-rate floor R the slo scheduler holds (default --slo-token-rate) and
`-rK` for K replicas behind the balancer (threads per replica = cores / K), e.g. `splitfuse-b256`, `slo-t4-b1024`;
`hf` (transformers generate, static batches of up to N requests, in this process); `vllm` (an OpenAI-compatible
server already running at --vllm-url). Each FastGen system is a `fastgen-deploy` deployment started for its runs and
stopped after them; requests go through its balancer (`--direct`: straight to its replica). An `slo` deployment's
replicas record every step's predicted and measured time (`--step-trace-dir`; the other schedules' replicas their
steps' measured times, the same cost for every system), and each run keeps its steps in
RAW/<workload>/<system>/c<N>[-<repeat>].steps.csv, which `steps` summarises (median absolute percentage error) and
plots; a run's summary has its engine's steps and the median time of its decode-only steps.

Every run (workload x system x clients [x repeat]) is recorded as soon as it ends: one line of OUT/summary.json
(meta: command, commit, date, machine, load, settings; summary: throughput, effective throughput and misses per R,
TTFT / inter-token / end-to-end percentiles), which the tables and plots are built from and which is tracked in
git; and its raw per-request records (every token's arrival time) in RAW/<workload>/<system>/c<N>[-<repeat>].json,
RAW defaulting to benchmarks/out/serving/<OUT's name>, which git ignores. `run` skips runs already in the summary
(`--force` redoes them), so an interrupted comparison resumes where it stopped and a large one can be run
piecewise. Before each run it waits until the CPUs are quiet (other processes' load below --quiet-cores) so a
neighbour's job does not land in one system's numbers only.

`--repeats K` brings every system up at once and runs the comparison K times, the systems' order rotating.
`--paired` (one client) goes further: every request is sent to each system in turn, the same prompt to each, so a
host whose speed drifts over minutes slows all systems alike instead of the one whose run it caught; each system's
requests, laid back to back, make its run (one summary line per system and repeat, as without it). The order varies
from request to request so that each system comes after each other equally often (`balanced_order`).
`--fresh` starts the deployments anew for every repeat: two processes of one configuration can differ by a few
percent for the whole of their lives, and only new processes per repeat spread that over the systems.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import math
import os
import re
import shutil
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..replica.config import SCHEDULERS
from .loadgen import RunResult, RunSpec, measure, print_summary, run_meta, spec_requests
from .provenance import RAW_DIR, RESULTS_DIR, command
from .report import add_run, has_run
from .stats import SLA, RequestRecord, back_to_back, summarize
from .workload import parse_workload

DEFAULT_OUT = RESULTS_DIR / "serving"


@dataclass(frozen=True)
class System:
    label: str  # names the result folder
    kind: str  # "fastgen" | "hf" | "vllm"
    scheduler: str | None = None
    replicas: int = 1
    budget: int | None = None  # --max-batch-tokens; None: the command's
    token_rate: float | None = None  # the slo scheduler's floor; None: the command's --slo-token-rate


SYSTEM_SUFFIX = re.compile(r"-(?:b(?P<budget>\d+)|t(?P<rate>\d+(?:\.\d+)?)|r(?P<replicas>\d+))")


def parse_system(text: str) -> System:
    if text in ("hf", "vllm"):
        return System(text, text)
    scheduler, _, suffixes = text.partition("-")
    suffixes = "-" + suffixes if suffixes else ""
    found = list(SYSTEM_SUFFIX.finditer(suffixes))
    if scheduler not in SCHEDULERS or "".join(m.group(0) for m in found) != suffixes:
        raise ValueError(
            f"unknown system {text!r}: use {', '.join(SCHEDULERS)} (optionally -bN budget, -tR slo floor, -rK "
            "replicas), hf or vllm"
        )
    parts = {k: v for m in found for k, v in m.groupdict().items() if v is not None}
    return System(
        text,
        "fastgen",
        scheduler,
        int(parts.get("replicas", 1)),
        int(parts["budget"]) if "budget" in parts else None,
        float(parts["rate"]) if "rate" in parts else None,
    )


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---- waiting for a quiet machine ----
def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def busy_cores(window: float = 2.0) -> float:
    """Cores in use over the last `window` seconds. Unlike the 1-minute load average this does not remember our own
    previous run, so it tells whether someone else is busy now."""
    b0, t0 = cpu_times()
    time.sleep(window)
    b1, t1 = cpu_times()
    return cpu_count() * (b1 - b0) / max(t1 - t0, 1e-9)


def wait_quiet(threshold: float, timeout: float) -> float:
    """Waits (up to timeout s) until fewer than `threshold` cores are busy; returns the last reading."""
    if threshold <= 0 or not Path("/proc/stat").exists():
        return float("nan")
    deadline = time.monotonic() + timeout
    busy = busy_cores()
    while busy >= threshold and time.monotonic() < deadline:
        print(
            f"  waiting for a quiet machine: {busy:.2f} cores busy (load {os.getloadavg()[0]:.2f})",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(5)
        busy = busy_cores()
    return busy


def process_cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes have used so far; those that are gone count nothing."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class CpuMeter:
    """CPU used during a run by everything on the machine and by our own processes (this one and the deployment's):
    the difference is what neighbours took, recorded with every run so a disturbed run shows in its numbers."""

    def __init__(self, pids: list[int]):
        self.pids = [os.getpid(), *pids]

    def ours(self) -> float:
        return process_cpu_seconds(self.pids)

    def __enter__(self) -> CpuMeter:
        self.t0, self.busy0, self.ours0 = time.monotonic(), cpu_times()[0], self.ours()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.monotonic() - self.t0, 1e-9)
        busy = (cpu_times()[0] - self.busy0) / os.sysconf("SC_CLK_TCK") / wall
        ours = (self.ours() - self.ours0) / wall
        self.result = {"busy_cores": busy, "our_cores": ours, "others_cores": max(0.0, busy - ours)}


# ---- systems under test ----
def free_base_port(count: int) -> int:
    from ..launch.probe import free_port

    return free_port("127.0.0.1", count=count)


def run_tag(workload: str, system: System, clients: int, seed: int, repeat: int | None) -> str:
    """What heads every prompt of one run, so that each run's prompts are fresh: a server that caches prefixes gets
    no free hits from an earlier run. Repeats run against deployments that stay up, so each repeat has its own tag;
    a peer's server may have served anything before, so its runs are told apart by the time."""
    # The repeat goes first: a prompt's first KV block is where the tag differs.
    tag = (f"r{repeat}-" if repeat else "") + f"{workload}-{system.label}-c{clients}-{seed}"
    return tag + (f"-{time.time_ns()}" if system.kind == "vllm" else "")


@contextlib.contextmanager
def fastgen_deployment(system: System, args: argparse.Namespace):
    """A fastgen-deploy deployment of `system`; yields the address to send requests to."""
    from ..launch import deployment
    from ..launch.config import DeployConfig, default_threads
    from ..launch.state import fastgen_home

    n = system.replicas
    base = free_base_port(2 * (n + 1))
    budget = system.budget or args.max_batch_tokens
    slo = system.scheduler == "slo"
    config = DeployConfig(
        name=f"bench-{system.label}-{os.getpid()}",
        model=args.model,
        replicas=n,
        scheduler=system.scheduler,
        dtype=args.dtype,
        max_batch_tokens=budget,
        max_seqs=min(args.max_seqs, budget),
        threads=args.threads or default_threads(cpu_count(), n),
        port=base,
        metrics_port=base + n + 1,
        http_port=0,  # requests go over gRPC; a vLLM baseline may hold the usual HTTP port
        timeout=args.start_timeout,
        sla_prompt_rate=args.prompt_rate,
        # The slo scheduler holds the largest R its replicas score: only the floor under test.
        sla_token_rates=(system.token_rate or args.slo_token_rate,) if slo else tuple(args.token_rates),
        # Every schedule traces its steps, so engine step times compare across systems (and all pay the same).
        step_trace_dir=str(step_trace_dir(args.raw, system).resolve()),
    )
    home = fastgen_home()
    started = time.monotonic()
    state = deployment.start(config, home)
    pids = [state["supervisor"]["pid"]] + [p["pid"] for p in state["processes"] if p.get("pid")]
    print(
        f"[{system.label}] deployment up in {time.monotonic() - started:.0f} s ({n} replica(s), "
        f"{config.threads} threads each)",
        file=sys.stderr,
        flush=True,
    )
    with stopped_after(home, config.name):
        yield f"127.0.0.1:{base + 1 if args.direct else base}", config, pids


@contextlib.contextmanager
def stopped_after(home: Path, name: str):
    """Stops deployment `name` when the block ends. A clean end also removes its state folder (a benchmark leaves
    nothing behind in FASTGEN_HOME); a failed one keeps it, logs and all, for a look."""
    from ..launch import deployment

    try:
        yield
    except BaseException:
        deployment.stop(home, name, timeout=30)
        raise
    deployment.stop(home, name, timeout=30)
    shutil.rmtree(home / name, ignore_errors=True)


@contextlib.contextmanager
def system_under_test(system: System, args: argparse.Namespace):
    """Yields (make_backend, settings to record). Deployments live outside the event loop, so an interrupt (Ctrl-C,
    SIGTERM) anywhere still stops them."""
    from .backends import FastGenBackend, HFBackend, OpenAIBackend, deployment_credentials

    if system.kind == "fastgen":
        with fastgen_deployment(system, args) as (address, config, pids):
            settings = {
                "scheduler": config.scheduler,
                "sla_prompt_rate": config.sla_prompt_rate,
                "sla_token_rates": list(config.sla_token_rates),
                "step_trace_dir": config.step_trace_dir,
                "replicas": config.replicas,
                "threads": config.threads,
                "max_batch_tokens": config.max_batch_tokens,
                "max_seqs": config.max_seqs,
                "dtype": config.dtype,
                "model": args.model,
                "through": "replica" if args.direct else "balancer",
            }
            credentials = deployment_credentials(config.name, "replica" if args.direct else "balancer")
            yield (lambda: FastGenBackend(address, **credentials)), settings | {"pids": pids}
    elif system.kind == "hf":
        threads = args.threads or cpu_count()
        settings = {"threads": threads, "dtype": args.dtype, "model": args.model, "batching": "static"}
        yield (lambda: HFBackend(tokenizer_dir(args), args.dtype, threads, max_batch=max(args.clients))), settings
    else:
        if not args.vllm_url:
            raise SystemExit("system vllm needs --vllm-url of a running vLLM OpenAI server (see benchmarks/RESULTS.md)")
        model = args.vllm_model or tokenizer_dir(args)
        yield (
            (lambda: OpenAIBackend(args.vllm_url, model, max_in_flight=max(args.clients))),
            {"url": args.vllm_url, "model": model},
        )


def tokenizer_dir(args: argparse.Namespace) -> str:
    from ..replica.weights import resolve_model

    return str(resolve_model(args.model))


# ---- the comparison ----
def default_raw(out: Path) -> Path:
    """Raw records of the runs summarised in OUT: benchmarks/out/serving/<OUT's name> (ignored by git)."""
    return RAW_DIR / "serving" / Path(out).resolve().name


def raw_path(raw: Path, workload: str, system: str, clients: int, repeat: int | None = None) -> Path:
    return raw / workload / system / (f"c{clients}.json" if repeat is None else f"c{clients}-{repeat}.json")


def step_trace_dir(raw: Path, system: System) -> Path:
    """Where a deployment's replicas append their steps (one CSV per replica, for the deployment's life)."""
    return Path(raw) / "steps" / system.label


class StepSlice:
    """The rows the replicas append to their step traces during one run, saved beside the run's raw records."""

    def __init__(self, folder: str | None):
        self.folder = Path(folder) if folder else None
        self.offsets = {p: p.stat().st_size for p in self.folder.glob("*.csv")} if self.folder else {}

    def save(self, raw: Path) -> Path | None:
        if self.folder is None:
            return None
        lines: list[str] = []
        for path in sorted(self.folder.glob("*.csv")):
            with path.open() as f:
                header = f.readline()
                f.seek(max(self.offsets.get(path, 0), len(header)))
                rows = f.read().splitlines()
            lines += [header.rstrip("\n")] if not lines else []
            lines += [f"{row},{path.stem}" for row in rows if row]
        if len(lines) < 2:  # no step ran
            return None
        lines[0] += ",replica"
        out = raw.with_suffix(".steps.csv")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        return out


def engine_steps(path: Path) -> dict:
    """What a run's step trace says of its engine: steps, seconds spent in them, and the median time of the steps
    that carried no prompt token (the inter-token time the engine itself sets). The clients' warm-up requests are
    in the trace's slice too, so busy seconds may exceed the run's measured duration."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    decodes = [float(r["measured_s"]) for r in rows if r["prompt_tokens"] == "0"]
    return {
        "steps": len(rows),
        "busy_s": sum(float(r["measured_s"]) for r in rows),
        "decode_steps": len(decodes),
        "decode_p50_ms": 1000 * statistics.median(decodes) if decodes else math.nan,
    }


def pending_runs(args: argparse.Namespace, system: System) -> list[tuple[str, int]]:
    return [
        (w, n) for w in args.workloads for n in args.clients if args.force or not has_run(args.out, w, system.label, n)
    ]


async def one_run(
    system: System,
    backend,
    settings: dict,
    workload: str,
    clients: int,
    args: argparse.Namespace,
    repeat: int | None = None,
) -> None:
    busy = wait_quiet(args.quiet_cores, args.quiet_timeout)
    tag = run_tag(workload, system, clients, args.seed, repeat)
    spec = RunSpec(
        parse_workload(workload), clients, None, args.requests, args.requests_scale, args.seed, tag, args.max_prompt
    )
    sla = SLA(args.prompt_rate, tuple(args.token_rates))
    steps = StepSlice(settings.get("step_trace_dir"))
    with CpuMeter(settings.get("pids", [])) as cpu:
        result = await measure(
            backend, spec, tokenizer_dir(args), sla, not args.no_progress, desc=f"{workload} {system.label} c{clients}"
        )
    await asyncio.sleep(0.2)  # a replica writes a step's trace row just after the step's outputs went out
    keep_run(
        system, settings, result, steps, workload, clients, repeat, {"busy_cores_before": busy, "cpu": cpu.result}, args
    )


def keep_run(
    system: System,
    settings: dict,
    result: RunResult,
    steps: StepSlice,
    workload: str,
    clients: int,
    repeat: int | None,
    load: dict,
    args: argparse.Namespace,
) -> None:
    """Records a measured run: its raw records and step slice under RAW, its summary line in OUT, a printed line."""
    raw = raw_path(args.raw, workload, system.label, clients, repeat)
    steps_file = steps.save(raw)
    result.meta |= (
        {
            "system": system.label,
            "kind": system.kind,
            "settings": {k: v for k, v in settings.items() if k != "pids"},
            "command": args.command_line,
            "raw": str(raw),
        }
        | load
        | ({"steps": str(steps_file), "engine_steps": engine_steps(steps_file)} if steps_file else {})
    )
    result.save_raw(raw)
    add_run(args.out, workload, system.label, clients, repeat, result.summary_json())
    print_summary(result, f"{workload} {system.label:<14} c{clients}:")
    cpu = load["cpu"]
    print(
        f"  cores busy during the run: {cpu['busy_cores']:.2f}, ours {cpu['our_cores']:.2f}, "
        f"others {cpu['others_cores']:.2f}",
        flush=True,
    )
    if "engine_steps" in result.meta:
        e = result.meta["engine_steps"]
        print(
            f"  engine: {e['steps']} steps, {e['busy_s']:.1f} s busy; decode-only steps p50 {e['decode_p50_ms']:.1f} ms"
        )


def paired_tag(workload: str, systems: list[System], seed: int, repeat: int) -> str:
    """One prompt set for every system of a paired repeat (each deployment sees each prompt once), fresh per
    repeat like run_tag's; a peer's server may have served anything before, so then the time goes in too."""
    tag = f"r{repeat}-{workload}-paired-{seed}"
    return tag + (f"-{time.time_ns()}" if any(s.kind == "vllm" for s in systems) else "")


async def paired_repeat(backends: list, workload: str, args: argparse.Namespace, repeat: int) -> None:
    """One client, every request sent to every system in turn (in balanced_order), the same prompt to each: a host
    whose speed drifts over minutes then slows all systems alike, where separate runs a minute apart would each catch
    it at a different speed. Each system's requests, laid back to back, make its run."""
    systems = [system for system, _, _ in backends]
    busy = wait_quiet(args.quiet_cores, args.quiet_timeout)
    tag = paired_tag(workload, systems, args.seed, repeat)
    spec = RunSpec(
        parse_workload(workload), 1, None, args.requests, args.requests_scale, args.seed, tag, args.max_prompt
    )
    requests = spec_requests(spec, spec.num_requests(), tokenizer_dir(args))
    warmup = spec_requests(spec, 1, tokenizer_dir(args), 10**6)[0]
    slices = [StepSlice(settings.get("step_trace_dir")) for _, _, settings in backends]
    for _, backend, _ in backends:
        await backend.run(warmup)
    records: list[list[RequestRecord]] = [[] for _ in backends]
    load_before = os.getloadavg()
    with CpuMeter([pid for _, _, settings in backends for pid in settings.get("pids", [])]) as cpu:
        for i, request in enumerate(requests):
            for j in balanced_order(len(backends), i + repeat):
                records[j].append(await backends[j][1].run(request))
    await asyncio.sleep(0.2)
    sla = SLA(args.prompt_rate, tuple(args.token_rates))
    for (system, _, settings), recs, steps in zip(backends, records, slices):
        laid = back_to_back(recs)
        meta = run_meta(spec, len(requests), load_before) | {"paired_with": [s.label for s in systems]}
        result = RunResult(meta, asdict(summarize(laid, sla)) | {"sla": asdict(sla)}, [r.to_json() for r in laid])
        keep_run(
            system, settings, result, steps, workload, 1, repeat, {"busy_cores_before": busy, "cpu": cpu.result}, args
        )


def balanced_order(n: int, row: int) -> list[int]:
    """The order in which request `row` goes to n systems: a Williams design, so that over n consecutive requests
    (2n when n is odd) every system is in every place equally often and follows every other system equally often.
    Plain rotation keeps each system behind the same neighbour, so whatever one leaves running for a moment after
    its request (its threads' spin-wait, its stream's last messages) would always land on the same next system."""
    base = [0]
    low, high = 1, n - 1
    while len(base) < n:
        base.append(low if len(base) % 2 else high)
        low, high = (low + 1, high) if len(base) % 2 == 0 else (low, high - 1)
    period = n if n % 2 == 0 else 2 * n
    row %= period
    order = [(b + row) % n for b in base]
    return order[::-1] if row >= n else order


def rotated(items, shift: int) -> list:
    items = list(items)
    shift %= len(items)
    return items[shift:] + items[:shift]


async def run_system(
    system: System, make_backend, settings: dict, runs: list[tuple[str, int]], args: argparse.Namespace
) -> None:
    backend = make_backend()
    await backend.open()
    try:
        for workload, clients in runs:
            await one_run(system, backend, settings, workload, clients, args)
    finally:
        await backend.close()


def run_all(args: argparse.Namespace) -> None:
    if args.repeats > 1 or args.paired:
        return run_repeats(args)
    for system in args.systems:
        runs = pending_runs(args, system)
        if not runs:
            print(f"[{system.label}] all runs already in {args.out} (--force redoes them)", file=sys.stderr)
            continue
        with system_under_test(system, args) as (make_backend, settings):
            asyncio.run(run_system(system, make_backend, settings, runs, args))


def run_repeats(args: argparse.Namespace) -> None:
    """Every system up at once; each repeat runs each system once, the order rotating, so slow drifts of a shared
    machine (and of the tree under test) spread over all systems instead of landing on one."""
    for repeats in [[k] for k in range(args.repeats)] if args.fresh else [range(args.repeats)]:
        if not any(pending_repeat(args, k) for k in repeats):
            continue
        with contextlib.ExitStack() as stack:
            up = [(s, *stack.enter_context(system_under_test(s, args))) for s in args.systems]
            asyncio.run(interleaved(up, args, repeats))


def pending_repeat(args: argparse.Namespace, k: int) -> bool:
    return args.force or any(
        not has_run(args.out, w, s.label, n, k) for w in args.workloads for n in args.clients for s in args.systems
    )


async def interleaved(up: list, args: argparse.Namespace, repeats) -> None:
    backends = []
    for system, make_backend, settings in up:
        backends.append((system, make_backend(), settings))
        await backends[-1][1].open()
    try:
        for k in repeats:
            for workload in args.workloads:
                for clients in args.clients:
                    pending = [
                        b for b in backends if args.force or not has_run(args.out, workload, b[0].label, clients, k)
                    ]
                    if not pending:  # measured before this resumed run
                        continue
                    if args.paired:
                        await paired_repeat(backends, workload, args, repeat=k)
                        continue
                    for system, backend, settings in rotated(pending, k):
                        await one_run(system, backend, settings, workload, clients, args, repeat=k)
    finally:
        for _, backend, _ in backends:
            await backend.close()


def interrupt(signum, frame):
    raise KeyboardInterrupt  # unwinds through the deployments' context managers, which stop them


# ---- command line ----
def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", type=lambda s: s.split(","), default=["C1", "C2"], help="default: C1,C2")
    p.add_argument(
        "--systems",
        type=lambda s: [parse_system(x) for x in s.split(",")],
        default=[parse_system(x) for x in ("splitfuse", "prefill_first", "static", "hf")],
        help="default: splitfuse,prefill_first,static,hf",
    )
    p.add_argument("--clients", type=int_list, default=[1, 2, 4, 8], help="default: 1,2,4,8")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default: 4 x clients + 16)")
    p.add_argument("--requests-scale", type=float, default=1.0, help="multiplies the request count (e.g. 0.5)")
    p.add_argument("--max-prompt", type=int, default=None, help="cap prompt lengths (smoke runs on small models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m", help="alias or Hugging Face folder (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--max-batch-tokens", type=int, default=512, help="engine token budget (default: 512)")
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="threads per replica / for hf (default: cores / replicas)")
    p.add_argument("--direct", action="store_true", help="send to the replica, not through the balancer")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--vllm-url", default=None, help="base URL of a running vLLM OpenAI server")
    p.add_argument("--vllm-model", default=None, help="model name vLLM serves (default: the model's folder)")
    p.add_argument("--prompt-rate", type=float, default=100.0, help="SLA P in prompt tokens/s (default: 100)")
    p.add_argument("--token-rates", type=float_list, default=[1.0, 2.0, 4.0], help="SLA R values (default: 1,2,4)")
    p.add_argument(
        "--slo-token-rate",
        type=float,
        default=2.0,
        help="the token-rate floor R of slo systems without -tR (default: %(default)g)",
    )
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.7,
        help="before each run, wait until fewer cores than this are busy (0: don't wait; default 0.7)",
    )
    p.add_argument(
        "--quiet-timeout",
        type=float,
        default=900.0,
        help="longest wait for quiet, seconds; the run then goes ahead and records the load (default 900)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="K > 1: all systems up together, runs interleaved K times (recorded with their repeat index)",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="one client only: all systems up together, every request sent to each in turn (the same prompt), so "
        "a drifting host slows all alike; each system's requests laid back to back make its run (one per repeat)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="with --repeats: start the deployments anew for every repeat, so differences between processes of "
        "one configuration spread over the systems",
    )
    p.add_argument("--force", action="store_true", help="redo runs whose results exist")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-report", action="store_true", help="skip tables and plots at the end")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the comparison (resumable), then report")
    add_run_args(run)
    report = sub.add_parser("report", help="tables, checks and plots from the results folder")
    steps = sub.add_parser("steps", help="the slo step-time model's error and predicted-vs-measured plots")
    for q in (run, report, steps):
        q.add_argument(
            "--out",
            type=Path,
            default=DEFAULT_OUT,
            help="results folder, tracked: summary.json and plots (default: %(default)s)",
        )
    for q in (run, steps):
        q.add_argument(
            "--raw",
            type=Path,
            default=None,
            help="raw per-request records (default: benchmarks/out/serving/<OUT's name>)",
        )
    steps.add_argument("--no-plots", action="store_true")
    report.add_argument("--headline", default="C1", help="workload of the SplitFuse vs prefill-first check")
    report.add_argument("--no-plots", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from .report import report, steps_report

    args = parse_args(argv)
    if args.command == "steps":
        print(steps_report(args.raw or default_raw(args.out), args.out, plots=not args.no_plots))
        return 0
    if args.command == "run":
        if args.paired and args.clients != [1]:
            raise SystemExit("--paired sends each request to every system in turn: it needs --clients 1")
        args.raw = args.raw or default_raw(args.out)
        args.command_line = command("serving", argv)
        print(f"load average before: {os.getloadavg()}", file=sys.stderr)
        # Our own handlers: asyncio.run would only cancel its task on Ctrl-C; this unwinds to the deployments.
        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, interrupt)
        run_all(args)
        if args.no_report:
            return 0
        args.headline, args.no_plots = args.workloads[0], False
        if any(s.scheduler == "slo" for s in args.systems):
            print(steps_report(args.raw, args.out))
    print(report(args.out, args.headline, plots=not args.no_plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
