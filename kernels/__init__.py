"""Kernels behind one interface: torch references that run anywhere, Triton versions for CUDA, and on CPUs the
torch kernels with a compiled C decode attention.

`select_kernels("auto" | "torch" | "cpu" | "triton", device)` returns a `Kernels` table; the model calls only it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .attention import AttentionMetadata, paged_attention, write_kv
from .norm import add_rms_norm, rms_norm, silu_mul
from .rotary import apply_rotary, rope_cos_sin, rope_inv_freq


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotates q (tokens, heads, head_dim) and k (tokens, kv_heads, head_dim) by position, writes rotated k and v
    into the cache; returns the rotated q."""
    rows = cos_sin[positions]  # (tokens, head_dim)
    write_kv(apply_rotary(k, rows), v, k_cache, v_cache, slot_mapping)
    return apply_rotary(q, rows)


@dataclass(frozen=True)
class Kernels:
    name: str
    rotary_write_kv: Callable[..., torch.Tensor]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


TORCH_KERNELS = Kernels("torch", rotary_write_kv, paged_attention, rms_norm, add_rms_norm, silu_mul)
BACKENDS = ("auto", "torch", "cpu", "triton")


def select_kernels(backend: str, device: torch.device | str) -> Kernels:
    """ "auto" picks Triton on CUDA and the CPU kernels elsewhere; "triton" on CPU needs TRITON_INTERPRET=1."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}: use one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "torch":
        return TORCH_KERNELS
    if backend == "cpu" or (backend == "auto" and device.type != "cuda"):
        from .cpu import CPU_KERNELS

        return CPU_KERNELS
    from .triton_kernels import TRITON_KERNELS  # imported lazily: triton is only needed here

    return TRITON_KERNELS


__all__ = [
    "AttentionMetadata",
    "Kernels",
    "TORCH_KERNELS",
    "select_kernels",
    "rope_inv_freq",
    "rope_cos_sin",
    "apply_rotary",
    "rms_norm",
    "add_rms_norm",
    "silu_mul",
    "paged_attention",
    "write_kv",
    "rotary_write_kv",
]
