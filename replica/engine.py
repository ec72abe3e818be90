"""The engine: requests in, one forward pass per step, new tokens and text out.

One thread owns an engine. `add_request` and `abort` between steps; `step()` runs
schedule -> run -> sample -> emit and returns what changed plus one stats record.

A request for n > 1 completions is one sequence until its prompt is prefilled; the step that computes the prompt's
last chunk draws the n first tokens from that one logits row, each completion with its own seed, and forks n - 1
sequences that share the prompt's full KV blocks (and copy its partly filled last one). From there each completion
runs, stops and finishes on its own.

A constrained request (structured output) has a grammar matcher per completion (constraints.py): the step asks it for
the tokens allowed now (the sampler masks the rest) and it accepts each emitted token. Unconstrained steps skip
all of it.

With speculative decoding (speculative.py) a decode may come with proposed tokens, verified in the same pass: the
sampler draws every position of it as if the proposals before it were accepted, and the proposals are accepted while
they equal those draws (docs/speculative.md says why that is exact for greedy and the rejection-sampling rule
otherwise); the first draw that differs, or the one after the last proposal, is emitted after them."""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass, field

import torch

from ..prefix_hash import adapter_salt
from .batch import Batch
from .config import SpeculativeConfig
from .constraints import Constraints, Matcher
from .detokenizer import IncrementalDetokenizer
from .draft_model import DraftProposer
from .lora_pool import AdapterInUse, LoraPool
from .model_runner import ModelRunner
from .models.llama import ModelConfig
from .ngram import NgramProposer
from .outputs import EngineLoad, RequestOutput, RequestTimings, StepResult, StepStats, TokenLogprob, TopLogprob
from .prompts import Prompt, PromptEncoder
from .request import FinishReason, Resume, SamplingParams, Sequence, Slo
from .sampler import SamplingRow, sample
from .scheduler import Scheduler
from .speculative import Speculation

_MASK64 = (1 << 64) - 1


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded `seed`: the request's own for index 0, so that n = 1 is
    unchanged, else splitmix64 of (seed, index) cut to 63 bits. A request for one completion with this seed gives
    the same tokens as completion `index` of the n."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


@dataclass(eq=False)
class _Request:
    request_id: str
    params: SamplingParams
    seed: int  # the request's, or one drawn at admission: every stream can be replayed
    prompt_text: str  # with echo; else ""
    banned: list[int]  # tokens that may not end the request before min_new_tokens
    unfinished: int  # completions not finished, those not forked yet included
    forked: bool  # the n - 1 other completions exist (always, for n = 1)
    lora: str = ""  # the LoRA adapter it runs under ("": the base model)
    grammar: object = None  # the compiled constraint (xgrammar's CompiledGrammar); None: unconstrained
    prompt_logprobs: list[TokenLogprob] | None = None  # with prompt_logprobs: one per prompt token from the second
    completions: list[_Completion] = field(default_factory=list)  # index order


@dataclass(eq=False)
class _Completion:
    req: _Request
    index: int
    seq: Sequence
    seed: int
    detok: IncrementalDetokenizer
    timings: RequestTimings
    output_ids: list[int] = field(default_factory=list)  # generated tokens (seq.token_ids' tail), for penalties
    logprobs: list[TokenLogprob] | None = None  # a list when asked for
    text: str = ""
    emitted: int = 0  # characters of text already sent
    finished: bool = False
    matcher: Matcher | None = None  # where it stands in its request's grammar; None: unconstrained


@dataclass(frozen=True)
class CacheInfo:
    """The paged KV pool and its prefix cache, as the replica reports them (GetStatus, WatchCache)."""

    block_size: int  # tokens per KV block: what a balancer splits prompts by to hash them
    blocks_total: int
    blocks_free: int  # never cached, or cached and held by no sequence (evictable)
    blocks_cached: int  # holding a prefix's KV, held or evictable; 0 without prefix caching
    prefix_caching: bool  # off: nothing is kept by content, so there are no changes to watch

    @property
    def blocks_used(self) -> int:
        return self.blocks_total - self.blocks_free


