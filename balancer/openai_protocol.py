"""The OpenAI-compatible API's protocol: JSON bodies of /v1/completions and /v1/chat/completions turned into
fastgen.v1 GenerateRequests, replies and stream chunks built in OpenAI's shapes, failures as OpenAI errors.

Pure: no I/O, no event loop, no torch. The sources are OpenAI's API reference and vLLM's
entrypoints/openai/protocol.py. As both do, unknown fields are ignored; a known field of the wrong type or out of
range is a 400 that names it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard, overload

import grpc

from ..proto import fastgen_pb2
from .limits import (
    DEFAULT_PROMPT_LIMITS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    PromptLimits,
    RequestRefused,
    check_constraint,
    check_message_count,
    check_prompt_chars,
    check_prompt_count,
    check_prompt_ids,
)
from .reasoning import ReasoningStream, split
from .structured import StructuredError, parse_constraint
from .tools import DEFAULT_TOOL_CALL_PARSER, ToolError, ToolPlan, ToolStream, extract, parse_tools

CHAT, COMPLETION = "chat", "completion"
MAX_SEED = 2**63 - 1  # the engine's seeds are in [0, 2**63)
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32
MAX_UINT32 = 2**32 - 1  # the other integers travel as uint32: any field without its own bound has this one
MAX_SLO_TTFT_MS = 86_400_000  # a day: the replica's MAX_SLO_TTFT_S
SLO_FIELDS = ("prompt_rate", "ttft_ms", "token_rate")
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; the engine reads 0 as greedy
MIN_LOGPROB = -9999.0  # JSON has no -Infinity; vLLM clamps the same way
DONE = b"data: [DONE]\n\n"

FINISH_REASONS: dict[int, str] = {  # keyed by the wire enum FinishReason's numbers
    fastgen_pb2.FINISH_REASON_LENGTH: "length",
    fastgen_pb2.FINISH_REASON_STOP: "stop",
    fastgen_pb2.FINISH_REASON_EOS: "stop",
    fastgen_pb2.FINISH_REASON_CANCELLED: "abort",  # vLLM's word for a request the server ended
}
HTTP_STATUS_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
RETRY_AFTER_S = 1  # what a 429 asks the client to wait: a replica's queue drains in about that
MAX_ERROR_CHARS = 500  # an error quotes the bad value: cut, so a huge body is not sent back
MAX_TOKEN_ID_DIGITS = len(str(MAX_TOKEN_ID))  # int() of a longer string costs, and past 4300 digits raises


# ---- errors -------------------------------------------------------------------------------------------------------
class ApiError(Exception):
    """An answer in OpenAI's error shape, with its HTTP status (and headers, such as a 429's Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + " ..."
    return ApiError(400, message, param=param)


def refused(e: RequestRefused) -> ApiError:
    return bad_request(str(e), e.param)


