"""Python clients of fastgen.v1.Generation: `Client` (blocking) and `AsyncClient` (asyncio), for a balancer or a
single replica alike.

    with Client("127.0.0.1:50050") as client:
        print(client.generate("Once upon a time", max_new_tokens=32).text)
        for text in client.stream([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1):
            print(text, end="", flush=True)
        result = client.generate("Once upon a time", n=3, temperature=0.8, logprobs=True, top_logprobs=2)
        for choice in result.completions():
            print(choice.index, choice.text, [lp.logprob for lp in choice.logprobs])

A deployment with an API key needs it (`api_key=`, default $FASTGEN_API_KEY), sent as `authorization: Bearer <key>`
metadata; one serving TLS needs `tls_ca=` (the CA that signed its certificate; `tls=True` trusts the system's roots),
and `tls_cert=`/`tls_key=` where the server asks for a client certificate (mutual TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import numbers
import os
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from ..proto import fastgen_pb2, fastgen_pb2_grpc
from .auth import bearer_metadata
from .grpc_server import CHANNEL_OPTIONS
from .tls import TlsFiles, open_channel

SAMPLING_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",  # {token id: bias}
    "stop_token_ids",
    "n",
    "logprobs",  # bool
    "top_logprobs",
    "include_stop_str_in_output",
    "keep_special_tokens",
    "echo",
    "prompt_logprobs",  # alternatives per prompt token; unset: none
    "constraint",  # structured output: a fastgen.v1.Constraint, or a dict of its fields ({"json_schema": "..."})
)
# slo: the request's own service level for the slo scheduler, a dict of fastgen.v1.Slo's fields (ttft_ms,
# token_rate, prompt_rate). lora_name: the LoRA adapter the request runs under (a replica's --lora-modules name).
CALL_FIELDS = ("request_id", "timeout", "slo", "lora_name")
# Requests of one batch in flight at once: enough to fill a deployment, few enough not to overflow its queues.
DEFAULT_MAX_IN_FLIGHT = 128
API_KEY_ENV = "FASTGEN_API_KEY"  # the balancer's key, also what a client sends by default

FINISH_REASONS = {
    fastgen_pb2.FINISH_REASON_UNSPECIFIED: None,
    fastgen_pb2.FINISH_REASON_LENGTH: "length",
    fastgen_pb2.FINISH_REASON_STOP: "stop",
    fastgen_pb2.FINISH_REASON_EOS: "eos",
    fastgen_pb2.FINISH_REASON_CANCELLED: "cancelled",
}
HEALTH_NAMES = {
    fastgen_pb2.HEALTH_UNKNOWN: "unknown",
    fastgen_pb2.HEALTH_SERVING: "serving",
    fastgen_pb2.HEALTH_NOT_SERVING: "not_serving",
}


class GenerationError(Exception):
    """A failed call: `.code` is the grpc.StatusCode, `.details` the server's message (what to change)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message

    @classmethod
    def from_rpc_error(cls, e: grpc.RpcError) -> GenerationError:
        return cls(e.code(), e.details() or "")


@dataclass
class TopLogprob:
    token_id: int
    token: str  # the token decoded alone
    logprob: float  # natural log, under the model's raw distribution


@dataclass
class TokenLogprob:
    token_id: int  # the generated token
    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)  # the top_logprobs most likely tokens, most likely first


@dataclass
class Choice:
    """One of the n completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    generated_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when logprobs was asked for


@dataclass
class GenerationResult:
    """The answer; with n > 1 the top-level fields are completion 0's and `choices` holds all n in index order."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "length", "stop", "eos" or "cancelled"
    prompt_tokens: int
    generated_tokens: int
    replica: str  # id of the replica that served the request
    request_id: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when logprobs was asked for
    choices: list[Choice] = field(default_factory=list)  # every completion when n > 1, else empty
    prompt_text: str = ""  # the prompt's text when echo was asked for
    cached_prompt_tokens: int = 0  # of prompt_tokens, how many the replica's prefix cache held at admission

    def completions(self) -> list[Choice]:
        """Every completion in index order, whatever n was (for n = 1, the one this result holds)."""
        if self.choices:
            return self.choices
        return [Choice(0, self.text, self.token_ids, self.finish_reason, self.generated_tokens, self.logprobs)]


@dataclass
class GenerationChunk:
    text: str  # text that became final with this chunk
    token_ids: list[int]  # ids sampled since the previous chunk
    finish_reason: str | None  # set on each completion's last chunk only
    prompt_tokens: int  # set on the last chunk
    generated_tokens: int  # set on the last chunk
    replica: str
    request_id: str
    index: int = 0  # which completion this continues (n > 1); the stream ends after every index's last chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids when logprobs was asked for
    prompt_text: str = ""  # the prompt's text, on the first chunk only, when echo was asked for
    cached_prompt_tokens: int = 0  # set on the last chunk: of prompt_tokens, how many the prefix cache held


