"""What the engine emits: per-request outputs after each step and one stats record per step (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .batch import StepPlan
from .request import FinishReason


@dataclass
class RequestTimings:
    arrival: float  # time.monotonic() when the request was added
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float  # natural log, under the raw (unpenalised, untempered) distribution
    token: str = ""  # the token decoded alone; filled by the engine


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int  # the sampled token
    logprob: float
    top: tuple[TopLogprob, ...] = ()  # the most likely tokens at its position, most likely first
    token: str = ""


@dataclass
class RequestOutput:
    request_id: str
    new_text: str  # text that became final during this step
    new_token_ids: list[int]  # tokens sampled during this step
    text: str  # all final text so far
    token_ids: list[int]  # all generated tokens so far
    prompt_tokens: int
    finish_reason: FinishReason | None
    timings: RequestTimings
    time: float  # when this output was produced (time.monotonic())
    num_preemptions: int = 0
    index: int = 0  # which of the request's n completions this continues
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new_token_ids, when asked for
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids, when asked for
    prompt_text: str = ""  # the prompt as text, when echo was asked for
    cached_prompt_tokens: int = 0  # of prompt_tokens, how many the prefix cache held when the request was admitted
    # With prompt_logprobs: one per prompt token from the second on (the first has no context); the request's list.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepStats:
    num_seqs: int  # sequences in the forward pass
    num_decode_tokens: int
    num_prefill_tokens: int
    token_budget: int
    num_preempted: int
    forward_s: float  # model forward + sampling
    step_s: float  # the whole step, scheduling and detokenization included
    num_waiting: int  # after the step
    num_running: int
    kv_blocks_used: int  # held by sequences (cached blocks no sequence holds count as free)
    kv_blocks_total: int
    prefix_cache_queries: int = 0  # tokens of the sequences admitted this step, looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (not prefilled)
    prefix_cache_evictions: int = 0  # cached blocks reused for other KV since the previous step
    prefix_cache_blocks: int = 0  # blocks holding cached prefixes after the step, held or not
    plan: StepPlan | None = None  # the slo scheduler's plan for the step (its step-time prediction, budget, load)
    # Speculative decoding (vLLM's spec_decode counters): verified decodes, the tokens proposed for them, those
    # accepted, and per proposal position j the decodes whose proposal j was accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    stats: StepStats | None = None  # None when there was nothing to run


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's load, for admission limits and status reports."""

    queued: int = 0  # requests waiting for their first forward pass (or preempted, waiting to be recomputed)
    running: int = 0  # sequences being prefilled or decoded
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    queued_prompt_tokens: int = 0  # tokens the queued requests still have to prefill
    pending_prompt_tokens: int = 0  # prompt tokens not yet prefilled, queued and running
    refuse_for_s: float | None = None  # the scheduler sheds load: refuse new requests, retry after this many seconds
    loras: tuple[str, ...] = ()  # the LoRA adapters the engine serves
    resident_loras: tuple[str, ...] = ()  # of those, the ones in a weight slot now (no load before they run)
