"""Attention over a paged KV cache for ragged batches (torch reference, fast on CPU).

A batch is the flattened new tokens of many sequences. Sequence i owns query rows
query_start[i]:query_start[i+1] and, after this step's write, seq_lens[i] cached tokens reached through
its row of block_tables. Decodes (one query token) come first in the batch, prompt chunks after them.
Cache layout per layer: (num_blocks, block_size, kv_heads, head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_start: torch.Tensor  # (seqs + 1,) int32: offsets of each sequence's new tokens in the batch
    seq_lens: torch.Tensor  # (seqs,) int32: cached tokens per sequence, this step's included
    block_tables: torch.Tensor  # (seqs, max_blocks) int32: cache blocks of each sequence; past them any valid id
    slot_mapping: torch.Tensor  # (tokens,) int64: cache slot (block * block_size + offset) of each new token
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    max_query_len: int
    max_seq_len: int
    query_start_host: list[int]  # query_start as a list: the torch path slices without a device sync
    seq_lens_host: list[int]
    # Per-step values a backend derives once and reuses in every layer (e.g. the Triton tile map).
    workspace: dict = field(default_factory=dict)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter k, v (tokens, kv_heads, head_dim) into their cache slots."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Cached tokens of several sequences: (seqs, kv_heads, length, head_dim)."""
    seqs, block_size = block_tables.shape[0], cache.shape[1]
    blocks = -(-length // block_size)
    ids = block_tables[:, :blocks].reshape(-1).long()
    # On CPU, index_select into a given buffer is faster than advanced indexing or the allocating form.
    x = torch.empty((seqs * blocks, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    torch.index_select(cache, 0, ids, out=x)
    x = x.view(seqs, blocks * block_size, *cache.shape[2:])  # (seqs, tokens, kv_heads, head_dim)
    return x[:, :length].transpose(1, 2)


DECODE_GROUP = 16  # decodes per gather: large enough to batch well, small enough to pad little


def attend(q, k, v, mask, scale: float, softcap: float = 0.0, is_causal: bool = False) -> torch.Tensor:
    """softmax(q k^T scale (soft-capped) masked) v for q (seqs, heads, queries, head_dim), k and v (seqs, kv_heads,
    keys, head_dim); mask broadcasts to (seqs, heads, queries, keys), True where a key is seen. Soft-capping is done
    in the order transformers' eager attention does it (scale, / cap, tanh, * cap, mask, softmax in float32)."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap  # (seqs, heads, queries, keys)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _seen_only(mask: torch.Tensor, *kv: torch.Tensor) -> list[torch.Tensor]:
    """k, v (seqs, kv_heads, keys, head_dim) with the keys no query sees zeroed: slots before a window or past a
    sequence's end may hold anything, NaN included, and a NaN leaks through a masked score (NaN * 0)."""
    seen = mask.reshape(mask.shape[0], -1, mask.shape[-1]).any(dim=1)[:, None, :, None]  # (seqs or 1, 1, keys, 1)
    return [x.masked_fill(~seen, 0) for x in kv]


def _decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, length: int, scale: float, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """One query token per sequence: q (seqs, heads, head_dim) -> (seqs, heads, head_dim)."""
    k = _gather(k_cache, block_tables, length)  # (seqs, kv_heads, length, head_dim)
    v = _gather(v_cache, block_tables, length)
    pos = torch.arange(length, device=q.device)[None, :]
    mask = pos < seq_lens[:, None]  # (seqs, length)
    if window:
        mask &= pos >= seq_lens[:, None] - window
    if window or softcap:
        k, v = _seen_only(mask[:, None, :], k, v)
    return attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, softcap).squeeze(2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of q (tokens, heads, head_dim) over each sequence's cache; returns (tokens, heads, head_dim).
    window: each query sees only its last `window` positions (itself included), as transformers' sliding window;
    softcap: scores -> softcap * tanh(scores / softcap). 0 turns either off."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        # Decodes are gathered to a common length; grouping similar lengths keeps that padding small.
        order = sorted(range(nd), key=meta.seq_lens_host.__getitem__)
        for lo in range(0, nd, DECODE_GROUP):
            rows = order[lo : lo + DECODE_GROUP]
            idx = torch.tensor(rows, device=q.device)
            out[idx] = _decode_attention(
                q[idx],
                k_cache,
                v_cache,
                meta.block_tables[idx],
                meta.seq_lens[idx],
                meta.seq_lens_host[rows[-1]],
                scale,
                window,
                softcap,
            )
    prefill_attention(q, k_cache, v_cache, meta, scale, out, window, softcap)
    return out


def prefill_attention(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor, window: int = 0, softcap: float = 0.0
) -> None:
    """The prompt chunks of the batch (every sequence after the decodes), written into out."""
    starts, lens = meta.query_start_host, meta.seq_lens_host
    for i in range(meta.num_decodes, len(lens)):
        lo, hi, length = starts[i], starts[i + 1], lens[i]
        k = _gather(k_cache, meta.block_tables[i : i + 1], length)  # (1, kv_heads, length, head_dim)
        v = _gather(v_cache, meta.block_tables[i : i + 1], length)
        qs = q[lo:hi].transpose(0, 1).unsqueeze(0)  # (1, heads, chunk, head_dim)
        chunk = hi - lo
        if chunk == length and not (window or softcap):
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # The chunk's queries sit at positions length-chunk .. length-1 of the sequence.
            q_pos = torch.arange(length - chunk, length, device=q.device)[:, None]
            k_pos = torch.arange(length, device=q.device)[None, :]
            mask = k_pos <= q_pos  # (chunk, length)
            if window:
                mask &= k_pos > q_pos - window
            if window or softcap:
                k, v = _seen_only(mask[None], k, v)
            o = attend(qs, k, v, mask, scale, softcap)
        out[lo:hi] = o[0].transpose(0, 1)
