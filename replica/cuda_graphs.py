"""Decode steps replayed from CUDA graphs.

A decode step of a large model is hundreds of small kernels; launched one by one from Python, launch time rather
than memory bandwidth bounds it. Each batch-size bucket's forward pass (embedding to logits) is captured once at
start-up over static input buffers; a decode-only step copies its inputs into the first rows of those buffers,
pads the rest of its bucket with rows that write the KV cache's scratch block and are never sampled, and replays.

Capture needs kernels that read no per-step value from the host (`Kernels.graph_safe`): a graph replays the launch
configuration it saw. Without capture (`capture=False`) the same padded static-buffer path runs eagerly, which is how
it is tested on machines without a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kernels import AttentionMetadata
from .batch import Batch
from .block_tables import DeviceBlockTables
from .models.llama import LlamaModel
from .step_lists import step_lists, to_device

log = logging.getLogger("fastgen.replica")


def bucket_sizes(max_seqs: int) -> list[int]:
    """Batch sizes a graph is captured for, as vLLM's: 1, 2, 4, then every multiple of 8, up to max_seqs (always
    included). A step pads up to the next one, so no step runs more than 7 padding rows."""
    sizes = [b for b in (1, 2, 4) if b < max_seqs] + list(range(8, max_seqs, 8))
    return sorted({*sizes, max_seqs})


@dataclass
class _Captured:
    meta: AttentionMetadata  # views of the static buffers for this bucket
    graph: torch.cuda.CUDAGraph | None


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches,
        block_size: int,
        max_seqs: int,
        max_model_len: int,
        pad_block: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        """pad_block: a KV block no sequence owns, where padding rows write their keys and values."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.pad_slot = pad_block * block_size
        self.buckets = bucket_sizes(max_seqs)
        rows, width = self.buckets[-1], -(-max_model_len // block_size)
        self.max_blocks = width
        self.pool_bytes = 0  # device memory the captured graphs reserved (0 until captured)
        # (largest bucket, vocab): every bucket's graph copies its logits into the first rows, so one output buffer
        # is held, not one per bucket (bucket x vocab each: a GiB at 256 sequences and a 128k vocabulary). Made by
        # the first forward pass (the largest bucket's warm-up, outside any capture), which knows the width and dtype.
        self.logits: torch.Tensor | None = None
        # Static inputs; every bucket's graph reads the first `bucket` rows.
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), self.pad_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.full((rows, width), pad_block, dtype=torch.int32, device=device)
        query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.captured = {
            b: _Captured(
                AttentionMetadata(
                    query_start=query_start[: b + 1],
                    seq_lens=self.seq_lens[:b],
                    block_tables=self.block_tables[:b],
                    slot_mapping=self.slot_mapping[:b],
                    num_decodes=b,
                    max_query_len=1,
                    max_seq_len=max_model_len,
                    query_start_host=list(range(b + 1)),
                    seq_lens_host=[max_model_len] * b,
                ),
                None,
            )
            for b in self.buckets
        }
        if capture:
            self._capture_all()

    def fits(self, batch: Batch) -> bool:
        """Decode-only, every row sampled, no more rows than the largest bucket."""
        n = len(batch.seqs)
        return (
            batch.num_decodes == n
            and n <= self.buckets[-1]
            and all(s.sample for s in batch.seqs)
            and max(len(s.block_table) for s in batch.seqs) <= self.max_blocks
        )

    def run(self, batch: Batch, tables: DeviceBlockTables) -> torch.Tensor:
        """Logits (sequences, vocab) of a batch that `fits`: a view of the one output buffer, valid until the next
        step. `tables`: the runner's, which the batch's block tables come from."""
        n = len(batch.seqs)
        bucket = next(b for b in self.buckets if b >= n)
        self._load(batch, bucket, tables)
        entry = self.captured[bucket]
        if entry.graph is None:
            return self._forward(entry.meta, bucket)[:n]
        entry.graph.replay()
        assert self.logits is not None, "made by the forward pass the graph captured"
        return self.logits[:n]

    def _load(self, batch: Batch, bucket: int, tables: DeviceBlockTables) -> None:
        """Copies the batch into the static buffers' first rows and padding into the rest of the bucket: one
        host-to-device copy, then copies on the device."""
        n, pad = len(batch.seqs), bucket - len(batch.seqs)
        lists = step_lists(batch, self.block_size)  # one token per sequence: rows are sequences
        update = tables.update(batch.seqs)
        flat = to_device(
            lists.tokens
            + [0] * pad
            + lists.positions
            + [0] * pad
            + lists.slots
            + [self.pad_slot] * pad
            + lists.seq_lens
            + [1] * pad
            + update.numbers(),
            self.device,
        )
        ids, pos, slot, lens, changes = flat.split([bucket] * 4 + [sum(update.sizes)])
        self.input_ids[:bucket].copy_(ids)
        self.positions[:bucket].copy_(pos)
        self.slot_mapping[:bucket].copy_(slot)
        self.seq_lens[:bucket].copy_(lens)
        self.block_tables[:n, : update.width].copy_(tables.apply(update, changes))
        if pad:  # padding rows read their one key from the pad block
            self.block_tables[n:bucket, 0].fill_(self.pad_slot // self.block_size)

    def _forward(self, meta: AttentionMetadata, bucket: int) -> torch.Tensor:
        """The bucket's logits, copied into the output buffer's first rows (bucket, vocab); inside a capture the
        model's own logits are the pool's to reuse once the graph ends."""
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], meta, self.kv_caches)  # (bucket, hidden)
        logits = self.model.logits(hidden)  # (bucket, vocab)
        if self.logits is None:
            self.logits = logits.new_empty(self.buckets[-1], logits.shape[1])
        return self.logits[:bucket].copy_(logits)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest bucket first, all in one memory pool: smaller graphs reuse the larger ones' activations."""
        pool, before = None, torch.cuda.memory_reserved(self.device)
        for bucket in reversed(self.buckets):
            entry = self.captured[bucket]
            # Warm-up compiles the Triton kernels and fills per-shape caches outside the capture.
            for _ in range(2):
                self._forward(entry.meta, bucket)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(entry.meta, bucket)
            entry.graph = graph
            pool = graph.pool()
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info(
            "CUDA graphs captured for decode batches of %s sequences (%.0f MiB of device memory)",
            ", ".join(map(str, self.buckets)),
            self.pool_bytes / 2**20,
        )
