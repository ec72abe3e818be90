"""Multi-LoRA cost: offline throughput with 1, 4 and 16 adapters in a mixed batch against the base model alone.

    python -m fastgen.benchmarks.lora --repeats 3 --json benchmarks/results/lora/NAME.json \
        [--model smollm2-135m] [--device cpu|cuda] [--dtype bfloat16] [--rank 16] [--no-prefix-caching]

Adapters: random LoRA weights of rank --rank on every q/k/v/o/gate/up/down projection, written in PEFT's format
(adapter_config.json + adapter_model.safetensors) to a temporary folder. The base run is a pipeline without
--enable-lora (what a deployment serving no adapter runs); each LoRA run is one pipeline with --enable-lora and
--max-loras 16 whose requests go round robin over the first k adapters, so a batch mixes all k (every adapter stays
resident: this measures the batched delta, not loads).

Workload: --requests random-token prompts of --prompt-min..--prompt-max tokens, --gen new tokens each (min_new_tokens
= max_new_tokens), all queued at once. Every repeat draws fresh prompts, the same for every configuration (no prefix
cache serves a repeat from an earlier one; but the LoRA configurations share one pipeline, whose cache serves a
prompt that an earlier configuration of the same repeat ran under the same adapter: a quarter of lora-4's and of
lora-16's prompts, unless --no-prefix-caching). Repeats are fixed before the run and interleaved, one of each
configuration in turn, after a two-token warm-up of each; the JSON keeps every repeat's seconds, the medians of
generated tokens/s and each LoRA configuration's loss against the base (1 - its median / the base's median). The
issue's goal: under 20% lost at 4 adapters."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..replica import pipeline
from ..replica.config import LoraConfig
from ..replica.models import ModelConfig
from ..replica.weights import load_hf_config, resolve_model
from .provenance import run_info

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A random rank-`rank` LoRA adapter of every projection in PEFT's format."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {  # (in, out) of each projection
        "q_proj": (cfg.hidden_size, q),
        "k_proj": (cfg.hidden_size, kv),
        "v_proj": (cfg.hidden_size, kv),
        "o_proj": (q, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj in PROJECTIONS:
            module = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            fan_in, fan_out = shapes[proj]
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    folder.mkdir(parents=True)
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS), bias="none")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def make_prompts(n: int, lo: int, hi: int, vocab: int, repeat: int) -> list[list[int]]:
    rng = random.Random(1000 + repeat)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_once(pipe, prompts, adapters: list[str], gen: int) -> float:
    names = [adapters[i % len(adapters)] for i in range(len(prompts))] if adapters else ""
    start = time.perf_counter()
    outs = pipe(prompts, lora=names, max_new_tokens=gen, min_new_tokens=gen, ignore_eos=True)
    seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == gen for o in outs)
    return seconds


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 where the hardware has it, else float32")
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16], help="adapters mixed in one batch")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-min", type=int, default=128)
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="every run prefills its prompts whole: the LoRA configurations share one pipeline, whose prefix cache "
        "otherwise serves a prompt that an earlier configuration of the same repeat ran under the same adapter "
        "(a quarter of lora-4's and of lora-16's prompts)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model(args.model, "auto")
    cfg = ModelConfig.from_hf(load_hf_config(folder))
    most = max(args.adapters)
    common = dict(
        dtype=args.dtype,
        device=args.device,
        max_batch_tokens=args.max_batch_tokens,
        max_seqs=min(args.requests, args.max_batch_tokens, 256),
        progress=False,
        **(dict(prefix_caching=False) if args.no_prefix_caching else {}),
    )
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"adapter-{i}" for i in range(most)]
        modules = tuple((n, str(write_adapter(Path(tmp) / n, cfg, args.rank, i))) for i, n in enumerate(names))
        lora = LoraConfig(enable_lora=True, lora_modules=modules, max_loras=most, max_lora_rank=args.rank)
        pipes = {"base": (pipeline(str(folder), **common), [])}
        lora_pipe = pipeline(str(folder), lora=lora, **common)
        for k in args.adapters:
            pipes[f"lora-{k}"] = (lora_pipe, names[:k])
        for pipe, adapters in pipes.values():  # warm-up: kernels compiled, every adapter loaded into its slot
            run_once(pipe, make_prompts(max(1, len(adapters)), 8, 8, cfg.vocab_size, -1), adapters, 2)
        seconds: dict[str, list[float]] = {name: [] for name in pipes}
        for repeat in range(args.repeats):
            prompts = make_prompts(args.requests, args.prompt_min, args.prompt_max, cfg.vocab_size, repeat)
            for name, (pipe, adapters) in pipes.items():
                seconds[name].append(run_once(pipe, prompts, adapters, args.gen))
                print(f"repeat {repeat} {name}: {seconds[name][-1]:.3f} s", flush=True)
    tokens = args.requests * args.gen
    medians = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    summary = {
        "info": run_info("lora", argv),
        "settings": vars(args) | {"json": str(args.json) if args.json else None},
        "seconds": seconds,
        "tokens_per_s_median": medians,
        "loss_vs_base": {name: 1 - medians[name] / medians["base"] for name in medians if name != "base"},
    }
    print(json.dumps({k: summary[k] for k in ("tokens_per_s_median", "loss_vs_base")}, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
