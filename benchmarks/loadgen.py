"""Load generator: one measured run against a running server, closed-loop (the paper's) or open-loop Poisson.

    python -m fastgen.benchmarks.loadgen --target 127.0.0.1:50050 --workload C1 --clients 4 --json summary.json
    python -m fastgen.benchmarks.loadgen --target 127.0.0.1:50050 --workload C2 --rate 0.5 --requests 40
    python -m fastgen.benchmarks.loadgen --openai http://127.0.0.1:8000 --openai-model /path/to/hf-folder ...

Closed loop: N clients each send one warm-up request, wait at a barrier, then send their next request as soon as
the previous one finished, until 4 x N + 16 requests (the CPU profile) have completed. Open loop: requests arrive
as a Poisson process of the given rate, whatever is still in flight. `--fixed-lengths` makes every prompt and
generation exactly the workload's means (no 30% spread), e.g. to compare two paths to one server. Prompts are
token ids, so the tokenizer of the served model must be given (`--tokenizer`, default: the embedded SmolLM2's folder).

`--json` writes the run's summary (percentiles, SLA figures, the command, commit and machine); the raw per-request
records (every token's arrival time) go to `--raw`, by default benchmarks/out/loadgen/<tag>.json, which git ignores.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .provenance import RAW_DIR, git_commit, machine, machine_name  # noqa: F401 (re-exported)
from .stats import SLA, RequestRecord, summarize
from .workload import BenchRequest, Workload, corpus_ids, load_tokenizer, make_requests, parse_workload


@dataclass
class RunSpec:
    workload: Workload
    clients: int = 1  # closed loop: concurrent clients
    rate: float | None = None  # open loop: requests per second (then `clients` is unused)
    requests: int | None = None  # None: 4 x clients + 16
    requests_scale: float = 1.0
    seed: int = 0
    tag: str = "run"  # names the prompts' headers: a new tag gives fresh prompts
    max_prompt: int | None = None
    fixed_lengths: bool = False  # every prompt and generation exactly the workload's means (fixed_requests)

    def num_requests(self) -> int:
        base = self.requests if self.requests is not None else 4 * self.clients + 16
        return max(1, round(base * self.requests_scale))


@dataclass
class RunResult:
    meta: dict
    summary: dict
    records: list[dict] = field(default_factory=list)  # raw: one per request, every token's arrival time

    def summary_json(self) -> dict:
        """What a results table is built from: meta and summary, no per-request records."""
        return {"meta": self.meta, "summary": self.summary}

    def save_summary(self, path: Path) -> None:
        write_json(path, self.summary_json(), indent=1)

    def save_raw(self, path: Path) -> None:
        """Everything, records included: for benchmarks/out/ (ignored by git), not for the tracked results."""
        write_json(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> RunResult:
        return cls(**json.loads(path.read_text()))


def fixed_requests(
    workload: Workload, n: int, tokenizer_dir: str, seed: int = 0, tag: str = "run", first_index: int = 0
) -> list[BenchRequest]:
    """Like make_requests (real text from the corpus at seeded offsets, each prompt opened by a header naming the
    tag and the request, so a new tag never shares a prefix with an old one), but every prompt is exactly
    workload.prompt_mean tokens and every generation exactly workload.gen_mean."""
    ids = corpus_ids(str(tokenizer_dir))
    tok = load_tokenizer(str(tokenizer_dir))
    rng = random.Random(f"{seed}-{workload.name}-fixed-{first_index}")
    out = []
    for i in range(first_index, first_index + n):
        header = tok.encode(f"[{tag} #{i}] ", add_special_tokens=False)
        start = rng.randrange(len(ids))
        body = [ids[(start + j) % len(ids)] for j in range(max(0, workload.prompt_mean - len(header)))]
        out.append(BenchRequest(i, (header + body)[: workload.prompt_mean], workload.gen_mean))
    return out


def spec_requests(spec: RunSpec, n: int, tokenizer_dir: str, first_index: int = 0) -> list[BenchRequest]:
    if spec.fixed_lengths:
        return fixed_requests(spec.workload, n, tokenizer_dir, spec.seed, spec.tag, first_index)
    return make_requests(spec.workload, n, tokenizer_dir, spec.seed, spec.tag, first_index, spec.max_prompt)


def write_json(path: Path, data, indent: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    tmp.replace(path)  # a run killed half-way leaves no file


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=False)


async def closed_loop(backend, requests, warmups, clients: int, bar=None) -> list[RequestRecord]:
    """The paper's clients: one warm-up each, a barrier, then back-to-back requests from a shared queue."""
    await asyncio.gather(*(backend.run(w, i) for i, w in enumerate(warmups[:clients])))
    pending = deque(requests)
    records: list[RequestRecord] = []

    async def client(i: int) -> None:
        while pending:
            rec = await backend.run(pending.popleft(), i)
            records.append(rec)
            if bar is not None:
                bar.update()

    await asyncio.gather(*(client(i) for i in range(clients)))
    return records


