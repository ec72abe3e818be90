"""Limits before work (DESIGN.md, "Contracts of the third wave"): every count and size of a request is checked where
it enters the balancer, gRPC (service.py) and HTTP (openai_protocol.py) alike and from the constants here, before
anything proportional to it is allocated or computed: a journal entry per completion, an upstream call per prompt,
the tokenization and hashing of a prompt for prefix-aware routing.

The per-request limits are the replica's (replica/request.py, which the balancer does not import; a test keeps them
equal), so the balancer refuses exactly what every replica would, only sooner. Prompt length is the replicas'
business too (they know their model's context); the balancer, which is not told it, refuses only what no model
takes (DEFAULT_MAX_PROMPT_TOKENS token ids, DEFAULT_MAX_PROMPT_CHARS characters), or less with --max-model-len.

Everything over a limit is INVALID_ARGUMENT (HTTP 400), never RESOURCE_EXHAUSTED: such a request never fits whatever
the load, and RESOURCE_EXHAUSTED tells a client to back off and retry (the balancer retries it on another replica,
the HTTP API answers it 429 with Retry-After).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_N = 128  # completions per prompt
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
MAX_CACHE_SALT_CHARS = 256
MAX_REQUEST_ID_CHARS = 256
# Structured output: the schema, regex or grammar text (or the choices together) is compiled by the replica into a
# grammar over the vocabulary, so its size bounds compile time and memory (replica/request.py has the same).
MAX_CONSTRAINT_CHARS = 1 << 16
MAX_CONSTRAINT_CHOICES = 1024
MAX_TOOLS = 128  # each tool's schema is rendered into the prompt, and a forced call's into the constraint
# An HTTP completion's prompts each become an upstream request: a batch API call, not a bulk job (vLLM's batch
# endpoints take a file for those). Completions over all prompts (prompts x n) are capped too.
MAX_PROMPTS_PER_CALL = 256
MAX_CHOICES_PER_CALL = 1024
MAX_CHAT_MESSAGES = 16384  # each is walked by the chat template; a conversation that long is a mistake
# What no served model takes today (the longest contexts are about a million tokens); characters at four a token
# with room to spare.
DEFAULT_MAX_PROMPT_TOKENS = 1 << 20
DEFAULT_MAX_PROMPT_CHARS = 8 << 20
# With --max-model-len: characters one token may stand for, generously (a run of spaces in a code vocabulary).
MAX_CHARS_PER_TOKEN = 64


class RequestRefused(ValueError):
    """A request over a limit: INVALID_ARGUMENT (HTTP 400) with a message saying what to change; `param` names the
    field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PromptLimits:
    """How long a prompt may be, in token ids and in characters (text, or chat messages' roles and contents)."""

    max_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    max_chars: int = DEFAULT_MAX_PROMPT_CHARS

    @classmethod
    def for_model_len(cls, max_model_len: int | None) -> PromptLimits:
        """The limits of a deployment whose replicas take prompts of at most `max_model_len` tokens (None: unknown)."""
        if not max_model_len:
            return cls()
        return cls(max_model_len, min(DEFAULT_MAX_PROMPT_CHARS, max_model_len * MAX_CHARS_PER_TOKEN))


DEFAULT_PROMPT_LIMITS = PromptLimits()


def at_most(name: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise RequestRefused(f"{name} may have at most {limit} {what}, got {count}", name)


def check_request(request, limits: PromptLimits = DEFAULT_PROMPT_LIMITS) -> None:
    """RequestRefused for a fastgen.v1.GenerateRequest over a limit. Only lengths are read before they are checked,
    so the cost does not grow with what is refused."""
    at_most("request_id", len(request.request_id), MAX_REQUEST_ID_CHARS, "characters")
    if request.HasField("resume"):
        raise RequestRefused("resume is set by the balancer when it moves a stream: leave it unset", "resume")
    check_params(request.params)
    check_prompt(request, limits)


def check_params(params) -> None:
    if params.n > MAX_N:
        raise RequestRefused(f"n must be in [1, {MAX_N}] (0 means 1), got {params.n}: ask for fewer completions", "n")
    if params.top_logprobs > MAX_TOP_LOGPROBS:
        raise RequestRefused(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {params.top_logprobs}", "top_logprobs"
        )
    at_most("stop", len(params.stop), MAX_STOP_STRINGS, "strings")
    longest = max(map(len, params.stop), default=0)
    at_most("stop", longest, MAX_STOP_CHARS, "characters per string")
    at_most("stop_token_ids", len(params.stop_token_ids), MAX_STOP_TOKEN_IDS, "ids")
    at_most("logit_bias", len(params.logit_bias), MAX_LOGIT_BIAS, "entries")
    at_most("cache_salt", len(params.cache_salt), MAX_CACHE_SALT_CHARS, "characters")
    if params.HasField("constraint"):
        check_constraint(params.constraint)


def check_constraint(constraint) -> None:
    """A fastgen.v1.Constraint's size: the text the replica compiles into a grammar."""
    kind = constraint.WhichOneof("kind")
    if kind == "choice":
        choices = constraint.choice.choices
        at_most("constraint.choice", len(choices), MAX_CONSTRAINT_CHOICES, "choices")
        size = sum(map(len, choices))
    else:
        size = len(getattr(constraint, kind)) if kind in ("json_schema", "regex", "grammar") else 0
    at_most(f"constraint.{kind}", size, MAX_CONSTRAINT_CHARS, "characters")


def check_prompt(request, limits: PromptLimits = DEFAULT_PROMPT_LIMITS) -> None:
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        check_prompt_ids(len(request.token_ids.ids), limits)
    elif kind == "text":
        check_prompt_chars(len(request.text), limits)
    elif kind == "messages":
        messages = request.messages.messages
        check_message_count(len(messages), limits)
        chars = sum(len(m.content) + len(m.role) + len(m.tool_calls_json) for m in messages)
        chars += len(request.messages.tools_json)
        check_prompt_chars(chars, limits, "messages")


def check_prompt_ids(count: int, limits: PromptLimits, name: str = "prompt") -> None:
    if count > limits.max_tokens:
        raise RequestRefused(
            f"the prompt has {count} token ids, more than the {limits.max_tokens} this deployment takes: shorten it",
            name,
        )


def check_prompt_chars(count: int, limits: PromptLimits, name: str = "prompt") -> None:
    if count > limits.max_chars:
        raise RequestRefused(
            f"the prompt has {count} characters, more than the {limits.max_chars} this deployment takes: shorten it",
            name,
        )


def check_message_count(count: int, limits: PromptLimits) -> None:
    limit = min(MAX_CHAT_MESSAGES, limits.max_tokens)  # every message costs at least one token
    at_most("messages", count, limit, "chat messages")


def check_prompt_count(prompts: int, n: int) -> None:
    """An HTTP call's prompts, and its completions over all of them."""
    at_most("prompt", prompts, MAX_PROMPTS_PER_CALL, "prompts per call (send several calls)")
    if prompts * n > MAX_CHOICES_PER_CALL:
        raise RequestRefused(
            f"{prompts} prompts x n={n} is {prompts * n} completions, more than the {MAX_CHOICES_PER_CALL} a call may "
            "ask for: lower n or send fewer prompts per call",
            "n",
        )
