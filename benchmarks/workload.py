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


# ---- Chat workload (BENCHMARKS.md "Chat workload (prefix reuse)") ----------------------------------------------
@dataclass(frozen=True)
class Conversation:
    """One chat: a system prompt and the user's messages, one per turn. Each turn sends the system prompt, every
    earlier turn (user message and the assistant's reply as generated) and the new user message."""

    index: int
    system: str
    user_messages: tuple[str, ...]
    reply_tokens: int  # every reply is exactly this long (ignore_eos), so the work is the same on every server


@dataclass(frozen=True)
class ChatWorkload:
    conversations: int = 16
    system_tokens: int = 300  # the shared system prompt
    user_mean: int = 60  # tokens per user message (30% spread)
    turns_mean: int = 4  # turns per conversation (30% spread, at least 1)
    reply_tokens: int = 32


def corpus_text(tokenizer_dir: str, rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of real text from a seeded offset of the corpus."""
    ids = corpus_ids(str(tokenizer_dir))
    start = rng.randrange(len(ids))
    piece = [ids[(start + j) % len(ids)] for j in range(max(1, tokens))]
    return load_tokenizer(str(tokenizer_dir)).decode(piece, skip_special_tokens=True)


def make_conversations(spec: ChatWorkload, tokenizer_dir: str, seed: int = 0, tag: str = "chat") -> list[Conversation]:
    """spec.conversations conversations sharing one system prompt; the same (spec, seed) gives the same lengths, turns
    and text whatever the tag. The tag opens the system prompt, so a new tag shares no prefix with an earlier run."""
    rng = random.Random(f"{seed}-chat")
    system = f"[{tag}] You are a helpful assistant. " + corpus_text(tokenizer_dir, rng, spec.system_tokens)
    out = []
    for i in range(spec.conversations):
        turns = min(2 * spec.turns_mean, sample_length(rng, spec.turns_mean, lo=1))
        users = tuple(
            f"[{i}.{t}] " + corpus_text(tokenizer_dir, rng, sample_length(rng, spec.user_mean, lo=4))
            for t in range(turns)
        )
        out.append(Conversation(i, system, users, spec.reply_tokens))
    return out


def make_hot_prefix_requests(
    n: int,
    tokenizer_dir: str,
    hot_fraction: float = 0.9,
    prefix_tokens: int = 600,
    suffix_mean: int = 40,
    reply_tokens: int = 16,
    seed: int = 0,
    tag: str = "hot",
) -> list[Conversation]:
    """Single-turn chats where hot_fraction of the requests share one long system prompt (the others each have a
    system prompt of their own, as long): the skew under which routing every request to the prefix's holder would
    overload it. As for make_conversations, the tag changes only the prompts' openings."""
    rng = random.Random(f"{seed}-hot")
    hot = f"[{tag} hot] " + corpus_text(tokenizer_dir, rng, prefix_tokens)
    out = []
    for i in range(n):
        system = (
            hot
            if rng.random() < hot_fraction
            else f"[{tag} cold {i}] " + corpus_text(tokenizer_dir, rng, prefix_tokens)
        )
        user = f"[{i}] " + corpus_text(tokenizer_dir, rng, sample_length(rng, suffix_mean, lo=4))
        out.append(Conversation(i, system, (user,), reply_tokens))
    return out
