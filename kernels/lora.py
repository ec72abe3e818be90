"""Batched LoRA (punica's SGMV shape): the rows of one step that run under adapters, sorted by adapter slot into
segments, each segment's low-rank delta computed in one shrink and one expand over all its rows.

A step carries tokens of several adapters (and of the base model, which get no delta). The model runner sorts the
rows once per step (`LoraSegments`); every adapted layer then adds, for each segment, (x A^T) B^T to its rows, with
the adapter's scaling already folded into B. The torch version here runs anywhere; the work per layer is one pair
of matrix multiplies per adapter present in the step, never one per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraSegments:
    """One step's rows grouped by adapter slot."""

    rows: torch.Tensor  # (adapted tokens,) int64: the rows of the step's tokens that run under an adapter, by slot
    # (slot, start, end): rows[start:end] run under the adapter in slot `slot`; slots ascending, each at most once
    segments: list[tuple[int, int, int]]
    table: torch.Tensor  # (3, segments) int64 on the device: `segments` as slots, starts, ends (a kernel's grid)
    max_rows: int  # rows of the longest segment
    # What a backend's kernel reads of this step, worked out on its first call and kept for every layer's (the CPU
    # backend: the row list's and table's addresses and sizes); None until then.
    kernel_args: tuple[int, ...] | None = field(default=None, repr=False, compare=False)


def lora_sgmv(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: LoraSegments, ranks: list[int]
) -> None:
    """y[rows of each segment] += (x[rows] a[slot]^T) b[slot]^T, in place.

    y (tokens, out) may be a column slice of a larger output; x (tokens, in); a (slots, max_rank, in); b (slots, out,
    max_rank), zero beyond each slot's rank; ranks: each slot's rank (0: this layer's part is not adapted there, its
    rows get no delta)."""
    for slot, start, end in seg.segments:
        rank = ranks[slot]
        if not rank:
            continue
        picked = seg.rows[start:end]
        shrunk = x.index_select(0, picked) @ a[slot, :rank].T  # (segment rows, rank)
        y.index_add_(0, picked, shrunk @ b[slot, :, :rank].T)  # (segment rows, out)
