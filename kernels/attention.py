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
    block_tables: torch.Tensor  # (seqs, max_blocks) int32: cache blocks of each sequence, padded with 0
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


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, length: int, scale: float) -> torch.Tensor:
    """One query token per sequence: q (seqs, heads, head_dim) -> (seqs, heads, head_dim)."""
    k = _gather(k_cache, block_tables, length)  # (seqs, kv_heads, length, head_dim)
    v = _gather(v_cache, block_tables, length)
    mask = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]  # (seqs, length)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return o.squeeze(2)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of q (tokens, heads, head_dim) over each sequence's cache; returns (tokens, heads, head_dim)."""
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
            )
    prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out


def prefill_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """The prompt chunks of the batch (every sequence after the decodes), written into out."""
    starts, lens = meta.query_start_host, meta.seq_lens_host
    for i in range(meta.num_decodes, len(lens)):
        lo, hi, length = starts[i], starts[i + 1], lens[i]
        k = _gather(k_cache, meta.block_tables[i : i + 1], length)  # (1, kv_heads, length, head_dim)
        v = _gather(v_cache, meta.block_tables[i : i + 1], length)
        qs = q[lo:hi].transpose(0, 1).unsqueeze(0)  # (1, heads, chunk, head_dim)
        chunk = hi - lo
        if chunk == length:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # The chunk's queries sit at positions length-chunk .. length-1 of the sequence.
            q_pos = torch.arange(length - chunk, length, device=q.device)
            mask = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]  # (chunk, length)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[lo:hi] = o[0].transpose(0, 1)
