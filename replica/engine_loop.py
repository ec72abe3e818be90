"""The engine thread, as an actor: one thread owns the engine, from building it to its last step, and asyncio callers
reach it only through its inbox. Three parts, as in TGI's router queue (a handle, a command enum, state owned by one
task):

- `EngineLoop`, the handle the service holds: `submit`, `abort` and `change_lora` put a `Command` on the inbox and
  return at once; `load`, `fatal` and `healthy()` read what the engine thread publishes.
- `Command`, what goes on the inbox: plain frozen dataclasses, each answered through what it carries (the request's
  `Outputs`, a future), on the caller's event loop; the engine thread never waits for a caller.
- `_EngineThread`, the state only the engine thread touches (the engine, the streams of the requests it runs, the
  failed steps in a row) and the loop that steps the engine.

A request for n completions gets outputs of all n on one `Outputs`, each marked with its index, and ends when the
last of them finishes."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..server.errors import QueueFullError
from .cache_feed import CacheFeed, PrefillRate
from .config import MAX_FAILED_STEPS, MAX_UNSENT_OUTPUTS, STALL_TIMEOUT_S
from .engine import Engine
from .outputs import EngineLoad, RequestOutput
from .prompts import Prompt
from .request import Resume, SamplingParams, Slo
from .step_model import StepTrace

log = logging.getLogger("fastgen.replica")


class ReaderTooSlow(QueueFullError):
    """A stream's reader left more outputs unsent than its bound: the request was cancelled (RESOURCE_EXHAUSTED)."""


class EngineDown(Exception):
    """The engine is beyond repair (its thread died, or its steps keep failing): the process exits so that its
    supervisor restarts it; requests end UNAVAILABLE, which the balancer retries or migrates elsewhere."""


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


# How a poisoned context shows itself in a message: torch's runtime and driver checks, and Triton's launcher (a launch
# after an earlier kernel's illegal address fails there before torch sees anything).
DEVICE_ERROR_MARKS = ("CUDA error", "CUDA driver error", "Triton Error [CUDA]")


def is_device_error(exc: BaseException | None) -> bool:
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


def completion_key(out: RequestOutput) -> str:
    """The request id for index 0, 'id#index' for the other completions of an n > 1 request."""
    return out.request_id if out.index == 0 else f"{out.request_id}#{out.index}"


def completions_to_send(params: SamplingParams, resume: tuple[Resume, ...] | None) -> int:
    """How many completions a request sends output for: all n, or those of a resumed request not finished yet."""
    return params.n if resume is None else sum(not r.finished for r in resume)


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


# ---- the commands: what callers put on the engine thread's inbox ---------------------------------------------------
@dataclass(frozen=True)
class Add:
    request_id: str  # the engine's key: made by the server, never the client's id (see ReplicaService._outputs)
    prompt: Prompt
    params: SamplingParams
    outputs: Outputs  # receives RequestOutput objects, or an Exception that ends the request
    resume: tuple[Resume, ...] | None = None  # per completion, output a replica that failed delivered
    slo: Slo | None = None  # the request's own service level
    label: str = ""  # the client's request_id, for logs
    lora: str = ""  # the LoRA adapter it runs under ("": the base model)


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class ChangeLora:
    """Serve adapter `name` from folder `path` from now on, or stop serving it (path None); the engine thread sets
    the result (the adapters served after it) or the exception."""

    name: str
    path: str | None
    result: asyncio.Future


@dataclass(frozen=True)
class Stop:
    """Wakes the engine thread so that it sees the loop is stopping; the commands behind it are never applied."""


Command = Add | Abort | ChangeLora | Stop


