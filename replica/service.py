"""The replica's gRPC service. One thread owns the engine and steps it; gRPC handlers only enqueue work and
await their request's outputs (grpc.aio). A request for n completions gets outputs of all n on one queue, each
marked with its index, and ends when the last of them finishes."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from ..proto import fastgen_pb2 as pb
from ..proto import fastgen_pb2_grpc
from ..server.errors import RETRY_AFTER_MS, QueueFullError, retry_hint_ms, status_for, trailing_metadata
from ..server.grpc_server import set_serving
from .cache_feed import CacheFeed, FellBehind, PrefillRate
from .config import MAX_FAILED_STEPS, MAX_UNSENT_OUTPUTS, STALL_TIMEOUT_S
from .engine import Engine
from .lora_pool import AdapterInUse, UnknownAdapter
from .outputs import EngineLoad, RequestOutput, TokenLogprob
from .prompts import ChatPrompt, Prompt
from .request import (
    MAX_CONSTRAINT_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    Constraint,
    FinishReason,
    Resume,
    SamplingParams,
    Slo,
    check_count,
)
from .step_model import StepTrace

log = logging.getLogger("fastgen.replica")

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


class ReaderTooSlow(QueueFullError):
    """A stream's reader left more outputs unsent than its bound: the request was cancelled (RESOURCE_EXHAUSTED)."""


class Outputs:
    """One request's outputs on their way from the engine thread to its handler; event loop only.

    Bounded, because a reader that stops reading (a stalled client, a full HTTP/2 window) would otherwise make the
    replica hold every step's output for as long as the request runs, and keep its KV blocks busy for nobody. Past
    `limit` unsent outputs the request is cancelled (`on_overflow`) and the handler gets ReaderTooSlow instead of what
    was queued. The engine thread only ever schedules `put_nowait`: it never waits for a reader."""

    def __init__(self, key: str, limit: int, on_overflow: Callable[[], None] = lambda: None) -> None:
        self.key = key  # the engine's id of the request (server-made; the client's id is a label only)
        self.limit = limit
        self.overflowed = False
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._on_overflow = on_overflow

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item: RequestOutput | Exception) -> None:
        if self.overflowed:
            return
        if len(self._items) >= self.limit and not isinstance(item, Exception):
            self.overflowed = True
            self._items.clear()
            item = ReaderTooSlow(
                f"reader too slow: over {self.limit} outputs of this stream were left unsent, so the request was "
                "cancelled; read the stream as it comes (or ask for fewer completions)"
            )
            self._on_overflow()
        self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | Exception:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


# ---- commands from handlers to the engine thread --------------------------------------------------------
@dataclass
class _Add:
    request_id: str  # the engine's key: made by the server, never the client's id (see ReplicaService._outputs)
    prompt: Prompt
    params: SamplingParams
    outputs: Outputs  # receives RequestOutput objects, or an Exception that ends the request
    resume: tuple[Resume, ...] | None = None  # per completion, output a replica that failed delivered
    slo: Slo | None = None  # the request's own service level
    label: str = ""  # the client's request_id, for logs
    lora: str = ""  # the LoRA adapter it runs under ("": the base model)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _LoraChange:
    """Serve adapter `name` from folder `path` from now on, or stop serving it (path None); the engine thread sets
    the result (the adapters served after it) or the exception."""

    name: str
    path: str | None
    result: asyncio.Future


@dataclass
class _Stream:
    outputs: Outputs
    unfinished: int  # completions that have not sent their last output


@dataclass(frozen=True)
class QueueLimits:
    max_requests: int = 256  # requests waiting for their first forward pass
    max_prompt_tokens: int = 262144  # prompt tokens of those requests
    # Outputs per completion a stream may leave unsent before it is cancelled as too slow a reader: about as many
    # steps of lag (an output is one step's tokens), far more than a live reader falls behind.
    max_unsent_outputs: int = MAX_UNSENT_OUTPUTS


