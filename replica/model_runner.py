"""Scheduled batch -> flat tensors -> one forward pass -> logits of the rows to sample.

With tensor parallelism, rank 0's runner sends every batch to the other ranks before running it (`run`), and their
runners run each batch they receive (`follow`): every rank then takes part in the same collectives.

With LoRA adapters, each rank reads the adapters the batch loads into their slots, and hands the adapted layers the
step's rows grouped by adapter slot (replica/lora.py) before the forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels import AttentionMetadata, Kernels
from ..kernels.lora import LoraSegments
from .batch import Batch
from .batch_broadcast import BatchBroadcast
from .block_tables import DeviceBlockTables
from .kv_cache import copy_blocks
from .models import DecoderModel
from .step_lists import step_lists, to_device

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphs
    from .lora import LoraWeights


@dataclass
class StepInputs:
    """One step's tensors on the model's device."""

    input_ids: torch.Tensor  # (tokens,) int64
    positions: torch.Tensor  # (tokens,) int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (sampled,) int64: the rows of the hidden states whose logits are sampled
    lora: LoraSegments | None = None  # the rows that run under LoRA adapters, by slot; None: none does


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_caches,
        block_size: int,
        device: torch.device,
        broadcast: BatchBroadcast | None = None,
        graphs: DecodeGraphs | None = None,
        lora: LoraWeights | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.broadcast = broadcast  # set on every rank of a tensor-parallel group
        self.graphs = graphs  # decode-only steps replay from these when set (CUDA)
        self.lora = lora  # the model's LoRA slots, with --enable-lora
        self.block_tables = DeviceBlockTables(device)  # the running sequences', updated with each step's changes

    @property
    def kernels(self) -> Kernels:
        """The kernel table the model runs on; the sampler takes its argmax from it."""
        return self.model.kernels

    def run(self, batch: Batch) -> torch.Tensor:
        """Returns logits (rows, vocab) in the model's dtype, in batch order: the last position of each sampled
        sequence, the last 1 + num_draft of a verify, every position of one marked all_logits (prompt logprobs). On
        rank 0 of a tensor-parallel group the other ranks get the batch first; a failure there leaves the ranks out
        of step and ends the process."""
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
        assert self.broadcast is not None, "ranks > 0 are ranks of a tensor-parallel group, which has a broadcast"
        while (batch := self.broadcast.receive()) is not None:
            self.forward(batch)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """This rank's forward pass over the batch; every rank gets the gathered logits. Forked sequences' KV block
        copies come first."""
        copy_blocks(self.kv_caches, batch.copies, self.device)
        for slot, path in batch.lora_loads:
            assert self.lora is not None, "a batch loads adapters only with --enable-lora"
            self.lora.load(slot, path)
        try:
            if self.graphs is not None and self.graphs.fits(batch):
                return self.graphs.run(batch, self.block_tables)
            step = self.prepare(batch)
        except BaseException:
            self.block_tables.forget()  # a step that failed may have sent the device fewer changes than it counted
            raise
        if self.lora is not None:
            self.lora.step.segments = step.lora
        hidden = self.model(step.input_ids, step.positions, step.meta, self.kv_caches)  # (tokens, hidden)
        return self.model.logits(hidden[step.sample_rows])

    def prepare(self, batch: Batch) -> StepInputs:
        """The batch's tensors, every one a view of a single host-to-device copy (or made from one on the device):
        the attention kernels' per-step table (the Triton tile map) too, which they would otherwise copy from
        pageable memory in the first layer, and the changes to the block tables kept on the device."""
        lists = step_lists(batch, self.block_size)
        tables = self.block_tables.update(batch.seqs)
        max_query_len = max(len(s.token_ids) for s in batch.seqs)
        attn = self.model.layers[0].self_attn
        plan = self.kernels.attention_plan(
            lists.query_start, max_query_len, attn.heads, attn.kv_heads, attn.head_dim, self.model.embed_tokens.dtype
        )
        extra = plan[1] if plan is not None else []
        flat = to_device(
            [*lists.tokens, *lists.positions, *lists.slots, *lists.query_start, *lists.seq_lens, *lists.sample_rows]
            + tables.numbers()
            + extra
            + lists.lora_rows
            + [v for column in zip(*lists.lora_segments) for v in column],  # slots, then starts, then ends
            self.device,
        )
        parts = flat.split(
            [len(lists.tokens)] * 3
            + [len(lists.query_start), len(lists.seq_lens)]
            + [
                len(lists.sample_rows),
                sum(tables.sizes),
                len(extra),
                len(lists.lora_rows),
                3 * len(lists.lora_segments),
            ]
        )
        input_ids, positions, slots, query_start, seq_lens, sample_rows, changes, extra, lora_rows, lora_table = parts
        meta = AttentionMetadata(
            query_start=query_start.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_tables=self.block_tables.apply(tables, changes),
            slot_mapping=slots,
            num_decodes=batch.num_decodes,
            max_query_len=max_query_len,
            max_seq_len=max(lists.seq_lens),
            query_start_host=lists.query_start,
            seq_lens_host=lists.seq_lens,
        )
        if plan is not None:
            meta.workspace[plan[0]] = extra.view(2, -1).to(torch.int32)
        lora = None
        if lists.lora_segments:
            longest = max(end - start for _, start, end in lists.lora_segments)
            lora = LoraSegments(lora_rows, lists.lora_segments, lora_table.view(3, -1), longest)
        return StepInputs(input_ids, positions, meta, sample_rows, lora)
