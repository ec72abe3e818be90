"""A mixture of experts on the CPU: its decode step against a dense model with the same active parameters, and its
offline throughput against transformers `generate`, on the same random checkpoint.

    python -m fastgen.benchmarks.moe --repeats 3 --json benchmarks/results/moe/NAME.json

The models (random weights, saved as safetensors, built here): a Mixtral of 4 layers, hidden 1024, 8 experts of
intermediate 2816, 2 per token, and a Llama of the same shape whose one MLP has intermediate 5632: a token reads the
same weights in both. Large enough to be weight-bound at decode (about 0.3 GB in float32 per token's worth of MoE
layers), small enough to build in seconds.

Decode step: the median of --steps engine steps with one sequence decoding (gpu_suite.decode_step_ms), each model
in its own pipeline, interleaved repeat by repeat. Offline: --requests random-token prompts of 64-128 tokens, --gen
new tokens each; transformers in static batches of 16 with left padding (benchmarks/offline.py's method). Repeats
are fixed before the run; medians and ratios of medians are reported, every repeat's seconds kept in the JSON."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .gpu_suite import decode_step_ms, run_transformers
from .provenance import run_info

SHAPE = dict(
    vocab_size=8192,
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
EXPERTS, PER_TOKEN, EXPERT_INTERMEDIATE = 8, 2, 2816


def build(folder: Path, moe: bool) -> Path:
    import transformers

    torch.manual_seed(0)
    if moe:
        config = transformers.MixtralConfig(
            **SHAPE, intermediate_size=EXPERT_INTERMEDIATE, num_local_experts=EXPERTS, num_experts_per_tok=PER_TOKEN
        )
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**SHAPE, intermediate_size=EXPERT_INTERMEDIATE * PER_TOKEN)
        model = transformers.LlamaForCausalLM(config)
    model.float().save_pretrained(folder, safe_serialization=True)
    return folder


def prompts_for(n: int, repeat: int) -> list[list[int]]:
    rng = random.Random(1000 + repeat)
    return [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(rng.randint(64, 128))] for _ in range(n)]


def fastgen_pipe(folder: Path, dtype: str):
    from ..replica import pipeline

    return pipeline(str(folder), dtype=dtype, progress=False, max_batch_tokens=512)


def offline_s(pipe, prompts, gen: int) -> float:
    start = time.perf_counter()
    outs = pipe(prompts, max_new_tokens=gen, min_new_tokens=gen, ignore_eos=True)
    elapsed = time.perf_counter() - start
    assert all(o.generated_tokens == gen for o in outs)
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per repeat")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    with tempfile.TemporaryDirectory() as tmp:
        moe_dir, dense_dir = build(Path(tmp) / "moe", True), build(Path(tmp) / "dense", False)
        pipes = {"moe": fastgen_pipe(moe_dir, args.dtype), "dense": fastgen_pipe(dense_dir, args.dtype)}
        hf = None
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=dtype).eval()
        for pipe in pipes.values():  # warm-up: the kernels' first calls
            pipe(prompts_for(2, -1), max_new_tokens=2)
        if hf is not None:
            run_transformers(hf, prompts_for(2, -1), 2, 2, "cpu")
        step_ms = {name: [] for name in pipes}
        offline = {"fastgen": [], "transformers": []}
        for r in range(args.repeats):
            for name, pipe in pipes.items():
                step_ms[name].append(decode_step_ms(pipe.engine, args.steps))
            prompts = prompts_for(args.requests, r)
            offline["fastgen"].append(offline_s(pipes["moe"], prompts, args.gen))
            if hf is not None:
                offline["transformers"].append(run_transformers(hf, prompts, args.gen, 16, "cpu"))
            print(
                f"repeat {r}: step ms { ({k: round(v[-1], 2) for k, v in step_ms.items()}) }, offline s "
                f"{ ({k: round(v[-1], 2) for k, v in offline.items() if v}) }",
                flush=True,
            )

    med = {k: statistics.median(v) for k, v in step_ms.items()}
    tokens = args.requests * args.gen
    summary = dict(
        benchmark="moe",
        **run_info("fastgen.benchmarks.moe", argv),
        dtype=args.dtype,
        threads=args.threads,
        model=dict(**SHAPE, experts=EXPERTS, per_token=PER_TOKEN, expert_intermediate=EXPERT_INTERMEDIATE),
        repeats=args.repeats,
        decode_step_ms={k: [round(x, 3) for x in v] for k, v in step_ms.items()},
        decode_step_median_ms={k: round(v, 3) for k, v in med.items()},
        moe_over_dense_step=round(med["moe"] / med["dense"], 3),
        floor_moe_over_dense_step=1.5,
        offline_s={k: [round(x, 3) for x in v] for k, v in offline.items() if v},
        offline_tokens=tokens,
        fastgen_tokens_per_s=round(tokens / statistics.median(offline["fastgen"]), 1),
    )
    if offline["transformers"]:
        summary["transformers_tokens_per_s"] = round(tokens / statistics.median(offline["transformers"]), 1)
        summary["fastgen_over_transformers"] = round(
            statistics.median(offline["transformers"]) / statistics.median(offline["fastgen"]), 2
        )
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