@dataclass(frozen=True)
class Watchdog:
    """When the engine counts as broken (EngineLoop.healthy, EngineLoop.fatal)."""

    stall_s: float = STALL_TIMEOUT_S  # work pending and no step completed for this long: NOT_SERVING until one does
    max_failed_steps: int = MAX_FAILED_STEPS  # failed in a row before the process exits: a broken device stays broken


class EngineDown(Exception):
    """The engine is beyond repair (its thread died, or its steps keep failing): the process exits so that its
    supervisor restarts it; requests end UNAVAILABLE, which the balancer retries or migrates elsewhere."""


# How a poisoned context shows itself in a message: torch's runtime and driver checks, and Triton's launcher (a launch
# after an earlier kernel's illegal address fails there before torch sees anything).
DEVICE_ERROR_MARKS = ("CUDA error", "CUDA driver error", "Triton Error [CUDA]")


def is_device_error(exc: BaseException) -> bool:
    """A CUDA error (an illegal address, a device-side assert) poisons the context: every later step fails too, and
    only a new process recovers. An out-of-memory error does not ("CUDA out of memory")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(mark in str(exc) for mark in DEVICE_ERROR_MARKS):
            return True
        if type(exc).__name__ in ("CudaError", "AcceleratorError"):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class EngineLoop:
    """Owns the engine on a thread of its own, from building it to its last step; asyncio callers talk to it through
    `submit` and `abort`.

    The same thread builds, warms up and steps the engine because OpenMP (torch's and the CPU kernels') keeps a pool
    of worker threads per thread that starts parallel work: a model built on one thread and run on another leaves
    two pools, libgomp then counts more threads than cores and stops its workers spinning between parallel regions,
    and every region pays a wake-up instead of finding its workers spinning (benchmarks/RESULTS.md has the cost).

    `healthy()` says whether the engine still makes progress (the watchdog's view); `on_fatal` runs on the event loop
    once the engine is beyond repair (`fatal` then holds why), and the replica process exits on it."""

    def __init__(
        self,
        build: Callable[[], Engine],
        metrics,
        limits: QueueLimits,
        loop: asyncio.AbstractEventLoop,
        trace: StepTrace | None = None,
        watchdog: Watchdog = Watchdog(),
        on_fatal: Callable[[BaseException], None] = lambda exc: None,
    ) -> None:
        self.engine: Engine | None = None  # set on the engine thread by build()
        self.trace = trace  # written by the engine thread only: every step's predicted and measured time
        self.metrics = metrics
        self.limits = limits
        self.loop = loop
        self.watchdog = watchdog
        self.load = EngineLoad()  # replaced whole by the engine thread after every step; read by GetStatus
        self.tokens_generated = 0  # written by the engine thread only
        self.cache_feed = CacheFeed()  # the prefix cache's changes, for WatchCache (event loop only)
        self.prefill_rate = PrefillRate()  # written by the engine thread only
        self.fatal: BaseException | None = None  # why the engine is beyond repair (set once, by the engine thread)
        self.progress_at = time.monotonic()  # when the engine thread last finished a step or found nothing to do
        self._on_fatal = on_fatal
        self._failed_steps = 0  # consecutive (engine thread only)
        self._build = build
        self._ready: asyncio.Future = loop.create_future()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._in_flight = 0  # requests submitted and not finished (read from the event loop)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    async def start(self) -> None:
        """Builds the engine on its thread and starts stepping it there; raises what building raised."""
        self._thread.start()
        await self._ready

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(None)
        self._thread.join(timeout=10)
        if self.trace is not None and not self._thread.is_alive():
            self.trace.close()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def healthy(self, now: float | None = None) -> bool:
        """False once the engine thread is gone or the engine is beyond repair, and while requests wait on an engine
        that has not finished a step for watchdog.stall_s (a wedged step, a hung tensor-parallel peer)."""
        if self.fatal is not None or not self._thread.is_alive():
            return False
        stalled_s = (time.monotonic() if now is None else now) - self.progress_at
        return not (self._in_flight and stalled_s > self.watchdog.stall_s)

    def submit(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        resume: tuple[Resume, ...] | None = None,
        slo: Slo | None = None,
        label: str = "",
        lora: str = "",
    ) -> Outputs:
        """Queues a request keyed `request_id` (unique: the caller makes it); its outputs come on what it returns."""
        limit = self.limits.max_unsent_outputs * completions_to_send(params, resume)
        outputs = Outputs(request_id, limit, lambda: self.abort(request_id))
        self._in_flight += 1
        self._inbox.put(_Add(request_id, prompt, params, outputs, resume, slo, label, lora))
        if self.fatal is not None or not self._thread.is_alive():  # nothing would ever answer it
            outputs.put_nowait(EngineDown(f"the replica's engine failed ({self.fatal}): retry on another replica"))
        return outputs

    def done(self) -> None:
        """Called by the handler once its request ended, however it ended."""
        self._in_flight -= 1

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def change_lora(self, name: str, path: str | None) -> list[str]:
        """Loads (path set) or unloads adapter `name` on the engine thread, between steps; returns the adapters served
        after it. Raises what the engine raised (ValueError and its kinds: what to change)."""
        result = self.loop.create_future()
        self._inbox.put(_LoraChange(name, path, result))
        return await result

    # ---- engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._build()
            self.engine.prompts.max_token_bytes  # noqa: B018 - computed here, before handlers read it
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self.loop.call_soon_threadsafe(self._ready.set_exception, exc)
            return
        self._publish_load()
        self.loop.call_soon_threadsafe(self._ready.set_result, None)
        try:
            while not self._stop and self.fatal is None:
                self._cycle()
        except BaseException as exc:  # noqa: BLE001 - outside a step the loop's own state may be half updated
            log.critical("the engine thread failed outside a step", exc_info=True)
            self._die(exc)

    def _cycle(self) -> None:
        self.progress_at = time.monotonic()
        self._apply(block=not self.engine.has_unfinished())
        if self._stop or not self.engine.has_unfinished():
            return
        try:
            result = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step must not take the replica down
            self._step_failed(exc)
            return
        self._failed_steps = 0
        for out in result.outputs:
            self.tokens_generated += len(out.new_token_ids)
            self._deliver(out)
        if result.stats is not None:
            self.metrics.on_step(result.stats)
            stats = result.stats
            if self.trace is not None:
                self.trace.write(time.monotonic(), stats)
            self.prefill_rate.observe(stats.num_prefill_tokens, stats.num_decode_tokens, stats.step_s)
        self._publish_load()
        self._publish_cache_events()

    def _step_failed(self, exc: Exception) -> None:
        self._failed_steps += 1
        log.exception("engine step failed (%d in a row); failing the requests in flight", self._failed_steps)
        if is_device_error(exc):
            # Not the requests' fault: they end UNAVAILABLE (EngineDown), which the balancer retries or migrates to
            # another replica, where INTERNAL would reach their clients as errors.
            self._die(exc)
            return
        self._fail_all(RuntimeError(f"engine step failed: {exc}"))
        if self._failed_steps >= self.watchdog.max_failed_steps:
            self._die(RuntimeError(f"{self._failed_steps} engine steps failed in a row, the last with: {exc}"))

    def _die(self, exc: BaseException) -> None:
        """The engine is beyond repair: fails whatever is in flight or queued, and hands `exc` to on_fatal."""
        self.fatal = exc
        log.critical("the engine is beyond repair (%s: %s): the replica exits", type(exc).__name__, exc)
        down = EngineDown(f"the replica's engine failed ({type(exc).__name__}: {exc}): retry on another replica")
        with contextlib.suppress(Exception):
            self._fail_all(down)
        while True:  # requests submitted since, which no step will ever take
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self.loop.call_soon_threadsafe(command.outputs.put_nowait, down)
            elif isinstance(command, _LoraChange):
                self.loop.call_soon_threadsafe(command.result.set_exception, down)
        self.loop.call_soon_threadsafe(self._on_fatal, exc)

    def _apply(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _LoraChange):
                self._change_lora(command)
            elif command.request_id in self._streams:
                for out in self.engine.abort(command.request_id):
                    self._deliver(out)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                command = None
        self._publish_load()

    def _change_lora(self, command: _LoraChange) -> None:
        try:
            if command.path is None:
                self.engine.remove_lora(command.name)
            else:
                self.engine.add_lora(command.name, command.path)
        except Exception as exc:  # noqa: BLE001 - the caller answers it; the engine is unchanged
            self.loop.call_soon_threadsafe(command.result.set_exception, exc)
            return
        self._publish_load()  # GetStatus lists the adapters at once
        self.loop.call_soon_threadsafe(command.result.set_result, self.engine.loras.names())

    def _add(self, command: _Add) -> None:
        try:
            load = self.engine.load()
            if load.queued >= self.limits.max_requests:
                raise QueueFullError(f"queue full ({load.queued} requests waiting): back off and retry")
            if load.queued_prompt_tokens >= self.limits.max_prompt_tokens:
                raise QueueFullError(
                    f"queue full (over {self.limits.max_prompt_tokens} prompt tokens waiting): back off and retry"
                )
            if load.refuse_for_s is not None:
                self.metrics.on_shed()
                raise QueueFullError(
                    f"overloaded: even decoding alone would break the token-rate floors; retry in "
                    f"{load.refuse_for_s:.1f} s",
                    round(load.refuse_for_s * 1000),
                )
            extra = {} if command.resume is None else {"resume": command.resume}
            extra |= {} if command.slo is None else {"slo": command.slo}
            extra |= {"lora": command.lora} if command.lora else {}
            self.engine.add_request(command.request_id, command.prompt, command.params, **extra)
        except (ValueError, QueueFullError) as exc:
            self.loop.call_soon_threadsafe(command.outputs.put_nowait, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bug must fail this request, not end the engine thread
            log.exception("admitting request %s (client id %r) failed", command.request_id, command.label)
            with contextlib.suppress(Exception):  # drop whatever part of it was admitted
                self.engine.abort(command.request_id)
            self.loop.call_soon_threadsafe(command.outputs.put_nowait, exc)
            return
        self._streams[command.request_id] = _Stream(
            command.outputs, completions_to_send(command.params, command.resume)
        )

    def _deliver(self, out: RequestOutput) -> None:
        # The metrics time each completion's tokens as a stream of its own.
        self.metrics.on_output(out if out.index == 0 else dataclasses.replace(out, request_id=completion_key(out)))
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            stream.unfinished -= 1
            if stream.unfinished == 0:
                del self._streams[out.request_id]
        else:
            # A stream sends deltas: the whole text, ids and logprobs so far, copied on every step and queued behind
            # a slow reader, would hold O(length^2). The last output keeps them, for Generate's answer.
            out = dataclasses.replace(out, text="", token_ids=[], logprobs=[])
        self.loop.call_soon_threadsafe(stream.outputs.put_nowait, out)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id)
            with contextlib.suppress(Exception):  # a broken engine must not keep the others from being told
                self.engine.abort(request_id)
            self.loop.call_soon_threadsafe(stream.outputs.put_nowait, exc)

    def _publish_cache_events(self) -> None:
        cache = self.engine.scheduler.allocator.cache
        if cache is None:
            return
        events, dropped = cache.drain_events()
        if dropped:
            self.loop.call_soon_threadsafe(self.cache_feed.publish, [], cache.hashes())
        elif events:
            self.loop.call_soon_threadsafe(self.cache_feed.publish, events)

    def _publish_load(self) -> None:
        self.load = self.engine.load()


async def watch_engine(service: ReplicaService, health, interval_s: float = 1.0) -> None:
    """Keeps grpc health in step with the engine (EngineLoop.healthy): NOT_SERVING while it is stalled or gone, so
    the balancer sends it nothing new and moves its streams; SERVING again once its steps complete. Cancelled
    before draining, which owns health from then on."""
    serving = True
    while True:
        await asyncio.sleep(interval_s)
        healthy = service.engine_loop.healthy()
        if healthy != serving and not service.draining:
            serving = healthy
            if healthy:
                log.warning("the engine completes steps again: SERVING")
            else:
                log.error("the engine has stopped making progress: NOT_SERVING")
            await set_serving(health, healthy)


# ---- proto <-> engine --------------------------------------------------------------------------------------
def prompt_from_proto(request: pb.GenerateRequest, max_tokens: int) -> Prompt:
    """The request's prompt; ValueError for a missing one, or for more token ids or chat messages than max_tokens
    (the context) holds, counted before they are copied: a message may hold millions of them."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        ids = request.token_ids.ids
        if len(ids) > max_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens but the context holds {max_tokens} tokens: shorten it")
        return list(ids)
    if kind == "messages":
        messages = request.messages.messages
        if not messages:
            raise ValueError("messages is empty: send at least one chat message")
        if len(messages) > max_tokens:  # each renders to at least one token
            raise ValueError(
                f"prompt has {len(messages)} chat messages but the context holds {max_tokens} tokens: send fewer"
            )
        listed = [_message(m) for m in messages]
        if not request.messages.tools_json:
            return listed
        try:
            tools = json.loads(request.messages.tools_json)
        except ValueError:
            raise ValueError("messages.tools_json is not JSON: send a list of tool definitions") from None
        if not isinstance(tools, list):
            raise ValueError("messages.tools_json must be a JSON list of tool definitions")
        return ChatPrompt(listed, tools)
    raise ValueError("no prompt: set one of text, token_ids or messages")


def _message(m: pb.ChatMessage) -> dict:
    """A chat message as chat templates take it: an assistant's tool calls with their arguments as objects (the
    templates of Qwen, Llama 3 and Hermes render them with tojson), a tool's answer with its call id."""
    message = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        try:
            calls = json.loads(m.tool_calls_json)
        except ValueError:
            raise ValueError("a message's tool_calls_json is not JSON: send OpenAI's list of tool calls") from None
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass  # left as the model wrote it
        message["tool_calls"] = calls
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def completion_key(out: RequestOutput) -> str:
    """The request id for index 0, 'id#index' for the other completions of an n > 1 request."""
    return out.request_id if out.index == 0 else f"{out.request_id}#{out.index}"


def resume_from_proto(request: pb.GenerateRequest, max_tokens: int) -> tuple[Resume, ...] | None:
    """The output a migrated request continues, one per completion, or None for a new request; ValueError when it
    cannot fit."""
    if not request.HasField("resume"):
        return None
    r = request.resume
    if not r.completions:  # n = 1
        if len(r.token_ids) >= max_tokens:  # checked before the ids are copied: a message can hold anything
            raise ValueError(f"resume holds {len(r.token_ids)} tokens but the context holds {max_tokens}")
        return (Resume(tuple(r.token_ids), r.text_chars),)
    if r.token_ids or r.text_chars:
        raise ValueError("resume sets both token_ids (for n = 1) and completions (for n > 1): send one of them")
    check_count("resume.completions", len(r.completions), MAX_N)
    longest = max(len(c.token_ids) for c in r.completions)
    if longest >= max_tokens:
        raise ValueError(f"resume holds {longest} tokens of one completion but the context holds {max_tokens}")
    if all(c.finished for c in r.completions):  # the stream would end at once, empty
        raise ValueError("every completion in resume is finished: nothing is left to resume")
    return tuple(Resume(tuple(c.token_ids), c.text_chars, c.finished) for c in r.completions)


def completions_to_send(params: SamplingParams, resume: tuple[Resume, ...] | None) -> int:
    """How many completions a request sends output for: all n, or those of a resumed request not finished yet."""
    return params.n if resume is None else sum(not r.finished for r in resume)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """server.errors.status_for, with the replica's own kinds of ValueError: an adapter it does not serve is
    NOT_FOUND, one that requests still use FAILED_PRECONDITION."""
    if isinstance(exc, UnknownAdapter):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, AdapterInUse):
        return grpc.StatusCode.FAILED_PRECONDITION
    return status_for(exc)


