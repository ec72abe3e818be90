"""Attention over a paged KV cache for ragged batches (torch reference, fast on CPU).

A batch is the flattened new tokens of many sequences. Sequence i owns query rows
query_start[i]:query_start[i+1] and, after this step's write, seq_lens[i] cached tokens reached through
its row of block_tables. Decodes (one query token) come first in the batch, prompt chunks after them.
Cache layout per layer: (num_blocks, block_size, kv_heads, head_dim).
"""
from __future__ import annotations

from dataclasses import dataclass

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
    # index_select on the flattened table is several times faster on CPU than advanced indexing.
    ids = block_tables[:, :blocks].reshape(-1).long()
    x = cache.index_select(0, ids).view(seqs, blocks * block_size, *cache.shape[2:])  # (seqs, tokens, kv_heads, hd)
    return x[:, :length].transpose(1, 2)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of q (tokens, heads, head_dim) over each sequence's cache; returns (tokens, heads, head_dim)."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        length = max(meta.seq_lens_host[:nd])
        k = _gather(k_cache, meta.block_tables[:nd], length)  # (decodes, kv_heads, length, head_dim)
        v = _gather(v_cache, meta.block_tables[:nd], length)
        positions = torch.arange(length, device=q.device)
        mask = positions[None, :] < meta.seq_lens[:nd, None]  # (decodes, length)
        qd = q[:nd].unsqueeze(2)  # (decodes, heads, 1, head_dim)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    starts, lens = meta.query_start_host, meta.seq_lens_host
    for i in range(nd, len(lens)):
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
    return out
