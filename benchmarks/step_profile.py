"""Cost of one engine step against the tokens it carries, on this machine: the curve that decides whether fusing
decodes into prompt chunks (Dynamic SplitFuse) can be cheap.

    python -m fastgen.benchmarks.step_profile --threads 2 --dtype bfloat16

On a GPU a forward pass costs about the same from one token up to a few hundred (it is bound by reading the
weights), so decodes ride along with a prompt chunk almost for free. Where the cost grows with every token, a step
that carries a 512-token chunk is as long as a prefill, and decodes fused into it wait as long as they would
behind a whole prompt. Prints milliseconds per step for decode batches of b sequences plus a prompt chunk of k
tokens (median of --repeats). --json writes them with the command, commit, date and machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path


def step_ms(engine, decodes: int, chunk: int, repeats: int) -> float:
    """Median time of a step with `decodes` decoding sequences and one prompt chunk of `chunk` tokens."""
    from fastgen.replica.request import SamplingParams

    times = []
    for r in range(repeats):
        for i in range(decodes):  # bring `decodes` sequences to their decode phase
            engine.add_request(f"d{r}-{i}", list(range(100, 116)), SamplingParams(max_new_tokens=64, ignore_eos=True))
        while engine.num_waiting or any_prefilling(engine):
            engine.step()
        if chunk:
            engine.add_request(f"p{r}", list(range(200, 200 + chunk)), SamplingParams(max_new_tokens=1))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        for rid in list(engine._requests):  # drop everything before the next sample
            engine.abort(rid)
    return statistics.median(times) * 1e3


def chunk_after_history_ms(engine, history: int, chunk: int, repeats: int) -> float:
    """Median time of the step that computes `chunk` prompt tokens of a sequence whose first `history` tokens are
    already cached (what Dynamic SplitFuse does to every prompt longer than the budget)."""
    from fastgen.replica.request import SamplingParams

    times = []
    for r in range(repeats):
        rid = f"h{history}-{chunk}-{r}"
        engine.add_request(rid, list(range(300, 300 + history + chunk)), SamplingParams(max_new_tokens=1))
        seq = engine.scheduler.waiting[0]
        config = engine.scheduler.config
        engine.scheduler.config = replace(config, max_batch_tokens=history)  # first step: exactly the history
        engine.step()
        engine.scheduler.config = config
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        assert seq.num_computed == history + chunk
        engine.abort(rid)
    return statistics.median(times) * 1e3


def any_prefilling(engine) -> bool:
    return any(seq.num_uncomputed > 1 for seq in engine.scheduler.running)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decodes", default="0,1,8")
    p.add_argument("--chunks", default="0,16,64,128,256,512")
    p.add_argument("--histories", default="0,512", help="cached tokens before the chunk (0: skip this table)")
    p.add_argument("--history-chunks", default="88,128,512")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    from fastgen.replica.builder import build_engine
    from fastgen.replica.config import EngineConfig, SchedulerConfig

    torch.set_num_threads(args.threads)
    engine = build_engine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            progress=False,
            scheduler=SchedulerConfig(max_batch_tokens=1024, max_seqs=64),
        )
    )
    histories = [int(x) for x in args.histories.split(",") if x]
    step_ms(engine, 1, 16, 2)  # warm-up
    rows = []
    for b in (int(x) for x in args.decodes.split(",")):
        for k in (int(x) for x in args.chunks.split(",")):
            if b == 0 and k == 0:
                continue
            ms = step_ms(engine, b, k, args.repeats)
            rows.append({"decodes": b, "chunk": k, "ms": ms})
            print(f"decodes {b:>2} + chunk {k:>4} tokens: {ms:7.1f} ms", flush=True)
    for h in histories:
        for k in (int(x) for x in args.history_chunks.split(",")):
            if h == 0:
                ms = step_ms(engine, 0, k, args.repeats)
            else:
                ms = chunk_after_history_ms(engine, h, k, args.repeats)
            rows.append({"history": h, "chunk": k, "ms": ms})
            print(f"chunk {k:>4} tokens after {h:>4} cached: {ms:7.1f} ms", flush=True)
    if args.json:
        from .provenance import run_info

        meta = run_info("step_profile", argv) | {"model": args.model, "dtype": args.dtype, "threads": args.threads}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