def check_lora(engine, name: str) -> None:
    """Refuses, before the request is queued, an adapter the replica does not serve: NOT_FOUND (UnknownAdapter) for
    an unknown name, INVALID_ARGUMENT where LoRA is off. The engine checks again when it admits the request (an
    adapter may be unloaded in between)."""
    if name and engine.loras is None:
        raise ValueError(
            f"request asks for LoRA adapter {name!r} but this replica serves none: start it with --enable-lora"
        )
    if name:
        engine.loras.path(name)


def slo_from_proto(request: pb.GenerateRequest) -> Slo | None:
    """The request's own service level (a field at 0 takes the deployment's); ValueError names a bad value."""
    if not request.HasField("slo"):
        return None
    s = request.slo
    slo = Slo(s.prompt_rate or None, s.ttft_ms / 1000 if s.ttft_ms else None, s.token_rate or None)
    slo.validate()
    return slo


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """The engine's parameters; proto3 zeros mean "off" or "default". ValueError names what to change."""
    # Before the lists are copied (and logit_bias sorted) on the event loop: a message may hold millions of entries.
    check_count("stop", len(p.stop), MAX_STOP_STRINGS)
    check_count("stop_token_ids", len(p.stop_token_ids), MAX_STOP_TOKEN_IDS)
    check_count("logit_bias", len(p.logit_bias), MAX_LOGIT_BIAS, "entries")
    if p.top_logprobs and not p.logprobs:
        raise ValueError(f"top_logprobs ({p.top_logprobs}) needs logprobs: set logprobs as well")
    return SamplingParams(
        max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p if p.top_p != 0 else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0 else 1.0,
        min_p=p.min_p,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        stop_token_ids=tuple(p.stop_token_ids),
        n=p.n or 1,
        logprobs=p.top_logprobs if p.logprobs else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        keep_special_tokens=p.keep_special_tokens,
        echo=p.echo,
        cache_salt=p.cache_salt,
        constraint=constraint_from_proto(p),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
    )


