"""Request and sequence state as plain counters (no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

MAX_N = 128  # completions per request
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows
# Per-request limits (docs/clients.md, "Limits"). Each bounds work the engine repeats for the request on every step,
# or what it keeps per request, so that one request cannot slow every other one down. OpenAI allows 4 stop strings
# and 300 logit_bias entries; vLLM sets no limit. Stop strings are matched on each step's new text and the longest one
# sets how much text a stream holds back; logit_bias and stop_token_ids are applied per sampled row and token.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
MAX_CACHE_SALT_CHARS = 256  # hashed into every cached prompt block's key
MAX_REQUEST_ID_CHARS = 256  # echoed in every chunk and kept while the request runs
# A constraint's text (schema, regex, grammar, or the choices together) is compiled into a grammar over the whole
# vocabulary: compile time and memory grow with it. 64 KiB holds any hand-written schema and most generated ones.
MAX_CONSTRAINT_CHARS = 1 << 16
MAX_CONSTRAINT_CHOICES = 1024
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # a stop string matched
    EOS = "eos"  # an end-of-sequence token was sampled
    CANCELLED = "cancelled"  # aborted by the caller


@dataclass(frozen=True)
class Constraint:
    """What generated text must match (structured output): `kind` is one of CONSTRAINT_KINDS and `value` the JSON
    schema, regex or grammar text ("" for json_object), or the tuple of choices. Hashable: compiled grammars are
    cached by it."""

    kind: str
    value: str | tuple[str, ...] = ""

    def validate(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            check_count("constraint.choice", len(self.value), MAX_CONSTRAINT_CHOICES, "choices")
            if not self.value:
                raise ValueError("a choice constraint needs at least one choice")
        size = sum(map(len, self.value)) if isinstance(self.value, tuple) else len(self.value)
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"constraint {self.kind} may have at most {MAX_CONSTRAINT_CHARS} characters, got {size}")
        if self.kind in ("json_schema", "regex", "grammar") and not self.value:
            raise ValueError(f"constraint {self.kind} must not be empty")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 0  # 0: the engine's default, capped by the context left
    min_new_tokens: int = 0
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # the same seed gives the same tokens whatever else is in the batch
    stop: tuple[str, ...] = ()  # stop strings, matched on text and left out of the output
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from every generated token's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # 1: off; > 1 discourages tokens of the prompt and output
    min_p: float = 0.0  # 0: off; drops tokens below min_p times the top token's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits
    stop_token_ids: tuple[int, ...] = ()  # end the request like EOS, with finish reason STOP
    n: int = 1  # completions of the prompt, prefilled once
    logprobs: int | None = None  # None: none; k >= 0: each token's logprob and its k most likely alternatives
    include_stop_str_in_output: bool = False
    keep_special_tokens: bool = False
    echo: bool = False  # return the prompt's text
    # Requests share cached prompt blocks only with requests of the same salt: a tenant's own salt keeps others from
    # reusing or probing (by timing) its prefixes. "": the shared default.
    cache_salt: str = ""
    constraint: Constraint | None = None  # structured output (replica/constraints.py); None: unconstrained
    # None: none; k >= 0: each prompt token's logprob (from the second on) and its k most likely alternatives,
    # computed in the prefill (every chunk of a split prompt).
    prompt_logprobs: int | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the field and what to change."""
        self._check_sizes()
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0 (0 means the server default), got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens}): "
                "lower min_new_tokens or raise max_new_tokens"
            )
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty: remove the empty entry")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 turns it off), got {value}")
        if not 0.0 < self.repetition_penalty <= 1e4 or self.repetition_penalty != self.repetition_penalty:
            raise ValueError(f"repetition_penalty must be > 0 (1 turns it off), got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 turns it off), got {self.min_p}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias for token {token} must be in [-100, 100], got {bias}")
        ids = [t for t, _ in self.logit_bias] + list(self.stop_token_ids)
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            limit = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
            raise ValueError(f"token ids in logit_bias and stop_token_ids must be {limit}, got {bad[:5]}")

    def _check_sizes(self) -> None:
        """The per-request limits, checked first so that a huge list is refused before it is walked."""
        check_count("stop", len(self.stop), MAX_STOP_STRINGS)
        long = [s for s in self.stop if len(s) > MAX_STOP_CHARS]
        if long:
            raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters, one has {len(long[0])}")
        check_count("stop_token_ids", len(self.stop_token_ids), MAX_STOP_TOKEN_IDS)
        check_count("logit_bias", len(self.logit_bias), MAX_LOGIT_BIAS, "entries")
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(
                f"cache_salt may have at most {MAX_CACHE_SALT_CHARS} characters, got {len(self.cache_salt)}"
            )
        if self.constraint is not None:
            self.constraint.validate()