@dataclass
class ReplicaInfo:
    replica: str
    address: str
    health: str  # "serving", "not_serving" or "unknown"
    queued_requests: int
    running_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_generated: int
    in_flight: int
    pending_prompt_tokens: int


@dataclass
class Status:
    model: str
    role: str  # "replica" or "balancer"
    replicas: list[ReplicaInfo] = field(default_factory=list)


# ---- Conversions between Python values and the wire messages. ----
def check_kwargs(kwargs: Mapping[str, Any]) -> None:
    unknown = sorted(set(kwargs) - set(SAMPLING_FIELDS) - set(CALL_FIELDS))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"valid ones are {', '.join(SAMPLING_FIELDS + CALL_FIELDS)}"
        )


def check_single_completion(kwargs: Mapping[str, Any]) -> None:
    if (kwargs.get("n") or 1) > 1:
        raise TypeError("stream yields one completion's text: use stream_chunks for n > 1 (each chunk has its index)")


def sampling_params(kwargs: Mapping[str, Any]) -> fastgen_pb2.SamplingParams:
    values = {k: kwargs[k] for k in SAMPLING_FIELDS if kwargs.get(k) is not None}
    stop = values.pop("stop", ())
    logit_bias = {int(t): float(b) for t, b in dict(values.pop("logit_bias", {})).items()}
    values["stop_token_ids"] = [int(t) for t in values.get("stop_token_ids", ())]
    if isinstance(values.get("constraint"), Mapping):
        values["constraint"] = fastgen_pb2.Constraint(**values["constraint"])
    params = fastgen_pb2.SamplingParams(**values, logit_bias=logit_bias)
    params.stop.extend([stop] if isinstance(stop, str) else list(stop))
    return params


def is_single_prompt(prompt: object) -> bool:
    """True for one prompt (text, token ids or chat messages); False for a list of prompts."""
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, Sequence):
        raise TypeError(f"a prompt is a str, a list of token ids or a list of chat messages, got {type(prompt)}")
    return len(prompt) > 0 and isinstance(prompt[0], (numbers.Integral, Mapping))


def build_request(
    prompt: str | Sequence[Any], request_id: str | None, kwargs: Mapping[str, Any]
) -> fastgen_pb2.GenerateRequest:
    req = fastgen_pb2.GenerateRequest(request_id=request_id or "", params=sampling_params(kwargs))
    if kwargs.get("slo") is not None:
        req.slo.CopyFrom(fastgen_pb2.Slo(**kwargs["slo"]))
    req.lora_name = str(kwargs.get("lora_name") or "")
    if isinstance(prompt, str):
        req.text = prompt
    elif len(prompt) > 0 and all(isinstance(m, Mapping) for m in prompt):
        req.messages.messages.extend(
            fastgen_pb2.ChatMessage(role=str(m.get("role", "")), content=str(m.get("content", ""))) for m in prompt
        )
    elif all(isinstance(t, numbers.Integral) for t in prompt):
        req.token_ids.ids.extend(int(t) for t in prompt)  # an empty list reaches the server, which explains
    else:
        raise TypeError("a prompt list must hold only token ids (int) or only chat messages (dict with role, content)")
    return req


def build_stream_request(prompt: str | Sequence[Any], kwargs: Mapping[str, Any]) -> fastgen_pb2.GenerateRequest:
    check_kwargs(kwargs)
    if not is_single_prompt(prompt):
        raise TypeError("stream takes one prompt; call it once per prompt")
    return build_request(prompt, kwargs.get("request_id"), kwargs)


def batch_requests(prompts: Sequence, kwargs: Mapping[str, Any]) -> list[fastgen_pb2.GenerateRequest]:
    base_id = kwargs.get("request_id")
    return [build_request(p, f"{base_id}-{i}" if base_id else None, kwargs) for i, p in enumerate(prompts)]


def to_logprobs(logprobs) -> list[TokenLogprob]:
    return [
        TokenLogprob(lp.token_id, lp.token, lp.logprob, [TopLogprob(t.token_id, t.token, t.logprob) for t in lp.top])
        for lp in logprobs
    ]


def to_result(resp: fastgen_pb2.GenerateResponse) -> GenerationResult:
    return GenerationResult(
        text=resp.text,
        token_ids=list(resp.token_ids),
        finish_reason=FINISH_REASONS[resp.finish_reason],
        prompt_tokens=resp.prompt_tokens,
        generated_tokens=resp.generated_tokens,
        replica=resp.replica,
        request_id=resp.request_id,
        logprobs=to_logprobs(resp.logprobs),
        choices=[
            Choice(
                c.index,
                c.text,
                list(c.token_ids),
                FINISH_REASONS[c.finish_reason],
                c.generated_tokens,
                to_logprobs(c.logprobs),
            )
            for c in resp.choices
        ],
        prompt_text=resp.prompt_text,
        cached_prompt_tokens=resp.cached_prompt_tokens,
    )


