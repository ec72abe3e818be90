"""Scheduled batch -> flat tensors -> one forward pass -> logits of the rows to sample."""
from __future__ import annotations

import torch

from ..kernels import AttentionMetadata
from .batch import Batch
from .models.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Returns logits (sampled sequences, vocab) in float32, in batch order."""
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
