"""The LoRA delta on the CPU: kernels/lora.py's `lora_sgmv` contract in one C call per layer part (csrc/lora.c),
every adapter of the step at once, instead of four torch ops per adapter. torch's version serves where the C
library is missing or the tensors are not in the layout it reads."""

from __future__ import annotations

import ctypes

import torch

from . import clib
from .lora import LoraSegments
from .lora import lora_sgmv as torch_lora_sgmv

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # csrc/lora.c's dtype codes
MAX_RANK = 256  # csrc/lora.c's MAX_RANK: the shrunk vector lives on its stack


def lora_sgmv(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: LoraSegments, ranks: list[int]
) -> None:
    """kernels/lora.py's contract: y[rows of each segment] += (x[rows] a[slot]^T) b[slot]^T, in place."""
    library = clib.get_library()
    if (
        library is None
        or y.dtype not in DTYPES
        or a.shape[1] > MAX_RANK
        or not (x.dtype == a.dtype == b.dtype == y.dtype)
        or not (y.is_cpu and x.is_cpu)
        or y.stride(1) != 1
        or x.stride(1) != 1
        or not (a.is_contiguous() and b.is_contiguous())
        or not (seg.rows.dtype == seg.table.dtype == torch.int64)
        or not (seg.rows.is_contiguous() and seg.table.is_contiguous())
    ):
        torch_lora_sgmv(y, x, a, b, seg, ranks)
        return
    slots, max_rank, fan_in = a.shape
    status = library.lora_sgmv(
        y.data_ptr(),
        y.stride(0),
        x.data_ptr(),
        x.stride(0),
        a.data_ptr(),
        b.data_ptr(),
        seg.rows.data_ptr(),
        seg.table.data_ptr(),
        (ctypes.c_int32 * len(ranks))(*ranks),
        seg.rows.numel(),
        len(seg.segments),
        slots,
        fan_in,
        b.shape[1],
        max_rank,
        DTYPES[y.dtype],
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(
            f"the C LoRA kernel declined: {len(seg.segments)} segments over {seg.rows.numel()} rows, slots {slots}, "
            f"rank {max_rank}, ranks {ranks}"
        )