# ---- the handle ----------------------------------------------------------------------------------------------------
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
        self.trace = trace  # written by the engine thread only: every step's predicted and measured time
        self.metrics = metrics
        self.limits = limits
        self.loop = loop
        self.watchdog = watchdog
        # Published by the engine thread, read by the event loop.
        self.engine: Engine | None = None  # set once built
        self.load = EngineLoad()  # replaced whole after every step; read by GetStatus
        self.tokens_generated = 0
        self.prefill_rate = PrefillRate()
        self.fatal: BaseException | None = None  # why the engine is beyond repair (set once)
        self.progress_at = time.monotonic()  # when the engine thread last finished a step or found nothing to do
        self.cache_feed = CacheFeed()  # the prefix cache's changes, for WatchCache (event loop only)
        self.stopping = False  # set by stop(); the engine thread ends at its next look
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.ready: asyncio.Future = loop.create_future()  # the engine is built (or failed to build)
        self._in_flight = 0  # requests submitted and not finished (event loop only)
        self._worker = _EngineThread(self, build, on_fatal)
        self._thread = threading.Thread(target=self._worker.run, name="engine", daemon=True)

    async def start(self) -> None:
        """Builds the engine on its thread and starts stepping it there; raises what building raised."""
        self._thread.start()
        await self.ready

    def stop(self) -> None:
        self.stopping = True
        self.inbox.put(Stop())
        self._thread.join(timeout=10)
        if self.trace is not None and not self._thread.is_alive():
            self.trace.close()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def _streams(self) -> dict[str, _Stream]:
        """The engine thread's streams by the engine's request id; for tests, which read it while the thread runs."""
        return self._worker.streams

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
        self.inbox.put(Add(request_id, prompt, params, outputs, resume, slo, label, lora))
        if self.fatal is not None or not self._thread.is_alive():  # nothing would ever answer it
            outputs.put_nowait(EngineDown(f"the replica's engine failed ({self.fatal}): retry on another replica"))
        return outputs

    def done(self) -> None:
        """Called by the handler once its request ended, however it ended."""
        self._in_flight -= 1

    def abort(self, request_id: str) -> None:
        self.inbox.put(Abort(request_id))

    async def change_lora(self, name: str, path: str | None) -> list[str]:
        """Loads (path set) or unloads adapter `name` on the engine thread, between steps; returns the adapters served
        after it. Raises what the engine raised (ValueError and its kinds: what to change)."""
        if self.fatal is not None or not self._thread.is_alive():  # nothing would ever answer it
            raise EngineDown(f"the replica's engine failed ({self.fatal}): load the adapter on another replica")
        result = self.loop.create_future()
        self.inbox.put(ChangeLora(name, path, result))
        return await result


# ---- the state the engine thread owns ------------------------------------------------------------------------------
@dataclass
class _Stream:
    outputs: Outputs
    unfinished: int  # completions that have not sent their last output


def _put_all(deliveries: list[tuple[Outputs, RequestOutput]]) -> None:
    """On the event loop: a step's outputs into their streams' queues, in the step's order; one stream's failure (its
    overflow callback raising) is logged and keeps none of the others from theirs."""
    for outputs, out in deliveries:
        try:
            outputs.put_nowait(out)
        except Exception:  # noqa: BLE001 - the step's other streams must still get their outputs
            log.exception("delivering an output to request %s failed", outputs.key)


