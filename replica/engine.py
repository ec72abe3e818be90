"""The engine: requests in, one forward pass per step, new tokens and text out.

One thread owns an engine. `add_request` and `abort` between steps; `step()` runs
schedule -> run -> sample -> emit and returns what changed plus one stats record."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from .batch import Batch
from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner
from .models.llama import ModelConfig
from .outputs import EngineLoad, RequestOutput, RequestTimings, StepResult, StepStats
from .prompts import Prompt, PromptEncoder
from .request import FinishReason, SamplingParams, Sequence
from .sampler import SamplingRow, sample
from .scheduler import Scheduler


@dataclass(eq=False)
class _Request:
    request_id: str
    seq: Sequence
    params: SamplingParams
    seed: int  # the request's, or one drawn at admission: every stream can be replayed
    detok: IncrementalDetokenizer
    timings: RequestTimings
    text: str = ""
    emitted: int = 0  # characters of text already sent
    emitted_tokens: int = 0


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer,
        model_config: ModelConfig,
        eos_token_ids: list[int],
        default_max_new_tokens: int = 256,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.prompts = PromptEncoder(tokenizer, model_config.vocab_size)
        self.eos_token_ids = eos_token_ids
        self.default_max_new_tokens = default_max_new_tokens
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._next_seq_id = 0

    # ---- requests ---------------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams = SamplingParams()) -> int:
        """Queues a request; returns its prompt length. Raises ValueError (what to change) for bad input."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use: choose a unique id")
        params.validate()
        prompt_ids = self.prompts.encode(prompt)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_model_len}: shorten the prompt"
            )
        max_new = params.max_new_tokens or min(self.default_max_new_tokens, room)
        if params.min_new_tokens > max_new:
            raise ValueError(
                f"min_new_tokens ({params.min_new_tokens}) exceeds the {max_new} tokens this request may generate"
            )
        seq = Sequence(self._next_seq_id, list(prompt_ids), len(prompt_ids), max_new)
        self.scheduler.add(seq)  # refuses what can never fit
        self._next_seq_id += 1
        # From the OS, not the random module: replicas started alike must not draw alike for unseeded requests.
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = _Request(
            request_id,
            seq,
            params,
            seed,
            IncrementalDetokenizer(self.tokenizer, prompt_ids),
            RequestTimings(arrival=time.monotonic()),
        )
        self._requests[request_id] = req
        self._by_seq[seq.seq_id] = req
        return len(prompt_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels a request and frees its KV blocks at once; None if it is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, FinishReason.CANCELLED, [], time.monotonic())

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def load(self) -> EngineLoad:
        """What is queued and running now, and how full the KV pool is."""
        s = self.scheduler
        return EngineLoad(
            queued=len(s.waiting),
            running=len(s.running),
            kv_blocks_used=s.allocator.num_used,
            kv_blocks_total=s.allocator.num_blocks,
            queued_prompt_tokens=sum(q.num_uncomputed for q in s.waiting),
            pending_prompt_tokens=sum(max(0, q.num_prompt_tokens - q.num_computed) for q in (*s.waiting, *s.running)),
        )

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        start = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch:
            return StepResult()
        forward_start = time.monotonic()
        logits = self.runner.run(batch)
        to_sample = [self._by_seq[s.seq_id] for s in batch.seqs if s.sample]
        tokens = sample(logits, [self._sampling_row(r) for r in to_sample], self.runner.kernels.argmax)
        now = time.monotonic()
        for s in batch.seqs:  # queue time ends when a request's first forward pass starts
            timings = self._by_seq[s.seq_id].timings
            timings.first_scheduled = timings.first_scheduled or forward_start
        outputs = [self._emit(req, token, now) for req, token in zip(to_sample, tokens)]
        return StepResult(outputs, self._stats(batch, now - forward_start, start))

    def _sampling_row(self, req: _Request) -> SamplingRow:
        p = req.params
        banned = self.eos_token_ids if req.seq.num_generated < p.min_new_tokens and not p.ignore_eos else []
        # The token being sampled goes at index num_tokens: its draws are keyed by (seed, that position).
        return SamplingRow(p.temperature, p.top_p, p.top_k, req.seed, req.seq.num_tokens, banned)

    def _emit(self, req: _Request, token: int, now: float) -> RequestOutput:
        seq, params = req.seq, req.params
        seq.token_ids.append(token)
        req.timings.first_token = req.timings.first_token or now
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        at_length = seq.num_generated >= seq.max_new_tokens
        previous = len(req.text)
        if not is_eos:
            req.text += req.detok.add(token)
        if is_eos or at_length:
            req.text += req.detok.flush()
        reason = FinishReason.EOS if is_eos else FinishReason.LENGTH if at_length else None
        if params.stop and seq.num_generated >= params.min_new_tokens:
            cut = _find_stop(req.text, params.stop, previous)
            if cut is not None:
                req.text, reason = req.text[:cut], FinishReason.STOP
        if reason is not None:
            return self._finish(req, reason, [token], now)
        # Hold back text that could still turn out to start a stop string.
        hold = max((len(s) for s in params.stop), default=1) - 1
        return self._output(req, [token], max(req.emitted, len(req.text) - hold), None, now)

    def _finish(self, req: _Request, reason: FinishReason, new_tokens: list[int], now: float) -> RequestOutput:
        self.scheduler.finish(req.seq)
        del self._requests[req.request_id]
        del self._by_seq[req.seq.seq_id]
        req.timings.finished = now
        return self._output(req, new_tokens, len(req.text), reason, now)

    def _output(self, req, new_tokens, visible: int, reason, now) -> RequestOutput:
        new_text, req.emitted = req.text[req.emitted : visible], visible
        seq = req.seq
        return RequestOutput(
            request_id=req.request_id,
            new_text=new_text,
            new_token_ids=new_tokens,
            text=req.text[:visible],
            token_ids=seq.token_ids[seq.num_prompt_tokens :],
            prompt_tokens=seq.num_prompt_tokens,
            finish_reason=reason,
            timings=req.timings,
            time=now,
            num_preemptions=seq.num_preemptions,
        )

    def _stats(self, batch: Batch, forward_s: float, start: float) -> StepStats:
        alloc = self.scheduler.allocator
        return StepStats(
            num_seqs=len(batch.seqs),
            num_decode_tokens=batch.num_decodes,
            num_prefill_tokens=batch.num_prefill_tokens,
            token_budget=self.scheduler.config.max_batch_tokens,
            num_preempted=len(batch.preempted),
            forward_s=forward_s,
            step_s=time.monotonic() - start,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_used=alloc.num_used,
            kv_blocks_total=alloc.num_blocks,
        )


def _find_stop(text: str, stops: tuple[str, ...], previous: int) -> int | None:
    """Earliest index where a stop string starts, looking only where new text could have completed one."""
    best = None
    for s in stops:
        i = text.find(s, max(0, previous - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
