"""What structured output costs (issue 47): the grammar mask per step at batch 64 with 64 different JSON schemas, and
the engine's decode step time with every sequence constrained against none.

    python -m fastgen.benchmarks.structured --repeats 5 --json benchmarks/results/structured/NAME.json

1. Mask: the engine's own path for one step — Constraints.masks (xgrammar fills each sequence's bitmask) and the
   sampler's unpack + masked_fill over (batch, vocab) logits — then each matcher accepts a token of a valid answer.
2. Throughput: the embedded SmolLM2 (float32) decodes `batch` requests of `tokens` tokens; the median time of the
   steps that decode the full batch, constrained (each request its own schema; a long free string so every step is
   constrained) and not. Both runs are greedy with min_new_tokens, so the batches are the same size. Repeats
   alternate their order; the throughput lost is taken within each repeat (1 - off / on), its median reported."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from .provenance import run_info


def schema(i: int) -> str:
    return json.dumps(
        {
            "type": "object",
            "properties": {
                f"note{i}": {"type": "string", "minLength": 400, "maxLength": 600},
                "n": {"type": "integer"},
            },
            "required": [f"note{i}", "n"],
            "additionalProperties": False,
        }
    )


def mask_cost(engine, batch: int, steps: int) -> dict:
    from ..replica.request import Constraint
    from ..replica.sampler import SamplingRow, _constrain

    cons = engine.constraints
    t = time.perf_counter()
    grammars = [cons.grammar(Constraint("json_schema", schema(i))) for i in range(batch)]
    compile_ms = (time.perf_counter() - t) * 1e3 / batch
    matchers = [cons.matcher(g) for g in grammars]
    answers = [
        engine.tokenizer.encode(f'{{"note{i}": "' + "lorem ipsum " * 60, add_special_tokens=False) for i in range(batch)
    ]
    logits = torch.randn(batch, engine.model_config.vocab_size)
    fill, apply = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        masks = cons.masks(matchers)
        t1 = time.perf_counter()
        rows = [SamplingRow(0.0, 1.0, 0, 0, 0, [], allowed=m) for m in masks]
        _constrain(logits.clone(), rows)
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        for m, ids in zip(matchers, answers):
            assert m.accept(ids[s])
    return {
        "compile_ms_per_schema": round(compile_ms, 2),
        "fill_ms_per_step": round(statistics.median(fill) * 1e3, 2),
        "apply_ms_per_step": round(statistics.median(apply) * 1e3, 2),
    }


def decode_step_s(engine, batch: int, tokens: int, constrained: bool, repeat: int) -> float:
    from ..replica.request import Constraint, SamplingParams

    times = []
    for i in range(batch):
        c = Constraint("json_schema", schema(i)) if constrained else None
        p = SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens, constraint=c)
        engine.add_request(f"{constrained}-{repeat}-{i}", f"Write note {i}:", p)
    while engine.has_unfinished():
        result = engine.step()
        st = result.stats
        if st is not None and st.num_decode_tokens == batch and st.num_prefill_tokens == 0:
            times.append(st.step_s)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="write the summary here (benchmarks/results/...)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ..replica import pipeline

    engine = pipeline(
        "smollm2-135m", dtype="float32", max_batch_tokens=2048, max_seqs=args.batch, progress=False
    ).engine
    out = {
        "meta": run_info("structured", argv),
        "batch": args.batch,
        "threads": args.threads,
        **mask_cost(engine, args.batch, args.steps),
    }
    decode_step_s(engine, args.batch, args.tokens, False, -1)  # warm-up: the first batch of a shape runs slower
    runs = {False: [], True: []}
    for r in range(args.repeats):  # interleaved, the order alternating: a drifting host hits both alike
        for constrained in (False, True) if r % 2 == 0 else (True, False):
            runs[constrained].append(decode_step_s(engine, args.batch, args.tokens, constrained, r))
    lost = [1 - off / on for off, on in zip(runs[False], runs[True])]
    out["decode_step_ms_off"] = [round(x * 1e3, 2) for x in runs[False]]
    out["decode_step_ms_on"] = [round(x * 1e3, 2) for x in runs[True]]
    out["throughput_lost"] = [round(x, 4) for x in lost]
    out["median_throughput_lost"] = round(statistics.median(lost), 4)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
