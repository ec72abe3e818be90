"""AWQ/GPTQ int4 linear layers as one Triton kernel for CUDA (CPU tensors too, under TRITON_INTERPRET=1): y = x W^T
(+ bias) with W a kernels/int4.py Int4Tensor, dequantized in registers tile by tile, never written out.

A program computes a (BLOCK_M rows, BLOCK_N output features) tile over a range of the input features: each BLOCK_K
step loads the int32 words of its (BLOCK_K, BLOCK_N) weight tile (a word's address repeated for its eight nibbles:
one read from memory, the rest from cache), shifts out the nibbles, takes the tile's one (scale, zero) per output
feature (BLOCK_K divides the group), and multiplies the dequantized tile, rounded to x's dtype as the reference's
`dequantize().to(x.dtype)` is, with tl.dot.

Two shapes of call:
- prompts (more than DECODE_ROWS rows): tall tiles over the whole input, one program per output tile;
- decode (few rows, bound by reading the weights): BLOCK_M 16, the smallest tile tensor cores take, and the input
  split across SPLIT_K programs so that about TARGET_PROGRAMS run at once however few output tiles the layer has.
  Partial sums go to a float32 buffer and are added in a fixed order (torch's sum over the splits), so results do not
  depend on scheduling, and no host value is read: a captured CUDA graph replays it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import dense
from .fp8 import Fp8Linear, pack_fp8
from .int4 import Int4Tensor, MixedOrders, common_perm
from .norm import silu_mul

DECODE_ROWS = 16
TARGET_PROGRAMS = 256  # about two per SM of an H100/H200: enough loads in flight to keep HBM busy


@dataclass(frozen=True)
class Int4Linear:
    """A layer's int4 parts joined along its output rows, on the device the kernel runs on."""

    qweight: torch.Tensor  # int32 (out, in / 8)
    scales: torch.Tensor  # (out, in / group)
    zeros: torch.Tensor  # uint8 (out, in / group)
    group_size: int
    perm: torch.Tensor | None = None  # int64 (in,): act-order's input column of each stored one (Int4Tensor.perm)

    @property
    def holds_weight(self) -> bool:
        return True

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 8


def pack_int4(parts: list[tuple[int, object]], out_features: int) -> Int4Linear | None:
    """A layer's quantized parts (first output row, weight) as one Int4Linear, or None where one is not int4, the
    parts differ in group size or column order, or a group is not a multiple of 16 (tl.dot's least K; the caller
    dequantizes)."""
    parts = sorted(parts, key=lambda p: p[0])
    tensors = [p for _, p in parts]
    if not tensors or not all(isinstance(t, Int4Tensor) for t in tensors):
        return None
    groups = {t.group_size for t in tensors if isinstance(t, Int4Tensor)}
    starts = [s for s, _ in parts]
    rows = [t.shape[0] for t in tensors if isinstance(t, Int4Tensor)]
    if len(groups) != 1 or starts != [sum(rows[:i]) for i in range(len(rows))] or sum(rows) != out_features:
        return None
    if next(iter(groups)) % 16:
        return None
    try:
        perm = common_perm(parts)
    except MixedOrders:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def joined(field: str) -> torch.Tensor:
        return torch.cat([getattr(t, field) for t in tensors]).to(device).contiguous()

    return Int4Linear(
        joined("qweight"), joined("scales"), joined("zeros"), groups.pop(), None if perm is None else perm.to(device)
    )


def pack_quantized(parts: list[tuple[int, object]], out_features: int) -> Int4Linear | Fp8Linear | None:
    """The Triton backend's quantized forms: int4 through the kernel below, fp8 through torch's scaled matmul."""
    return pack_int4(parts, out_features) or pack_fp8(parts, out_features)


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    rows,
    features,
    fan_in,
    stride_xm,
    stride_om,
    stride_os,  # between splits' partial outputs (0 when SPLIT_K is 1)
    k_per_split,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,  # added in float32 before the one rounding (SPLIT_K 1 only)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < rows
    n_ok = n < features
    kk = tl.arange(0, BLOCK_K)
    words = fan_in // 8
    groups = fan_in // GROUP
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm  # (BLOCK_M, 1)
    w_cols = qweight_ptr + n[None, :].to(tl.int64) * words  # (1, BLOCK_N)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + kk  # every k < fan_in: the splits and BLOCK_K divide it
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)  # (BLOCK_M, BLOCK_K)
        word = tl.load(w_cols + (k // 8)[:, None], mask=n_ok[None, :], other=0)  # (BLOCK_K, BLOCK_N) int32
        q = (word >> ((k % 8) * 4)[:, None]) & 0xF
        g = k0 // GROUP
        scale = tl.load(scales_ptr + n.to(tl.int64) * groups + g, mask=n_ok, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + n.to(tl.int64) * groups + g, mask=n_ok, other=0).to(tl.int32)
        w = ((q - zero[None, :]).to(tl.float32) * scale[None, :]).to(x.dtype)  # exact, then x's rounding
        acc += tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split.to(tl.int64) * stride_os + m[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tiles(rows: int, features: int, fan_in: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) for a call; BLOCK_K divides the group, SPLIT_K the input's K steps."""
    block_k = next(b for b in (128, 64, 32, 16) if group % b == 0)
    if rows > DECODE_ROWS:
        block_m = 64 if rows <= 256 else 128
        return block_m, 128, min(block_k, 64), 1
    block_n = 64
    steps = fan_in // block_k
    wanted = max(1, TARGET_PROGRAMS // triton.cdiv(features, block_n))
    split = max(d for d in range(1, min(wanted, steps) + 1) if steps % d == 0)
    return DECODE_ROWS, block_n, block_k, split


def int4_linear(x: torch.Tensor, packed: Int4Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) W^T + bias -> (..., out) in x's dtype."""
    features, fan_in = packed.shape
    x2 = x.reshape(-1, fan_in)
    if packed.perm is not None:
        x2 = x2.index_select(1, packed.perm)  # act-order: the input in the stored columns' order
    elif x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    block_m, block_n, block_k, split = _tiles(rows, features, fan_in, packed.group_size)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 would otherwise lose ~3 digits to tf32
    if split == 1:
        out = torch.empty(rows, features, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split, rows, features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(features, block_n), split)
    _int4_matmul_kernel[grid](
        x2,
        packed.qweight,
        packed.scales,
        packed.zeros,
        bias if bias is not None and split == 1 else out,  # any pointer where there is none: never read
        out,
        rows,
        features,
        fan_in,
        x2.stride(0),
        out.stride(-2),
        out.stride(0) if split > 1 else 0,
        fan_in // split,
        GROUP=packed.group_size,
        HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=precision,
        enable_fp_fusion=True,  # said, not defaulted: the dequantized products are exact either way
    )
    if split > 1:
        y = out.sum(0)  # the splits in a fixed order, in float32
        out = (y + bias.float() if bias is not None else y).to(x.dtype)
    return out.view(*x.shape[:-1], features)


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, packed: object | None):
    """The Triton backend's linear: int4 layers through the kernel, the rest through torch (cuBLAS, fp8 GEMMs)."""
    if isinstance(packed, Int4Linear):
        return int4_linear(x, packed, bias)
    return dense.linear(x, weight, bias, packed)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor | None, packed: object | None) -> torch.Tensor:
    return silu_mul(linear(x, weight, None, packed))
