"""Decode batches past 8 rows on AMX-INT8 tiles, as one replica meets them: its engine in process under a closed loop.

    python -m fastgen.benchmarks.decode_batches [--clients 8,16,32] [--repeats 3] [--seconds 30] [--threads 1] \
        [--json benchmarks/results/quantization/decode_batches_HOST.json]

One engine built as a replica builds it (the embedded GGUF in its blocks, bfloat16, the slo scheduler calibrated as at
start-up, prefix caching off: every prompt is computed), --threads torch threads (a default deployment's replica on 2
cores has one). N clients each keep one request in flight: token ids drawn at random, 250-450 prompt tokens, 64 out,
EOS ignored (the served benchmark's shape, benchmarks/against_vllm.py). Two ways of running the decode steps, in turn
within each repeat, the order alternating:

- `amx-int8`: the fused decode layer takes decode batches up to kernels/decode_layer.py decode_rows (32 where the
  process may use AMX-INT8), its projections on csrc/linear_amx_q8.c from 5 rows (AMX_INT8_MIN_ROWS);
- `vnni-only`: the fused decode layers' max_rows set to INT8_MAX_ROWS (8) and amx_rows to 0, as before
  linear_amx_q8.c: a larger decode batch runs module by module, its projections one bfloat16 GEMM on the layer
  dequantized in panels.

Per run: tokens computed per second (prompt and decode), requests finished per second, steps, mean step time,
decode and prompt tokens per step. Medians of the repeats, and the median over repeats of amx-int8 / vnni-only's
tokens per second, per client count. On a CPU without AMX-INT8 both are the same path, and
the benchmark says so and stops.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

MODES = ("amx-int8", "vnni-only")


def closed_loop(engine, clients: int, seconds: float, seed: int) -> dict:
    """`clients` requests kept in flight for `seconds`; what the engine did meanwhile."""
    from fastgen.replica.request import SamplingParams

    rng, vocab = random.Random(seed), engine.model_config.vocab_size
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    added = 0

    def add() -> None:
        nonlocal added
        ids = [rng.randrange(100, vocab) for _ in range(rng.randint(250, 450))]
        engine.add_request(f"s{seed}-{added}", ids, params)
        added += 1

    for _ in range(clients):
        add()
    start, finished, steps = time.monotonic(), 0, []
    while time.monotonic() - start < seconds:
        result = engine.step()
        if result.stats is not None:
            steps.append(result.stats)
        for out in result.outputs:
            if out.finished:
                finished += 1
                add()
    elapsed = time.monotonic() - start
    for rid in list(engine._requests):  # nothing carries over into the next run
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return {
        # every token a step computed, prompt and decode: unlike finished requests, which come in waves when every
        # client starts at once, it does not depend on where the window ends
        "tokens_per_s": sum(s.num_decode_tokens + s.num_prefill_tokens for s in steps) / elapsed,
        "requests_per_s": finished / elapsed,
        "steps": len(steps),
        "step_ms": 1e3 * statistics.mean(s.step_s for s in steps),
        "decode_tokens_per_step": statistics.mean(s.num_decode_tokens for s in steps),
        "prompt_tokens_per_step": statistics.mean(s.num_prefill_tokens for s in steps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="8,16,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    from fastgen.kernels import quant
    from fastgen.replica.__main__ import warm_up
    from fastgen.replica.builder import build_engine
    from fastgen.replica.engine_args import EngineArgs

    torch.set_num_threads(args.threads)
    if quant.amx_int8_kernel() is None:
        print("this CPU has no AMX-INT8 (or Linux refused the tile state): both ways are the same path")
        return 0
    config = EngineArgs(model="smollm2-135m", threads=args.threads).engine_config()
    engine = build_engine(replace(config, cache=replace(config.cache, prefix_caching=False), progress=False))
    warm_up(engine)
    layers = engine.runner.model.layers
    fused = {"amx-int8": [layer.fused for layer in layers]}
    fused["vnni-only"] = [replace(f, max_rows=quant.INT8_MAX_ROWS, amx_rows=0) for f in fused["amx-int8"]]
    assert all(f is not None and f.max_rows > quant.INT8_MAX_ROWS for f in fused["amx-int8"])
    clients = [int(c) for c in args.clients.split(",")]
    runs: dict[str, dict[str, list[dict]]] = {str(c): {m: [] for m in MODES} for c in clients}
    for r in range(args.repeats):
        for c in clients:
            for mode in MODES if (r + c) % 2 == 0 else MODES[::-1]:
                for layer, f in zip(layers, fused[mode]):
                    layer.fused = f
                run = closed_loop(engine, c, args.seconds, seed=1000 * r + c)
                runs[str(c)][mode].append(run)
                print(f"repeat {r} clients {c:>3} {mode:>9}: {run['tokens_per_s']:.0f} tok/s, "
                      f"{run['requests_per_s']:.2f} req/s, "
                      f"step {run['step_ms']:.1f} ms, {run['decode_tokens_per_step']:.1f} decode + "
                      f"{run['prompt_tokens_per_step']:.1f} prompt tokens a step", flush=True)  # fmt: skip
    medians = {
        c: {m: {k: statistics.median(run[k] for run in by_mode[m]) for k in by_mode[m][0]} for m in MODES}
        for c, by_mode in runs.items()
    }
    ratios = {
        c: statistics.median(a["tokens_per_s"] / v["tokens_per_s"] for a, v in zip(by["amx-int8"], by["vnni-only"]))
        for c, by in runs.items()
    }
    print("\n| clients | tok/s amx-int8 | tok/s vnni-only | ÷ per repeat, median | step ms amx-int8 | vnni-only |")
    print("|---|---|---|---|---|---|")
    for c, m in medians.items():
        a, v = m["amx-int8"], m["vnni-only"]
        print(f"| {c} | {a['tokens_per_s']:.0f} | {v['tokens_per_s']:.0f} | {ratios[c]:.2f}x | "
              f"{a['step_ms']:.1f} | {v['step_ms']:.1f} |")  # fmt: skip
    if args.json:
        from .provenance import run_info

        meta = run_info("decode_batches", argv) | {"threads": args.threads, "seconds": args.seconds}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {"meta": meta, "medians": medians, "ratios": ratios, "runs": runs}
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
