"""`--quantization fp8`: a float checkpoint's linear weights as float8 E4M3 with one float32 scale per output
channel, made at load, multiplied with activations quantized to E4M3 per token at each call (dynamic scales), in one
torch._scaled_mm: on CUDA, the fp8 tensor cores of an H100/H200 (compute capability 8.9 and later) with the scales
applied in its epilogue; elsewhere torch's reference of the same op, which is what lets the CPU tests run this path.

The numerics are vLLM's fp8 "w8a8" with per-channel weights and per-token activations (its FP8 dynamic scheme):
scale = max|row| / 448 (E4M3's largest value), values rounded to nearest even by the cast; the product accumulates
in float32 and is written in the activations' dtype, the bias added after."""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)  # an all-zero row or token still has a usable scale (its values are all 0)


def fp8_supported(device: torch.device) -> str | None:
    """None where fp8 matrix multiplies run on this device, else why not."""
    if device.type != "cuda":
        return None  # torch's reference: correct, slow (the torch and Triton kernels' tests on the CPU)
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"fp8 needs compute capability 8.9 or later (Ada, Hopper): this GPU is {major}.{minor}"
    return None


@dataclass(frozen=True)
class Fp8Tensor:
    """A weight (rows, cols) as E4M3 values times one float32 scale per row: w[r, c] ~ values[r, c] * scales[r]."""

    values: torch.Tensor  # float8_e4m3fn (rows, cols)
    scales: torch.Tensor  # float32 (rows,)

    name = "fp8"

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.values.shape
        return rows, cols

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scales.numel() * 4

    def splits_at(self, *columns: int) -> bool:
        return True  # one scale a row: any column may start a shard

    def narrow(self, dim: int, start: int, length: int) -> Fp8Tensor:
        scales = self.scales.narrow(0, start, length) if dim == 0 else self.scales
        return Fp8Tensor(self.values.narrow(dim, start, length), scales)

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales[:, None]


def quantize_fp8(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> Fp8Tensor:
    """weight (rows, cols) -> E4M3 per output channel. absmax: the rows' max |w| where this is a shard of wider rows
    (a row-parallel layer's), so every TP size serves the same values."""
    w = weight.detach().float()
    if absmax is None:
        absmax = w.abs().amax(dim=1)
    scales = (absmax.float() / E4M3_MAX).clamp(min=MIN_SCALE)
    values = (w / scales[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Tensor(values, scales)


@dataclass(frozen=True)
class Fp8Linear:
    """A layer's fp8 parts joined along its output rows: what fp8_linear reads."""

    values: torch.Tensor  # float8_e4m3fn (out, in)
    scales: torch.Tensor  # float32 (1, out): _scaled_mm's row-wise scale of its second operand

    @property
    def holds_weight(self) -> bool:
        return True


def pack_fp8(parts: list[tuple[int, object]], out_features: int) -> Fp8Linear | None:
    """A layer's quantized parts (first output row, weight) as one Fp8Linear; None unless all are fp8 and cover the
    rows in order."""
    parts = sorted(parts, key=lambda p: p[0])
    tensors = [t for _, t in parts if isinstance(t, Fp8Tensor)]
    if not tensors or len(tensors) != len(parts):
        return None
    rows = [t.shape[0] for t in tensors]
    if [s for s, _ in parts] != [sum(rows[:i]) for i in range(len(rows))] or sum(rows) != out_features:
        return None
    if out_features % 16 or tensors[0].shape[1] % 16:  # the fp8 GEMM's operands' dimensions
        return None
    values = torch.cat([t.values for t in tensors]).contiguous()
    scales = torch.cat([t.scales for t in tensors]).view(1, -1).contiguous()
    return Fp8Linear(values, scales)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (tokens, in) -> (E4M3 values, float32 scales (tokens, 1)): each token's own scale, max|x| / 448."""
    scales = (x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scales).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scales


def fp8_linear(x: torch.Tensor, packed: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) W^T + bias -> (..., out) in x's dtype."""
    features, fan_in = packed.values.shape
    x2 = x.reshape(-1, fan_in)
    xq, x_scales = quantize_rows(x2)
    # CUDA's row-wise scaled fp8 GEMM writes bfloat16 only: other dtypes are rounded from it (torch's CPU op any)
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage]
        xq, packed.values.t(), scale_a=x_scales, scale_b=packed.scales, out_dtype=out_dtype
    ).to(x.dtype)
    if bias is not None:  # after the rounding: row-wise scaled fp8 products take no bias on every torch build
        y = y + bias
    return y.view(*x.shape[:-1], features)


def fp8_linear_reference(x: torch.Tensor, packed: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float64 from the same quantized operands: what fp8_linear computes, up to summation."""
    xq, x_scales = quantize_rows(x.reshape(-1, x.shape[-1]))
    a = xq.double() * x_scales.double()
    w = packed.values.double() * packed.scales.double().view(-1, 1)
    y = (a @ w.t()).to(x.dtype).double()  # rounded as fp8_linear's product is, before the bias
    return y if bias is None else y + bias.double()
