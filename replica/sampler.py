"""Sampling from the last logits of each sequence, the whole batch at once on the logits' device: greedy,
temperature, top-k, top-p, min-p; logit bias and repetition, frequency and presence penalties; logprobs of the raw
distribution.

The order is vLLM's: logprobs of the raw logits; bans (EOS before min_new_tokens); grammar masks (structured output,
replica/constraints.py); logit_bias; repetition, frequency
and presence penalties; then the argmax (greedy) or temperature, min-p, top-k and top-p, and the draw. Rows that set
none of bias, penalties or min-p take the same path, with the same results, as a sampler without them.

A sampled token is a pure function of the row's probabilities and of (seed, position of the token being sampled):
`draw_bits` hashes (seed, position, vocabulary index) with integer tensor ops, so a request draws the same bits on
CPU and CUDA, whatever else is in the batch, after a preemption, or on another replica (which is what lets a stream
resume elsewhere). One draw per row (vocabulary index 0) is inverted through the row's cumulative distribution:
a hash per vocabulary entry, as an exponential race would need, costs milliseconds per row on a CPU core."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from .outputs import TokenLogprob, TopLogprob

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
    source: int | None = None  # the logits row to sample from (None: this row's index); n completions share one
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    output_ids: Sequence[int] = ()  # tokens generated so far (presence and frequency penalties)
    context_ids: Sequence[int] = ()  # prompt + generated tokens (repetition penalty); read only when that is on
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the k most likely alternatives
    # The tokens a grammar allows now, as a packed bitmask (ceil(V / 32),) int32 on the host (bit t % 32 of word
    # t // 32); None: unconstrained.
    allowed: torch.Tensor | None = None

    @property
    def penalized(self) -> bool:
        """Whether bias or a penalty changes the row's logits, which a greedy row's argmax must then see."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


@dataclass
class Sampled:
    tokens: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # one per row; None where the row asked for none


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
def sample(logits: torch.Tensor, rows: list[SamplingRow], argmax: Callable[[torch.Tensor], list[int]]) -> Sampled:
    """logits (L, vocab) in the model's dtype -> a token per row and, for rows that ask, its logprobs. Row i samples
    from logits[rows[i].source] (logits[i] without a source), so rows sharing a source each see their own copy.

    Greedy rows without bias or penalties take the maximum in the model's dtype (widening to float32 is exact, so the
    choice is the same) by `argmax`, the kernels' (`Kernels.argmax`: the index of each row's maximum, the first of
    equal maxima). All other rows are selected, penalized in float32 where they ask, and drawn (or, greedy, argmaxed)
    together on the device, with one transfer to the host for their tokens and every row's logprobs (a batch that
    mixes both also pays the argmax's own). Where every row samples its own row of logits, bans and penalties may
    be written into them."""
    source = [i if r.source is None else r.source for i, r in enumerate(rows)]
    raw = _raw_logprobs(logits, rows, source)  # before the bans, which may write into logits
    tokens = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.temperature <= 0 and not r.penalized]
    if greedy:
        for i, token in zip(greedy, argmax(_selected(logits, rows, source, greedy))):
            tokens[i] = token
    # Plain drawn, penalized drawn, penalized greedy: so that the drawn rows and the penalized rows are each a slice.
    on_device = (
        [i for i, r in enumerate(rows) if r.temperature > 0 and not r.penalized]
        + [i for i, r in enumerate(rows) if r.temperature > 0 and r.penalized]
        + [i for i, r in enumerate(rows) if r.temperature <= 0 and r.penalized]
    )
    device_tokens = _on_device(logits, rows, source, on_device) if on_device else None
    return _collect(tokens, on_device, device_tokens, raw, logits.device)


