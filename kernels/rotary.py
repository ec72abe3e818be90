"""Rotary position embedding (rotate-half layout, as Hugging Face Llama), with llama3 frequency scaling. A table
narrower than head_dim rotates only the first dims of each head (partial rotary: Phi, Falcon), the rest pass."""

from __future__ import annotations

import math

import torch

from .attention import write_kv


def rope_inv_freq(
    head_dim: int, theta: float, llama3_scaling: tuple[float, float, float, int] | None = None
) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in float32; llama3_scaling = (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if llama3_scaling is None:
        return inv_freq
    factor, low_freq_factor, high_freq_factor, old_context_len = llama3_scaling
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """Table (max_positions, head_dim) in float32: cos in the first half, sin in the second."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # (positions, head_dim/2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x (tokens, heads, head_dim) rotated by cos_sin rows (tokens, rotary_dim) already gathered by position; dims
    past rotary_dim pass unchanged."""
    if cos_sin.shape[-1] < x.shape[-1]:
        rotary_dim = cos_sin.shape[-1]
        return torch.cat([apply_rotary(x[..., :rotary_dim], cos_sin), x[..., rotary_dim:]], dim=-1)
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half].to(x.dtype), cos_sin[:, None, half:].to(x.dtype)  # (tokens, 1, half)
    x1, x2 = x[..., :half], x[..., half:]
    # Same arithmetic as HF's `x * cos + rotate_half(x) * sin`, so float32 results match bit for bit.
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


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