def utf8_text(value: str, name: str) -> str:
    """`value` when it can travel as UTF-8; a 400 for a lone surrogate (JSON's "\\ud800" escape), which no
    protobuf string field takes."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(
                f"{name} holds {value[e.start]!r}, a lone surrogate, which is not valid UTF-8", name
            ) from None
    return value


def error_from_failure(code: grpc.StatusCode, details: str, retry_after_ms: int | None = None) -> ApiError:
    """The HTTP answer to a request the balancer failed with a gRPC status; a 429's Retry-After is the replica's hint
    in whole seconds, rounded up."""
    status = HTTP_STATUS_OF.get(code, 500)
    wait_s = RETRY_AFTER_S if retry_after_ms is None else max(1, -(-retry_after_ms // 1000))
    headers = {"Retry-After": str(wait_s)} if status == 429 else None
    return ApiError(status, details or code.name, code=code.name.lower(), headers=headers)


def unknown_model(name: str, served: Sequence[str]) -> ApiError:
    return ApiError(
        404,
        f"The model `{name}` does not exist: this deployment serves {', '.join(f'`{s}`' for s in served)}",
        param="model",
        code="model_not_found",
    )


# ---- typed reads of a JSON object -----------------------------------------------------------------------------------
def _is_int(value: object) -> TypeGuard[int | float]:
    # JSON true/false are Python bools, which are ints: never a number here. 16.0 counts as 16, as pydantic reads it.
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _finite(value: int | float) -> bool:
    # Python's json reads NaN and Infinity, and integers too large for a float.
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _range_text(lo, hi) -> str:
    if hi is None:
        return f">= {lo}"
    return f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"


@dataclass(frozen=True)
class Fields:
    """Reads a request body's fields; null or absent is the default. A wrong type or value raises a 400 naming the
    field."""

    body: dict

    def get(self, name: str):
        return self.body.get(name)

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"{name} must be true or false, got {value!r}", name)
        return value

    @overload
    def integer(self, name: str, default: int, lo: int | None = None, hi: int | None = None) -> int: ...
    @overload
    def integer(self, name: str, default: None = None, lo: int | None = None, hi: int | None = None) -> int | None: ...
    def integer(self, name: str, default: int | None = None, lo: int | None = None, hi: int | None = None):
        value = self.body.get(name)
        if value is None:
            return default
        if not _is_int(value):
            raise bad_request(f"{name} must be an integer, got {value!r}", name)
        value = int(value)
        hi = MAX_UINT32 if hi is None else hi
        if (lo is not None and value < lo) or value > hi:
            raise bad_request(f"{name} must be {_range_text(lo, hi)}, got {value}", name)
        return value

    @overload
    def number(self, name: str, default: float, lo: float | None = None, hi: float | None = None) -> float: ...
    @overload
    def number(
        self, name: str, default: None = None, lo: float | None = None, hi: float | None = None
    ) -> float | None: ...
    def number(self, name: str, default: float | None = None, lo: float | None = None, hi: float | None = None):
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise bad_request(f"{name} must be a finite number, got {value!r}", name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise bad_request(f"{name} must be {_range_text(lo, hi)}, got {value}", name)
        return float(value)

    def text(self, name: str, default: str | None = None) -> str | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad_request(f"{name} must be a string, got {value!r}", name)
        return utf8_text(value, name)

    def token_ids(self, name: str) -> list[int]:
        value = self.body.get(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(_is_token_id(t) for t in value):
            raise bad_request(f"{name} must be a list of token ids (integers >= 0), got {value!r}", name)
        return [int(t) for t in value]


def _is_token_id(value: object) -> bool:
    return _is_int(value) and 0 <= value <= MAX_TOKEN_ID


# ---- requests -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ApiRequest:
    """One parsed API call: a GenerateRequest per prompt, and what shaping the answer needs."""

    kind: str  # CHAT | COMPLETION
    prompts: tuple[fastgen_pb2.GenerateRequest, ...]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # per-token logprobs asked for
    top_logprobs: int = 0
    echo: bool = False
    tools: ToolPlan | None = None  # chat with tools: how the output becomes tool calls (balancer/tools.py)
    # vLLM's prompt_logprobs field: completions' choices carry them; a chat reply (one prompt) at its top level
    prompt_logprobs: bool = False
    reasoning: str | None = None  # chat: the --reasoning-parser that splits thoughts into reasoning_content
    prompt_only: bool = False  # max_tokens 0 with echo (lm-eval's loglikelihood): the one token generated is dropped


def requested_model(body: object) -> str | None:
    """The body's `model` (None when absent); checked before the rest so an unknown model is a 404 first."""
    return Fields(_object(body)).text("model")


