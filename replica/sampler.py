"""Sampling from the last logits of each sequence, the whole batch at once on the logits' device: greedy,
temperature, top-k, top-p.

A sampled token is a pure function of the row's probabilities and of (seed, position of the token being sampled):
`draw_bits` hashes (seed, position, vocabulary index) with integer tensor ops, so a request draws the same bits on
CPU and CUDA, whatever else is in the batch, after a preemption, or on another replica (which is what lets a stream
resume elsewhere). One draw per row (vocabulary index 0) is inverted through the row's cumulative distribution:
a hash per vocabulary entry, as an exponential race would need, costs milliseconds per row on a CPU core."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
# Keys that separate the hash's stages (arbitrary odd constants: the fractional bits of sqrt(2) and sqrt(3)).
_SEED_KEY = 0x6A09E667
_ROW_KEY = 0xBB67AE85


@dataclass
class SamplingRow:
    temperature: float  # 0: greedy
    top_p: float  # 1: off
    top_k: int  # 0: off
    seed: int  # in [0, 2**63): the request's own or one drawn at admission
    position: int  # index in the sequence (prompt included) of the token being sampled
    banned: list[int]  # token ids that may not be sampled now (EOS before min_new_tokens)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) as int64, split into two 16-bit halves of c so that no product
    overflows int64 (signed overflow is not something to rely on across devices)."""
    lo = x * (c & 0xFFFF)
    hi = (x * (c >> 16)) & 0xFFFF
    return (lo + (hi << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values that mixes every input bit into every output bit: Chris Wellons' "lowbias32"
    (xorshift-multiply, two rounds)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def draw_bits(seed: torch.Tensor, position: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """The random bits of draws: seed (rows,) int64 in [0, 2**63), position (rows,) int64 in [0, 2**32), vocab (V,)
    int64 in [0, 2**32) -> (rows, V) int64 in [0, 2**32), on the inputs' device. The same bits on every device.

    In 32-bit words, with mix = `_mix32`:
        key  = mix(mix(mix(seed_lo ^ SEED_KEY) ^ seed_hi) ^ position)
        bits = mix(mix(vocab ^ key) ^ mix(key ^ ROW_KEY))
    Within a row, distinct vocabulary indices give distinct bits (every step is a bijection of vocab)."""
    lo, hi = seed & _MASK32, seed >> 32
    key = _mix32(_mix32(_mix32(lo ^ _SEED_KEY) ^ hi) ^ (position & _MASK32))  # (rows,)
    key2 = _mix32(key ^ _ROW_KEY)  # (rows,)
    return _mix32(_mix32(vocab[None, :] ^ key[:, None]) ^ key2[:, None])  # (rows, V)


def uniforms(bits: torch.Tensor) -> torch.Tensor:
    """32-bit draws -> float32 uniforms in (0, 1): the top 23 bits, centred in their interval, so that every value
    is exact in float32 (24 bits centred would need 25 and round up to 1) and -log(u) is finite and positive."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow], argmax: Callable[[torch.Tensor], list[int]]) -> list[int]:
    """logits (rows, vocab) in the model's dtype -> one token id per row. Greedy rows take the maximum in that dtype
    (widening to float32 is exact, so the choice is the same) by `argmax`, the kernels' (`Kernels.argmax`: the index
    of each row's maximum, the first of equal maxima); sampled rows are widened and drawn together, with one
    transfer to the host for all of them (a batch that mixes both also pays the argmax's own)."""
    _ban(logits, rows)
    tokens = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.temperature <= 0]
    drawn = [i for i, r in enumerate(rows) if r.temperature > 0]
    if greedy:
        for i, token in zip(greedy, argmax(_subset(logits, greedy))):
            tokens[i] = token
    if drawn:
        for i, token in zip(drawn, _draw(_subset(logits, drawn), [rows[i] for i in drawn]).tolist()):
            tokens[i] = token
    return tokens


def _subset(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """The given rows of logits (all of them without a copy)."""
    if len(index) == logits.shape[0]:
        return logits
    return logits[torch.tensor(index, dtype=torch.int64, device=logits.device)]


def _ban(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Sets every banned (row, token) to -inf in one indexed write."""
    pairs = [(i, t) for i, r in enumerate(rows) for t in r.banned]
    if pairs:
        where = torch.tensor(pairs, dtype=torch.int64, device=logits.device)  # (pairs, 2)
        logits[where[:, 0], where[:, 1]] = float("-inf")


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits (m, V) of sampled rows -> (m,) int64 token ids on the device."""
    device, vocab = logits.device, logits.shape[1]
    floats = torch.tensor([[r.temperature, r.top_p] for r in rows], dtype=torch.float32, device=device)  # (m, 2)
    ints = torch.tensor([[r.seed, r.position, r.top_k] for r in rows], dtype=torch.int64, device=device)  # (m, 3)
    scaled = logits.float() / floats[:, :1]  # (m, V)
    max_k = max((r.top_k for r in rows if 0 < r.top_k < vocab), default=0)
    any_top_p = any(r.top_p < 1.0 for r in rows)
    keep = keep_mask(scaled, ints[:, 2], floats[:, 1], max_k, any_top_p)
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)  # (m, V)
    # Inverse CDF in float64, so that rounding in the running sum moves no boundary a float32 draw can tell apart.
    # u > 0, so the first index whose cumulative mass reaches u * total never has probability 0.
    cdf = probs.double().cumsum(dim=-1)  # (m, V)
    u = uniforms(draw_bits(ints[:, 0], ints[:, 1], torch.zeros(1, dtype=torch.int64, device=device)))  # (m, 1)
    token = torch.searchsorted(cdf, u.double() * cdf[:, -1:])  # (m, 1)
    return token.clamp(max=vocab - 1)[:, 0]  # (m,)


def keep_mask(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int, any_top_p: bool
) -> torch.Tensor:
    """The tokens each row may draw: scaled logits (m, V) float32, top_k (m,) (0: off), top_p (m,) (1: off) ->
    (m, V) bool. Top-k keeps every token at least as likely as the k-th (ties stay); top-p then keeps the smallest
    prefix, most likely first, whose renormalised mass reaches top_p (the top token always stays). max_k and
    any_top_p come from the host so that no step here waits on the device: the largest top_k below V (0: no row
    has top-k) and whether any row has top_p < 1."""
    vocab = scaled.shape[1]
    probs = torch.softmax(scaled, dim=-1)  # (m, V)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if max_k > 0:
        on = (top_k > 0) & (top_k < vocab)  # (m,)
        top = probs.topk(max_k, dim=-1).values  # (m, max_k), descending
        kth = top.gather(1, (top_k.clamp(1, max_k) - 1)[:, None])  # (m, 1)
        keep = probs >= torch.where(on[:, None], kth, torch.zeros_like(kth))  # rows without top-k keep all
    if any_top_p:
        kept = probs * keep  # (m, V)
        sorted_p, order = kept.sort(dim=-1, descending=True, stable=True)  # (m, V)
        q = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
        # Rows without top-p get a threshold nothing reaches, so rounding in the cumsum drops nothing there.
        threshold = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, float("inf")))[:, None]  # (m, 1)
        drop_sorted = q.cumsum(dim=-1) - q >= threshold  # (m, V)
        keep = keep & ~torch.zeros_like(keep).scatter(1, order, drop_sorted)
    return keep