def constraint_from_proto(p: pb.SamplingParams) -> Constraint | None:
    """The request's structured-output constraint; its size is checked before anything is copied."""
    if not p.HasField("constraint"):
        return None
    c = p.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        raise ValueError("constraint is set but holds no kind: set one of json_schema, json_object, regex, choice")
    if kind == "choice":
        check_count("constraint.choice", len(c.choice.choices), MAX_CONSTRAINT_CHOICES, "choices")
        constraint = Constraint(kind, tuple(c.choice.choices))
    elif kind == "json_object":
        constraint = Constraint(kind)
    else:
        constraint = Constraint(kind, getattr(c, kind))
    constraint.validate()
    return constraint


def logprobs_to_proto(logprobs: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            token=lp.token,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in lp.top],
        )
        for lp in logprobs
    ]


def response_from(request_id: str, outs: list[RequestOutput], replica: str) -> pb.GenerateResponse:
    """The answer to Generate from the final output of every completion, in index order: the top-level fields are
    completion 0's, and choices lists all of them when there are several."""
    first = outs[0]
    resp = pb.GenerateResponse(
        request_id=request_id,
        text=first.text,
        token_ids=first.token_ids,
        finish_reason=FINISH_REASONS[first.finish_reason],
        prompt_tokens=first.prompt_tokens,
        cached_prompt_tokens=first.cached_prompt_tokens,
        generated_tokens=first.generated_tokens,
        replica=replica,
        logprobs=logprobs_to_proto(first.logprobs),
        prompt_text=first.prompt_text,
        prompt_logprobs=logprobs_to_proto(first.prompt_logprobs),
    )
    if len(outs) > 1:
        resp.choices.extend(
            pb.Choice(
                index=o.index,
                text=o.text,
                token_ids=o.token_ids,
                finish_reason=FINISH_REASONS[o.finish_reason],
                generated_tokens=o.generated_tokens,
                logprobs=logprobs_to_proto(o.logprobs),
            )
            for o in outs
        )
    return resp


