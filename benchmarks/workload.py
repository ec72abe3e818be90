"""Workloads of the serving benchmark: request lengths and real-text prompts, reproducible from a seed.

Lengths are normal around the workload's means with a standard deviation of 30% of the mean (the paper's "30%
variance", as in DeepSpeed-MII's benchmark scripts), clipped to a sane range. Prompts are token ids sliced from
benchmarks/data/corpus.txt at random offsets (wrapping around), each opened by a short header naming the run and
the request: servers that cache prefixes (vLLM) then never see the same prefix twice, within a run or across runs
whose tag differs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
VARIANCE = 0.3


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_mean: int
    gen_mean: int


WORKLOADS = {
    "C1": Workload("C1", 600, 60),  # BENCHMARKS.md CPU profile
    "C2": Workload("C2", 300, 128),
    "W1200x60": Workload("W1200x60", 1200, 60),  # the paper's GPU workloads
    "W1200x128": Workload("W1200x128", 1200, 128),
    "W2600x60": Workload("W2600x60", 2600, 60),
    "W2600x128": Workload("W2600x128", 2600, 128),
}


def parse_workload(text: str) -> Workload:
    """'C1', or a custom 'PROMPTxGEN' such as '64x8'."""
    if text in WORKLOADS:
        return WORKLOADS[text]
    try:
        prompt, gen = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"unknown workload {text!r}: use {', '.join(WORKLOADS)} or PROMPTxGEN, e.g. 64x8") from None
    return Workload(text, prompt, gen)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: list[int]  # token ids
    max_new_tokens: int


def sample_length(rng: random.Random, mean: int, lo: int = 1) -> int:
    """Normal around mean, sd 30% of it, clipped to [lo, 2 x mean]."""
    return max(lo, min(2 * mean, round(rng.gauss(mean, VARIANCE * mean))))


@lru_cache(maxsize=4)
def corpus_ids(tokenizer_dir: str) -> tuple[int, ...]:
    return tuple(load_tokenizer(tokenizer_dir).encode(CORPUS.read_text(), add_special_tokens=False))


@lru_cache(maxsize=4)
def load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def make_requests(
    workload: Workload,
    n: int,
    tokenizer_dir: str,
    seed: int = 0,
    tag: str = "run",
    first_index: int = 0,
    max_prompt: int | None = None,
) -> list[BenchRequest]:
    """n requests; the same (workload, seed, tag, first_index) gives the same requests."""
    ids = corpus_ids(str(tokenizer_dir))
    tok = load_tokenizer(str(tokenizer_dir))
    rng = random.Random(f"{seed}-{workload.name}-{first_index}")
    out = []
    for i in range(first_index, first_index + n):
        length = sample_length(rng, workload.prompt_mean, lo=8)
        if max_prompt is not None:
            length = min(length, max_prompt)
        header = tok.encode(f"[{tag} #{i}] ", add_special_tokens=False)
        start = rng.randrange(len(ids))
        body = [ids[(start + j) % len(ids)] for j in range(max(0, length - len(header)))]
        out.append(BenchRequest(i, (header + body)[:length], sample_length(rng, workload.gen_mean)))
    return out