@dataclass(frozen=True)
class CacheChanges:
    """The prefix cache's changes since the engine was last asked (Engine.cache_events), for WatchCache: `events`
    as (stored, hash), oldest first (stored False: evicted); or, where the record overflowed, `snapshot`, every
    cached hash, for the reader to start again from."""

    events: list[tuple[bool, bytes]] = field(default_factory=list)
    snapshot: list[bytes] | None = None


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer,
        model_config: ModelConfig,
        eos_token_ids: list[int],
        default_max_new_tokens: int = 256,
        speculative_config: SpeculativeConfig | None = None,
        draft: ModelRunner | None = None,
    ) -> None:
        """draft: the draft model's runner, for speculative_config method draft_model."""
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.prompts = PromptEncoder(tokenizer, model_config.vocab_size)
        self.eos_token_ids = eos_token_ids
        self.default_max_new_tokens = default_max_new_tokens
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Completion] = {}
        self._next_seq_id = 0
        self._token_texts: dict[int, str] = {}  # token id -> the token decoded alone (for logprobs)
        self.constraints = Constraints(tokenizer, model_config.vocab_size, eos_token_ids)
        self._scoring = 0  # unfinished requests that ask for prompt logprobs: 0 skips looking for them in a step
        self._lora_requests: dict[str, int] = {}  # unfinished requests per LoRA adapter (the base's under "")
        if speculative_config is not None:
            config = speculative_config
            ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "draft_model":
                assert draft is not None, "build_engine builds a draft runner for method draft_model"
                self._proposer = DraftProposer(draft)
            else:
                self._proposer = ngram
            scheduler.speculation = Speculation(config, self._propose)

    # ---- requests ---------------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams = SamplingParams(),
        resume: tuple[Resume, ...] | None = None,
        slo: Slo | None = None,
        lora: str = "",
    ) -> int:
        """Queues a request; returns its prompt length. Raises ValueError (what to change) for bad input. With
        `resume` (one per completion, in index order), the request continues output another replica delivered
        (stream migration); `slo` is its own service level (the slo scheduler plans for it; the others ignore it);
        `lora` names the LoRA adapter it runs under ("": the base model; an unknown name raises UnknownAdapter)."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use: choose a unique id")
        params.validate(self.model_config.vocab_size)
        if lora:
            self._check_lora(lora)
        if slo is not None:
            slo.validate()
        prompt_ids, prompt_text = self.prompts.encode_with_text(prompt, want_text=params.echo)
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
        if resume is not None:
            self._check_resume(resume, params, max_new)
        self.scheduler.check_fits(len(prompt_ids), max_new)  # refuses what can never fit, before anything is queued
        # From the OS, not the random module: replicas started alike must not draw alike for unseeded requests.
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        banned = ([] if params.ignore_eos else list(self.eos_token_ids)) + list(params.stop_token_ids)
        text = prompt_text if params.echo else ""
        # A new request starts on one sequence (with n > 1 it forks the others once its prompt is in); a resumed one
        # has every completion already, each continuing on a sequence of its own.
        resumes = resume or (Resume(()),)
        unfinished = params.n if resume is None else sum(not r.finished for r in resume)
        # Compiled already when the service awaited it; else compiled here. Resumed tokens the grammar refuses are
        # refused before anything is registered.
        grammar = self.constraints.grammar(params.constraint) if params.constraint is not None else None
        for delivered in resumes if grammar is not None and resume is not None else ():
            self.constraints.matcher(grammar, delivered.token_ids)
        req = _Request(request_id, params, seed, text, banned, unfinished, forked=resume is not None or params.n == 1)
        req.lora = lora
        self._lora_requests[lora] = self._lora_requests.get(lora, 0) + 1
        req.grammar = grammar
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = []
            self._scoring += 1
        self._requests[request_id] = req
        arrival = time.monotonic()
        for index, delivered in enumerate(resumes):
            if delivered.finished:
                continue
            # Resumed tokens sit after the prompt as generated ones: the scheduler recomputes them as it would after a
            # preemption, and the next draw is keyed by the same position as on the replica that failed.
            seq = Sequence(
                self._next_seq_id,
                list(prompt_ids) + list(delivered.token_ids),
                len(prompt_ids),
                max_new,
                # Prompt logprobs need every prompt position computed: a salt of its own keeps cached blocks away.
                cache_salt=adapter_salt(
                    params.cache_salt if req.prompt_logprobs is None else f"{params.cache_salt}\0{request_id}", lora
                ),
                slo=slo,
                resumed=resume is not None,
                lora=lora,
            )
            self._next_seq_id += 1
            self.scheduler.add(seq)
            c = self._start(req, seq, RequestTimings(arrival=arrival), index)
            self._replay(c, delivered)
        return len(prompt_ids)

    # ---- LoRA adapters ----------------------------------------------------------------------------------------
    @property
    def loras(self) -> LoraPool | None:
        """The adapters this engine serves (None: started without --enable-lora)."""
        return self.scheduler.loras

    def _check_lora(self, name: str) -> None:
        if self.loras is None:
            raise ValueError(f"request asks for LoRA adapter {name!r} but LoRA is off: start with --enable-lora")
        self.loras.path(name)  # UnknownAdapter for a name it does not know

    def add_lora(self, name: str, path: str) -> None:
        """Registers the PEFT adapter in folder `path` under `name`, read and checked against the model and
        --max-lora-rank now (ValueError says what is wrong); it is loaded into a slot when a request first needs it."""
        if self.loras is None:
            raise ValueError(f"cannot load LoRA adapter {name!r}: LoRA is off, start with --enable-lora")
        if name in self.loras.names():
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded: unload it first or pick another name")
        assert self.runner.lora is not None, "build_engine gives the runner LoRA slots iff it makes a LoraPool"
        self.runner.lora.read(path)
        self.loras.add(name, str(path))

    def remove_lora(self, name: str) -> None:
        """Forgets adapter `name`; refused (ValueError) while running sequences use it."""
        if self.loras is None:
            raise ValueError("LoRA is off: start with --enable-lora")
        self.loras.path(name)
        if self._lora_requests.get(name):
            raise AdapterInUse(
                f"LoRA adapter {name!r} has {self._lora_requests[name]} unfinished requests: retry later"
            )
        self.loras.remove(name)

    def _check_resume(self, resume: tuple[Resume, ...], params: SamplingParams, max_new: int) -> None:
        if len(resume) != params.n:
            raise ValueError(
                f"resume holds the output of {len(resume)} completions but the request asks for n = {params.n}: "
                "send one per completion, in index order"
            )
        if all(r.finished for r in resume):
            raise ValueError("every completion in resume is finished: nothing is left to resume")
        for index, r in enumerate(resume):
            if not r.finished and len(r.token_ids) >= max_new:
                raise ValueError(
                    f"resume holds {len(r.token_ids)} tokens of completion {index} but the request may generate "
                    f"{max_new}: nothing is left to resume"
                )
            bad = [t for t in r.token_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"resume token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})"
                )

    def _replay(self, c: _Completion, resume: Resume) -> None:
        """Puts a resumed completion where the failed replica left it. Its tokens are output (penalties and
        min_new_tokens count them) and their text is rebuilt token by token as it was produced there, so that a
        character or a stop string split across the seam comes out whole; the characters the client has are marked
        sent, so the hold-back for stop strings continues from the same place."""
        c.output_ids.extend(resume.token_ids)
        if c.matcher is not None:  # the grammar state is rebuilt from them
            for token in resume.token_ids:
                c.matcher.accept(token)  # add_request checked that the grammar takes them
        for token in resume.token_ids:
            c.text += c.detok.add(token)
        c.emitted = min(resume.text_chars, len(c.text))

    def _start(self, req: _Request, seq: Sequence, timings: RequestTimings, index: int) -> _Completion:
        """Completion number `index` of req, on seq."""
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids[: seq.num_prompt_tokens], p.keep_special_tokens)
        c = _Completion(req, index, seq, completion_seed(req.seed, index), detok, timings)
        c.matcher = self.constraints.matcher(req.grammar) if req.grammar is not None else None
        c.logprobs = [] if p.logprobs is not None else None
        req.completions.append(c)
        self._by_seq[seq.seq_id] = c
        return c

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Cancels a request's unfinished completions and frees their KV blocks at once: one output per completion
        it ends, in index order; empty if the request is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        now = time.monotonic()
        outputs = [self._finish(c, FinishReason.CANCELLED, [], now) for c in req.completions if not c.finished]
        if not req.forked:  # cancelled while its prompt was prefilled: the other completions never started
            outputs += [self._unborn(req, i, now) for i in range(1, req.params.n)]
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def load(self) -> EngineLoad:
        """What is queued and running now, and how full the KV pool is."""
        s = self.scheduler
        pool = self.cache_info()
        return EngineLoad(
            queued=len(s.waiting),
            running=len(s.running),
            kv_blocks_used=pool.blocks_used,
            kv_blocks_total=pool.blocks_total,
            queued_prompt_tokens=sum(q.num_uncomputed for q in s.waiting),
            pending_prompt_tokens=sum(max(0, q.num_prompt_tokens - q.num_computed) for q in (*s.waiting, *s.running)),
            refuse_for_s=s.refuse_for(),
            loras=tuple(self.loras.names()) if self.loras is not None else (),
            resident_loras=tuple(self.loras.resident()) if self.loras is not None else (),
        )

    # ---- the KV pool ------------------------------------------------------------------------------------
    def cache_info(self) -> CacheInfo:
        """The KV pool's geometry and fill. Its counts are plain reads: from another thread than the engine's, a
        moment's view."""
        a = self.scheduler.allocator
        return CacheInfo(a.block_size, a.num_blocks, a.num_free, a.num_cached, a.cache is not None)

    def cache_events(self) -> CacheChanges:
        """The prefix cache's changes since the last call (none without prefix caching). Engine thread only: it
        drains the cache's record, which is bounded, so a caller that asks too seldom gets a snapshot instead."""
        cache = self.scheduler.allocator.cache
        if cache is None:
            return CacheChanges()
        events, dropped = cache.drain_events()
        return CacheChanges(snapshot=cache.hashes()) if dropped else CacheChanges(events)

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        start = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch:
            return StepResult()
        forward_start = time.monotonic()
        batch = self._mark_prompt_logprobs(batch)
        logits = self._take_prompt_logprobs(batch, self.runner.run(batch))
        for s in batch.seqs:  # queue time ends when a request's first forward pass starts
            timings = self._by_seq[s.seq_id].timings
            timings.first_scheduled = timings.first_scheduled or forward_start
        owners, rows = self._rows(
            [(self._by_seq[s.seq_id], s.token_ids[1:] if s.num_draft else []) for s in batch.seqs if s.sample]
        )
        sampled = sample(logits, rows, self.runner.kernels.argmax)
        now = time.monotonic()
        outputs, accepted = self._emit_all(owners, sampled, now)
        self.scheduler.observe(batch)
        return StepResult(outputs, self._stats(batch, accepted, now - forward_start, start))

    def _propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] tokens proposed for seqs[i]. None for a constrained completion: its grammar would have to
        accept each proposal before the mask of the next position exists, so it does not speculate."""
        limits = [0 if self._by_seq[s.seq_id].matcher is not None else n for s, n in zip(seqs, limits)]
        return self._proposer.propose(seqs, limits)

    def _mark_prompt_logprobs(self, batch: Batch) -> Batch:
        """The batch with the prompt chunks of requests that ask for prompt logprobs marked all_logits."""
        if not self._scoring:
            return batch
        marked = [dataclasses.replace(s, all_logits=True) if self._wants_prompt_logprobs(s) else s for s in batch.seqs]
        return dataclasses.replace(batch, seqs=marked) if any(s.all_logits for s in marked) else batch

    def _wants_prompt_logprobs(self, s) -> bool:
        c = self._by_seq[s.seq_id]
        lps = c.req.prompt_logprobs
        # Not yet recorded up to this chunk's end (a recompute after a preemption records nothing again).
        if lps is None or c.index != 0 or len(lps) + 1 >= c.seq.num_prompt_tokens:
            return False
        return s.start <= len(lps) < s.start + len(s.token_ids)  # the chunk holds the next target's context

    def _take_prompt_logprobs(self, batch: Batch, logits):
        """Records the prompt logprobs of the marked chunks; returns the logits of the sampled rows only."""
        if not any(s.all_logits for s in batch.seqs):
            return logits
        keep, row = [], 0
        for s in batch.seqs:
            if not s.all_logits:
                keep += range(row, row + s.num_logits)
                row += s.num_logits
                continue
            c, n = self._by_seq[s.seq_id], len(s.token_ids)
            self._record_prompt_logprobs(c, s.start, logits[row : row + n])
            keep += [row + n - 1] if s.sample else []
            row += n
        return logits[keep]

    def _record_prompt_logprobs(self, c: _Completion, start: int, logits) -> None:
        """logits (n, V) of positions start .. start + n - 1, which predict the tokens after each: float32
        log-softmax, as transformers' reference computes it."""
        lps, seq, k = c.req.prompt_logprobs, c.seq, c.req.params.prompt_logprobs
        assert lps is not None, "only chunks of requests that ask for prompt logprobs are marked all_logits"
        first = len(lps) - start  # the first row whose target (the token after it) is not recorded yet
        last = min(logits.shape[0], seq.num_prompt_tokens - 1 - start)  # targets beyond the prompt are not its
        if last <= first:
            return
        rows = torch.log_softmax(logits[first:last].float(), dim=-1)
        targets = seq.token_ids[start + first + 1 : start + last + 1]
        chosen = rows.gather(1, torch.tensor(targets, device=rows.device)[:, None])[:, 0].tolist()
        top = rows.topk(k, dim=-1) if k else None
        values, ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
        for j, (token, lp) in enumerate(zip(targets, chosen)):
            alternatives = tuple(TopLogprob(i, v) for i, v in zip(ids[j], values[j])) if k else ()
            lps.append(self._named(TokenLogprob(token, lp, alternatives)))

    def _rows(
        self, sampled: list[tuple[_Completion, list[int]]]
    ) -> tuple[list[tuple[_Completion, list[int]]], list[SamplingRow]]:
        """The completions to sample with their proposals, and their rows, from the logits of the sequences sampled
        (in batch order, 1 + its proposals each). A prompt prefilled for n > 1 completions forks here and gets n
        rows from its one."""
        owners: list[tuple[_Completion, list[int]]] = []
        rows: list[SamplingRow] = []
        source = 0  # the logits row of the position sampled
        for c, draft in sampled:
            group = (c,) if c.req.forked else (c, *self._fork(c))
            for member in group:
                for j in range(len(draft) + 1):  # position j is drawn as if draft[:j] were accepted
                    rows.append(self._sampling_row(member, draft[:j], None if len(rows) == source + j else source + j))
                owners.append((member, draft))
            source += len(draft) + 1
        if any(c.matcher is not None for c, _ in owners):  # constrained completions propose nothing: a row each
            for row, allowed in zip(rows, self.constraints.masks([c.matcher for c, _ in owners])):
                row.allowed = allowed
        return owners, rows

    def _fork(self, parent: _Completion) -> list[_Completion]:
        """The n - 1 other completions of parent's request, on sequences holding its prompt; the scheduler starts
        them on parent's KV blocks (or queues them to be recomputed when blocks are short)."""
        req, seq = parent.req, parent.seq
        req.forked = True
        children = []
        for _ in range(1, req.params.n):
            child = Sequence(
                self._next_seq_id,
                list(seq.token_ids),
                seq.num_prompt_tokens,
                seq.max_new_tokens,
                cache_salt=seq.cache_salt,
                slo=seq.slo,
                lora=seq.lora,
            )
            self._next_seq_id += 1
            children.append(self._start(req, child, dataclasses.replace(parent.timings), len(req.completions)))
        self.scheduler.fork(seq, [c.seq for c in children])
        return children

    def _sampling_row(self, c: _Completion, draft: list[int], source: int | None) -> SamplingRow:
        """The row of the token after c's tokens and `draft` (proposals taken as accepted)."""
        p, seq = c.req.params, c.seq
        # A grammar decides where a constrained output ends: a ban on EOS there could leave no token allowed.
        banned = c.req.banned if seq.num_generated + len(draft) < p.min_new_tokens and c.matcher is None else []
        # The token being sampled goes at index num_tokens + len(draft): its draws are keyed by (seed, that position).
        return SamplingRow(
            p.temperature,
            p.top_p,
            p.top_k,
            c.seed,
            seq.num_tokens + len(draft),
            banned,
            source=source,
            min_p=p.min_p,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logit_bias=p.logit_bias,
            # The lists themselves (the sampler only reads them); behind a verify's proposals, copies with them, made
            # only where a penalty reads them.
            output_ids=c.output_ids + draft if draft and (p.presence_penalty or p.frequency_penalty) else c.output_ids,
            context_ids=seq.token_ids + draft if draft and p.repetition_penalty != 1.0 else seq.token_ids,
            logprobs=p.logprobs,
        )

    def _emit_all(self, owners: list[tuple[_Completion, list[int]]], sampled, now: float):
        """One output per completion sampled, and (proposed, accepted) per verified one. A completion emits its
        proposals while they equal the tokens drawn at their positions, then the draw after the last one accepted."""
        outputs, accepted, row = [], [], 0
        for c, draft in owners:
            tokens, logprobs = sampled.tokens[row : row + len(draft) + 1], sampled.logprobs[row : row + len(draft) + 1]
            row += len(draft) + 1
            n = next((j for j, t in enumerate(draft) if tokens[j] != t), len(draft))
            outputs.append(self._emit(c, tokens[: n + 1], logprobs[: n + 1], now))
            accepted += [(len(draft), n)] if draft else []
        return outputs, accepted

    def _emit(
        self, c: _Completion, tokens: list[int], logprobs: list[TokenLogprob | None], now: float
    ) -> RequestOutput:
        """Appends tokens to c until one ends it; one output with those appended."""
        c.timings.first_token = c.timings.first_token or now
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            reason = self._append(c, token, logprob)
            if reason is not None:
                return self._finish(c, reason, tokens[: i + 1], now)
        # Hold back text that could still turn out to start a stop string.
        hold = max((len(s) for s in c.req.params.stop), default=1) - 1
        return self._output(c, tokens, max(c.emitted, len(c.text) - hold), None, now)

    def _append(self, c: _Completion, token: int, logprob: TokenLogprob | None) -> FinishReason | None:
        """Appends one token to c: why it ends c, or None."""
        seq, params = c.seq, c.req.params
        seq.token_ids.append(token)
        c.output_ids.append(token)
        if c.logprobs is not None and logprob is not None:
            c.logprobs.append(self._named(logprob))
        reason = self._token_reason(token, params)  # EOS or a stop token: its text is left out
        if c.matcher is not None:
            c.matcher.accept(token)  # the mask allowed only tokens it accepts
            if c.matcher.done:  # the grammar's end (EOS) was accepted: nothing may follow, ignore_eos or not
                reason = reason or FinishReason.EOS
        at_length = seq.num_generated >= seq.max_new_tokens
        previous = len(c.text)
        if reason is None:
            c.text += c.detok.add(token)
        if reason is not None or at_length:
            c.text += c.detok.flush()
        reason = reason or (FinishReason.LENGTH if at_length else None)
        if params.stop and seq.num_generated >= params.min_new_tokens:
            found = _find_stop(c.text, params.stop, previous)
            if found is not None:
                cut, stop = found
                end = cut + len(stop) if params.include_stop_str_in_output else cut
                c.text, reason = c.text[:end], FinishReason.STOP
        return reason

    def _token_reason(self, token: int, params: SamplingParams) -> FinishReason | None:
        if token in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.EOS
        return FinishReason.STOP if token in params.stop_token_ids else None

    def _named(self, lp: TokenLogprob) -> TokenLogprob:
        """lp with the token strings filled in."""
        top = tuple(dataclasses.replace(t, token=self._token_text(t.token_id)) for t in lp.top)
        return dataclasses.replace(lp, token=self._token_text(lp.token_id), top=top)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._token_texts[token_id] = text
        return text

    def _finish(self, c: _Completion, reason: FinishReason, new_tokens: list[int], now: float) -> RequestOutput:
        self.scheduler.finish(c.seq)
        del self._by_seq[c.seq.seq_id]
        c.finished = True
        c.timings.finished = now
        self._count_finished(c.req)
        return self._output(c, new_tokens, len(c.text), reason, now)

    def _count_finished(self, req: _Request) -> None:
        req.unfinished -= 1
        if req.unfinished == 0:
            del self._requests[req.request_id]
            self._lora_requests[req.lora] -= 1
            self._scoring -= req.prompt_logprobs is not None

    def _output(self, c: _Completion, new_tokens, visible: int, reason, now) -> RequestOutput:
        new_text, c.emitted = c.text[c.emitted : visible], visible
        seq, logprobs = c.seq, c.logprobs or []
        return RequestOutput(
            request_id=c.req.request_id,
            new_text=new_text,
            new_token_ids=new_tokens,
            text=c.text[:visible],
            token_ids=list(c.output_ids),
            prompt_tokens=seq.num_prompt_tokens,
            finish_reason=reason,
            timings=c.timings,
            time=now,
            num_preemptions=seq.num_preemptions,
            index=c.index,
            new_logprobs=logprobs[len(logprobs) - len(new_tokens) :],
            logprobs=list(logprobs),
            prompt_text=c.req.prompt_text,
            cached_prompt_tokens=c.req.completions[0].seq.num_cached_prompt_tokens,  # the request's: its prompt's
            prompt_logprobs=c.req.prompt_logprobs or [],  # complete once any token is sampled
        )

    def _unborn(self, req: _Request, index: int, now: float) -> RequestOutput:
        """The cancelled output of a completion that was never forked."""
        self._count_finished(req)
        parent = req.completions[0]
        timings = dataclasses.replace(parent.timings, finished=now)
        return RequestOutput(
            request_id=req.request_id,
            new_text="",
            new_token_ids=[],
            text="",
            token_ids=[],
            prompt_tokens=parent.seq.num_prompt_tokens,
            finish_reason=FinishReason.CANCELLED,
            timings=timings,
            time=now,
            index=index,
            prompt_text=req.prompt_text,
        )

    def _stats(self, batch: Batch, accepted: list[tuple[int, int]], forward_s: float, start: float) -> StepStats:
        pool = self.cache_info()
        prefix = self.scheduler.prefix_stats()
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
            kv_blocks_used=pool.blocks_used,
            kv_blocks_total=pool.blocks_total,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            prefix_cache_evictions=prefix.evictions,
            prefix_cache_blocks=pool.blocks_cached,
            plan=batch.plan,
            spec_drafts=len(accepted),
            spec_draft_tokens=sum(k for k, _ in accepted),
            spec_accepted_tokens=sum(n for _, n in accepted),
            spec_accepted_per_pos=tuple(
                sum(n > j for _, n in accepted) for j in range(max((k for k, _ in accepted), default=0))
            ),
        )


def _find_stop(text: str, stops: tuple[str, ...], previous: int) -> tuple[int, str] | None:
    """Where the earliest stop string starts and which it is, looking only where new text could have completed
    one."""
    best = None
    for s in stops:
        i = text.find(s, max(0, previous - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
