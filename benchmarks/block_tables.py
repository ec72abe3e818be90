"""A decode step's block tables on the host: built whole every step (the model runner before replica/block_tables.py:
every sequence's table padded to the longest, made a tensor, copied to the device) against kept on the device and
sent as changes (`DeviceBlockTables`), and the tensor-parallel broadcast's length either way. Decode steps of a few
batch sizes and context lengths (16-token blocks), each sequence's table already sent once, none crossing into a new
block: the steady state between block boundaries. Host time only: on a CPU the "device" copy is the tensor itself.

    python -m fastgen.benchmarks.block_tables [--repeats 7] [--json benchmarks/results/block_tables.json]

Prints a markdown table of medians (microseconds per step, numbers per broadcast).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fastgen.replica.batch import Batch, ScheduledSeq
from fastgen.replica.batch_broadcast import encode_batch
from fastgen.replica.block_tables import BlockTableRows, DeviceBlockTables

SHAPES = [(8, 32), (64, 32), (64, 125), (256, 125)]  # (sequences, blocks each): 512 and 2000 tokens of context
CALLS = 100  # steps per timed repeat


def whole_tables(batch: Batch) -> torch.Tensor:
    """The baseline: what ModelRunner.prepare built every step before (its share of the step's one copy)."""
    width = max(len(s.block_table) for s in batch.seqs)
    flat = [b for s in batch.seqs for b in s.block_table + [0] * (width - len(s.block_table))]
    return torch.tensor(flat, dtype=torch.int64).view(len(batch.seqs), width).to(torch.int32)


def median_us(step, batch: Batch, repeats: int) -> float:
    step(batch)  # warm-up; for the kept tables, the step that sends them whole
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(CALLS):
            step(batch)
        times.append((time.perf_counter() - start) / CALLS)
    return statistics.median(times) * 1e6


def measure(seqs: int, blocks: int, repeats: int) -> dict:
    batch = Batch(
        [ScheduledSeq(i, [1], blocks * 16 - 1, list(range(i * blocks, (i + 1) * blocks)), True) for i in range(seqs)],
        seqs,
        [],
    )
    kept = DeviceBlockTables(torch.device("cpu"))

    def kept_tables(batch: Batch) -> torch.Tensor:
        update = kept.update(batch.seqs)
        return kept.apply(update, torch.tensor(update.numbers(), dtype=torch.int64))

    assert torch.equal(kept_tables(batch), whole_tables(batch))
    sent = BlockTableRows()
    return {
        "seqs": seqs,
        "blocks": blocks,
        "whole_us": median_us(whole_tables, batch, repeats),
        "kept_us": median_us(kept_tables, batch, repeats),
        "encode_whole_us": median_us(encode_batch, batch, repeats),
        "encode_kept_us": median_us(lambda b: encode_batch(b, sent), batch, repeats),
        "broadcast_whole": len(encode_batch(batch)),
        "broadcast_kept": len(encode_batch(batch, sent)),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(seqs, blocks, args.repeats) for seqs, blocks in SHAPES]
    print("| sequences x blocks | tables µs: whole · kept; ratio | broadcast µs: whole · kept | numbers sent |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['seqs']} x {r['blocks']} | {r['whole_us']:.0f} · {r['kept_us']:.0f}; "
            f"{r['whole_us'] / r['kept_us']:.2f}× | {r['encode_whole_us']:.0f} · {r['encode_kept_us']:.0f} | "
            f"{r['broadcast_whole']} · {r['broadcast_kept']} |"
        )
    if args.json:
        from .provenance import run_info

        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = run_info("block_tables", argv) | {"calls": CALLS, "repeats": args.repeats}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
