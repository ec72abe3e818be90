"""Block tables kept on the device and sent as changes (replica/block_tables.py): what a step sends rebuilds every
sequence's table exactly, on the other ranks and on the device, through growth, shrinking, a head given back,
preemption and rows taken back; and a decode step sends next to nothing."""

from __future__ import annotations

import random

import torch

from fastgen.replica.batch import Batch, ScheduledSeq
from fastgen.replica.batch_broadcast import INLINE, decode_batch, encode_batch
from fastgen.replica.block_tables import BlockTableRows, DeviceBlockTables, common_prefix


def random_steps(seed: int, steps: int, live: int = 40, step_seqs: int = 24) -> list[list[tuple[int, list[int]]]]:
    """Steps of (seq_id, block table): tables that grow, shrink (rejected drafts), have their head aliased (a
    sliding window's released blocks), are freed and reallocated (preemption), sequences that end and new ones,
    and steps that run a subset of the live sequences."""
    rng = random.Random(seed)
    tables: dict[int, list[int]] = {}
    next_id, out = 0, []
    for _ in range(steps):
        while len(tables) < live:
            tables[next_id] = [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
            next_id += 1
        for seq_id in rng.sample(sorted(tables), 6):
            table = tables[seq_id]
            match rng.randrange(5):
                case 0:
                    table.append(rng.randrange(1000))
                case 1:
                    del table[max(1, len(table) - rng.randrange(3)) :]
                case 2:
                    table[: len(table) - 1] = [table[-1]] * (len(table) - 1)
                case 3:
                    table[:] = [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
                case 4:
                    del tables[seq_id]
        ids = rng.sample(sorted(tables), min(step_seqs, len(tables)))
        out.append([(seq_id, list(tables[seq_id])) for seq_id in ids])
    return out


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix([], [4]) == 0


def test_changes_rebuild_every_table_on_the_other_side():
    sender, receiver = BlockTableRows(rows=8), BlockTableRows(rows=8)  # 24 sequences a step: rows double
    for step in random_steps(seed=1, steps=300):
        changes = sender.changes(step)
        rebuilt = receiver.apply([seq_id for seq_id, _ in step], [(c.kept, c.tail) for c in changes])
        assert rebuilt == [table for _, table in step]
        assert [c.row for c in changes] == [receiver.row_of[seq_id] for seq_id, _ in step]
    assert sender.num_rows == receiver.num_rows == 32
    assert len(sender.row_of) <= sender.num_rows


def test_rows_are_taken_back_oldest_first_and_never_from_the_step():
    rows = BlockTableRows(rows=2)
    rows.changes([(1, [5]), (2, [6])])
    rows.changes([(2, [6])])
    (change,) = rows.changes([(3, [7, 8])])  # no free row: 1's, unused longest, is taken back
    assert change.row == 0 and change.kept == 0 and rows.row_of == {2: 1, 3: 0}
    assert [c.kept for c in rows.changes([(1, [5]), (2, [6, 9]), (3, [7, 8])])] == [0, 1, 2]  # 1 whole again
    assert rows.num_rows == 4


def test_a_decode_step_sends_only_new_blocks():
    rows = BlockTableRows()
    tables = {i: list(range(100 * i, 100 * i + 125)) for i in range(64)}  # 2000 tokens of 16-token blocks each
    first = rows.changes(list(tables.items()))
    assert sum(len(c.tail) for c in first) == 64 * 125
    tables[7].append(9999)  # one sequence crossed into a new block
    later = rows.changes(list(tables.items()))
    assert [(c.row, c.kept, c.tail) for c in later if c.tail] == [(first[7].row, 125, [9999])]


def test_device_tables_match_the_steps_tables():
    device_tables = DeviceBlockTables(torch.device("cpu"), rows=4, width=2)
    for step in random_steps(seed=2, steps=200, live=12, step_seqs=10):
        seqs = [ScheduledSeq(seq_id, [1], 0, table, True) for seq_id, table in step]
        update = device_tables.update(seqs)
        got = device_tables.apply(update, torch.tensor(update.numbers(), dtype=torch.int64))
        width = max(len(t) for _, t in step)
        assert got.shape == (len(step), width) and got.dtype == torch.int32 and got.is_contiguous()
        for row, (_, table) in zip(got.tolist(), step):
            assert row[: len(table)] == table  # past a table's length: stale ids, never read
    assert device_tables.table.shape == (16, 16)


def test_the_broadcast_sends_a_long_decode_step_in_one_message():
    """64 sequences at 2000 tokens: their tables went in every step (8k numbers, two broadcasts); once sent, a
    decode step is its headers and tokens."""
    sender, receiver = BlockTableRows(), BlockTableRows()
    seqs = [ScheduledSeq(i, [i], 2000, list(range(125 * i, 125 * i + 125)), True) for i in range(64)]
    batch = Batch(seqs, 64, [])
    first = encode_batch(batch, sender)
    assert decode_batch(first, receiver) == batch and len(first) > INLINE
    following = Batch([ScheduledSeq(s.seq_id, [5], 2001, s.block_table, True) for s in seqs], 64, [])
    message = encode_batch(following, sender)
    assert decode_batch(message, receiver) == following and 1 + len(message) <= INLINE


def test_the_benchmark_checks_both_ways_agree(monkeypatch, tmp_path, capsys):
    import json

    from fastgen.benchmarks import block_tables as benchmark

    monkeypatch.setattr(benchmark, "SHAPES", [(4, 3)])
    monkeypatch.setattr(benchmark, "CALLS", 2)
    benchmark.main(["--repeats", "1", "--json", str(tmp_path / "b.json")])
    (row,) = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert row["broadcast_kept"] == row["broadcast_whole"] - 4 * 3
    assert "| 4 x 3 |" in capsys.readouterr().out


def test_a_step_that_fails_before_its_changes_land_sends_the_next_whole(tiny_model_dir, monkeypatch):
    """prepare counts a step's changes as sent before they reach the device; should the step fail in between, the
    next one must not trust them."""
    from fastgen.replica import model_runner, pipeline

    runner = pipeline(str(tiny_model_dir), dtype="float32", progress=False).engine.runner
    first = Batch([ScheduledSeq(0, [5, 6, 7], 0, [3], True)], 0, [])
    second = Batch([ScheduledSeq(0, [8], 3, [3], True)], 1, [])  # the same table: a change of nothing
    expected = runner.forward(first), runner.forward(second)
    runner.block_tables.table.fill_(0)  # another step's leftovers
    runner.block_tables.forget()

    def fail(values, device):
        raise RuntimeError("the copy failed")

    with monkeypatch.context() as m:
        m.setattr(model_runner, "to_device", fail)
        try:
            runner.forward(first)
        except RuntimeError:
            pass
    assert torch.equal(runner.forward(first), expected[0]) and torch.equal(runner.forward(second), expected[1])
