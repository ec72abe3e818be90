"""The LoRA delta on the CPU: kernels/lora.py's `lora_sgmv` contract in one C call per layer part (csrc/lora.c),
every adapter of the step at once, instead of four torch ops per adapter. torch's version serves where the C
library is missing or the tensors are not in the layout it reads.

In bfloat16 on CPUs with AMX (`on_amx`), where fan_in is a multiple of 32, the kernel runs both products on the
matrix engine, 16 rows of a segment at a time. It reads the adapters' A and B in the engine's tile order:
`tile_order` makes that copy of a layer part's slots on its first call, and of its loaded slots again after an
adapter is loaded into them (the slots' version counters say when), so no step packs them; the copy is as large as
the slots. Elsewhere (float32, other CPUs, other shapes) each row is one pass over its adapter's A and B. Either way
a row's result is the same in any batch and on any thread count."""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from . import clib
from .lora import LoraSegments
from .lora import lora_sgmv as torch_lora_sgmv

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # csrc/lora.c's dtype codes
TILED = 2  # csrc/lora.c's code for bfloat16 with a and b in tile order
MAX_RANK = 256  # csrc/lora.c's MAX_RANK: the row kernel's shrunk vector lives on its stack


@functools.cache
def on_amx() -> bool:
    """Whether bfloat16 deltas whose fan_in is a multiple of 32 run on the matrix engine here (csrc/lora.c's AMX path,
    built under the same guard as the AMX prompt attention, whose entry point asks Linux for the tile state)."""
    library = clib.get_library()
    return library is not None and bool(library.prefill_attention_available())


@functools.lru_cache(maxsize=1024)
def _c_ranks(ranks: tuple[int, ...]) -> ctypes.Array:
    """Each slot's rank as the C call reads it; a layer part's ranks change only when an adapter is loaded."""
    return (ctypes.c_int32 * len(ranks))(*ranks)


def tile_order(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots a (slots, max_rank, fan_in) and b (slots, fan_out, max_rank), bfloat16, in csrc/lora.c's tile order:
    per slot, A's rank tiles (16 ranks) by 32-input blocks, each 16 rows of input pairs x 16 ranks; B's column tiles
    (16 outputs) by rank blocks of kb (max_rank rounded up to even, at most 32), each kb / 2 rows of rank pairs x 16
    outputs; ranks and outputs past the slots' zero."""
    slots, max_rank, fan_in = a.shape
    fan_out = b.shape[1]
    rank16 = -(-max_rank // 16) * 16
    kb = min(32, max_rank + max_rank % 2)
    kp, tiles = -(-max_rank // kb) * kb, -(-fan_out // 16)
    a_tiles = F.pad(a, (0, 0, 0, rank16 - max_rank)).view(slots, rank16 // 16, 16, fan_in // 32, 16, 2)
    b_tiles = F.pad(b, (0, kp - max_rank, 0, 16 * tiles - fan_out)).view(slots, tiles, 16, kp // kb, kb // 2, 2)
    return a_tiles.permute(0, 1, 3, 4, 2, 5).contiguous(), b_tiles.permute(0, 1, 3, 4, 2, 5).contiguous()


def _tiled(a: torch.Tensor, b: torch.Tensor, ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """tile_order(a, b), kept on a until either changes: loading an adapter into a slot (or clearing one) writes them
    in place, which bumps their version counters. Only slots of nonzero rank are tiled (the kernel reads no other);
    the copy is updated in place. None where the versions cannot be read (tensors made in inference mode keep none)."""
    try:
        key = (a.data_ptr(), a._version, b.data_ptr(), b._version)
    except RuntimeError:
        return None
    kept = getattr(a, "_fastgen_lora_tiles", None)
    if kept is None or kept[0] != key:
        used = [slot for slot, rank in enumerate(ranks) if rank]
        if kept is None or len(used) == len(ranks):
            tiles = tile_order(a, b)
        else:
            tiles = kept[1]
            if used:
                index = torch.tensor(used)
                for whole, part in zip(tiles, tile_order(a[index], b[index])):
                    whole[index] = part
        kept = (key, tiles)
        # kept on the slots' tensor: lives and dies with them
        a._fastgen_lora_tiles = kept  # pyright: ignore[reportAttributeAccessIssue]
    return kept[1]


def _step_args(seg: LoraSegments) -> tuple[int, ...] | None:
    """(rows' address, table's address, adapted rows, segments) of the step, once for all its calls; None where the C
    kernel cannot read the row list or the table as they are."""
    if seg.kernel_args is None:
        rows, table = seg.rows, seg.table
        fits = (
            rows.dtype == table.dtype == torch.int64
            and rows.is_cpu
            and table.is_cpu
            and rows.is_contiguous()
            and table.is_contiguous()
        )
        seg.kernel_args = (rows.data_ptr(), table.data_ptr(), rows.numel(), len(seg.segments)) if fits else ()
    return seg.kernel_args or None


def lora_sgmv(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: LoraSegments, ranks: list[int]
) -> None:
    """kernels/lora.py's contract: y[rows of each segment] += (x[rows] a[slot]^T) b[slot]^T, in place."""
    library = clib.get_library()
    dtype = DTYPES.get(y.dtype)
    step = _step_args(seg)
    if (
        library is None
        or dtype is None
        or step is None
        or not (x.dtype == a.dtype == b.dtype == y.dtype)
        or a.shape[1] > MAX_RANK
        or not (y.is_cpu and x.is_cpu)
        or y.stride(1) != 1
        or x.stride(1) != 1
        or not (a.is_contiguous() and b.is_contiguous())
    ):
        torch_lora_sgmv(y, x, a, b, seg, ranks)
        return
    (slots, max_rank, fan_in), fan_out = a.shape, b.shape[1]
    rows, table, total, segments = step
    tiled = _tiled(a, b, ranks) if dtype == DTYPES[torch.bfloat16] and fan_in % 32 == 0 and on_amx() else None
    if tiled is not None:
        a, b, dtype = tiled[0], tiled[1], TILED
    status = library.lora_sgmv(
        y.data_ptr(),
        y.stride(0),
        x.data_ptr(),
        x.stride(0),
        a.data_ptr(),
        b.data_ptr(),
        rows,
        table,
        _c_ranks(tuple(ranks)),
        total,
        segments,
        slots,
        fan_in,
        fan_out,
        max_rank,
        dtype,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(
            f"the C LoRA kernel declined: {segments} segments over {total} rows, slots {slots}, rank {max_rank}, "
            f"ranks {ranks}"
        )