def check_count(name: str, count: int, limit: int, what: str = "items") -> None:
    """ValueError when a list field holds more than `limit` items."""
    if count > limit:
        raise ValueError(f"{name} may have at most {limit} {what}, got {count}")


MAX_SLO_TTFT_S = 86400.0  # a first-token deadline further out than a day is a mistake, not a service level


@dataclass(frozen=True)
class Slo:
    """A request's own service level for the slo scheduler; None fields take the deployment's (SloConfig). The first
    token is due ttft_s after arrival when set, else prompt_tokens / prompt_rate after it; token_rate is the floor of
    the rate its tokens arrive at (every span-16 moving average of the gaps at most 1 / token_rate). A request may
    only loosen the deployment's service level unless SloConfig.allow_client_tightening is set."""

    prompt_rate: float | None = None  # prompt tokens/s
    ttft_s: float | None = None  # seconds
    token_rate: float | None = None  # tokens/s

    def validate(self) -> None:
        """Raises ValueError naming the field and what to change."""
        for name, hi in (("prompt_rate", None), ("ttft_s", MAX_SLO_TTFT_S), ("token_rate", None)):
            value = getattr(self, name)
            if value is None:
                continue
            if not 0.0 < value < float("inf") or (hi is not None and value > hi):
                limit = f"in (0, {hi:g}]" if hi is not None else "a finite number > 0"
                raise ValueError(f"slo.{name} must be {limit}, got {value}")


@dataclass(frozen=True)
class Resume:
    """Output of one completion that a client already has from a replica that failed: the completion continues after
    it, as if it had run here from the start (the tokens count as generated, and the text's first text_chars
    characters are not sent again). A request resumes with one per completion, in index order."""

    token_ids: tuple[int, ...]
    text_chars: int = 0
    finished: bool = False  # its last output was delivered: it is not continued (n > 1 only)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and where its KV cache stands. KV for token_ids[:num_computed] is in the cache."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    max_new_tokens: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    # Leading blocks of block_table given back as the sequence moved past them (outside the model's attention
    # window, SchedulerConfig.kv_window): their entries alias a held block and hold no reference.
    num_released: int = 0
    num_preemptions: int = 0
    cache_salt: str = ""
    # Content hashes of token_ids' full blocks computed so far (prefix_cache); kept through preemption so that a
    # recomputed sequence finds its own blocks if they are still cached.
    block_hashes: list[bytes] = field(default_factory=list)
    slo: Slo | None = None  # the request's own service level (the slo scheduler); None: the deployment's
    # Prompt tokens its first admission found in the prefix cache (the API's cached_tokens); a recompute after a
    # preemption finding its own blocks again does not count.
    num_cached_prompt_tokens: int = 0
    resumed: bool = False  # continues a request another replica started and failed in (stream migration)
    # Speculative decoding with a draft model: the draft's KV holds token_ids[:num_draft_computed] (and the tokens it
    # proposed past them, counted here until verification settles how many were accepted).
    num_draft_computed: int = 0
    lora: str = ""  # the LoRA adapter it runs under ("": the base model)
    lora_slot: int = -1  # the adapter's weight slot while it runs (lora_pool); -1: none held

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is not cached yet: 1 while decoding, more while (re)filling a prompt."""
        return len(self.token_ids) - self.num_computed

    @property
    def mid_stream(self) -> bool:
        """Its client already has output of its request: tokens generated here, or a stream resumed from elsewhere
        (the completion resumed may have had none of its own delivered yet)."""
        return self.resumed or self.num_generated > 0

    @property
    def max_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_new_tokens
