"""A scheduled batch flattened on the host into the per-token and per-sequence lists a step's tensors are made from,
and the one copy that takes each list to the device: shared by the model runner (every step) and the decode graphs
(their static inputs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .batch import Batch


@dataclass
class StepLists:
    """A batch's flat per-token and per-sequence values, on the host."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]  # cache slot of each token: block * block_size + offset
    query_start: list[int]  # (seqs + 1): offsets of each sequence's tokens
    seq_lens: list[int]  # cached tokens per sequence once this step has written its own
    sample_rows: list[int]  # the token rows whose logits are sampled
    lora_rows: list[int] = field(default_factory=list)  # the token rows of LoRA sequences, grouped by slot
    lora_segments: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, end) of lora_rows


def step_lists(batch: Batch, block_size: int) -> StepLists:
    out = StepLists([], [], [], [0], [], [])
    by_slot: dict[int, list[int]] = {}
    for s in batch.seqs:
        n = len(s.token_ids)
        out.tokens += s.token_ids
        span = range(s.start, s.start + n)
        out.positions += span
        out.slots += [s.block_table[p // block_size] * block_size + p % block_size for p in span]
        out.query_start.append(out.query_start[-1] + n)
        out.seq_lens.append(s.start + n)
        # Every position's for prompt logprobs, the last 1 + num_draft for a verify, the last for a sampled chunk.
        out.sample_rows += range(out.query_start[-1] - s.num_logits, out.query_start[-1])
        if s.lora_slot >= 0:
            by_slot.setdefault(s.lora_slot, []).extend(range(out.query_start[-2], out.query_start[-1]))
    for slot in sorted(by_slot):  # one segment per adapter: its rows from every sequence of the step
        start = len(out.lora_rows)
        out.lora_rows += by_slot[slot]
        out.lora_segments.append((slot, start, len(out.lora_rows)))
    return out


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """One int64 tensor on the device. On CUDA it crosses in one copy from pinned memory that does not wait for the
    device (torch's caching host allocator keeps the pinned buffer until the copy is done)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
