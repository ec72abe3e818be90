"""The paged KV cache tensors: per layer, keys and values of shape (num_blocks, block_size, kv_heads, head_dim)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One contiguous pool split into per-layer (k_cache, v_cache) views."""
    pool = torch.zeros(num_layers, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    return [(pool[i, 0], pool[i, 1]) for i in range(num_layers)]


def copy_blocks(kv_caches, copies: list[tuple[int, int]], device) -> None:
    """Copies whole blocks (src, dst) in every layer's keys and values. Each layer gathers every source before it
    writes any destination, so a block that is both (freed and reused since) is read as it was."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
    for k_cache, v_cache in kv_caches:
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))


@dataclass(frozen=True)
class DeviceMemory:
    """What the builder measured on one device, in bytes (builder._kv_blocks), as vLLM profiles it."""

    total: int  # the device's memory
    free_at_start: int  # free before the model loaded: what the CUDA context and other processes left
    weights: int  # torch's allocations once the model is loaded
    activation_peak: int  # a forward pass and sampling at the token budget, above the weights
    untracked: int  # appeared since the start outside torch's allocator: cuBLAS/NCCL workspaces, kernel modules
    graphs: int  # room for the CUDA graphs captured after the pool: the largest decode bucket's peak and its output


def kv_blocks_for_device(memory: DeviceMemory, utilization: float, bytes_per_block: int) -> int:
    """KV blocks that fit a device: `utilization` of its total memory (vLLM's --gpu-memory-utilization), but no more
    than was free at the start (another process's memory is not ours), less the weights, the activation peak, the
    memory torch does not track and the CUDA graphs' room. Raises ValueError, with the figures and what to change,
    when not one block is left."""
    usable = min(int(memory.total * utilization), memory.free_at_start)
    held = memory.weights + memory.activation_peak + memory.untracked + memory.graphs
    budget = usable - held
    blocks = max(0, budget) // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"no device memory left for the KV cache: {utilization:g} of {gib(memory.total)} "
            f"({gib(memory.free_at_start)} free at start) allows {gib(usable)}; "
            f"the weights hold {gib(memory.weights)}, "
            f"a forward pass at the token budget peaks at {gib(memory.activation_peak)} more, "
            f"{gib(memory.untracked)} is outside torch's allocator and the CUDA graphs need {gib(memory.graphs)}, "
            f"which leaves {gib(budget)} where one KV block needs {bytes_per_block} bytes: raise "
            "--gpu-memory-utilization, lower --max-batch-tokens or --max-seqs, free the device of other processes, "
            "spread the model over more --tp ranks, use --enforce-eager, or use a smaller "
            "model or dtype"
        )
    return blocks


def gib(n: int) -> str:
    """Bytes as GiB with two decimals, for logs and messages."""
    return f"{n / (1 << 30):.2f} GiB"
