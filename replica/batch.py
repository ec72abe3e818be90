"""The scheduled batch: the one seam between the scheduler and the model runner (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledSeq:
    seq_id: int
    token_ids: list[int]  # the tokens to run this step: one for a decode, a chunk for a prompt
    start: int  # position of token_ids[0] in the sequence (tokens before it are cached)
    block_table: list[int]  # cache blocks holding positions 0 .. start + len(token_ids) - 1
    sample: bool  # the chunk ends the known tokens: sample the next one from its last logits


@dataclass(frozen=True)
class Batch:
    seqs: list[ScheduledSeq]  # decodes (one token) first, then prompt chunks
    num_decodes: int
    preempted: list[int]  # seq ids preempted while building this batch (their blocks are free again)
    # (src, dst) KV blocks to copy in every layer before the forward pass: a forked sequence's copy of its parent's
    # prompt. All copies read the cache as the previous step left it.
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes

    def __bool__(self) -> bool:
        return bool(self.seqs)
