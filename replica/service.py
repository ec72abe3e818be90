"""The replica's gRPC service. gRPC handlers only convert and check requests, enqueue them on the engine thread
(engine_loop.EngineLoop) and await their outputs (grpc.aio); the service asks the engine what it reports and never
steps it."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from pathlib import Path
from typing import Any, NoReturn

import grpc

from ..proto import fastgen_pb2 as pb
from ..proto import fastgen_pb2_grpc
from ..server.errors import RETRY_AFTER_MS, retry_hint_ms, status_for, trailing_metadata
from ..server.grpc_server import set_serving
from .cache_feed import FellBehind
from .engine_loop import EngineDown, EngineLoop, completions_to_send
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

log = logging.getLogger("fastgen.replica")

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


async def watch_engine(service: ReplicaService, health, interval_s: float = 1.0) -> None:
    """Keeps grpc health in step with the engine (EngineLoop.healthy): NOT_SERVING while it is stalled or gone, so
    the balancer sends it nothing new and moves its streams; SERVING again once its steps complete. Cancelled
    before draining, which owns health from then on."""
    engine_loop = service.engine_loop
    assert engine_loop is not None, "started once the engine loop is set"
    serving = True
    while True:
        await asyncio.sleep(interval_s)
        healthy = engine_loop.healthy()
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
    message: dict[str, Any] = {"role": m.role, "content": m.content}
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


def finish_reason_to_proto(out: RequestOutput) -> pb.FinishReason:
    assert out.finish_reason is not None, "asked of finished outputs only"
    return FINISH_REASONS[out.finish_reason]


def response_from(request_id: str, outs: list[RequestOutput], replica: str) -> pb.GenerateResponse:
    """The answer to Generate from the final output of every completion, in index order: the top-level fields are
    completion 0's, and choices lists all of them when there are several."""
    first = outs[0]
    resp = pb.GenerateResponse(
        request_id=request_id,
        text=first.text,
        token_ids=first.token_ids,
        finish_reason=finish_reason_to_proto(first),
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
                finish_reason=finish_reason_to_proto(o),
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
        chunk.finish_reason = finish_reason_to_proto(out)
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
            assert engine is not None, "the engine loop is set once started, which it is once the engine is built"
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

    async def _fail(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        code: grpc.StatusCode,
        message: str,
        retry_ms: int = RETRY_AFTER_MS,
    ) -> NoReturn:
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
        engine_loop = self.engine_loop
        load = EngineLoad() if engine_loop is None else engine_loop.load
        status = pb.ReplicaStatus(
            replica=self.replica_id,
            health=pb.HEALTH_SERVING if self.serving else pb.HEALTH_NOT_SERVING,
            queued_requests=load.queued,
            running_requests=load.running,
            kv_blocks_used=load.kv_blocks_used,
            kv_blocks_total=load.kv_blocks_total,
            tokens_generated=0 if engine_loop is None else engine_loop.tokens_generated,
            pending_prompt_tokens=load.pending_prompt_tokens,
            in_flight=0 if engine_loop is None else engine_loop.in_flight,
            lora_adapters=load.loras,
            resident_lora_adapters=load.resident_loras,
        )
        if engine_loop is not None:
            engine = engine_loop.engine
            assert engine is not None, "the engine loop is set once started, which it is once the engine is built"
            pool = engine.cache_info()
            status.kv_block_size = pool.block_size
            status.prefix_caching = pool.prefix_caching
            status.prefill_tokens_per_second = engine_loop.prefill_rate.tokens_per_second
            if self._tokenizer_path is None:  # looked up once: it is on every status poll
                self._tokenizer_path = tokenizer_path(engine.tokenizer)
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
        except EngineDown as exc:
            await self._fail(context, method, grpc.StatusCode.UNAVAILABLE, str(exc))
        self.metrics.on_rpc(method, grpc.StatusCode.OK)
        return pb.LoraAdaptersResponse(lora_adapters=names)

    async def WatchCache(self, request, context: grpc.aio.ServicerContext):
        if self.engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica is still loading: retry shortly")
        engine = self.engine_loop.engine
        assert engine is not None, "the engine loop is set once started, which it is once the engine is built"
        if not engine.cache_info().prefix_caching:
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