def to_chunk(chunk: fastgen_pb2.GenerateChunk) -> GenerationChunk:
    return GenerationChunk(
        text=chunk.text,
        token_ids=list(chunk.token_ids),
        finish_reason=FINISH_REASONS[chunk.finish_reason],
        prompt_tokens=chunk.prompt_tokens,
        generated_tokens=chunk.generated_tokens,
        replica=chunk.replica,
        request_id=chunk.request_id,
        index=chunk.index,
        logprobs=to_logprobs(chunk.logprobs),
        prompt_text=chunk.prompt_text,
        cached_prompt_tokens=chunk.cached_prompt_tokens,
    )


def to_status(resp: fastgen_pb2.StatusResponse) -> Status:
    replicas = [
        ReplicaInfo(
            replica=r.replica,
            address=r.address,
            health=HEALTH_NAMES.get(r.health, "unknown"),
            queued_requests=r.queued_requests,
            running_requests=r.running_requests,
            kv_blocks_used=r.kv_blocks_used,
            kv_blocks_total=r.kv_blocks_total,
            tokens_generated=r.tokens_generated,
            in_flight=r.in_flight,
            pending_prompt_tokens=r.pending_prompt_tokens,
        )
        for r in resp.replicas
    ]
    return Status(model=resp.model, role=resp.role, replicas=replicas)


# ---- Credentials. ----
@dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches a server: the bearer token it sends, and TLS (None: plaintext)."""

    metadata: tuple[tuple[str, str], ...] = ()
    tls: TlsFiles | None = None
    server_name: str | None = None  # the name the server's certificate must carry, when the address is not it


def channel_security(
    api_key: str | None,
    tls: bool = False,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_server_name: str | None = None,
) -> ChannelSecurity:
    """The clients' credential arguments checked and gathered; api_key None means $FASTGEN_API_KEY ("" sends none)."""
    key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
    files = TlsFiles(tls_cert, tls_key, tls_ca)
    problems = files.problems(role="client")
    if problems:
        flags = {"--tls-cert": "tls_cert", "--tls-key": "tls_key", "--tls-ca": "tls_ca"}
        for flag, name in flags.items():
            problems = [p.replace(flag, name) for p in problems]
        raise ValueError("; ".join(problems))
    secure = tls or bool(tls_ca or tls_cert)
    return ChannelSecurity(bearer_metadata(key), files if secure else None, tls_server_name)