def _subset(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """The given rows of logits, in order: logits itself when that is all of them, else a copy."""
    if len(index) == logits.shape[0] and index == list(range(len(index))):
        return logits
    return logits[torch.tensor(index, dtype=torch.int64, device=logits.device)]


def _selected(logits: torch.Tensor, rows: list[SamplingRow], source: list[int], index: list[int]) -> torch.Tensor:
    """The logits rows[index] sample from, (len(index), V), with their bans and grammar masks."""
    selected = _subset(logits, [source[i] for i in index])
    _ban(selected, [rows[i] for i in index])
    _constrain(selected, [rows[i] for i in index])
    return selected


def _constrain(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Sets every token a row's grammar does not allow to -inf: the constrained rows' bitmasks go to the device in
    one copy and become an additive mask there (0 allowed, -inf not), added in place. Nothing runs when no row is
    constrained."""
    masked = [j for j, r in enumerate(rows) if r.allowed is not None]
    if not masked:
        return
    allowed = [a for r in rows if (a := r.allowed) is not None]  # the masked rows' bitmasks, in order
    native = _native_apply() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if native is not None:  # xgrammar's C++ kernel: a third of the torch ops' time on a CPU
        bits = torch.full((logits.shape[0], allowed[0].shape[0]), -1, dtype=torch.int32)
        bits[masked] = torch.stack(allowed)
        native(logits, bits, vocab_size=logits.shape[1], indices=masked)
        return
    bits = torch.stack(allowed).to(logits.device)  # (c, W) int32
    penalty = _byte_table(logits.device, logits.dtype)[bits.view(torch.uint8).long()].flatten(1)[:, : logits.shape[1]]
    if len(masked) == logits.shape[0]:
        logits.add_(penalty)
    else:
        logits.index_add_(0, torch.tensor(masked, dtype=torch.int64, device=logits.device), penalty)


_BYTE_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _native_apply():
    """xgrammar's in-place bitmask kernel for float32 logits on the CPU (None without xgrammar: the torch path)."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        return None
    return functools.partial(apply_token_bitmask_inplace, backend="cpu")


def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 8): a byte of a bitmask -> the additive mask of its 8 tokens (0 for a set bit, -inf for a clear one).
    A lookup per byte costs half what shifting every bit out of the 32-bit words does on a CPU."""
    table = _BYTE_TABLES.get((device, dtype))
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)
        _BYTE_TABLES[(device, dtype)] = table
    return table


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed bitmasks (c, W) int32 -> (c, vocab) bool: token t is bit t % 32 of word t // 32 (xgrammar's layout).
    Viewed as bytes (little-endian, as every device torch runs on), token t is bit t % 8 of byte t // 8."""
    return torch.isfinite(_byte_table(bits.device, torch.float32)[bits.view(torch.uint8).long()]).flatten(1)[:, :vocab]


def _ban(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Sets every banned (row, token) to -inf in one indexed write."""
    pairs = [(i, t) for i, r in enumerate(rows) for t in r.banned]
    if pairs:
        where = torch.tensor(pairs, dtype=torch.int64, device=logits.device)  # (pairs, 2)
        logits[where[:, 0], where[:, 1]] = float("-inf")


def _on_device(logits: torch.Tensor, rows: list[SamplingRow], source: list[int], order: list[int]) -> torch.Tensor:
    """The tokens of rows[order], which are plain drawn, then penalized drawn, then penalized greedy rows ->
    (len(order),) int64 on the device."""
    picked = [rows[i] for i in order]
    x = _selected(logits, rows, source, order)  # (m, V)
    plain = sum(not r.penalized for r in picked)
    drawn = sum(r.temperature > 0 for r in picked)
    if plain < len(order):
        # Penalties in float32, as vLLM; the plain rows' draw widens them anyway, so their tokens do not change.
        x = x.float()
        penalize(x[plain:], picked[plain:])
    parts = []
    if drawn:
        parts.append(_draw(x[:drawn], picked[:drawn]))
    if drawn < len(order):
        parts.append(x[drawn:].argmax(dim=-1))  # the first of equal maxima, as `Kernels.argmax`
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def penalize(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Adds each row's logit_bias, then applies its repetition, frequency and presence penalties (vLLM's order and
    formulas), in place: logits (q, V) float32, one row per SamplingRow. Every id, with the number of them each row
    has, goes to the device in one copy and every number in one more; the counts are one scatter over all rows."""
    q, vocab = logits.shape
    device = logits.device
    outputs = [r.output_ids if r.presence_penalty or r.frequency_penalty else () for r in rows]
    contexts = [r.context_ids if r.repetition_penalty != 1.0 else () for r in rows]
    bias = [(j, t, b) for j, r in enumerate(rows) for t, b in r.logit_bias]
    sizes = [[len(o) for o in outputs], [len(c) for c in contexts], [j for j, _, _ in bias], [t for _, t, _ in bias]]
    ints = torch.tensor(list(chain(*sizes, *outputs, *contexts)), dtype=torch.int64).to(device)
    counted, repeated = sum(sizes[0]), sum(sizes[1])
    out_sizes, ctx_sizes, b_rows, b_ids, out_ids, ctx_ids = ints.split([q, q, len(bias), len(bias), counted, repeated])
    factors = [x for r in rows for x in (r.presence_penalty, r.frequency_penalty, r.repetition_penalty)]
    nums = torch.tensor(factors + [b for _, _, b in bias], dtype=torch.float32).to(device)
    per_row, b_values = nums[: 3 * q].view(q, 3), nums[3 * q :]  # per_row: presence, frequency, repetition
    if bias:
        logits.index_put_((b_rows, b_ids), b_values, accumulate=True)
    if repeated:
        seen = torch.zeros(q * vocab, dtype=torch.bool, device=device)
        seen[_owners(ctx_sizes, repeated) * vocab + ctx_ids] = True
        penalty = torch.where(seen.view(q, vocab), per_row[:, 2:3], 1.0)  # (q, V)
        logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    if counted:
        where = _owners(out_sizes, counted) * vocab + out_ids
        counts = torch.zeros(q * vocab, device=device).scatter_add_(0, where, torch.ones(counted, device=device))
        counts = counts.view(q, vocab)  # (q, V)
        logits.sub_(per_row[:, 1:2] * counts)
        logits.sub_(per_row[:, 0:1] * (counts > 0))


def _owners(sizes: torch.Tensor, total: int) -> torch.Tensor:
    """The row of each of `total` concatenated ids, from each row's count (q,) -> (total,). The total comes from the
    host: without it, repeat_interleave would wait on the device to size its output."""
    rows = torch.arange(sizes.shape[0], device=sizes.device)
    return torch.repeat_interleave(rows, sizes, output_size=total)


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits (m, V) of sampled rows -> (m,) int64 token ids on the device."""
    device, vocab = logits.device, logits.shape[1]
    floats = torch.tensor([[r.temperature, r.top_p, r.min_p] for r in rows], dtype=torch.float32, device=device)
    ints = torch.tensor([[r.seed, r.position, r.top_k] for r in rows], dtype=torch.int64, device=device)  # (m, 3)
    scaled = logits.float() / floats[:, :1]  # (m, V)
    max_k = max((r.top_k for r in rows if 0 < r.top_k < vocab), default=0)
    any_top_p = any(r.top_p < 1.0 for r in rows)
    min_p = floats[:, 2] if any(r.min_p > 0 for r in rows) else None
    keep = keep_mask(scaled, ints[:, 2], floats[:, 1], max_k, any_top_p, min_p)
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)  # (m, V)
    # Inverse CDF in float64, so that rounding in the running sum moves no boundary a float32 draw can tell apart.
    # u > 0, so the first index whose cumulative mass reaches u * total never has probability 0.
    cdf = probs.double().cumsum(dim=-1)  # (m, V)
    u = uniforms(draw_bits(ints[:, 0], ints[:, 1], torch.zeros(1, dtype=torch.int64, device=device)))  # (m, 1)
    token = torch.searchsorted(cdf, u.double() * cdf[:, -1:])  # (m, 1)
    return token.clamp(max=vocab - 1)[:, 0]  # (m,)


def keep_mask(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    max_k: int,
    any_top_p: bool,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tokens each row may draw: scaled logits (m, V) float32, top_k (m,) (0: off), top_p (m,) (1: off), min_p
    (m,) (0: off; None: off in every row) -> (m, V) bool. Min-p keeps the tokens at least min_p times as likely as
    the top one; top-k keeps every token at least as likely as the k-th (ties stay); top-p then keeps the smallest
    prefix, most likely first, whose mass renormalised over what min-p and top-k kept reaches top_p (the top token
    always stays). That is vLLM's order: min-p before top-k and top-p. max_k and any_top_p come from the host so that
    no step here waits on the device: the largest top_k below V (0: no row has top-k) and whether any row has
    top_p < 1."""
    vocab = scaled.shape[1]
    probs = torch.softmax(scaled, dim=-1)  # (m, V)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if min_p is not None:
        keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    if max_k > 0:
        on = (top_k > 0) & (top_k < vocab)  # (m,)
        top = probs.topk(max_k, dim=-1).values  # (m, max_k), descending
        kth = top.gather(1, (top_k.clamp(1, max_k) - 1)[:, None])  # (m, 1)
        keep = keep & (probs >= torch.where(on[:, None], kth, torch.zeros_like(kth)))  # rows without top-k keep all
    if any_top_p:
        kept = probs * keep  # (m, V)
        sorted_p, order = kept.sort(dim=-1, descending=True, stable=True)  # (m, V)
        q = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
        # Rows without top-p get a threshold nothing reaches, so rounding in the cumsum drops nothing there.
        threshold = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, float("inf")))[:, None]  # (m, 1)
        drop_sorted = q.cumsum(dim=-1) - q >= threshold  # (m, V)
        keep = keep & ~torch.zeros_like(keep).scatter(1, order, drop_sorted)
    return keep


