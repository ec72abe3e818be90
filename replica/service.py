"""The replica's gRPC service. One thread owns the engine and steps it; gRPC handlers only enqueue work and
await their request's outputs (grpc.aio)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ..proto import fastgen_pb2 as pb
from ..proto import fastgen_pb2_grpc
from ..server.errors import QueueFullError, status_for
from .engine import Engine
from .outputs import EngineLoad, RequestOutput
from .prompts import Prompt
from .request import FinishReason, SamplingParams

log = logging.getLogger("fastgen.replica")

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


# ---- commands from handlers to the engine thread --------------------------------------------------------
@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    outputs: asyncio.Queue  # receives RequestOutput objects, or an Exception that ends the request


@dataclass
class _Abort:
    request_id: str


@dataclass(frozen=True)
class QueueLimits:
    max_requests: int = 256  # requests waiting for their first forward pass
    max_prompt_tokens: int = 262144  # prompt tokens of those requests


class EngineLoop:
    """Owns the engine on a thread of its own, from building it to its last step; asyncio callers talk to it through
    `submit` and `abort`.

    The same thread builds, warms up and steps the engine because OpenMP (torch's and the CPU kernels') keeps a pool
    of worker threads per thread that starts parallel work: a model built on one thread and run on another leaves
    two pools, libgomp then counts more threads than cores and stops its workers spinning between parallel regions,
    and every region pays a wake-up instead of finding its workers spinning (benchmarks/RESULTS.md has the cost)."""

    def __init__(
        self, build: Callable[[], Engine], metrics, limits: QueueLimits, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.engine: Engine | None = None  # set on the engine thread by build()
        self.metrics = metrics
        self.limits = limits
        self.loop = loop
        self.load = EngineLoad()  # replaced whole by the engine thread after every step; read by GetStatus
        self.tokens_generated = 0  # written by the engine thread only
        self._build = build
        self._ready: asyncio.Future = loop.create_future()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}  # engine thread only
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

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams) -> asyncio.Queue:
        outputs: asyncio.Queue = asyncio.Queue()
        self._in_flight += 1
        self._inbox.put(_Add(request_id, prompt, params, outputs))
        return outputs

    def done(self) -> None:
        """Called by the handler once its request ended, however it ended."""
        self._in_flight -= 1

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    # ---- engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self.loop.call_soon_threadsafe(self._ready.set_exception, exc)
            return
        self._publish_load()
        self.loop.call_soon_threadsafe(self._ready.set_result, None)
        while not self._stop:
            self._apply(block=not self.engine.has_unfinished())
            if self._stop or not self.engine.has_unfinished():
                continue
            try:
                result = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a failed step must not take the replica down
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            for out in result.outputs:
                self.tokens_generated += len(out.new_token_ids)
                self._deliver(out)
            if result.stats is not None:
                self.metrics.on_step(result.stats)
            self._publish_load()

    def _apply(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            if isinstance(command, _Add):
                self._add(command)
            elif command.request_id in self._streams:
                out = self.engine.abort(command.request_id)
                if out is not None:
                    self._deliver(out)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                command = None
        self._publish_load()

    def _add(self, command: _Add) -> None:
        try:
            load = self.engine.load()
            if load.queued >= self.limits.max_requests:
                raise QueueFullError(f"queue full ({load.queued} requests waiting): back off and retry")
            if load.queued_prompt_tokens >= self.limits.max_prompt_tokens:
                raise QueueFullError(
                    f"queue full (over {self.limits.max_prompt_tokens} prompt tokens waiting): back off and retry"
                )
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except (ValueError, QueueFullError) as exc:
            self.loop.call_soon_threadsafe(command.outputs.put_nowait, exc)
            return
        self._streams[command.request_id] = command.outputs

    def _deliver(self, out: RequestOutput) -> None:
        self.metrics.on_output(out)
        stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
        if stream is not None:
            self.loop.call_soon_threadsafe(stream.put_nowait, out)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            stream = self._streams.pop(request_id)
            self.loop.call_soon_threadsafe(stream.put_nowait, RuntimeError(f"engine step failed: {exc}"))

    def _publish_load(self) -> None:
        self.load = self.engine.load()


# ---- proto <-> engine --------------------------------------------------------------------------------------
def prompt_from_proto(request: pb.GenerateRequest) -> Prompt:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "messages":
        if not request.messages.messages:
            raise ValueError("messages is empty: send at least one chat message")
        return [{"role": m.role, "content": m.content} for m in request.messages.messages]
    raise ValueError("no prompt: set one of text, token_ids or messages")


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p if p.top_p != 0 else 1.0,  # proto3 zero means "off"
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
    )


class ReplicaService(fastgen_pb2_grpc.GenerationServicer):
    def __init__(self, replica_id: str, model_name: str, metrics) -> None:
        self.engine_loop: EngineLoop | None = None  # set once the model is loaded and warm
        self.replica_id = replica_id
        self.model_name = model_name
        self.metrics = metrics
        self.draining = False

    async def _outputs(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, method: str):
        """Admits the request and yields its outputs; aborts it if the caller goes away first."""
        if self.engine_loop is None:
            await self._fail(context, method, grpc.StatusCode.UNAVAILABLE, "replica is still loading: retry shortly")
        if self.draining:
            await self._fail(context, method, grpc.StatusCode.UNAVAILABLE, "replica is draining: retry elsewhere")
        try:
            prompt = prompt_from_proto(request)
            params = params_from_proto(request.params)
        except ValueError as exc:
            await self._fail(context, method, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = request.request_id or uuid.uuid4().hex
        outputs = self.engine_loop.submit(request_id, prompt, params)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, Exception):
                    finished = True
                    await self._fail(context, method, status_for(out), str(out))
                finished = out.finished
                yield request_id, out
        finally:
            self.engine_loop.done()
            if not finished:  # cancelled, deadline passed, or the client went away
                self.engine_loop.abort(request_id)
                self.metrics.on_rpc(method, grpc.StatusCode.CANCELLED)

    async def _fail(self, context, method: str, code: grpc.StatusCode, message: str):
        self.metrics.on_rpc(method, code)
        await context.abort(code, message)

    async def Generate(self, request, context):
        async for request_id, out in self._outputs(request, context, "Generate"):
            if out.finished:
                self.metrics.on_rpc("Generate", grpc.StatusCode.OK)
                return pb.GenerateResponse(
                    request_id=request_id,
                    text=out.text,
                    token_ids=out.token_ids,
                    finish_reason=FINISH_REASONS[out.finish_reason],
                    prompt_tokens=out.prompt_tokens,
                    generated_tokens=out.generated_tokens,
                    replica=self.replica_id,
                )

    async def GenerateStream(self, request, context):
        async for request_id, out in self._outputs(request, context, "GenerateStream"):
            chunk = pb.GenerateChunk(
                request_id=request_id, text=out.new_text, token_ids=out.new_token_ids, replica=self.replica_id
            )
            if out.finished:
                chunk.finish_reason = FINISH_REASONS[out.finish_reason]
                chunk.prompt_tokens = out.prompt_tokens
                chunk.generated_tokens = out.generated_tokens
                self.metrics.on_rpc("GenerateStream", grpc.StatusCode.OK)
            yield chunk

    async def GetStatus(self, request, context):
        loading = self.engine_loop is None
        load = EngineLoad() if loading else self.engine_loop.load
        status = pb.ReplicaStatus(
            replica=self.replica_id,
            health=pb.HEALTH_NOT_SERVING if self.draining or loading else pb.HEALTH_SERVING,
            queued_requests=load.queued,
            running_requests=load.running,
            kv_blocks_used=load.kv_blocks_used,
            kv_blocks_total=load.kv_blocks_total,
            tokens_generated=0 if loading else self.engine_loop.tokens_generated,
            pending_prompt_tokens=load.pending_prompt_tokens,
            in_flight=0 if loading else self.engine_loop.in_flight,
        )
        return pb.StatusResponse(model=self.model_name, role="replica", replicas=[status])
