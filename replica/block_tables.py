"""Block tables kept where they are read, and sent as changes.

A sequence's block table gains one block every block_size tokens and otherwise stays as it was, yet building each
step's tables whole sends every entry of every sequence every step: (sequences x blocks) numbers, padded, copied to
the device (a 64-sequence decode step at 2k tokens of context: 8k numbers) and broadcast to every tensor-parallel
rank. Here each sequence holds a row of a table that lasts from step to step, and a step sends, per sequence, how
many leading entries its row already holds and the entries after those: at a decode step, nearly always none.

`BlockTableRows` (no torch) decides the rows and the changes. Its state follows from the steps it was shown alone,
so rank 0's copy, which computes changes, and another rank's, which applies them, agree without sending rows.
`DeviceBlockTables` keeps the rows on the model's device, where the attention kernels read a step's tables from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch import ScheduledSeq

FIRST_ROWS = 64  # rows double when a step needs more (the first step of a deployment past 64 sequences)
FIRST_WIDTH = 64  # blocks per row, doubled when a table is longer


@dataclass
class TableChange:
    row: int  # the row that holds the sequence's table
    kept: int  # leading entries the row already holds
    tail: list[int]  # the entries after those: the table is the row's first `kept` entries, then these


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a table that grew or stayed), compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


class BlockTableRows:
    """Which row holds each sequence's block table, and what every row holds. A sequence keeps its row while it
    runs; a new one takes a free row, else the row unused for the most steps (its sequence, should it run again, is
    sent whole). Nothing tells it that a sequence ended: rows are taken back only when needed."""

    def __init__(self, rows: int = FIRST_ROWS) -> None:
        self.tables: list[list[int]] = [[] for _ in range(rows)]  # what each row holds
        self.owner: list[int | None] = [None] * rows  # whose table each row holds
        self.used: list[int] = [0] * rows  # the last step that used each row
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.step = 0

    @property
    def num_rows(self) -> int:
        return len(self.owner)

    def claim(self, seq_ids: Sequence[int]) -> list[int]:
        """The row of each sequence of a step (distinct ids); rows double when the step uses every one."""
        self.step += 1
        rows = [self.row_of.get(seq_id, -1) for seq_id in seq_ids]
        for row in rows:
            if row >= 0:
                self.used[row] = self.step
        need = rows.count(-1)
        if need == 0:
            return rows
        spare = [row for row in range(self.num_rows) if self.used[row] < self.step]
        while len(spare) < need:
            spare += range(self.num_rows, 2 * self.num_rows)
            self.tables += [[] for _ in range(self.num_rows)]
            self.owner += [None] * self.num_rows
            self.used += [0] * self.num_rows
        spare.sort(key=lambda row: (self.owner[row] is not None, self.used[row]))  # free rows first, then the oldest
        taken = iter(spare)
        for i, seq_id in enumerate(seq_ids):
            if rows[i] < 0:
                row = rows[i] = next(taken)
                if (previous := self.owner[row]) is not None:
                    del self.row_of[previous]
                self.owner[row], self.row_of[seq_id], self.used[row] = seq_id, row, self.step
                self.tables[row].clear()
        return rows

    def changes(self, tables: Sequence[tuple[int, list[int]]]) -> list[TableChange]:
        """(seq_id, block table) of each sequence of a step -> what its row lacks; the rows then hold the tables."""
        out = []
        for row, (_, table) in zip(self.claim([seq_id for seq_id, _ in tables]), tables):
            held = self.tables[row]
            kept = common_prefix(held, table)
            out.append(TableChange(row, kept, table[kept:]))
            del held[kept:]
            held += out[-1].tail
        return out

    def apply(self, seq_ids: Sequence[int], changes: Sequence[tuple[int, list[int]]]) -> list[list[int]]:
        """The other side of `changes`: (kept, tail) of each sequence of a step -> the sequences' whole tables."""
        out = []
        for row, (kept, tail) in zip(self.claim(seq_ids), changes):
            held = self.tables[row]
            if kept > len(held):
                raise ValueError(f"a change keeps {kept} entries of a row holding {len(held)}: the sides disagree")
            del held[kept:]
            held += tail
            out.append(list(held))
        return out


@dataclass
class TableUpdate:
    """One step's changes to the device tables, as numbers for the step's one host-to-device copy."""

    rows: list[int]  # each sequence's row, in batch order
    slots: list[int]  # flat positions (row * row width + column) in the table of the entries that change
    values: list[int]  # their new block ids
    width: int  # blocks in the step's longest table: the columns the step reads

    def numbers(self) -> list[int]:
        return self.rows + self.slots + self.values

    @property
    def sizes(self) -> list[int]:
        return [len(self.rows), len(self.slots), len(self.values)]


class DeviceBlockTables:
    """Every running sequence's block table on the device, a row each, brought up to date a step at a time. Past
    its table's length a row holds stale block ids (valid ids of this cache), where step-built tables held zeros:
    the kernels read no block past a sequence's length."""

    def __init__(self, device: torch.device, rows: int = FIRST_ROWS, width: int = FIRST_WIDTH) -> None:
        self.rows = BlockTableRows(rows)
        self.table = torch.zeros((rows, width), dtype=torch.int32, device=device)

    def update(self, seqs: Sequence[ScheduledSeq]) -> TableUpdate:
        """The step's changes, in numbers; the table grows first where the step needs more rows or columns."""
        changes = self.rows.changes([(s.seq_id, s.block_table) for s in seqs])
        width = max((len(s.block_table) for s in seqs), default=0)
        self._fit(self.rows.num_rows, width)
        stride = self.table.shape[1]
        slots = [c.row * stride + c.kept + j for c in changes for j in range(len(c.tail))]
        return TableUpdate([c.row for c in changes], slots, [v for c in changes for v in c.tail], max(width, 1))

    def apply(self, update: TableUpdate, numbers: torch.Tensor) -> torch.Tensor:
        """numbers: update.numbers() on the device (int64). Writes the changes; returns the step's tables,
        (sequences, update.width) int32, contiguous."""
        rows, slots, values = numbers.split(update.sizes)
        if update.slots:
            self.table.view(-1).index_copy_(0, slots, values.to(torch.int32))
        return self.table[:, : update.width].index_select(0, rows)

    def forget(self) -> None:
        """After a step that failed between `update` and `apply`: the rows may claim entries the device never got, so
        the next step sends every table whole."""
        self.rows = BlockTableRows(self.rows.num_rows)

    def _fit(self, rows: int, width: int) -> None:
        have_rows, have_width = self.table.shape
        if rows <= have_rows and width <= have_width:
            return
        while have_width < width:
            have_width *= 2
        grown = self.table.new_zeros((max(rows, have_rows), have_width))
        grown[: self.table.shape[0], : self.table.shape[1]] = self.table
        self.table = grown
