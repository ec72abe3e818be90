"""Sampling from the last logits of each sequence: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class SamplingRow:
    temperature: float  # 0: greedy
    top_p: float
    top_k: int
    generator: torch.Generator | None  # per request, so its draws do not depend on the rest of the batch
    banned: list[int]  # token ids that may not be sampled now (EOS before min_new_tokens)


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow], argmax: Callable[[torch.Tensor], list[int]]) -> list[int]:
    """logits (rows, vocab) in the model's dtype -> one token id per row. Greedy rows take the maximum in that dtype
    (widening to float32 is exact, so the choice is the same) by `argmax`, the kernels' (`Kernels.argmax`: the index
    of each row's maximum, the first of equal maxima); sampled rows are widened first."""
    for i, row in enumerate(rows):
        if row.banned:
            logits[i, row.banned] = float("-inf")
    tokens = argmax(logits)
    for i, row in enumerate(rows):
        if row.temperature > 0:
            tokens[i] = _sample_row(logits[i].float(), row)
    return tokens


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    logits = logits / row.temperature
    if 0 < row.top_k < logits.numel():
        kth = torch.topk(logits, row.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if row.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop = sorted_probs.cumsum(0) - sorted_probs >= row.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
    noise = torch.empty_like(probs).exponential_(generator=row.generator)
    return int((probs / noise).argmax())
