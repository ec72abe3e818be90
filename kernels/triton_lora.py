"""Triton LoRA delta (punica's SGMV): kernels/lora.py's `lora_sgmv` in two launches per call, whatever the number of
adapters in the step.

- shrink: grid (segments, row tiles); a program multiplies one tile of its segment's rows of x by its slot's A,
  s = x A^T (rows, max_rank), in float32.
- expand: grid (segments, row tiles, output tiles); y[rows] += s B^T for one tile of outputs.

A segment's rows are gathered through the sorted row list, so rows of one adapter need not be adjacent in the batch.
Slots are read at their padded max_rank (zero beyond an adapter's rank, and all zero where the adapter leaves this
part alone): per-slot ranks would have to cross to the device on every call, a synchronising copy that costs more
than the padded work. Rows are unique, so the expand adds without atomics. A tile past its
segment's end masks every load and store. They also run on CPU tensors under
TRITON_INTERPRET=1."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora import LoraSegments

BLOCK_M = 16  # rows per tile: decode steps bring few rows per adapter
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _tile_rows(table_ptr, rows_ptr, num_segments, BLOCK_M: tl.constexpr):
    """This program's adapter slot and its tile of the segment: positions in the sorted row list, their mask (inside
    the segment), and the batch rows at them."""
    seg = tl.program_id(0)
    slot = tl.load(table_ptr + seg)
    offs_m = tl.load(table_ptr + num_segments + seg) + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < tl.load(table_ptr + 2 * num_segments + seg)
    return slot, offs_m, mask_m, tl.load(rows_ptr + offs_m, mask=mask_m, other=0)


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    rows_ptr,
    table_ptr,
    s_ptr,
    num_segments,
    K,
    R,
    stride_xm,
    stride_as,
    stride_ar,
    stride_sm,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, offs_m, mask_m, row = _tile_rows(table_ptr, rows_ptr, num_segments, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x_ptrs = x_ptr + row[:, None] * stride_xm + offs_k[None, :]
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a_ptrs = a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None]
        a = tl.load(a_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_K, BLOCK_R): A^T
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(s_ptr + offs_m[:, None] * stride_sm + offs_r[None, :], acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(
    s_ptr,
    b_ptr,
    rows_ptr,
    table_ptr,
    y_ptr,
    num_segments,
    N,
    R,
    stride_sm,
    stride_bs,
    stride_bn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, offs_m, mask_m, row = _tile_rows(table_ptr, rows_ptr, num_segments, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    s_ptrs = s_ptr + offs_m[:, None] * stride_sm + offs_r[None, :]
    s = tl.load(s_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    b_ptrs = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None]
    b = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_R, BLOCK_N): B^T
    delta = tl.dot(s.to(b.dtype), b, input_precision=PRECISION)
    y_ptrs = y_ptr + row[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_sgmv(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: LoraSegments, ranks: list[int]
) -> None:
    """kernels/lora.py's contract: y[rows of each segment] += (x[rows] a[slot]^T) b[slot]^T, in place. `ranks` is not
    read: a slot is computed at its padded rank (see the module's docstring)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, num_segments, max_rank = seg.rows, len(seg.segments), a.shape[1]
    n_out = y.shape[1]
    block_r = max(16, triton.next_power_of_2(max_rank))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 would otherwise lose ~3 digits to tf32
    s = torch.empty((rows.shape[0], max_rank), dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(seg.max_rows, BLOCK_M)
    _shrink_kernel[(num_segments, tiles)](
        x,
        a,
        rows,
        seg.table,
        s,
        num_segments,
        x.shape[1],
        max_rank,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        s.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_K=BLOCK_K,
        BLOCK_R=block_r,
        PRECISION=precision,
    )
    _expand_kernel[(num_segments, tiles, triton.cdiv(n_out, BLOCK_N))](
        s,
        b,
        rows,
        seg.table,
        y,
        num_segments,
        n_out,
        max_rank,
        s.stride(0),
        b.stride(0),
        b.stride(1),
        y.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_R=block_r,
        PRECISION=precision,
    )