def parse_chat(
    body: object,
    request_id: str,
    limits: PromptLimits = DEFAULT_PROMPT_LIMITS,
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER,
    reasoning_parser: str | None = None,
) -> ApiRequest:
    f = Fields(_object(body))
    f.text("model")  # its value is the caller's to check (requested_model)
    messages = parse_messages(f.get("messages"), limits)
    logprobs = f.flag("logprobs")
    top = f.integer("top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    prompt_top = f.integer("prompt_logprobs", None, 0, MAX_TOP_LOGPROBS)
    try:
        plan, tools_json, tool_constraint = parse_tools(f.body, tool_call_parser)
    except ToolError as e:
        raise bad_request(str(e), e.param) from None
    n = f.integer("n", 1, 1, MAX_N)
    max_tokens = f.integer("max_completion_tokens", lo=1)
    params = sampling_params(f, n, max_tokens if max_tokens is not None else f.integer("max_tokens", lo=1))
    params.logprobs, params.top_logprobs = logprobs, top
    if prompt_top is not None:  # the rendered conversation's tokens, template included, as vLLM scores them
        params.prompt_logprobs = prompt_top
    if tool_constraint is not None:
        if params.HasField("constraint"):
            raise bad_request("a forced tool_choice cannot be combined with response_format", "tool_choice")
        try:  # the tools' schemas become the grammar: its size is the replica's limit too
            check_constraint(tool_constraint)
        except RequestRefused as e:
            raise bad_request(f"the tools' schemas are too large for a forced tool_choice: {e}", "tools") from None
        params.constraint.CopyFrom(tool_constraint)
    request = fastgen_pb2.GenerateRequest(request_id=request_id, params=params, slo=parse_slo(f.get("slo")))
    request.messages.messages.extend(messages)
    request.messages.tools_json = tools_json
    try:
        check_prompt_chars(sum(len(m.content) for m in messages) + len(tools_json), limits, "tools")
    except RequestRefused as e:
        raise refused(e) from None
    stream, include_usage = stream_flags(f)
    return ApiRequest(
        CHAT,
        (request,),
        n,
        stream,
        include_usage,
        logprobs,
        top,
        tools=plan,
        prompt_logprobs=prompt_top is not None,
        reasoning=reasoning_parser,
    )


def parse_completion(body: object, request_id: str, limits: PromptLimits = DEFAULT_PROMPT_LIMITS) -> ApiRequest:
    f = Fields(_object(body))
    f.text("model")
    prompts = parse_prompts(f.get("prompt"), limits)
    top = f.integer("logprobs", None, 0, MAX_TOP_LOGPROBS)
    echo = f.flag("echo")
    prompt_top = f.integer("prompt_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if f.get("suffix") is not None:
        raise bad_request("suffix is not supported", "suffix")
    n = f.integer("n", 1, 1, MAX_N)
    try:
        check_prompt_count(len(prompts), n)
    except RequestRefused as e:
        raise refused(e) from None
    best_of = f.integer("best_of", None, 1)
    if best_of is not None and best_of != n:
        raise bad_request("best_of is not supported (leave it out, or equal to n)", "best_of")
    max_tokens = f.integer("max_tokens", lo=0)
    if max_tokens == 0 and not echo:
        raise bad_request(
            "max_tokens 0 generates nothing: set echo to score the prompt, or ask for tokens", "max_tokens"
        )
    params = sampling_params(f, n, 1 if max_tokens == 0 else max_tokens)
    params.logprobs, params.top_logprobs, params.echo = top is not None, top or 0, echo
    if echo and top is not None or prompt_top is not None:  # echo with logprobs scores the prompt's tokens too
        params.prompt_logprobs = max(top or 0, prompt_top or 0)
    slo = parse_slo(f.get("slo"))
    requests = []
    for i, prompt in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        request = fastgen_pb2.GenerateRequest(request_id=rid, params=params, slo=slo)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        requests.append(request)
    stream, include_usage = stream_flags(f)
    logprobs = top is not None
    return ApiRequest(
        COMPLETION,
        tuple(requests),
        n,
        stream,
        include_usage,
        logprobs,
        top or 0,
        echo,
        prompt_logprobs=prompt_top is not None,
        prompt_only=max_tokens == 0,
    )


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def stream_flags(f: Fields) -> tuple[bool, bool]:
    stream = f.flag("stream")
    options = f.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options needs stream set to true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {options!r}", "stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad_request(f"stream_options.include_usage must be true or false, got {include!r}", "stream_options")
    return stream, bool(include)


def sampling_params(f: Fields, n: int, max_tokens: int | None) -> fastgen_pb2.SamplingParams:
    """The fields every generation route shares, in the engine's terms (0 leaves a field at its default)."""
    p = fastgen_pb2.SamplingParams(
        max_new_tokens=max_tokens or 0,  # unset: the server's default, capped by the context left
        min_new_tokens=f.integer("min_tokens", 0, 0),
        temperature=f.number("temperature", DEFAULT_TEMPERATURE, 0.0),
        top_p=f.number("top_p", 1.0, 0.0, 1.0),
        top_k=max(0, f.integer("top_k", 0, -1)),  # -1 is vLLM's "off", as 0 is the engine's
        ignore_eos=f.flag("ignore_eos"),
        presence_penalty=f.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=f.number("repetition_penalty", 1.0, 0.0),
        min_p=f.number("min_p", 0.0, 0.0, 1.0),
        stop_token_ids=f.token_ids("stop_token_ids"),
        n=n,
        include_stop_str_in_output=f.flag("include_stop_str_in_output"),
        keep_special_tokens=not f.flag("skip_special_tokens", True),
        cache_salt=f.text("cache_salt", "") or "",  # vLLM's field: prefix-cache isolation per tenant
    )
    if p.top_p == 0:
        raise bad_request("top_p must be in (0, 1], got 0", "top_p")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids may have at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    if p.repetition_penalty == 0:
        raise bad_request("repetition_penalty must be > 0 (1 turns it off), got 0", "repetition_penalty")
    seed = f.integer("seed", None, 0, MAX_SEED)
    if seed is not None:
        p.seed = seed
    p.stop.extend(parse_stop(f.get("stop")))
    try:  # response_format, structured_outputs or guided_* (balancer/structured.py)
        constraint = parse_constraint(f.body)
    except StructuredError as e:
        raise bad_request(str(e), e.param) from None
    if constraint is not None:
        p.constraint.CopyFrom(constraint)
    for token, bias in parse_logit_bias(f.get("logit_bias")).items():
        p.logit_bias[token] = bias
    return p


def parse_slo(value: object) -> fastgen_pb2.Slo | None:
    """FastGen's extension field `slo`: {"ttft_ms": ..., "token_rate": ..., "prompt_rate": ...}, each optional (the
    deployment's --sla-* values stand in), the request's own service level for the slo scheduler."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f'slo must be an object such as {{"ttft_ms": 2000, "token_rate": 4}}, got {value!r}', "slo")
    unknown = sorted(set(value) - set(SLO_FIELDS))
    if unknown:
        raise bad_request(f"slo has unknown fields {unknown}: use {', '.join(SLO_FIELDS)}", "slo")
    f = Fields({f"slo.{name}": v for name, v in value.items()})  # errors name the field as slo.<name>
    slo = fastgen_pb2.Slo(ttft_ms=f.integer("slo.ttft_ms", 0, 1, MAX_SLO_TTFT_MS))
    for name in ("prompt_rate", "token_rate"):
        rate = f.number(f"slo.{name}", 0.0, 0.0)
        if name in value and not rate > 0:
            raise bad_request(f"slo.{name} must be > 0 tokens/s, got {rate}", f"slo.{name}")
        setattr(slo, name, rate)
    return slo


def parse_stop(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request(f"stop must be a string or a list of strings, got {value!r}", "stop")
    if any(not s for s in value):
        raise bad_request("stop strings must not be empty", "stop")
    if len(value) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may have at most {MAX_STOP_STRINGS} strings, got {len(value)}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise bad_request(f"stop strings may have at most {MAX_STOP_CHARS} characters", "stop")
    return [utf8_text(s, "stop") for s in value]


def parse_logit_bias(value: object) -> dict[int, float]:
    """OpenAI's map of token ids (JSON object keys, so strings) to a bias in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"logit_bias must be an object of token id to bias, got {value!r}", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(value)}", "logit_bias")
    biases = {}
    for key, bias in value.items():
        # ASCII digits only: str.isdigit() is also true of "²" and "١", which int() refuses or reads as another number.
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS
        token = int(key) if digits else None
        if token is None or token > MAX_TOKEN_ID:
            raise bad_request(f"logit_bias keys must be token ids (integers >= 0), got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for {key}", "logit_bias")
        biases[token] = float(bias)
    return biases


def parse_prompts(value: object, limits: PromptLimits = DEFAULT_PROMPT_LIMITS) -> list[str | list[int]]:
    """A completion prompt: a string, a list of strings, a list of token ids or a list of token-id lists. Counts and
    lengths are checked before any prompt is walked or copied."""
    try:
        if isinstance(value, str):
            check_prompt_chars(len(value), limits)
            return [utf8_text(value, "prompt")]
        if isinstance(value, list) and value:
            if isinstance(value[0], (str, list)):
                check_prompt_count(len(value), 1)
            else:
                check_prompt_ids(len(value), limits)
            return _prompts_of(value, limits)
    except RequestRefused as e:
        raise refused(e) from None
    raise bad_request(PROMPT_SHAPES, "prompt")


PROMPT_SHAPES = (
    "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists (none of them empty)"
)


def _prompts_of(value: list, limits: PromptLimits) -> list[str | list[int]]:
    if all(isinstance(p, str) for p in value):
        for p in value:
            check_prompt_chars(len(p), limits)
        return [utf8_text(p, "prompt") for p in value]
    if all(_is_token_id(t) for t in value):
        return [[int(t) for t in value]]
    if all(isinstance(p, list) for p in value):
        for p in value:
            check_prompt_ids(len(p), limits)
        if all(p and all(_is_token_id(t) for t in p) for p in value):
            return [[int(t) for t in p] for p in value]
    raise bad_request(PROMPT_SHAPES, "prompt")


def parse_messages(value: object, limits: PromptLimits = DEFAULT_PROMPT_LIMITS) -> list[fastgen_pb2.ChatMessage]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    try:
        check_message_count(len(value), limits)
    except RequestRefused as e:
        raise refused(e) from None
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(m: object, where: str) -> fastgen_pb2.ChatMessage:
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object with role and content, got {m!r}", where)
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise bad_request(f"{where}.role must be a string such as user, system or assistant", f"{where}.role")
    content = _content(m.get("content"), role, f"{where}.content")
    message = fastgen_pb2.ChatMessage(
        role=utf8_text(role, f"{where}.role"), content=utf8_text(content, f"{where}.content")
    )
    calls, call_id = m.get("tool_calls"), m.get("tool_call_id")
    if calls:  # an assistant turn that called tools, sent back in an agent's loop
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise bad_request(f"{where}.tool_calls must be a list of tool calls", f"{where}.tool_calls")
        message.tool_calls_json = json.dumps(calls, ensure_ascii=False, separators=(",", ":"))
    if call_id is not None:
        if not isinstance(call_id, str):
            raise bad_request(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        message.tool_call_id = call_id
    return message


def _content(content: object, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":  # an assistant turn that only called tools
        return ""
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        strings = [t for t in texts if isinstance(t, str)]
        if len(strings) == len(content):  # every part a text part
            return "\n".join(strings)  # as vLLM joins text parts
    raise bad_request(f'{where} must be a string or a list of {{"type": "text", "text": ...}} parts', where)


# ---- replies --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Meta:
    """What every reply and chunk of one API call repeats."""

    id: str
    created: int
    model: str


def finish_reason(reason: int) -> str | None:
    return FINISH_REASONS.get(reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the replicas' prefix caches held."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choices_of(response: fastgen_pb2.GenerateResponse) -> Sequence:
    """The completions of one response in index order (the top-level fields are the only one when n is 1)."""
    return response.choices or [response]


def response_usage(responses: Sequence[fastgen_pb2.GenerateResponse]) -> dict:
    completion = sum(c.generated_tokens for r in responses for c in choices_of(r))
    cached = sum(r.cached_prompt_tokens for r in responses)
    return usage(sum(r.prompt_tokens for r in responses), completion, cached)


def _logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN


def chat_logprobs(tokens: Sequence[fastgen_pb2.TokenLogprob]) -> dict:
    """OpenAI's choices[].logprobs of a chat completion: content[] with token, logprob, bytes, top_logprobs."""

    def entry(t) -> dict:
        return {"token": t.token, "logprob": _logprob(t.logprob), "bytes": list(t.token.encode())}

    return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in t.top]} for t in tokens]}


def completion_logprobs(tokens: Sequence[fastgen_pb2.TokenLogprob], offset: int = 0) -> dict:
    """OpenAI's legacy logprobs: parallel lists of tokens, their logprobs, a {token: logprob} dict of the
    alternatives per position (the sampled token always among them) and each token's offset in the text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        alternatives = {a.token: _logprob(a.logprob) for a in t.top}
        alternatives.setdefault(t.token, _logprob(t.logprob))
        out["tokens"].append(t.token)
        out["token_logprobs"].append(_logprob(t.logprob))
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(t.token)
    return out


def chat_response(meta: Meta, api: ApiRequest, responses: Sequence[fastgen_pb2.GenerateResponse]) -> dict:
    choices = [
        {
            "index": i * api.n + j,
            **chat_message(api, c.text, finish_reason(c.finish_reason)),
            "logprobs": chat_logprobs(c.logprobs) if api.logprobs else None,
        }
        for i, r in enumerate(responses)
        for j, c in enumerate(choices_of(r))
    ]
    reply = _reply(meta, "chat.completion", choices, response_usage(responses))
    if api.prompt_logprobs:
        reply["prompt_logprobs"] = vllm_prompt_logprobs(responses[0].prompt_logprobs)
    return reply


def chat_message(api: ApiRequest, text: str, reason: str | None) -> dict:
    """A finished choice's message and finish reason: the text, or the tool calls found in it."""
    thoughts, answer = None, text
    if api.reasoning is not None:
        thoughts, answer = split(api.reasoning, text)
    message: dict[str, object]
    if api.tools is None or answer is None:
        message = {"role": "assistant", "content": answer}
        if api.reasoning is not None:
            message["reasoning_content"] = thoughts
        return {"message": message, "finish_reason": reason}
    content, calls = extract(api.tools, answer)
    message = {"role": "assistant", "content": content}
    if api.reasoning is not None:
        message["reasoning_content"] = thoughts
    if calls:
        message["tool_calls"] = calls
        reason = "tool_calls" if reason == "stop" or api.tools.forced else reason
    return {"message": message, "finish_reason": reason}


def completion_response(meta: Meta, api: ApiRequest, responses: Sequence[fastgen_pb2.GenerateResponse]) -> dict:
    choices = []
    for i, r in enumerate(responses):
        prefix = r.prompt_text if api.echo else ""
        for j, c in enumerate(choices_of(r)):
            text, generated = (prefix, []) if api.prompt_only else (prefix + c.text, c.logprobs)
            logprobs = None
            if api.logprobs:
                logprobs = completion_logprobs(generated, len(prefix))
                if api.echo:
                    logprobs = _joined(echo_logprobs(r.prompt_text, r.prompt_logprobs), logprobs)
            choice = {"index": i * api.n + j, "text": text, "logprobs": logprobs}
            choice["finish_reason"] = "length" if api.prompt_only else finish_reason(c.finish_reason)
            if api.prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(r.prompt_logprobs)
            choices.append(choice)
    return _reply(meta, "text_completion", choices, response_usage(responses))


def echo_logprobs(prompt_text: str, tokens: Sequence[fastgen_pb2.TokenLogprob]) -> dict:
    """The legacy logprobs of an echoed prompt: its first token has none (null), as OpenAI's; its text is what the
    prompt holds before the others' text."""
    rest = completion_logprobs(tokens)
    tail = "".join(rest["tokens"])
    first = prompt_text[: len(prompt_text) - len(tail)] if prompt_text.endswith(tail) else ""
    rest["text_offset"] = [o + len(first) for o in rest["text_offset"]]
    return _joined({"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}, rest)


def _joined(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def vllm_prompt_logprobs(tokens: Sequence[fastgen_pb2.TokenLogprob]) -> list:
    """vLLM's prompt_logprobs: null for the first token, then {token id: {logprob, rank, decoded_token}} per token,
    the token's own and its alternatives."""
    out: list = [None]
    for t in tokens:
        entry = {str(a.token_id): {"logprob": _logprob(a.logprob), "decoded_token": a.token} for a in t.top}
        entry.setdefault(str(t.token_id), {"logprob": _logprob(t.logprob), "decoded_token": t.token})
        out.append(entry)
    return out


def _reply(meta: Meta, kind: str, choices: list[dict], used: dict | None) -> dict:
    return {
        "id": meta.id,
        "object": kind,
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": used,
    }


def lora_fields(body: object, need_path: bool) -> tuple[str, str]:
    """(lora_name, lora_path) of a /v1/load_lora_adapter or /v1/unload_lora_adapter body."""
    f = Fields(_object(body))
    name, path = f.text("lora_name") or "", f.text("lora_path") or ""
    if not name:
        raise bad_request("lora_name is required: the name requests give as their model", "lora_name")
    if need_path and not path:
        raise bad_request("lora_path is required: the adapter's folder on the replicas' host", "lora_path")
    return name, path


def model_list(names: Sequence[str], created: int, adapters: Sequence[str] = ()) -> dict:
    """The models served, then the LoRA adapters, each with the base model as its parent (vLLM's cards)."""
    cards = [{"id": n, "object": "model", "created": created, "owned_by": "fastgen", "root": n} for n in names]
    parent = names[0] if names else None
    cards += [
        {"id": a, "object": "model", "created": created, "owned_by": "fastgen", "root": a, "parent": parent}
        for a in adapters
    ]
    return {"object": "list", "data": cards}


# ---- streams --------------------------------------------------------------------------------------------------------
@dataclass
class StreamUsage:
    """Token counts of a stream, from the last chunk of every choice."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)  # by prompt
    cached_tokens: dict[int, int] = field(default_factory=dict)  # by prompt
    completion_tokens: int = 0

    def add(self, prompt: int, chunk: fastgen_pb2.GenerateChunk) -> None:
        if chunk.finish_reason:
            self.prompt_tokens[prompt] = chunk.prompt_tokens
            self.cached_tokens[prompt] = chunk.cached_prompt_tokens
            self.completion_tokens += chunk.generated_tokens

    def total(self) -> dict:
        return usage(sum(self.prompt_tokens.values()), self.completion_tokens, sum(self.cached_tokens.values()))


@dataclass
class Stream:
    """Turns the upstream chunks of one API call, tagged with their prompt's position, into the API's stream
    events; `usage_event` is the include_usage chunk (no choices) that ends a stream."""

    meta: Meta
    api: ApiRequest
    kind: str = ""  # the chunks' "object"
    counted: StreamUsage = field(default_factory=StreamUsage)

    def events(self, prompt: int, chunk: fastgen_pb2.GenerateChunk) -> list[dict]:
        raise NotImplementedError

    def chunk_event(self, choices: list[dict]) -> dict:
        event = {"id": self.meta.id, "object": self.kind, "created": self.meta.created, "model": self.meta.model}
        event["choices"] = choices
        if self.api.include_usage:
            event["usage"] = None  # OpenAI: null on every chunk but the last
        return event

    def usage_event(self) -> dict:
        return {**self.chunk_event([]), "usage": self.counted.total()}

    def _index(self, prompt: int, chunk: fastgen_pb2.GenerateChunk) -> int:
        return prompt * self.api.n + chunk.index


@dataclass
class ChatStream(Stream):
    kind: str = "chat.completion.chunk"
    started: bool = False
    tool_streams: dict[int, ToolStream] = field(default_factory=dict)  # by choice, with tools
    reasoning_streams: dict[int, ReasoningStream] = field(default_factory=dict)  # by choice, with a reasoning parser

    def events(self, prompt: int, chunk: fastgen_pb2.GenerateChunk) -> list[dict]:
        self.counted.add(prompt, chunk)
        out = []
        if not self.started:  # as OpenAI and vLLM open a stream: the role of every choice, empty content
            self.started = True
            for i in range(len(self.api.prompts) * self.api.n):
                opening = {"role": "assistant", "content": ""}
                out.append(self.chunk_event([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}]))
            if self.api.prompt_logprobs:  # the first chunk carries them, as the whole reply's top level does
                out[0]["prompt_logprobs"] = vllm_prompt_logprobs(chunk.prompt_logprobs)
        logprobs = chat_logprobs(chunk.logprobs) if self.api.logprobs and chunk.logprobs else None
        index, reason = self._index(prompt, chunk), finish_reason(chunk.finish_reason)
        if self.api.reasoning is not None or self.api.tools is not None:
            deltas, reason = self._parsed(index, chunk, reason)
            deltas = deltas or ([{}] if logprobs or reason else [])
            for k, delta in enumerate(deltas):  # the chunk's logprobs and finish reason ride on its last delta
                last = k == len(deltas) - 1
                choice = {"index": index, "delta": delta, "logprobs": logprobs if last else None}
                out.append(self.chunk_event([{**choice, "finish_reason": reason if last else None}]))
            return out
        if chunk.text or logprobs or chunk.finish_reason:
            delta = {"content": chunk.text} if chunk.text or not chunk.finish_reason else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
            out.append(self.chunk_event([{**choice, "finish_reason": reason}]))
        return out

    def _parsed(self, index: int, chunk, reason: str | None) -> tuple[list[dict], str | None]:
        """The chunk's deltas through the choice's parsers: thoughts as reasoning_content (with a reasoning parser),
        the answer after them as content, or, with tools, through the choice's tool stream, as the whole reply
        splits them (chat_message). The finish reason becomes tool_calls where a call was made."""
        finished = bool(chunk.finish_reason)
        deltas = [{"content": chunk.text}] if chunk.text else []
        if self.api.reasoning is not None:
            thoughts = self.reasoning_streams.setdefault(index, ReasoningStream(self.api.reasoning))
            deltas = thoughts.feed(chunk.text, finished)
        if self.api.tools is None:
            return deltas, reason
        tools = self.tool_streams.setdefault(index, ToolStream(self.api.tools))
        answer = "".join(d["content"] for d in deltas if "content" in d)
        deltas = [d for d in deltas if "content" not in d]
        if answer or finished:
            deltas += tools.feed(answer, finished)
        if reason is not None and tools.called:
            reason = "tool_calls" if reason == "stop" or tools.plan.forced else reason
        return deltas, reason


@dataclass
class CompletionStream(Stream):
    kind: str = "text_completion"
    prompt_texts: dict[int, str] = field(default_factory=dict)  # by prompt; only the first chunk carries it
    offsets: dict[int, int] = field(default_factory=dict)  # text sent so far, by choice
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # by prompt; the first chunk carries them too

    def events(self, prompt: int, chunk: fastgen_pb2.GenerateChunk) -> list[dict]:
        self.counted.add(prompt, chunk)
        if chunk.prompt_text:
            self.prompt_texts[prompt] = chunk.prompt_text
        if chunk.prompt_logprobs:
            self.prompt_logprobs[prompt] = list(chunk.prompt_logprobs)
        index = self._index(prompt, chunk)
        first = index not in self.offsets
        generated, generated_lps = ("", []) if self.api.prompt_only else (chunk.text, chunk.logprobs)
        echoed = self.prompt_texts.get(prompt, "") if self.api.echo and first else ""
        text = echoed + generated
        offset = self.offsets.get(index, 0)
        logprobs = None
        if self.api.logprobs and (generated_lps or echoed):
            logprobs = completion_logprobs(generated_lps, offset + len(echoed))
            if echoed:  # the prompt's own logprobs open the choice, as in the whole answer
                logprobs = _joined(echo_logprobs(echoed, self.prompt_logprobs.get(prompt, [])), logprobs)
        self.offsets[index] = offset + len(text)
        if not (text or logprobs or chunk.finish_reason):
            return []
        reason = finish_reason(chunk.finish_reason)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": "length" if reason and self.api.prompt_only else reason,
        }
        return [self.chunk_event([choice])]


STREAMS: dict[str, Callable[[Meta, ApiRequest], Stream]] = {CHAT: ChatStream, COMPLETION: CompletionStream}


def dumps(data: object) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def sse(data: object) -> bytes:
    """One Server-Sent Event carrying `data` as JSON."""
    return b"data: " + dumps(data).encode() + b"\n\n"
