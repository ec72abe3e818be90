"""The paged KV cache tensors: per layer, keys and values of shape (num_blocks, block_size, kv_heads, head_dim)."""

from __future__ import annotations

import torch


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One contiguous pool split into per-layer (k_cache, v_cache) views."""
    pool = torch.zeros(num_layers, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    return [(pool[i, 0], pool[i, 1]) for i in range(num_layers)]
