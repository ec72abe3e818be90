"""Kernels behind one interface, the `Kernels` table (kernels/table.py): attention over the paged KV cache, rotary
embedding with the cache write, RMSNorm, the MLP's activation, linear layers and greedy sampling's argmax.

Three backends fill it: torch references that run anywhere (`TORCH_KERNELS`); on CPUs, compiled C kernels for the
hot paths with the torch references wherever a kernel does not apply (kernels/cpu.py); on CUDA, Triton kernels
(kernels/triton_kernels.py). `select_kernels("auto" | "torch" | "cpu" | "triton", device)` returns the table; the
model and the sampler call only it.
"""

from __future__ import annotations

from fastgen import toplevel

if toplevel.is_bare(__name__):  # imported as bare `kernels` from the repository root: see fastgen/toplevel.py
    toplevel.hand_over(__name__, __file__)
else:
    import torch

    from .attention import AttentionMetadata, paged_attention, write_kv
    from .norm import add_rms_norm, gelu_tanh_mul, rms_norm, silu_mul
    from .rotary import apply_rotary, rope_cos_sin, rope_inv_freq, rotary_write_kv
    from .table import TORCH_KERNELS, Kernels

BACKENDS = ("auto", "torch", "cpu", "triton")


def select_kernels(backend: str, device: torch.device | str, float32_int8: bool = False) -> Kernels:
    """ "auto" picks Triton on CUDA and the CPU kernels elsewhere; "triton" on CPU needs TRITON_INTERPRET=1.
    float32_int8: the CPU kernels' float32 decode rows over quantized blocks round their activations to int8
    (kernels/quant.py's QuantLinear.float32_int8)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}: use one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "torch":
        return TORCH_KERNELS
    if backend == "cpu" or (backend == "auto" and device.type != "cuda"):
        from .cpu import CPU_KERNELS, CPU_KERNELS_FLOAT32_INT8

        return CPU_KERNELS_FLOAT32_INT8 if float32_int8 else CPU_KERNELS
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
    "gelu_tanh_mul",
    "paged_attention",
    "write_kv",
    "rotary_write_kv",
]