async def open_loop(backend, requests, rate: float, seed: int = 0, bar=None) -> list[RequestRecord]:
    """Poisson arrivals at `rate` per second (seeded gaps), each request sent on time whatever is in flight."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    records: list[RequestRecord] = []

    async def one(req, at: float) -> None:
        await asyncio.sleep(max(0.0, at - loop.time()))
        records.append(await backend.run(req, req.index))
        if bar is not None:
            bar.update()

    t, tasks = loop.time(), []
    for req in requests:
        t += rng.expovariate(rate)
        tasks.append(asyncio.ensure_future(one(req, t)))
    await asyncio.gather(*tasks)
    return records


async def measure(
    backend, spec: RunSpec, tokenizer_dir: str, sla: SLA = SLA(), progress: bool = True, desc: str = ""
) -> RunResult:
    n = spec.num_requests()
    requests = spec_requests(spec, n, tokenizer_dir)
    warmups = spec_requests(spec, spec.clients, tokenizer_dir, 10**6)
    bar = progress_bar(n, desc, progress)
    load_before = os.getloadavg()
    try:
        if spec.rate is not None:
            records = await open_loop(backend, requests, spec.rate, spec.seed, bar)
        else:
            records = await closed_loop(backend, requests, warmups, spec.clients, bar)
    finally:
        if bar is not None:
            bar.close()
    meta = run_meta(spec, n, load_before)
    return RunResult(
        meta=meta,
        summary=asdict(summarize(records, sla)) | {"sla": asdict(sla)},
        records=[r.to_json() for r in records],
    )


def run_meta(spec: RunSpec, n: int, load_before) -> dict:
    return {
        "workload": asdict(spec.workload),
        "mode": "open" if spec.rate is not None else "closed",
        "clients": spec.clients,
        "rate": spec.rate,
        "requests": n,
        "seed": spec.seed,
        "tag": spec.tag,
        "fixed_lengths": spec.fixed_lengths,
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine(),
        "python": sys.version.split()[0],
    }


def default_tokenizer() -> str:
    from ..replica.weights import resolve_model

    return str(resolve_model("smollm2-135m"))


def print_summary(result: RunResult, label: str = "") -> None:
    s = result.summary
    eff = ", ".join(f"R={r}: {v:.3f}" for r, v in s["effective"].items())
    miss = ", ".join(f"R={r}: {v:.0%}" for r, v in s["sla_missed"].items())
    print(
        f"{label} {s['requests']} requests ({s['failed']} failed) in {s['duration_s']:.1f} s: "
        f"throughput {s['throughput']:.3f} req/s ({s['token_throughput']:.1f} tok/s); effective {eff}; "
        f"missing SLA {miss}; TTFT p50/p95 {s['ttft']['p50']:.3f}/{s['ttft']['p95']:.3f} s; "
        f"inter-token p50/p95/p99 {s['inter_token']['p50'] * 1e3:.0f}/{s['inter_token']['p95'] * 1e3:.0f}/"
        f"{s['inter_token']['p99'] * 1e3:.0f} ms; e2e p50/p95 {s['latency']['p50']:.2f}/{s['latency']['p95']:.2f} s",
        flush=True,
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.loadgen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--target", help="host:port of a FastGen balancer or replica")
    target.add_argument("--openai", help="base URL of an OpenAI-compatible server (vLLM)")
    p.add_argument("--openai-model", default=None, help="model name the OpenAI server serves")
    p.add_argument("--api-key", default=None, help="bearer token for --openai (default: $FASTGEN_API_KEY, else none)")
    p.add_argument(
        "--keepalive", action="store_true", help="--openai: keep one connection per client (default: one per request)"
    )
    p.add_argument("--tokenizer", default=None, help="Hugging Face folder of the served model's tokenizer")
    p.add_argument("--workload", default="C1", help="C1, C2, ... or PROMPTxGEN (default: C1)")
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument("--requests", type=int, default=None, help="default: 4 x clients + 16")
    p.add_argument("--requests-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fixed-lengths", action="store_true", help="every prompt and generation exactly the workload's means"
    )
    p.add_argument("--tag", default=None, help="prompt header tag (default: unique per run)")
    p.add_argument("--prompt-rate", type=float, default=100.0, help="SLA P, prompt tokens/s (default 100)")
    p.add_argument("--token-rates", default="1,2,4", help="SLA R values, tokens/s (default 1,2,4)")
    p.add_argument("--json", type=Path, default=None, help="write the run's summary here (no per-request records)")
    p.add_argument(
        "--raw", type=Path, default=None, help="raw per-request records (default: benchmarks/out/loadgen/<tag>.json)"
    )
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def make_backend(args: argparse.Namespace):
    from .backends import FastGenBackend, OpenAIBackend

    if args.target:
        return FastGenBackend(args.target)
    api_key = args.api_key or os.environ.get("FASTGEN_API_KEY")
    model = args.openai_model or args.tokenizer or default_tokenizer()
    return OpenAIBackend(args.openai, model, api_key=api_key, keepalive=args.keepalive)


async def main_async(args: argparse.Namespace) -> RunResult:
    backend = make_backend(args)
    spec = RunSpec(
        parse_workload(args.workload), args.clients, args.rate, args.requests, args.requests_scale, args.seed, args.tag
    )
    spec.fixed_lengths = args.fixed_lengths
    sla = SLA(args.prompt_rate, tuple(float(r) for r in args.token_rates.split(",")))
    await backend.open()
    try:
        return await measure(backend, spec, args.tokenizer or default_tokenizer(), sla, not args.no_progress)
    finally:
        await backend.close()


def main(argv=None) -> int:
    from .provenance import command

    args = parse_args(argv)
    args.tag = args.tag or f"{os.getpid()}-{datetime.datetime.now():%H%M%S}"
    result = asyncio.run(main_async(args))
    result.meta["command"] = command("loadgen", argv)
    raw = args.raw or RAW_DIR / "loadgen" / f"{args.tag}.json"
    result.meta["raw"] = str(raw)
    print_summary(result, args.workload)
    result.save_raw(raw)
    if args.json:
        result.save_summary(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
