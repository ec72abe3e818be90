"""Offline throughput: FastGen's pipeline against transformers `generate` (static batches of 16, left padding,
min_new_tokens = max_new_tokens) on SmolLM2-135M, same dtype, same prompts, same thread count, one run.

    python -m fastgen.benchmarks.offline --dtype bfloat16 --threads 1 --repeats 3
    python -m fastgen.benchmarks.offline --skip-hf --vllm-url http://127.0.0.1:8000 --vllm-model smollm2-135m

With --vllm-url the same prompts also go, all at once, to a running vLLM OpenAI-compatible server, timed from the
first request to the last token.

Repeats run interleaved, one of each system in turn; the ratio is of medians, and each repeat's own ratio is
reported too, as is the first repeat (cold: nothing but a two-token warm-up ran before it). Every repeat sends
fresh prompts (slices of the corpus at offsets no other prompt starts at), the same to every system: no prefix cache,
FastGen's or vLLM's, can serve a repeat from an earlier one, so servers may keep their caches on.

W1: 64 requests, prompt lengths uniform in 128-512, 128 generated tokens.
W2: 16 requests of 1,024 prompt tokens, 64 generated tokens.
FastGen's token budget per step is --max-batch-tokens (default 2048, vLLM's own default). FastGen's KV pool is
--kv-cache-gib (default 2 GiB, what benchmarks/out/vllm_start.sh gives vLLM): with less,
W1's 64 sequences do not all fit and some are preempted and recomputed, work the peer does not do.
Also reports model FLOP/s of a 512- and a 2048-token prefill (fresh prompts) against a large matmul's FLOP/s measured
in the same run.

--json writes the summary RESULTS.md's tables are built from (small: every repeat's seconds, medians, ratios, the
command, commit, date and machine); this benchmark keeps no per-request records. Print its table with
`python -m fastgen.benchmarks.report FILE`."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from .provenance import run_info

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
WORKLOADS = {"W1": dict(n=64, prompt=(128, 512), gen=128), "W2": dict(n=16, prompt=(1024, 1024), gen=64)}


def make_prompts(tokenizer, n: int, lo: int, hi: int, repeat: int = 0) -> list[list[int]]:
    """Token-id prompts sliced from the real-text corpus (wrapping around), lengths uniform in [lo, hi]. Each starts
    at an offset of its own, and repeat r takes the offsets after those of repeats 0 .. r-1 in one fixed shuffle: no
    two prompts of a run, nor of any two repeats, begin alike (while the corpus has offsets left), so no prefix
    cache can serve one from another."""
    ids = tokenizer.encode(CORPUS.read_text(), add_special_tokens=False)
    offsets = random.Random(0).sample(range(len(ids)), len(ids))
    rng = random.Random(repeat)
    prompts = []
    for i in range(n):
        length, start = rng.randint(lo, hi), offsets[(repeat * n + i) % len(ids)]
        prompts.append([ids[(start + j) % len(ids)] for j in range(length)])
    return prompts


def run_fastgen(pipe, prompts, gen) -> float:
    start = time.perf_counter()
    outs = pipe(prompts, max_new_tokens=gen, min_new_tokens=gen, ignore_eos=True)
    elapsed = time.perf_counter() - start
    assert all(o.generated_tokens == gen for o in outs)
    return elapsed


def run_transformers(model, prompts, gen, batch=16) -> float:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=gen,
                min_new_tokens=gen,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + gen
    return time.perf_counter() - start


def run_vllm(url: str, model: str, prompts, gen) -> float:
    """Every prompt sent at once to a vLLM OpenAI server (greedy, exactly gen tokens each); seconds until the last
    token arrived."""
    from concurrent.futures import ThreadPoolExecutor

    from .backends import OpenAIBackend
    from .workload import BenchRequest

    backend = OpenAIBackend(url, model, max_in_flight=1)
    requests = [BenchRequest(i, list(p), gen) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        records = list(pool.map(backend.run_blocking, requests))
    bad = [r.error or f"{len(r.token_times)} tokens" for r in records if r.error or len(r.token_times) != gen]
    if bad:
        raise RuntimeError(f"vLLM did not return {gen} tokens for every request: {bad[:3]}")
    return max(r.end for r in records) - start


PREFILL_LENGTHS = (512, 2048)


def prefill_flops(pipe, dtype, length: int) -> tuple[float, float]:
    """(model FLOP/s of one prefill of `length` tokens, FLOP/s of a 4096^2 x 512 matmul) in the same dtype. The
    model's FLOPs count the linear layers (the LM head for one row), not attention."""
    engine = pipe.engine
    from fastgen.replica.parallel import ParallelLinear, ParallelLMHead

    layers = [m for m in engine.runner.model.modules() if isinstance(m, ParallelLinear)]
    # Counted from the layers' shapes: a packed layer holds no plain weight.
    params = sum(m.out_features * m.in_features for m in layers if not isinstance(m, ParallelLMHead))
    params += engine.model_config.vocab_size * engine.model_config.hidden_size / length  # one LM-head row
    vocab = engine.model_config.vocab_size
    times = []
    for i in range(3):
        # A first token of its own for every prompt: the prefix cache holds nothing of it.
        prompt = [(100 + 7919 * (i + 1) * length + j * 31) % (vocab - 100) + 100 for j in range(length)]
        start = time.perf_counter()
        pipe([prompt], max_new_tokens=1)
        times.append(time.perf_counter() - start)
    model_flops = 2 * params * length / min(times)
    a, b = torch.randn(512, 4096, dtype=dtype), torch.randn(4096, 4096, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    matmul_flops = 2 * 512 * 4096 * 4096 * 5 / (time.perf_counter() - start)
    return model_flops, matmul_flops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-repeats", type=int, default=None, help="repeats for transformers (default --repeats)")
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="FastGen's token budget per forward pass: the same as vLLM's (its V1 engine's default "
        "max_num_batched_tokens, 2048)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=2.0,
        help="FastGen's KV pool in GiB: the same as the peer's (benchmarks/out/vllm_start.sh gives vLLM "
        "VLLM_CPU_KVCACHE_SPACE=2); a smaller pool preempts and recomputes sequences W1's 64 cannot all fit",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8"],
        help="FastGen's weights: auto serves the GGUF's own blocks, none dequantizes to --dtype (default: auto)",
    )
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--scale", type=float, default=1.0, help="shrink request counts (smoke runs)")
    p.add_argument("--vllm-url", default=None, help="also time a running vLLM OpenAI server on the same prompts")
    p.add_argument("--vllm-model", default="smollm2-135m", help="the model name that server serves")
    p.add_argument("--json", type=Path, default=None, help="write the summary here (e.g. benchmarks/results/NAME.json)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from fastgen.replica import pipeline

    dtype = getattr(torch, args.dtype)
    pipe = pipeline(
        "smollm2-135m",
        dtype=args.dtype,
        max_batch_tokens=args.max_batch_tokens,
        kv_cache_memory=int(args.kv_cache_gib * 2**30),
        quantization=args.quantization,
        progress=False,
    )
    pipe([[1, 2, 3]], max_new_tokens=2)  # warm-up
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from fastgen.replica.weights import resolve_model

        hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=dtype).eval()
    load = os.getloadavg()
    results = {}
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        n = max(1, int(w["n"] * args.scale))
        tokens = n * w["gen"]
        # Repeats interleaved (FastGen, transformers, vLLM, FastGen, ...): the host's speed drifts by tens of percent
        # over minutes, and interleaving spreads the drift over every system instead of charging it to one.
        hf_repeats = 0 if hf is None else args.hf_repeats or args.repeats
        ours, theirs, vllm = [], [], []
        for r in range(max(args.repeats, hf_repeats)):
            prompts = make_prompts(pipe.tokenizer, n, *w["prompt"], repeat=r)
            if r < args.repeats:
                ours.append(run_fastgen(pipe, prompts, w["gen"]))
            if r < hf_repeats:
                theirs.append(run_transformers(hf, prompts, w["gen"]))
            if args.vllm_url and r < args.repeats:
                vllm.append(run_vllm(args.vllm_url, args.vllm_model, prompts, w["gen"]))
        results[name] = dict(
            requests=n,
            generated_tokens=tokens,
            fastgen_s=ours,
            transformers_s=theirs,
            fastgen_median_s=statistics.median(ours),
            fastgen_tok_s=tokens / statistics.median(ours),
        )
        line = (
            f"{name}: FastGen median {statistics.median(ours):.1f} s ({tokens / statistics.median(ours):.0f} tok/s), "
            f"first {ours[0]:.1f} s"
        )
        if theirs:
            ratio = statistics.median(theirs) / statistics.median(ours)
            paired = [t / o for o, t in zip(ours, theirs)]  # each repeat's pair ran back to back
            line += (
                f", transformers {statistics.median(theirs):.1f} s -> {ratio:.2f}x "
                f"(per repeat {min(paired):.2f}-{max(paired):.2f}x)"
            )
            results[name]["transformers_median_s"] = statistics.median(theirs)
            results[name]["speedup"] = ratio
            results[name]["speedup_per_repeat"] = paired
        if vllm:
            results[name]["vllm_s"] = vllm
            results[name]["vllm_median_s"] = statistics.median(vllm)
            results[name]["speedup_vs_vllm"] = statistics.median(vllm) / statistics.median(ours)
            results[name]["speedup_vs_vllm_first"] = vllm[0] / ours[0]
            line += (
                f", vLLM {statistics.median(vllm):.1f} s (first {vllm[0]:.1f} s) -> "
                f"{results[name]['speedup_vs_vllm']:.2f}x (first {vllm[0] / ours[0]:.2f}x)"
            )
        print(line, flush=True)
    for length in PREFILL_LENGTHS:
        model_flops, matmul_flops = prefill_flops(pipe, dtype, length)
        results[f"prefill_{length}"] = dict(model_flops=model_flops, matmul_flops=matmul_flops)
        print(
            f"prefill {length}: {model_flops / 1e9:.1f} GFLOP/s vs matmul {matmul_flops / 1e9:.1f} GFLOP/s "
            f"({model_flops / matmul_flops:.0%})"
        )
    results["meta"] = run_info("offline") | dict(
        dtype=args.dtype,
        threads=args.threads,
        kv_cache_gib=args.kv_cache_gib,
        max_batch_tokens=args.max_batch_tokens,
        quantization=args.quantization,
        load_before=load,
        load_after=os.getloadavg(),
    )
    print(json.dumps(results["meta"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