# ---- Blocking client. ----
class Client:
    """Blocking client over one channel. A list of prompts runs concurrently (up to `max_in_flight` at once) and
    returns results in order. Sampling keyword arguments are SamplingParams' fields; also `request_id` and
    `timeout` (seconds, overriding the client's). Credentials: see the module's doc (`security`, when given, replaces
    the other credential arguments)."""

    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        *,
        api_key: str | None = None,
        tls: bool = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        security: ChannelSecurity | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        security = security or channel_security(api_key, tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self._metadata = security.metadata
        self._channel = open_channel(address, CHANNEL_OPTIONS, security.tls, security.server_name)
        self._stub = fastgen_pb2_grpc.GenerationStub(self._channel)

    def generate(self, prompt, **kwargs) -> GenerationResult | list[GenerationResult]:
        check_kwargs(kwargs)
        timeout = kwargs.get("timeout", self.timeout)
        if is_single_prompt(prompt):
            req = build_request(prompt, kwargs.get("request_id"), kwargs)
            try:
                return to_result(self._stub.Generate(req, timeout=timeout, metadata=self._metadata))
            except grpc.RpcError as e:
                raise GenerationError.from_rpc_error(e) from None
        return self._generate_batch(batch_requests(prompt, kwargs), timeout)

    def stream(self, prompt, **kwargs) -> Iterator[str]:
        """Yields the new text of each chunk (empty chunks are skipped); one completion only (stream_chunks for n > 1,
        whose chunks say which completion they continue)."""
        check_single_completion(kwargs)
        return self._texts(self.stream_chunks(prompt, **kwargs))

    def stream_chunks(self, prompt, **kwargs) -> Generator[GenerationChunk, None, None]:
        """Yields each chunk; closing the iterator early cancels the request. Arguments are checked now, the call
        starts at the first `next`."""
        req = build_stream_request(prompt, kwargs)
        return self._stream(req, kwargs.get("timeout", self.timeout))

    @staticmethod
    def _texts(chunks: Generator[GenerationChunk, None, None]) -> Iterator[str]:
        with contextlib.closing(chunks):  # closing the texts closes (cancels) the call
            for chunk in chunks:
                if chunk.text:
                    yield chunk.text

    def _stream(
        self, req: fastgen_pb2.GenerateRequest, timeout: float | None
    ) -> Generator[GenerationChunk, None, None]:
        call = self._stub.GenerateStream(req, timeout=timeout, metadata=self._metadata)
        try:
            for chunk in call:
                yield to_chunk(chunk)
        except grpc.RpcError as e:
            raise GenerationError.from_rpc_error(e) from None
        finally:
            call.cancel()  # a consumer that stops early frees the server's work; a no-op after the end

    def status(self, timeout: float | None = None) -> Status:
        try:
            request, timeout = fastgen_pb2.StatusRequest(), timeout or self.timeout
            return to_status(self._stub.GetStatus(request, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as e:
            raise GenerationError.from_rpc_error(e) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _generate_batch(self, requests: list, timeout: float | None) -> list[GenerationResult]:
        # Futures on the one channel give concurrency without a thread per request; the semaphore bounds it.
        slots = threading.Semaphore(self.max_in_flight)
        failed = threading.Event()

        def on_done(future: grpc.Future) -> None:
            if not future.cancelled() and future.exception() is not None:
                failed.set()
            slots.release()

        futures = []
        try:
            for req in requests:
                slots.acquire()
                if failed.is_set():
                    break  # stop sending; collecting the results below raises the failure
                future = self._stub.Generate.future(req, timeout=timeout, metadata=self._metadata)
                future.add_done_callback(on_done)
                futures.append(future)
            return [to_result(f.result()) for f in futures]
        except grpc.RpcError as e:
            raise GenerationError.from_rpc_error(e) from None
        finally:
            for f in futures:
                f.cancel()  # after a failure, the rest of the batch is abandoned; a no-op on finished calls


# ---- Asyncio client. ----
class AsyncClient:
    """The asyncio twin of `Client`: `await generate(...)`, `async for text in stream(...)`. Create and use it
    inside one event loop."""

    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        *,
        api_key: str | None = None,
        tls: bool = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        security: ChannelSecurity | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        security = security or channel_security(api_key, tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self._metadata = security.metadata
        self._channel = open_channel(address, CHANNEL_OPTIONS, security.tls, security.server_name, aio=True)
        self._stub = fastgen_pb2_grpc.GenerationStub(self._channel)

    async def generate(self, prompt, **kwargs) -> GenerationResult | list[GenerationResult]:
        check_kwargs(kwargs)
        timeout = kwargs.get("timeout", self.timeout)
        if is_single_prompt(prompt):
            return await self._generate_one(build_request(prompt, kwargs.get("request_id"), kwargs), timeout)
        slots = asyncio.Semaphore(self.max_in_flight)

        async def bounded(req):
            async with slots:
                return await self._generate_one(req, timeout)

        tasks = [asyncio.ensure_future(bounded(r)) for r in batch_requests(prompt, kwargs)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()  # the first failure ends the batch: cancel the rest

    def stream(self, prompt, **kwargs) -> AsyncIterator[str]:
        """`async for text in client.stream(...)`: the new text of each chunk (empty chunks are skipped); one
        completion only (stream_chunks for n > 1)."""
        check_single_completion(kwargs)
        return self._texts(self.stream_chunks(prompt, **kwargs))

    def stream_chunks(self, prompt, **kwargs) -> AsyncGenerator[GenerationChunk, None]:
        """`async for chunk in client.stream_chunks(...)`; arguments are checked now, the call starts with the
        iteration."""
        req = build_stream_request(prompt, kwargs)
        return self._stream(req, kwargs.get("timeout", self.timeout))

    @staticmethod
    async def _texts(chunks: AsyncGenerator[GenerationChunk, None]) -> AsyncIterator[str]:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk.text:
                    yield chunk.text

    async def _stream(
        self, req: fastgen_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncGenerator[GenerationChunk, None]:
        call = self._stub.GenerateStream(req, timeout=timeout, metadata=self._metadata)
        try:
            async for chunk in call:
                yield to_chunk(chunk)
        except grpc.RpcError as e:
            raise GenerationError.from_rpc_error(e) from None
        finally:
            call.cancel()

    async def status(self, timeout: float | None = None) -> Status:
        try:
            request, timeout = fastgen_pb2.StatusRequest(), timeout or self.timeout
            resp = await self._stub.GetStatus(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise GenerationError.from_rpc_error(e) from None
        return to_status(resp)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _generate_one(self, req: fastgen_pb2.GenerateRequest, timeout: float | None) -> GenerationResult:
        try:
            return to_result(await self._stub.Generate(req, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as e:
            raise GenerationError.from_rpc_error(e) from None