# ---- logprobs of the raw distribution ---------------------------------------------------------------------------
@dataclass
class _Raw:
    """Logprobs of the raw logits for the rows that ask for them, taken before anything changes the logits."""

    rows: list[int]  # the rows that ask, in order
    slots: list[int]  # each one's row in `logprobs` (rows sharing a source share one)
    ks: list[int]  # alternatives each one asks for (no more than the vocabulary)
    logprobs: torch.Tensor  # (u, V) float32, one row per distinct source
    top: tuple[torch.Tensor, torch.Tensor] | None  # values, indices (u, width), most likely first; None: width 0


def _raw_logprobs(logits: torch.Tensor, rows: list[SamplingRow], source: list[int]) -> _Raw | None:
    wanted = {i: r.logprobs for i, r in enumerate(rows) if r.logprobs is not None}  # row -> alternatives it asks
    asking = list(wanted)
    if not asking:
        return None
    sources = list(dict.fromkeys(source[i] for i in asking))
    slot = {s: j for j, s in enumerate(sources)}
    logprobs = torch.log_softmax(_subset(logits, sources), dim=-1, dtype=torch.float32)  # (u, V)
    ks = [min(k, logits.shape[1]) for k in wanted.values()]
    top = None
    if max(ks):
        values, indices = logprobs.topk(max(ks), dim=-1)  # (u, width) each
        top = (values, indices)
    return _Raw(asking, [slot[source[i]] for i in asking], ks, logprobs, top)


