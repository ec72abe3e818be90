"""The `--quantization` modes against each other, offline, on one model in one process: the weights each holds, one
stream's decode, N concurrent streams and a long prompt's prefill.

    python -m fastgen.benchmarks.quantization --repeats 3 --json benchmarks/results/quantization/NAME.json

Each mode's engine is built once (`pipeline(model, dtype, quantization=mode)`, the deployment's threads), then every
repeat measures each mode in turn, the order rotating between repeats, on fresh random prompts (the same for every
mode within a repeat; prefix caching off):
- decode: one stream, a --decode-prompt-tokens prompt, --gen tokens: (tokens - 1) / (last token - first token);
- concurrent: --streams sequences at once, each a --decode-prompt-tokens prompt and --gen tokens: all their tokens
  over the time from adding them to the last token;
- prefill: one --prefill-tokens prompt, one token generated: prompt tokens / time to that token.
Ratios against the first mode (the baseline, `none` by default) are taken within each repeat; medians reported.

Modes `awq` and `gptq` serve the model's float checkpoint quantized here to int4 (round to nearest, groups of
--int4-group, packed as AutoAWQ and AutoGPTQ write them: fastgen/int4_writer.py; gptq symmetric) with quantization
auto: the speed of an AWQ/GPTQ checkpoint served on this CPU (its layers as GGUF blocks, kernels/int4.py), not the
accuracy of a calibrated one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from .llama_cpp import MEASURES, add_workload_args
from .provenance import run_info


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The weights the model holds, each once: float parameters, a packed float layer at its dtype's size, quantized
    layers' (and a quantized embedding's) blocks. A tied head's blocks are its embedding's."""
    from ..kernels.quant import QuantizedTensor, QuantLinear

    held = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = {}
    for module in model.modules():
        packed, quantized = getattr(module, "packed", None), getattr(module, "quantized", None)
        if isinstance(packed, QuantLinear):
            blocks.update((w.data.data_ptr(), w.nbytes) for _, w, _ in packed.slabs)
        elif packed is not None and getattr(module, "weight", True) is None:  # the packed form holds the weight
            held += module.out_features * module.in_features * dtype.itemsize
        if isinstance(quantized, QuantizedTensor):
            blocks[quantized.data.data_ptr()] = quantized.nbytes
    return held + sum(blocks.values())


INT4_MODES = {"awq": {}, "gptq": {"sym": True}}  # int4_writer options of each


def int4_checkpoint(model: str, mode: str, group: int, root: Path) -> str:
    """The model's float checkpoint written as an int4 one of `mode`'s layout under root."""
    from ..int4_writer import write_int4_checkpoint
    from ..replica.weights import resolve_model

    folder = root / mode
    write_int4_checkpoint(resolve_model(model), folder, root / f"{mode}-dequantized", mode, group, **INT4_MODES[mode])
    return str(folder)


def run(engine, prompts: list[list[int]], gen: int) -> list[list[float]]:
    """Runs the prompts to `gen` tokens each (EOS ignored); returns each one's token times."""
    from ..replica.request import SamplingParams

    params = SamplingParams(max_new_tokens=gen, min_new_tokens=gen, ignore_eos=True)
    times: dict[str, list[float]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
    done = 0
    while done < len(prompts):
        out = engine.step().outputs
        now = time.perf_counter()
        for o in out:
            times.setdefault(o.request_id, []).extend([now] * (o.generated_tokens - len(times.get(o.request_id, []))))
            done += o.finished
    return list(times.values())


def measure(engine, args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    def fresh(count: int, length: int) -> list[list[int]]:
        return [[rng.randrange(200, 49000) for _ in range(length)] for _ in range(count)]

    run(engine, fresh(1, args.decode_prompt_tokens), 8)  # warm-up
    (one,) = run(engine, fresh(1, args.decode_prompt_tokens), args.gen)
    start = time.perf_counter()
    many = run(engine, fresh(args.streams, args.decode_prompt_tokens), args.gen)
    concurrent = args.streams * args.gen / (max(t[-1] for t in many) - start)
    start = time.perf_counter()
    (long,) = run(engine, fresh(1, args.prefill_tokens), 1)
    return {
        "decode": (args.gen - 1) / (one[-1] - one[0]),
        "concurrent": concurrent,
        "prefill": args.prefill_tokens / (long[0] - start),
    }


def summarize(runs: dict[str, list[dict[str, float]]], held: dict[str, int], baseline: str) -> dict:
    out = {}
    for mode, repeats in runs.items():
        entry = {"weight_bytes": held[mode]}
        for m in MEASURES:
            values = [r[m] for r in repeats]
            ratios = [v / b[m] for v, b in zip(values, runs[baseline])]
            entry[m] = {
                "tokens_per_s": [round(v, 1) for v in values],
                "over_baseline": [round(r, 3) for r in ratios],
                "median_ratio": round(statistics.median(ratios), 3),
            }
        out[mode] = entry
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.quantization",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--modes", default="none,int8,auto", help="quantization modes, awq and gptq too; the first is the baseline"
    )
    p.add_argument("--int4-group", type=int, default=64, help="input features per scale of the awq/gptq modes")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    add_workload_args(p)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    return args


def main(argv=None) -> int:
    from ..replica import pipeline

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    scratch = tempfile.TemporaryDirectory()
    engines = {}
    for m in modes:
        model, quantization = args.model, m
        if m in INT4_MODES:
            model, quantization = int4_checkpoint(args.model, m, args.int4_group, Path(scratch.name)), "auto"
        pipe = pipeline(model, dtype=args.dtype, quantization=quantization, prefix_caching=False, progress=False)
        engines[m] = pipe.engine
    dtype = getattr(torch, args.dtype)
    held = {m: weight_bytes(e.runner.model, dtype) for m, e in engines.items()}
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        order = modes[repeat % len(modes) :] + modes[: repeat % len(modes)]
        for mode in order:
            runs[mode].append(measure(engines[mode], args, random.Random(repeat)))
            print(f"repeat {repeat} {mode}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    summary = {
        "meta": run_info("quantization", args.argv) | {"dtype": args.dtype, "threads": args.threads},
        "baseline": modes[0],
        "modes": summarize(runs, held, modes[0]),
    }
    for mode, entry in summary["modes"].items():
        cells = [f"{entry[m]['median_ratio']}× ({statistics.median(entry[m]['tokens_per_s'])} tok/s)" for m in MEASURES]
        print(f"{mode:6} {entry['weight_bytes'] / 2**20:7.1f} MiB  " + "  ".join(cells))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
