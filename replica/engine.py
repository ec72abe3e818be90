"""The engine: requests in, one forward pass per step, new tokens and text out.

One thread owns an engine. `add_request` and `abort` between steps; `step()` runs
schedule -> run -> sample -> emit and returns what changed plus one stats record."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from ..kernels import select_kernels
from . import weights
from .batch import Batch
from .batch_broadcast import BatchBroadcast
from .block_allocator import BlockAllocator
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache import allocate_kv_cache, bytes_per_block
from .model_runner import ModelRunner
from .models.llama import LlamaModel, ModelConfig
from .outputs import RequestOutput, RequestTimings, StepResult, StepStats
from .parallel import TPGroup
from .request import FinishReason, SamplingParams, Sequence
from .sampler import SamplingRow, sample
from .scheduler import Scheduler

CHAT_ROLES = ("system", "user", "assistant", "tool")
Prompt = str | Seq[int] | Seq[dict]


@dataclass(eq=False)
class _Request:
    request_id: str
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
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
        self.eos_token_ids = eos_token_ids
        self.default_max_new_tokens = default_max_new_tokens
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._next_seq_id = 0

    # ---- requests ---------------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def encode(self, prompt: Prompt) -> list[int]:
        """Text, token ids or chat messages ({role, content} dicts) -> token ids; ValueError on bad input."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: send some text, token ids or chat messages")
            return self.tokenizer.encode(prompt)
        items = list(prompt)
        if not items:
            raise ValueError("prompt is empty: send some text, token ids or chat messages")
        if all(isinstance(m, dict) for m in items):
            return self._render_chat(items)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise ValueError(
                "prompt must be a string, a list of token ids (ints) or a list of {role, content} messages"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in items if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary: ids must be in [0, {vocab})")
        return items

    def _render_chat(self, messages: list[dict]) -> list[int]:
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"message {i} has unknown role {m.get('role')!r}: use one of {', '.join(CHAT_ROLES)}")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} needs a string 'content'")
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template: send plain text or token ids instead of messages")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams = SamplingParams()) -> int:
        """Queues a request; returns its prompt length. Raises ValueError (what to change) for bad input."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use: choose a unique id")
        params.validate()
        prompt_ids = self.encode(prompt)
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
        generator = None
        if params.temperature > 0:
            generator = torch.Generator().manual_seed(
                params.seed if params.seed is not None else random.getrandbits(63)
            )
        req = _Request(
            request_id,
            seq,
            params,
            generator,
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

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        start = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch:
            return StepResult()
        forward_start = time.monotonic()
        logits = self.runner.run(batch)
        to_sample = [self._by_seq[s.seq_id] for s in batch.seqs if s.sample]
        tokens = sample(logits, [self._sampling_row(r) for r in to_sample])
        now = time.monotonic()
        for s in batch.seqs:  # queue time ends when a request's first forward pass starts
            timings = self._by_seq[s.seq_id].timings
            timings.first_scheduled = timings.first_scheduled or forward_start
        outputs = [self._emit(req, token, now) for req, token in zip(to_sample, tokens)]
        return StepResult(outputs, self._stats(batch, now - forward_start, start))

    def _sampling_row(self, req: _Request) -> SamplingRow:
        p = req.params
        banned = self.eos_token_ids if req.seq.num_generated < p.min_new_tokens and not p.ignore_eos else []
        return SamplingRow(p.temperature, p.top_p, p.top_k, req.generator, banned)

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


def build_engine(config: EngineConfig, tp: TPGroup = TPGroup(), broadcast: BatchBroadcast | None = None) -> Engine:
    """Loads the model and tokenizer, sizes the KV pool and wires up the engine. With tensor parallelism this is
    rank 0's part: it sends every batch through `broadcast` to the other ranks (which run `build_runner` only)."""
    folder = weights.resolve_model(config.model)
    hf_config = weights.load_hf_config(folder)
    model_config = ModelConfig.from_hf(hf_config)
    tokenizer = weights.load_tokenizer(folder)

    max_len = config.max_model_len or model_config.max_position_embeddings
    if model_config.sliding_window:
        max_len = min(max_len, model_config.sliding_window)  # attention here is full, so stay inside the window
    if max_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's {model_config.max_position_embeddings} positions"
        )
    sched_config = dataclasses.replace(config.scheduler, max_model_len=max_len)

    runner, num_blocks = build_runner(config, tp, broadcast)
    scheduler = Scheduler(sched_config, BlockAllocator(num_blocks, config.cache.block_size))
    eos = weights.eos_token_ids(folder, hf_config, tokenizer)
    return Engine(runner, scheduler, tokenizer, model_config, eos, config.default_max_new_tokens)


def build_runner(config: EngineConfig, tp: TPGroup = TPGroup(), broadcast: BatchBroadcast | None = None):
    """This rank's shards of the weights and its KV cache (for its KV heads), in a model runner; returns the runner
    and the number of KV blocks, the same on every rank."""
    device = torch.device(config.device)
    dtype = weights.parse_dtype(config.dtype, device)
    folder = weights.resolve_model(config.model)
    model_config = ModelConfig.from_hf(weights.load_hf_config(folder))
    kernels = select_kernels(config.kernels, device)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(model_config, tp, kernels)
    finally:
        torch.set_default_dtype(previous)
    # Tensors are memory-mapped: each rank reads only the pages of its own shards.
    model.load_weights(weights.iter_safetensors(folder, progress=config.progress and tp.rank == 0))
    model.eval()
    model.pack_weights()

    attn = model.layers[0].self_attn
    block_size = config.cache.block_size
    # The memory budget is per rank; each block holds only this rank's KV heads.
    per_block = bytes_per_block(model_config.num_layers, block_size, attn.kv_heads, attn.head_dim, dtype)
    num_blocks = tp.agree_min(config.cache.num_blocks or max(1, config.cache.memory_bytes // per_block), device)
    kv = allocate_kv_cache(model_config.num_layers, num_blocks, block_size, attn.kv_heads, attn.head_dim, dtype, device)
    return ModelRunner(model, kv, block_size, device, broadcast), num_blocks
