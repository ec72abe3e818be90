"""Scheduled batch -> flat tensors -> one forward pass -> logits of the rows to sample.

With tensor parallelism, rank 0's runner sends every batch to the other ranks before running it (`run`), and their
runners run each batch they receive (`follow`): every rank then takes part in the same collectives."""

from __future__ import annotations

import torch

from ..kernels import AttentionMetadata, Kernels
from .batch import Batch
from .batch_broadcast import BatchBroadcast
from .kv_cache import copy_blocks
from .models.llama import LlamaModel


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches,
        block_size: int,
        device: torch.device,
        broadcast: BatchBroadcast | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.broadcast = broadcast  # set on every rank of a tensor-parallel group

    @property
    def kernels(self) -> Kernels:
        """The kernel table the model runs on; the sampler takes its argmax from it."""
        return self.model.kernels

    def run(self, batch: Batch) -> torch.Tensor:
        """Returns logits (sampled sequences, vocab) in the model's dtype, in batch order. On rank 0 of a
        tensor-parallel group the other ranks get the batch first; a failure there leaves the ranks out of step and
        ends the process."""
        if self.broadcast is None:
            return self.forward(batch)
        try:
            self.broadcast.send(batch)
            return self.forward(batch)
        except Exception as exc:  # noqa: BLE001 - any failure between collectives breaks the group
            self.broadcast.abandon(exc)
            raise

    def follow(self) -> None:
        """Ranks > 0: runs every batch rank 0 sends until it says stop. Raises RuntimeError when rank 0 is gone."""
        while (batch := self.broadcast.receive()) is not None:
            self.forward(batch)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """This rank's forward pass over the batch; every rank gets the gathered logits. Forked sequences' KV block
        copies come first."""
        copy_blocks(self.kv_caches, batch.copies, self.device)
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)  # (tokens, hidden)
        return self.model.logits(hidden[sample_rows])

    def prepare(self, batch: Batch):
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, seq_lens, sample_rows = [0], [], []
        for s in batch.seqs:
            n = len(s.token_ids)
            tokens += s.token_ids
            span = range(s.start, s.start + n)
            positions += span
            slots += [s.block_table[p // bs] * bs + p % bs for p in span]
            query_start.append(query_start[-1] + n)
            seq_lens.append(s.start + n)
            if s.sample:
                sample_rows.append(query_start[-1] - 1)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]

        def tensor(x, dtype=torch.int32):
            return torch.tensor(x, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            query_start=tensor(query_start),
            seq_lens=tensor(seq_lens),
            block_tables=tensor(tables),
            slot_mapping=tensor(slots, torch.int64),
            num_decodes=batch.num_decodes,
            max_query_len=max(len(s.token_ids) for s in batch.seqs),
            max_seq_len=max(seq_lens),
            query_start_host=query_start,
            seq_lens_host=seq_lens,
        )
        return tensor(tokens, torch.int64), tensor(positions, torch.int64), meta, tensor(sample_rows, torch.int64)