class _EngineThread:
    """The engine thread's side: the engine, the streams of its requests and its failed steps in a row, touched by
    this thread alone. It answers callers on their event loop (call_soon_threadsafe) and publishes to the handle's
    fields that say so; from the handle it reads only its settings, its inbox and whether it is stopping."""

    def __init__(self, handle: EngineLoop, build: Callable[[], Engine], on_fatal: Callable[[BaseException], None]):
        self.handle = handle
        self.loop = handle.loop
        self.inbox = handle.inbox
        self.engine: Engine  # built by run() before anything else here reads it
        self.streams: dict[str, _Stream] = {}
        self.failed_steps = 0  # consecutive
        self._build = build
        self._on_fatal = on_fatal

    def run(self) -> None:
        h = self.handle
        try:
            h.engine = self.engine = self._build()
            self.engine.prompts.max_token_bytes  # noqa: B018 - computed here, before handlers read it
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self.loop.call_soon_threadsafe(h.ready.set_exception, exc)
            return
        self._publish_load()
        self.loop.call_soon_threadsafe(h.ready.set_result, None)
        try:
            while not h.stopping and h.fatal is None:
                self._cycle()
        except BaseException as exc:  # noqa: BLE001 - outside a step the loop's own state may be half updated
            log.critical("the engine thread failed outside a step", exc_info=True)
            self._die(exc)

    def _cycle(self) -> None:
        h = self.handle
        h.progress_at = time.monotonic()
        self._apply(block=not self.engine.has_unfinished())
        if h.stopping or not self.engine.has_unfinished():
            return
        try:
            result = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step must not take the replica down
            self._step_failed(exc)
            return
        self.failed_steps = 0
        for out in result.outputs:
            h.tokens_generated += len(out.new_token_ids)
        self._deliver(result.outputs)
        if result.stats is not None:
            h.metrics.on_step(result.stats)
            stats = result.stats
            if h.trace is not None:
                h.trace.write(time.monotonic(), stats)
            h.prefill_rate.observe(stats.num_prefill_tokens, stats.num_decode_tokens, stats.step_s)
        self._publish_load()
        self._publish_cache_events()

    def _step_failed(self, exc: Exception) -> None:
        self.failed_steps += 1
        log.exception("engine step failed (%d in a row); failing the requests in flight", self.failed_steps)
        if is_device_error(exc):
            # Not the requests' fault: they end UNAVAILABLE (EngineDown), which the balancer retries or migrates to
            # another replica, where INTERNAL would reach their clients as errors.
            self._die(exc)
            return
        self._fail_all(RuntimeError(f"engine step failed: {exc}"))
        if self.failed_steps >= self.handle.watchdog.max_failed_steps:
            self._die(RuntimeError(f"{self.failed_steps} engine steps failed in a row, the last with: {exc}"))

    def _die(self, exc: BaseException) -> None:
        """The engine is beyond repair: fails whatever is in flight or queued, and hands `exc` to on_fatal."""
        self.handle.fatal = exc
        log.critical("the engine is beyond repair (%s: %s): the replica exits", type(exc).__name__, exc)
        down = EngineDown(f"the replica's engine failed ({type(exc).__name__}: {exc}): retry on another replica")
        with contextlib.suppress(Exception):
            self._fail_all(down)
        while True:  # requests submitted since, which no step will ever take
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Add):
                self.loop.call_soon_threadsafe(command.outputs.put_nowait, down)
            elif isinstance(command, ChangeLora):
                self.loop.call_soon_threadsafe(command.result.set_exception, down)
        self.loop.call_soon_threadsafe(self._on_fatal, exc)

    def _apply(self, block: bool) -> None:
        try:
            command = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while not isinstance(command, Stop):
            if isinstance(command, Add):
                self._add(command)
            elif isinstance(command, ChangeLora):
                self._change_lora(command)
            elif command.request_id in self.streams:
                self._deliver(self.engine.abort(command.request_id))
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
        self._publish_load()

    def _change_lora(self, command: ChangeLora) -> None:
        try:
            if command.path is None:
                self.engine.remove_lora(command.name)
            else:
                self.engine.add_lora(command.name, command.path)
        except Exception as exc:  # noqa: BLE001 - the caller answers it; the engine is unchanged
            self.loop.call_soon_threadsafe(command.result.set_exception, exc)
            return
        self._publish_load()  # GetStatus lists the adapters at once
        loras = self.engine.loras
        assert loras is not None, "add_lora and remove_lora raise when LoRA is off"
        self.loop.call_soon_threadsafe(command.result.set_result, loras.names())

    def _add(self, command: Add) -> None:
        limits, metrics = self.handle.limits, self.handle.metrics
        try:
            load = self.engine.load()
            if load.queued >= limits.max_requests:
                raise QueueFullError(f"queue full ({load.queued} requests waiting): back off and retry")
            if load.queued_prompt_tokens >= limits.max_prompt_tokens:
                raise QueueFullError(
                    f"queue full (over {limits.max_prompt_tokens} prompt tokens waiting): back off and retry"
                )
            if load.refuse_for_s is not None:
                metrics.on_shed()
                raise QueueFullError(
                    f"overloaded: even decoding alone would break the token-rate floors; retry in "
                    f"{load.refuse_for_s:.1f} s",
                    round(load.refuse_for_s * 1000),
                )
            extra: dict[str, Any] = {} if command.resume is None else {"resume": command.resume}
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
        self.streams[command.request_id] = _Stream(command.outputs, completions_to_send(command.params, command.resume))

    def _deliver(self, outs: Iterable[RequestOutput]) -> None:
        """Hands a step's outputs to their streams in one callback on the event loop: each call_soon_threadsafe
        writes to the loop's wake-up socket, and a call per output (one per stream per step) took ~4% of the
        replica's samples at 8 streams, on cores the forward shares."""
        ready = [delivery for out in outs if (delivery := self._delivery(out)) is not None]
        if ready:
            self.loop.call_soon_threadsafe(_put_all, ready)

    def _delivery(self, out: RequestOutput) -> tuple[Outputs, RequestOutput] | None:
        # The metrics time each completion's tokens as a stream of its own.
        self.handle.metrics.on_output(
            out if out.index == 0 else dataclasses.replace(out, request_id=completion_key(out))
        )
        stream = self.streams.get(out.request_id)
        if stream is None:
            return None
        if out.finished:
            stream.unfinished -= 1
            if stream.unfinished == 0:
                del self.streams[out.request_id]
        else:
            # A stream sends deltas: the whole text, ids and logprobs so far, copied on every step and queued behind
            # a slow reader, would hold O(length^2). The last output keeps them, for Generate's answer.
            out = dataclasses.replace(out, text="", token_ids=[], logprobs=[])
        return stream.outputs, out

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.streams):
            stream = self.streams.pop(request_id)
            with contextlib.suppress(Exception):  # a broken engine must not keep the others from being told
                self.engine.abort(request_id)
            self.loop.call_soon_threadsafe(stream.outputs.put_nowait, exc)

    def _publish_cache_events(self) -> None:
        changes = self.engine.cache_events()
        if changes.snapshot is not None:
            self.loop.call_soon_threadsafe(self.handle.cache_feed.publish, [], changes.snapshot)
        elif changes.events:
            self.loop.call_soon_threadsafe(self.handle.cache_feed.publish, changes.events)

    def _publish_load(self) -> None:
        self.handle.load = self.engine.load()