def chunk_from(request_id: str, out: RequestOutput, replica: str, first: bool) -> pb.GenerateChunk:
    """One stream chunk: what out added to its completion; prompt_text on the stream's first chunk only."""
    chunk = pb.GenerateChunk(
        request_id=request_id,
        text=out.new_text,
        token_ids=out.new_token_ids,
        replica=replica,
        index=out.index,
        logprobs=logprobs_to_proto(out.new_logprobs),
        prompt_text=out.prompt_text if first else "",
        prompt_logprobs=logprobs_to_proto(out.prompt_logprobs) if first else [],
    )
    if out.finished:
        chunk.finish_reason = FINISH_REASONS[out.finish_reason]
        chunk.prompt_tokens = out.prompt_tokens
        chunk.cached_prompt_tokens = out.cached_prompt_tokens
        chunk.generated_tokens = out.generated_tokens
    return chunk


class ReplicaService(fastgen_pb2_grpc.GenerationServicer):
    def __init__(self, replica_id: str, model_name: str, metrics) -> None:
        self.engine_loop: EngineLoop | None = None  # set once the model is loaded and warm
        self.replica_id = replica_id
        self.model_name = model_name
        self.metrics = metrics
        self.draining = False
        self._tokenizer_path: str | None = None

    @property
    def serving(self) -> bool:
        return not self.draining and self.engine_loop is not None and self.engine_loop.healthy()

    async def _outputs(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, method: str):
        """Admits the request and yields (request_id, output, last) for each output of its completions, last on the
        one that finishes the final completion; aborts the request if the caller goes away first."""
        if self.engine_loop is None:
            await self._fail(context, method, grpc.StatusCode.UNAVAILABLE, "replica is still loading: retry shortly")
        if self.draining:
            await self._fail(context, method, grpc.StatusCode.UNAVAILABLE, "replica is draining: retry elsewhere")
        if self.engine_loop.fatal is not None:
            await self._fail(context, method, grpc.StatusCode.UNAVAILABLE, "replica's engine failed: retry elsewhere")
        try:
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise ValueError(f"request_id may have at most {MAX_REQUEST_ID_CHARS} characters")
            engine = self.engine_loop.engine
            prompt = prompt_from_proto(request, engine.max_model_len)
            params = params_from_proto(request.params)
            engine.prompts.check_size(prompt, engine.max_model_len)
            resume = resume_from_proto(request, engine.max_model_len)
            if method == "Generate" and request.resume.completions:
                # Its finished completions' output is the client's alone: an answer here would leave them out.
                raise ValueError("a resumed request for n > 1 completions is streamed only: use GenerateStream")
            slo = slo_from_proto(request)
            check_lora(engine, request.lora_name)
            if params.constraint is not None:  # the request waits for its grammar, compiled off the engine thread
                await asyncio.wrap_future(engine.constraints.compile(params.constraint))
        except ValueError as exc:
            await self._fail(context, method, status_of(exc), str(exc))
        # The engine keys requests by an id of the server's own: clients choose theirs freely, so two may pick the
        # same, and neither may reach the other's request (cancel it, or learn that it runs). The client's id is only
        # echoed back. Cancelling is the call's own: its context ending closes this generator.
        key = uuid.uuid4().hex
        request_id = request.request_id or key
        outputs = self.engine_loop.submit(
            key, prompt, params, resume, slo, label=request.request_id, lora=request.lora_name
        )
        unfinished = completions_to_send(params, resume)
        try:
            while unfinished:
                out = await outputs.get()
                if isinstance(out, Exception):
                    unfinished = 0
                    code = grpc.StatusCode.UNAVAILABLE if isinstance(out, EngineDown) else status_of(out)
                    await self._fail(context, method, code, str(out), retry_hint_ms(out))
                unfinished -= out.finished
                yield request_id, out, unfinished == 0
        finally:
            self.engine_loop.done()
            if unfinished:  # cancelled, deadline passed, or the client went away
                self.engine_loop.abort(key)
                self.metrics.on_rpc(method, grpc.StatusCode.CANCELLED)

    async def _fail(self, context, method: str, code: grpc.StatusCode, message: str, retry_ms: int = RETRY_AFTER_MS):
        self.metrics.on_rpc(method, code)
        await context.abort(code, message, trailing_metadata(code, retry_ms))

    async def Generate(self, request, context):
        final: dict[int, RequestOutput] = {}
        async for request_id, out, last in self._outputs(request, context, "Generate"):
            if out.finished:
                final[out.index] = out
            if last:
                self.metrics.on_rpc("Generate", grpc.StatusCode.OK)
                return response_from(request_id, [final[i] for i in sorted(final)], self.replica_id)

    async def GenerateStream(self, request, context):
        first = True
        async for request_id, out, last in self._outputs(request, context, "GenerateStream"):
            if last:
                self.metrics.on_rpc("GenerateStream", grpc.StatusCode.OK)
            yield chunk_from(request_id, out, self.replica_id, first)
            first = False

    async def GetStatus(self, request, context):
        loading = self.engine_loop is None
        load = EngineLoad() if loading else self.engine_loop.load
        status = pb.ReplicaStatus(
            replica=self.replica_id,
            health=pb.HEALTH_SERVING if self.serving else pb.HEALTH_NOT_SERVING,
            queued_requests=load.queued,
            running_requests=load.running,
            kv_blocks_used=load.kv_blocks_used,
            kv_blocks_total=load.kv_blocks_total,
            tokens_generated=0 if loading else self.engine_loop.tokens_generated,
            pending_prompt_tokens=load.pending_prompt_tokens,
            in_flight=0 if loading else self.engine_loop.in_flight,
            lora_adapters=load.loras,
            resident_lora_adapters=load.resident_loras,
        )
        if not loading:
            allocator = self.engine_loop.engine.scheduler.allocator
            status.kv_block_size = allocator.block_size
            status.prefix_caching = allocator.cache is not None
            status.prefill_tokens_per_second = self.engine_loop.prefill_rate.tokens_per_second
            if self._tokenizer_path is None:  # looked up once: it is on every status poll
                self._tokenizer_path = tokenizer_path(self.engine_loop.engine.tokenizer)
            status.tokenizer_path = self._tokenizer_path
        return pb.StatusResponse(model=self.model_name, role="replica", replicas=[status])

    async def LoadLoraAdapter(self, request, context):
        return await self._change_lora("LoadLoraAdapter", request.lora_name, request.lora_path, context)

    async def UnloadLoraAdapter(self, request, context):
        return await self._change_lora("UnloadLoraAdapter", request.lora_name, None, context)

    async def _change_lora(self, method: str, name: str, path: str | None, context) -> pb.LoraAdaptersResponse:
        if self.engine_loop is None:
            await self._fail(context, method, grpc.StatusCode.UNAVAILABLE, "replica is still loading: retry shortly")
        if path == "":
            await self._fail(context, method, grpc.StatusCode.INVALID_ARGUMENT, "lora_path is empty: give the folder")
        try:
            names = await self.engine_loop.change_lora(name, path)
        except ValueError as exc:
            code = status_of(exc)
            await self._fail(context, method, code, str(exc))
        self.metrics.on_rpc(method, grpc.StatusCode.OK)
        return pb.LoraAdaptersResponse(lora_adapters=names)

    async def WatchCache(self, request, context):
        if self.engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica is still loading: retry shortly")
        if self.engine_loop.engine.scheduler.allocator.cache is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "prefix caching is off on this replica (--no-prefix-caching): it has no cached blocks to watch",
            )
        try:
            async for batch in self.engine_loop.cache_feed.watch():
                yield pb.CacheEvents(
                    seq=batch.seq,
                    reset=batch.reset,
                    snapshot=batch.snapshot,
                    stored=batch.stored,
                    removed=batch.removed,
                )
        except FellBehind:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "this watcher fell behind the cache's changes: watch again"
            )


def tokenizer_path(tokenizer) -> str:
    """The folder of the replica's own Hugging Face tokenizer (tokenizer.json), for a balancer to hash prompts with;
    '' for a borrowed tokenizer (its ids wrap around the model's vocabulary) or none."""
    from .weights import BorrowedTokenizer, TokenIdsOnly

    if isinstance(tokenizer, (BorrowedTokenizer, TokenIdsOnly)):
        return ""
    folder = getattr(tokenizer, "name_or_path", "") or ""
    return str(Path(folder).resolve()) if folder and (Path(folder) / "tokenizer.json").is_file() else ""
