"""The scheduled batch: the one seam between the scheduler and the model runner (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .step_model import StepShape


@dataclass(frozen=True)
class ScheduledSeq:
    seq_id: int
    token_ids: list[int]  # the tokens to run this step: one for a decode, a chunk for a prompt
    start: int  # position of token_ids[0] in the sequence (tokens before it are cached)
    block_table: list[int]  # cache blocks holding positions 0 .. start + len(token_ids) - 1
    sample: bool  # the chunk ends the known tokens: sample the next one from its last logits
    all_logits: bool = False  # the logits of every position are returned, not only the last (prompt logprobs)
    # Speculative decoding: token_ids is a decode's token and then this many proposed tokens, verified in this pass;
    # the logits of its last 1 + num_draft positions are returned (replica/speculative.py).
    num_draft: int = 0
    lora_slot: int = -1  # the weight slot of the LoRA adapter it runs under; -1: the base model

    @property
    def num_logits(self) -> int:
        """Rows of logits the model returns for it."""
        return len(self.token_ids) if self.all_logits else (1 + self.num_draft if self.sample else 0)


@dataclass(frozen=True)
class StepPlan:
    """What the slo scheduler planned for a batch: read by the engine's stats, never by the model runner."""

    shape: StepShape  # what the step carries, as the step-time model sees it
    predicted_s: float  # the step-time model's prediction for the batch as built (nan before it has data)
    budget_s: float  # the time the step was allowed: the least slack of the streams it serves (inf: nothing bounds it)
    overloaded: bool  # even a decode-only step breaks some stream's token-rate floor
    past_deadline: int  # requests waiting for a first token they can no longer get by its deadline
    behind: int  # streams whose inter-token moving average went past their floor
    drift: float = 1.0  # the step-time model's recent miss: its predictions are its fit times this


@dataclass(frozen=True)
class Batch:
    seqs: list[ScheduledSeq]  # decodes (one token) first, then verifies (speculative decodes), then prompt chunks
    num_decodes: int
    preempted: list[int]  # seq ids preempted while building this batch (their blocks are free again)
    # (src, dst) KV blocks to copy in every layer before the forward pass: a forked sequence's copy of its parent's
    # prompt. All copies read the cache as the previous step left it.
    copies: list[tuple[int, int]] = field(default_factory=list)
    plan: StepPlan | None = None  # set by the slo scheduler; rank 0 only (not broadcast)
    # (slot, adapter folder): LoRA adapters to read into their weight slots before the forward pass (lora_pool)
    lora_loads: list[tuple[int, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes

    def __bool__(self) -> bool:
        return bool(self.seqs)
