"""Rank 0's scheduled batch, sent to the other ranks of its tensor-parallel group before every forward pass.

The batch travels as flat int64 tensors (a length, then the payload) over a gloo group of its own, on the CPU even
where the model's collectives run on NCCL: the other ranks rebuild the same `Batch` and run the same
`ModelRunner.prepare`, so every rank builds identical input tensors without a device round trip. Block tables go as
changes to what the last steps sent (replica/block_tables.py): a decode step's tables add nothing. The first
broadcast has a fixed size that holds most batches whole (a decode step of 64 sequences needs about 600 numbers):
one round trip per step, where a separate length would cost two. A length of -1 says stop.

Ranks > 0 wait for the next batch without a deadline: an idle replica sends nothing for hours, and that is not a
failure. A peer that dies closes its sockets, which ends any wait at once with an error; one that hangs with its
sockets open is found by rank 0, whose sends (like every rank's model collectives) fail after --tp-timeout.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from typing import NoReturn, cast

import torch
import torch.distributed as dist

from .batch import Batch, ScheduledSeq
from .block_tables import BlockTableRows

log = logging.getLogger("fastgen.replica")

STOP = -1
INLINE = 1024  # int64 numbers in the first broadcast of a message: its length, then the start of the batch
IDLE_TIMEOUT = timedelta(days=365)
# Exit status of a rank whose group broke (a peer died, or this rank failed between two collectives).
EXIT_GROUP_BROKEN = 3
# seq_id, start, flags (sample, all_logits, num_draft << 2), LoRA slot, tokens, kept blocks, new blocks
_SEQ_HEADER = 7


def exit_now(code: int) -> NoReturn:
    """Ends this rank's process with `code` without interpreter finalization, for a rank that leaves without
    destroy_process_group (its group broke, or it failed): gloo's worker threads may still hold a finished or
    failed collective, and dropping it frees that step's tensors, whose Python objects need the GIL. Once
    Py_Finalize has begun, the GIL ends any other thread that asks for it with pthread_exit, whose unwinding
    through the tensor's noexcept destructor calls std::terminate: SIGABRT ("terminate called without an active
    exception") instead of `code`. os._exit ends every thread at once, whatever it holds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def encode_batch(batch: Batch, sent: BlockTableRows | None = None) -> list[int]:
    """[seqs, decodes, preempted, copies, LoRA loads, *preempted ids, *copies as src, dst pairs, *loads as slot,
    length, *path's code points, then per sequence: seq_id, start, flags, LoRA slot, tokens, kept blocks, new
    blocks, *token_ids, *new blocks]: its block table is the first `kept` entries the receiver's rows hold for it,
    then the new ones. `sent`: the tables sent before, updated; None: a receiver that holds none."""
    sent = BlockTableRows() if sent is None else sent
    changes = sent.changes([(s.seq_id, s.block_table) for s in batch.seqs])
    flat = [len(batch.seqs), batch.num_decodes, len(batch.preempted), len(batch.copies), len(batch.lora_loads)]
    flat += batch.preempted
    for src, dst in batch.copies:
        flat += (src, dst)
    for slot, path in batch.lora_loads:
        flat += (slot, len(path), *map(ord, path))
    for s, change in zip(batch.seqs, changes):
        flags = int(s.sample) | int(s.all_logits) << 1 | s.num_draft << 2
        flat += (s.seq_id, s.start, flags, s.lora_slot, len(s.token_ids), change.kept, len(change.tail))
        flat += s.token_ids
        flat += change.tail
    return flat


def decode_batch(flat: list[int], received: BlockTableRows | None = None) -> Batch:
    """encode_batch's other side; `received` must have seen what the sender's `sent` saw."""
    num_seqs, num_decodes, num_preempted, num_copies, num_loads = flat[:5]
    i = 5 + num_preempted
    preempted = flat[5:i]
    copies = list(zip(flat[i : i + 2 * num_copies : 2], flat[i + 1 : i + 2 * num_copies : 2]))
    i += 2 * num_copies
    loads = []
    for _ in range(num_loads):
        slot, length = flat[i : i + 2]
        loads.append((slot, "".join(map(chr, flat[i + 2 : i + 2 + length]))))
        i += 2 + length
    headers, tokens, changes = [], [], []
    for _ in range(num_seqs):
        header = flat[i : i + _SEQ_HEADER]
        num_tokens, kept, num_new = header[4:]
        i += _SEQ_HEADER
        tokens.append(flat[i : i + num_tokens])
        changes.append((kept, flat[i + num_tokens : i + num_tokens + num_new]))
        headers.append(header)
        i += num_tokens + num_new
    received = BlockTableRows() if received is None else received
    tables = received.apply([header[0] for header in headers], changes)
    seqs = [
        ScheduledSeq(seq_id, ids, start, table, bool(flags & 1), bool(flags & 2), flags >> 2, slot)
        for (seq_id, start, flags, slot, *_), ids, table in zip(headers, tokens, tables)
    ]
    return Batch(seqs, num_decodes, preempted, copies, lora_loads=loads)


class BatchBroadcast:
    """Rank 0 sends each step's batch, the other ranks receive it. Every rank of the default process group must
    construct it, in the same order as their other groups (it creates one)."""

    def __init__(self, rank: int, timeout: timedelta = IDLE_TIMEOUT) -> None:
        self.rank = rank
        # Every rank is a member (no ranks list), so this is a ProcessGroup, never the int torch's typing also allows
        # (GroupMember.NON_GROUP_MEMBER).
        self.group = cast("dist.ProcessGroup", dist.new_group(backend="gloo", timeout=timeout))
        self.tables = BlockTableRows()  # the block tables rank 0 sent: on rank 0 what it sent, elsewhere what came

    def send(self, batch: Batch) -> None:
        flat = encode_batch(batch, self.tables)
        self._send([len(flat), *flat])

    def stop(self) -> bool:
        """Tells the other ranks to exit; False when they are already gone (the group is broken)."""
        try:
            self._send([STOP])
        except RuntimeError as exc:
            log.warning("could not tell the other ranks to stop (already gone?): %s", exc)
            return False
        return True

    def receive(self) -> Batch | None:
        """The next batch from rank 0, or None when it says stop. Raises RuntimeError when rank 0 is gone."""
        first = torch.empty(INLINE, dtype=torch.int64)
        self._broadcast(first)
        length = int(first[0])
        if length == STOP:
            return None
        flat = first[1 : 1 + length].tolist()
        if 1 + length > INLINE:
            rest = torch.empty(1 + length - INLINE, dtype=torch.int64)
            self._broadcast(rest)
            flat += rest.tolist()
        return decode_batch(flat, self.tables)

    def abandon(self, exc: BaseException) -> NoReturn:
        """Ends this process at once with EXIT_GROUP_BROKEN: its ranks are out of step (a peer died, or a step
        failed between two collectives), so no later step can succeed; the engine thread that noticed cannot unwind
        the server, and a rank that returned would exit through interpreter finalization (see exit_now). The
        launcher (fastgen-deploy's supervisor, torchrun) then restarts the whole group."""
        log.critical("rank %d left its tensor-parallel group: %s: %s", self.rank, type(exc).__name__, exc)
        exit_now(EXIT_GROUP_BROKEN)

    def _send(self, message: list[int]) -> None:
        first = torch.zeros(INLINE, dtype=torch.int64)
        head = message[:INLINE]
        first[: len(head)] = torch.tensor(head, dtype=torch.int64)
        self._broadcast(first)
        if len(message) > INLINE:
            self._broadcast(torch.tensor(message[INLINE:], dtype=torch.int64))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self.group)
