"""The balancer's OpenAI-compatible HTTP API (aiohttp), served from the balancer's event loop beside its gRPC server.

    POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /version

Handlers call the routing and retry core (service.Balancer) directly, with no second hop through gRPC; the
protocol itself (parsing, shapes, error mapping) lives in openai_protocol. A stream's HTTP status is decided by its
first upstream chunk, so a request the replica refuses is a plain 4xx/5xx; a failure after that arrives as an error
event followed by [DONE]. A client that disconnects has its handler cancelled (aiohttp's handler_cancellation),
which cancels the upstream call: the replica aborts the request and frees its KV blocks.

With an API key, every route but /health needs `Authorization: Bearer <key>`, as in vLLM (the same check as the
gRPC side's, server/auth.py); with several (one per tenant) each tenant's requests get their own prefix-cache salt
(tenants.py). With an ssl.SSLContext it serves HTTPS.

Bodies are bounded before they are parsed: MAX_BODY_BYTES, and a count of JSON containers and values (a body of
empty lists costs fifty times its size as Python objects); nesting too deep for the parser is a 400 too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import cast

from aiohttp import web

from .. import __version__
from ..proto import fastgen_pb2
from ..server.auth import bearer_token, token_accepted
from ..server.grpc_server import PortInUseError
from ..server.metrics import HTTP_ROUTES, HttpMetrics
from .limits import DEFAULT_PROMPT_LIMITS, PromptLimits
from .openai_protocol import (
    CHAT,
    COMPLETION,
    DONE,
    STREAMS,
    ApiError,
    ApiRequest,
    Meta,
    chat_response,
    completion_response,
    dumps,
    error_from_failure,
    lora_fields,
    model_list,
    parse_chat,
    parse_completion,
    requested_model,
    sse,
    unknown_model,
)
from .service import Balancer, RequestFailed
from .tools import DEFAULT_TOOL_CALL_PARSER, parser_for_template

log = logging.getLogger("fastgen.balancer.http")

API_KEY_ENV = "FASTGEN_API_KEY"
MAX_BODY_BYTES = 64 << 20  # long token-id prompts; the same limit as gRPC messages
# JSON values a body may hold, counted by their separators and brackets before parsing: a million-token prompt as ids
# fits; 64 MiB of "[]," or "1," would be over a gigabyte of Python objects.
MAX_JSON_VALUES = 2 << 20
MAX_JSON_CONTAINERS = 1 << 20
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_LEFT = web.RequestKey("fastgen.client_left", bool)  # the client disconnected mid-stream
CLIENT_CLOSED_STATUS = 499  # what the metrics record for a request the client abandoned (nginx's code)

PARSERS = {CHAT: parse_chat, COMPLETION: parse_completion}
REPLIES = {CHAT: chat_response, COMPLETION: completion_response}
ID_PREFIXES = {CHAT: "chatcmpl", COMPLETION: "cmpl"}


@dataclass(frozen=True)
class ApiSettings:
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()  # accepted besides the model the replicas report (e.g. --model)
    api_keys: tuple[str, ...] = ()  # further keys accepted (one per tenant), besides api_key
    limits: PromptLimits = DEFAULT_PROMPT_LIMITS
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER  # how "auto" tool calls are found in a model's output
    reasoning_parser: str | None = None  # how a reasoning model's thoughts are split off (balancer/reasoning.py)

    @property
    def accepted_keys(self) -> tuple[str, ...]:
        return tuple(k for k in (self.api_key, *self.api_keys) if k)


class OpenAIApi:
    def __init__(self, balancer: Balancer, settings: ApiSettings = ApiSettings(), metrics: HttpMetrics | None = None):
        self._balancer = balancer
        self._settings = settings
        self._metrics = metrics
        self._created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._observe, self._errors, self._auth], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        return app

    def served_models(self) -> list[str]:
        names = [self._balancer.model(), *self._settings.served_model_names]
        return list(dict.fromkeys(n for n in names if n))

    # ---- routes ----
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETION)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT)

    async def models(self, request: web.Request) -> web.Response:
        return json_response(model_list(self.served_models(), self._created, self._balancer.lora_adapters()))

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's: {"lora_name", "lora_path"}; every replica serves the adapter (a folder on its host) from now on."""
        name, path = lora_fields(await read_json(request), need_path=True)
        await self._change_lora(name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's: {"lora_name"}; 409 while requests use it."""
        name, _ = lora_fields(await read_json(request), need_path=False)
        await self._change_lora(name, None)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _change_lora(self, name: str, path: str | None) -> None:
        try:
            await self._balancer.change_lora(name, path)
        except RequestFailed as f:
            raise error_from_failure(f.code, f.details, f.retry_after_ms) from None

    async def health(self, request: web.Request) -> web.Response:
        serving = self._balancer.pool.any_healthy()
        return json_response({"status": "ok" if serving else "unavailable"}, 200 if serving else 503)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": __version__})

    # ---- generation ----
    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await read_json(request)
        meta = Meta(f"{ID_PREFIXES[kind]}-{uuid.uuid4().hex}", int(time.time()), self._model(requested_model(body)))
        settings = self._settings
        extra = {"tool_call_parser": self._tool_call_parser(), "reasoning_parser": settings.reasoning_parser}
        extra = extra if kind == CHAT else {}
        api = PARSERS[kind](body, meta.id, self._settings.limits, **extra)
        if meta.model in self._balancer.lora_adapters():  # `model` names a LoRA adapter: its requests run under it
            for prompt in api.prompts:
                prompt.lora_name = meta.model
        caller = bearer_token(request.headers.get("Authorization"))
        if api.stream:
            return await self._stream(request, api, meta, caller)
        responses = await self._generate_all(api.prompts, caller)
        return json_response(REPLIES[kind](meta, api, responses))

    def _tool_call_parser(self) -> str:
        """--tool-call-parser, or with auto the family's of the replicas' chat template (known once the balancer
        loaded their tokenizer for prefix routing; hermes until then)."""
        if self._settings.tool_call_parser != "auto":
            return self._settings.tool_call_parser
        tokenizer = getattr(getattr(self._balancer.pool, "hasher", None), "tokenizer", None)
        return parser_for_template(getattr(tokenizer, "template_source", None))

    def _model(self, requested: str | None) -> str:
        """The name replies carry; 404 for a model this deployment does not serve. Until a replica has reported its
        model (none healthy yet) any name passes: the request then fails as unavailable, which is the truth."""
        served = self.served_models()
        if requested is None:
            return served[0] if served else ""
        if served and requested not in served and requested not in self._balancer.lora_adapters():
            raise unknown_model(requested, served + self._balancer.lora_adapters())
        return requested

    async def _generate_all(self, prompts: Sequence[fastgen_pb2.GenerateRequest], caller: str | None) -> list:
        try:
            return await gather_or_cancel([self._balancer.generate(p, caller=caller) for p in prompts])
        except RequestFailed as f:
            raise error_from_failure(f.code, f.details, f.retry_after_ms) from None

    async def _stream(
        self, request: web.Request, api: ApiRequest, meta: Meta, caller: str | None
    ) -> web.StreamResponse:
        stream = STREAMS[api.kind](meta, api)
        # Balancer.stream is an async generator (merged closes what it does not finish); its annotation says less.
        streams = [cast(AsyncGenerator, self._balancer.stream(p, caller=caller)) for p in api.prompts]
        async with contextlib.aclosing(merged(streams)) as upstream:
            try:
                first = await anext(upstream, None)
            except RequestFailed as f:  # nothing sent yet: a plain HTTP error
                raise error_from_failure(f.code, f.details, f.retry_after_ms) from None
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            try:
                await relay(response, upstream, first, stream)
            except ConnectionResetError:  # the client left; closing `upstream` cancels the replica's work
                request[CLIENT_LEFT] = True
            return response

    # ---- middlewares: metrics (outermost), errors in OpenAI's shape, auth ----
    @web.middleware
    async def _observe(self, request: web.Request, handler) -> web.StreamResponse:
        started = time.perf_counter()
        status = CLIENT_CLOSED_STATUS  # unless a response comes back: a cancelled handler means the client left
        try:
            response = await handler(request)
            status = CLIENT_CLOSED_STATUS if request.get(CLIENT_LEFT) else response.status
            return response
        finally:
            if self._metrics is not None:
                self._metrics.on_request(route_of(request), status, time.perf_counter() - started)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except web.HTTPException as e:  # aiohttp's own answers: unknown path, wrong method, body too large
            if e.status < 400:
                raise
            return error_response(ApiError(e.status, f"{e.reason}: {request.method} {request.path}", code=_slug(e)))
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return error_response(ApiError(500, "internal error in the balancer; see its log", code="internal"))

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        keys = self._settings.accepted_keys
        if keys and request.path != "/health" and not token_accepted(request.headers.get("Authorization", ""), keys):
            raise ApiError(
                401, "Incorrect or missing API key: send Authorization: Bearer <key>", code="invalid_api_key"
            )
        return await handler(request)


def route_of(request: web.Request) -> str:
    """The metrics' route label: one of the API's routes, or "other" (unknown paths stay one series)."""
    route = request.match_info.route.resource
    canonical = route.canonical if route is not None else ""
    return canonical if canonical in HTTP_ROUTES else "other"


def _slug(e: web.HTTPException) -> str:
    return e.reason.lower().replace(" ", "_")


async def read_json(request: web.Request) -> object:
    raw = await request.read()
    check_json_size(raw)
    try:
        return json.loads(raw)
    except ValueError as e:  # malformed JSON or text that is not UTF-8
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it nests too deeply") from None


def check_json_size(raw: bytes) -> None:
    """A 413 for a body that would parse into too many Python objects. Brackets and commas inside strings count
    too: the bound is generous enough for any prompt within the limits."""
    containers = raw.count(b"[") + raw.count(b"{")
    values = raw.count(b",")
    if containers > MAX_JSON_CONTAINERS or values > MAX_JSON_VALUES:
        raise ApiError(
            413,
            f"the request body holds too many JSON values ({values} commas, {containers} arrays and objects; at most "
            f"{MAX_JSON_VALUES} and {MAX_JSON_CONTAINERS}): send fewer or shorter prompts",
            code="request_too_large",
        )


def json_response(data: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(data, status=status, headers=headers, dumps=dumps)


def error_response(e: ApiError) -> web.Response:
    return json_response(e.body(), e.status, e.headers)


async def relay(response: web.StreamResponse, upstream: AsyncIterator, first, stream) -> None:
    """Writes the stream's events from `first` on, the usage chunk when asked for, and [DONE]; a failure after the
    first chunk becomes an error event."""
    item = first
    try:
        while item is not None:
            for event in stream.events(*item):
                await response.write(sse(event))
            item = await anext(upstream, None)
        if stream.api.include_usage:
            await response.write(sse(stream.usage_event()))
    except RequestFailed as f:
        await response.write(sse(error_from_failure(f.code, f.details, f.retry_after_ms).body()))
    await response.write(DONE)


async def gather_or_cancel(calls: Sequence) -> list:
    """The results of `calls` in order; the first failure cancels the others (their replicas stop too)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()  # no-op for the finished ones
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: Sequence[AsyncGenerator]) -> AsyncGenerator[tuple[int, object], None]:
    """(position, item) from several streams as items arrive; the first failure ends it, and closing it cancels
    every stream still running."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=64)
    tasks = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            position, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                running -= 1
            else:
                yield position, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(position: int, stream: AsyncGenerator, queue: asyncio.Queue) -> None:
    try:
        async with contextlib.aclosing(stream) as items:
            async for item in items:
                await queue.put((position, item, None))
        await queue.put((position, None, None))
    except RequestFailed as f:
        await queue.put((position, None, f))


async def start_http(
    api: OpenAIApi, host: str, port: int, shutdown_timeout: float = 30.0, ssl_context: ssl.SSLContext | None = None
) -> tuple[web.AppRunner, int]:
    """Serves `api` on host:port (0 picks a free port) in the running event loop, over TLS with `ssl_context`;
    returns the runner (cleanup() stops taking requests and lets those in flight finish within shutdown_timeout)
    and the bound port."""
    runner = web.AppRunner(api.app(), handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise PortInUseError(f"cannot serve HTTP on {host}:{port} ({e}): is the port in use? choose another") from e
    return runner, runner.addresses[0][1]