def _collect(
    tokens: list[int], order: list[int], device_tokens: torch.Tensor | None, raw: _Raw | None, device: torch.device
) -> Sampled:
    """Fills in the tokens of rows[order] from the device, and the logprobs, in one transfer to the host."""
    assert (device_tokens is not None) == bool(order), "device tokens exactly where rows sample on the device"
    if raw is None:
        for i, token in zip(order, device_tokens.tolist() if device_tokens is not None else []):
            tokens[i] = token
        return Sampled(tokens, [None] * len(tokens))
    # Every row's token on the device (the host's greedy ones, the device's written over them), to gather the
    # sampled tokens' logprobs there; the indices travel in the same copy.
    n, m, k = len(tokens), len(order), len(raw.rows)
    host = torch.tensor(tokens + order + raw.rows + raw.slots, dtype=torch.int64).to(device)
    every, where, asking, slots = host.split([n, m, k, k])
    if device_tokens is not None:  # order
        every = every.index_put((where,), device_tokens)
    chosen = raw.logprobs[slots, every[asking]]  # (k,) the sampled tokens' raw logprobs
    # float64 holds token ids and float32 logprobs exactly, so one tensor carries all of it.
    parts = [device_tokens.double()] if device_tokens is not None else []
    parts.append(chosen.double())
    if raw.top is not None:
        parts += [raw.top[0].double().flatten(), raw.top[1].double().flatten()]
    flat = torch.cat(parts).tolist()
    for i, token in zip(order, flat[:m]):
        tokens[i] = int(token)
    return Sampled(tokens, _token_logprobs(raw, flat[m:], tokens))


def _token_logprobs(raw: _Raw, flat: list[float], tokens: list[int]) -> list[TokenLogprob | None]:
    """flat: the sampled tokens' logprobs (k), then the top values and the top indices (u * width each)."""
    k, size = len(raw.rows), raw.top[0].numel() if raw.top is not None else 0
    width = raw.top[0].shape[1] if raw.top is not None else 0
    chosen, values, ids = flat[:k], flat[k : k + size], flat[k + size :]
    out: list[TokenLogprob | None] = [None] * len(tokens)
    for j, (i, slot, alternatives) in enumerate(zip(raw.rows, raw.slots, raw.ks)):
        base = slot * width
        top = tuple(TopLogprob(int(ids[base + c]), values[base + c]) for c in range(alternatives))
        out[i] = TokenLogprob(tokens[i], chosen[j], top)
    return out
