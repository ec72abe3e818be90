"""SLO-aware Dynamic SplitFuse (`--scheduler slo`): the token budget of every step chosen from the requests'
deadlines and a step-time model fitted on the engine's own steps (no torch).

Every request has two deadlines of the paper's SLA (BENCHMARKS.md): its first token is due prompt_tokens / P seconds
after arrival, and after that its next token is due 1 / R seconds after the previous one. Holding every gap within
1 / R keeps every span-16 moving average of the gaps within it (an average of numbers that are all at most 1 / R
is at most 1 / R), so a stream that never waits longer than its floor meets the rate part of the SLA, and the
moving average's own allowance for one longer gap is the margin that absorbs a misprediction.

Each step:
1. every decoding sequence gets its token (as in SplitFuse: decodes never pause, least of all when behind);
2. the step may take as long as the stream with the least slack allows: the least time left before a decoding
   stream's next token is due, times HEADROOM. A stream already past due yields: it bounds the step by its floor
   alone. Nothing bounds a step that serves no stream but the token cap (max_batch_tokens);
3. prompt chunks fill that time, as many tokens as the step-time model predicts fit, to the requests in order of
   their next deadline (least laxity first; a request's work counts from its cached prefix). Requests that can no
   longer make their first-token deadline, found as Moore and Hodgson's rule finds the fewest late jobs (in
   deadline order, whenever the work so far overruns a deadline, the largest job so far is given up), go after
   every request that still can, in arrival order; a stream recomputed after a preemption (or resumed from a replica
   that failed) is never given up: its next token is due a floor after its last one (resumed: after it was queued
   here). A chunk that ends a prompt also bounds the step by that prompt's own first-token deadline. No
   starvation: a request that later ones overtook `max_overtakes` times goes first from then on, within
   STARVING_SHARE of the step's prompt time and tokens while requests that can still be on time wait (behind a
   backlog every waiting request starves in turn, and precedence without a cap would serve them all, first come
   first served, ahead of every request that could still be on time); while they do, the others are judged on the
   rest of the time;
4. when even the decodes alone are predicted to take longer than the shortest floor (overload), the step carries
   the decodes and at most OVERLOAD_CHUNK prompt tokens of requests that have sent nothing yet, and with
   `admission="refuse"` new requests are refused, with the time the shortest running stream needs to finish as the
   retry hint, until it clears. A stream being recomputed mid-way (preempted, or resumed from a replica that
   failed) is not held to OVERLOAD_CHUNK: it is stalled past its floor already, and chunking its context would
   stall it for many steps more to shorten each of everyone else's by little.

With speculative decoding, the decodes' proposals (verified in the step, as chunks continuing their sequences) count
in the step's shape before prompt chunks fill it, and a step verifies them only when the model predicts more tokens
per second with them than without (`_worth_verifying`).

Admission, KV allocation, preemption, prefix caching and forks are the SplitFuse scheduler's (this is a subclass).
Until the model has seen a few steps (a replica calibrates it at start-up) steps are bounded by max_batch_tokens
alone, as SplitFuse's are.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from .batch import Batch, ScheduledSeq, StepPlan
from .block_allocator import BlockAllocator
from .config import SchedulerConfig
from .lora_pool import LoraPool
from .request import SamplingParams, SeqStatus, Sequence, Slo
from .scheduler import Scheduler
from .step_model import StepModel, StepShape

HEADROOM = 0.8  # share of the least slack a step is planned to take: the margin for the model's error
OVERLOAD_CHUNK = 64  # prompt tokens a step still carries while overloaded, so that queued requests move
ALPHA = 2 / (16 + 1)  # the SLA's moving average of inter-token gaps (span 16, as fastgen.server.sla scores it)
RETRY_BOUNDS_S = (0.1, 60.0)  # the retry hint of a refused request stays within these
MIN_PROMPT_SHARE = 0.05  # of step time, when judging which deadlines can still be met (overloaded: little)
STARVING_SHARE = 0.25  # of a step's prompt time and tokens the starving take first while others can be on time
PROBE_EVERY = 16  # steps whose proposals the step-time model declines, per step that verifies them all the same


@dataclass(eq=False)
class _Stream:
    """Where one sequence stands against its service level."""

    seq: Sequence
    arrival: float
    first_due: float  # when its first token is due
    gap: float  # 1 / R: the longest wait for each next token
    tokens: int  # generated tokens seen so far
    last: float | None = None  # when the latest token came (None: no token yet on this replica)
    ema: float | None = None  # the SLA's moving average of its gaps
    behind: bool = False  # the moving average went past the floor: the rate part of its SLA is missed
    passed: int = 0  # steps in which later requests were admitted while it waited
    cached: int = 0  # waiting: prompt tokens its cached prefix covers, as last looked up
    cached_seen: int = -1  # the pool's eviction count when it was looked up (-1: not yet)

    def due(self) -> float:
        return self.first_due if self.last is None else self.last + self.gap


@dataclass
class _Order:
    """The streams with prompt tokens to compute, in the order they get them."""

    streams: list[_Stream]
    hopeless: set[_Stream]  # those that can no longer meet their next deadline
    capped: int  # the first `capped` are starving and go first, within STARVING_SHARE of the step (0: no cap);
    # they come again after the requests that can still be on time, for what is left


@dataclass
class _Fill:
    """The step being built: what it carries so far, its predicted time, the time it may take, the tokens left (of
    them, `fresh` for requests that have sent nothing yet)."""

    shape: StepShape
    predicted_s: float
    budget_s: float
    tokens: int
    fresh: int


class SloScheduler(Scheduler):
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        model: StepModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        loras: LoraPool | None = None,
    ) -> None:
        super().__init__(config, allocator, loras)
        self.model = model or StepModel(experts=config.moe_routing, window=config.kv_window)
        self.clock = clock
        self.overloaded = False
        self._streams: dict[int, _Stream] = {}
        self._forked: list[Sequence] = []  # children started since the last observe: their first token came with it
        self._step_start = 0.0
        self._plan: StepPlan | None = None
        self._declined = 0  # steps in a row whose proposals the step-time model found not worth verifying

    def _schedules(self) -> dict[str, Callable[[], Batch]]:
        return super()._schedules() | {"slo": self._schedule_slo}

    # ---- streams -------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        super().add(seq)
        slo, deployment = seq.slo or Slo(), self.config.slo
        prompt_rate = slo.prompt_rate or deployment.prompt_rate
        token_rate = slo.token_rate or deployment.token_rate
        ttft = slo.ttft_s if slo.ttft_s is not None else seq.num_prompt_tokens / prompt_rate
        if not deployment.allow_client_tightening:  # a request may loosen the deployment's service level only
            token_rate = min(token_rate, deployment.token_rate)
            ttft = max(ttft, seq.num_prompt_tokens / deployment.prompt_rate)
        now = self.clock()
        gap = 1.0 / token_rate
        # A stream resumed from a replica that failed is mid-way for its client: like one recomputed after a
        # preemption, its next token is due a floor from now, and it is never given up.
        last = now if seq.mid_stream else None
        self._streams[seq.seq_id] = _Stream(seq, now, now + ttft, gap, seq.num_generated, last)

    def fork(self, parent: Sequence, children: list[Sequence]) -> int:
        shared = super().fork(parent, children)
        stream = self._streams[parent.seq_id]
        for child in children:
            self._streams[child.seq_id] = dataclasses.replace(stream, seq=child)
        self._forked += children
        return shared

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        self._streams.pop(seq.seq_id, None)

    def observe(self, batch: Batch) -> None:
        """The step is done and its tokens are out: the step-time model learns the step's time, and every stream
        that got a token moves its deadline."""
        super().observe(batch)
        now = self.clock()
        if batch.plan is not None:
            self.model.observe(batch.plan.shape, now - self._step_start)
        got = [self._streams.get(s.seq_id) for s in batch.seqs if s.sample]
        got += [self._streams.get(c.seq_id) for c in self._forked]
        self._forked = []
        for stream in got:
            if stream is not None and stream.seq.num_generated > stream.tokens:
                self._token(stream, now)

    @staticmethod
    def _token(stream: _Stream, now: float) -> None:
        if stream.last is not None:
            d = (now - stream.last) / max(1, stream.seq.num_generated - stream.tokens)  # a verify emits several
            stream.ema = d if stream.ema is None else stream.ema + ALPHA * (d - stream.ema)
            stream.behind = stream.behind or stream.ema > stream.gap
        stream.last = now
        stream.tokens = stream.seq.num_generated

    def refuse_for(self) -> float | None:
        if not self.overloaded or not self.running or self.config.slo.admission != "refuse":
            return None  # (an idle engine runs no step that would clear the flag: it is not overloaded)
        step = self._plan.predicted_s if self._plan is not None else math.nan
        left = min((s.max_tokens - s.num_tokens + 1 for s in self.running), default=1)
        lo, hi = RETRY_BOUNDS_S
        return lo if math.isnan(step) else min(hi, max(lo, left * step))

    def _worth_verifying(self, decodes: list[ScheduledSeq], drafts: dict[int, list[int]]) -> bool:
        """Verify when the step-time model says the tokens expected per second rise: the step with the verifies
        (each a chunk of 1 + d tokens) over the step without, against (decodes + the accepted tokens expected at the
        recent acceptance rate) over decodes. Before the model is ready, always; when it declines, still every
        PROBE_EVERY-th time, so that the acceptance rate follows the workload."""
        if not self.model.ready:
            return True
        plain = StepShape.of_decodes(decodes, self.config.kv_window)
        rest = [s for s in decodes if s.seq_id not in drafts]
        verify = StepShape.of_decodes(rest, self.config.kv_window)
        for s in decodes:
            if s.seq_id in drafts:
                verify = verify.plus_chunk(s.start, 1 + len(drafts[s.seq_id]), self.config.kv_window)
        expected = self.acceptance.rate * sum(len(d) for d in drafts.values())
        if self.model.predict(verify) * len(decodes) <= self.model.predict(plain) * (len(decodes) + expected):
            self._declined = 0
            return True
        self._declined += 1
        return self._declined % PROBE_EVERY == 0

    # ---- the schedule --------------------------------------------------------------------------------------
    def _schedule_slo(self) -> Batch:
        now = self._step_start = self.clock()
        scheduled: set[int] = set()
        decoding = self._decode_all(scheduled)
        decodes, verifies = self._speculate(decoding.seqs, self.config.max_batch_tokens - len(decoding.seqs))
        preempted = list(decoding.preempted)
        shape = StepShape.of_decodes(decodes, self.config.kv_window)
        for v in verifies:  # as batch_shape counts them: chunks that continue their sequences
            shape = shape.plus_chunk(v.start, len(v.token_ids), self.config.kv_window)
        decode_s = self.model.predict(shape)
        streams = [self._streams[s.seq_id] for s in decodes + verifies]
        budget_s, floor_s = self._time_budget(streams, decode_s, now)
        self.overloaded = decode_s > floor_s
        tokens = self.config.max_batch_tokens - len(decodes) - sum(len(v.token_ids) for v in verifies)
        fresh = min(tokens, OVERLOAD_CHUNK) if self.overloaded else tokens
        order = self._order(shape, budget_s, now, admit=not preempted)
        plan = _Fill(shape, decode_s, budget_s, tokens, fresh)
        chunks = self._fill(plan, order, now, scheduled, preempted)
        self._plan = StepPlan(
            plan.shape,
            plan.predicted_s,
            plan.budget_s,
            self.overloaded,
            sum(1 for s in order.hopeless if s.last is None),
            sum(1 for s in self._streams.values() if s.behind),
            self.model.drift,
        )
        return Batch(decodes + verifies + chunks, len(decodes), preempted, plan=self._plan)

    def _fill(
        self, plan: _Fill, order: _Order, now: float, scheduled: set[int], preempted: list[int]
    ) -> list[ScheduledSeq]:
        """Prompt chunks for the streams in `order`, each as large as the tokens and time left allow (time is not
        counted while overloaded or before the model is ready); updates `plan` as they are placed."""
        timed = self.model.ready and not self.overloaded
        chunks: list[ScheduledSeq] = []
        served_arrival = -math.inf  # the latest arrival among the streams that got a chunk
        # The starving go first but leave the rest of the step to requests that can still be on time: under a
        # backlog every waiting request starves in turn, and precedence without a cap would make the schedule FIFO.
        cap_tokens = plan.tokens - int(STARVING_SHARE * plan.tokens)
        cap_s = plan.predicted_s + STARVING_SHARE * max(0.0, plan.budget_s - plan.predicted_s)
        for k, stream in enumerate(order.streams):
            if plan.tokens <= 0:
                break
            seq = stream.seq
            if seq.seq_id in scheduled:
                continue  # a starving stream's second place: it had its chunk in its first
            capped = k < order.capped
            time_left = (cap_s if capped else plan.budget_s) - plan.predicted_s if timed else math.inf
            tokens = plan.tokens - cap_tokens if capped else plan.tokens
            if stream.last is None:
                tokens = min(tokens, plan.fresh)
                if tokens <= 0:
                    continue  # overloaded: the prompt tokens of requests not started are spent
            if capped and (tokens <= 0 or self._fit(seq, self._next_chunk_start(stream), time_left, tokens) <= 0):
                continue  # its share of the step is spent
            if seq.status is SeqStatus.RUNNING:
                n = self._fit(seq, seq.num_computed, time_left, tokens)
                chunk = self._continue_prompt(seq, n, scheduled, preempted)
            elif preempted:
                continue  # a pool short enough to preempt admits nothing new this step (as SplitFuse)
            else:
                chunk = self._admit_one(stream, time_left, tokens, scheduled)
            if chunk is None and stream.passed >= self.config.max_overtakes:
                break  # it waits for blocks or a free sequence slot: later requests may not take them first
            if chunk is None:
                continue
            served_arrival = max(served_arrival, stream.arrival)
            chunks.append(chunk)
            plan.tokens -= len(chunk.token_ids)
            plan.fresh = min(plan.fresh - (len(chunk.token_ids) if stream.last is None else 0), plan.tokens)
            plan.shape = plan.shape.plus_chunk(chunk.start, len(chunk.token_ids), self.config.kv_window)
            plan.predicted_s = self.model.predict(plan.shape)
            if timed and chunk.sample and stream.last is None and stream not in order.hopeless:
                # Its first token comes at the end of this step: the step must end by its deadline.
                plan.budget_s = min(plan.budget_s, max(plan.predicted_s, HEADROOM * (stream.first_due - now)))
        served = {c.seq_id for c in chunks}
        for stream in dict.fromkeys(order.streams):  # overtaken: it waited while a later request got a chunk
            if stream.arrival < served_arrival and stream.seq.seq_id not in served:
                stream.passed += 1
        return chunks

    @staticmethod
    def _time_budget(decoding: list[_Stream], decode_s: float, now: float) -> tuple[float, float]:
        """(the time this step may take, the shortest floor among the streams it decodes), both times HEADROOM.

        A stream bounds the step by the time left before its next token is due. One that can no longer get it in
        time yields: it bounds the step by its floor alone (so its gaps from now on stay within it), and a prompt
        whose last token is being computed and that is already too late for its first-token deadline not at all."""
        budget = floor = math.inf
        for stream in decoding:
            slack = HEADROOM * (stream.due() - now)
            if stream.last is not None:
                floor = min(floor, HEADROOM * stream.gap)
                budget = min(budget, slack if slack >= decode_s else HEADROOM * stream.gap)
            elif slack >= decode_s:
                budget = min(budget, slack)
        return budget, floor

    def _next_chunk_start(self, stream: _Stream) -> int:
        """Where the stream's next prompt chunk starts: after its computed tokens, or for a waiting one after its
        cached prefix. The lookup is kept until the pool evicts: blocks published since can only make it longer,
        so a kept one errs on the side of more work."""
        seq = stream.seq
        if seq.status is not SeqStatus.WAITING:
            return seq.num_computed
        if stream.cached_seen != self.allocator.num_evictions:
            stream.cached = self._cached_prefix(seq).num_blocks * self.allocator.block_size
            stream.cached_seen = self.allocator.num_evictions
        return stream.cached

    def _fit(self, seq: Sequence, start: int, time_left: float, tokens_left: int) -> int:
        """Prompt tokens of seq from `start` that the step has room and time for."""
        n = min(seq.num_tokens - start, tokens_left)
        return n if time_left == math.inf else min(n, self.model.chunk_fitting(start, time_left))

    def _admit_one(
        self, stream: _Stream, time_left: float, tokens_left: int, scheduled: set[int]
    ) -> ScheduledSeq | None:
        """Starts waiting stream's sequence with its first chunk when max_seqs, the KV pool and the step allow."""
        if len(self.running) >= self.config.max_seqs:
            return None
        seq = stream.seq
        hits = self._cached_prefix(seq)
        cached = hits.num_blocks * self.allocator.block_size
        n = self._fit(seq, cached, time_left, tokens_left)
        room = self._room_for(self.allocator.blocks_for(cached + n) - hits.num_blocks, hits.blocks)
        if n <= 0 or not room or not self._adapter_ready(seq):
            return None
        return self._start(self.waiting.index(seq), hits, n, scheduled)

    def _order(self, decodes: StepShape, budget_s: float, now: float, admit: bool) -> _Order:
        """The streams with prompt tokens to compute, in the order they get them (see the module's docstring)."""
        pending = [
            self._streams[s.seq_id] for s in self.running if s.status is SeqStatus.RUNNING and s.num_uncomputed > 1
        ]
        if admit:
            pending += [self._streams[s.seq_id] for s in self.waiting]
        if not pending:
            return _Order([], set(), 0)
        share = self._prompt_share(decodes, budget_s)
        starving = [s for s in pending if s.passed >= self.config.max_overtakes]
        if starving and len(starving) < len(pending):  # each side has its part of the prompt time
            on_time = [s for s in pending if s.passed < self.config.max_overtakes]
            hopeless = self._given_up(starving, share * STARVING_SHARE, now)
            hopeless |= self._given_up(on_time, share * (1 - STARVING_SHARE), now)
        else:
            hopeless = self._given_up(pending, share, now)
        first = sorted(starving, key=lambda s: s.arrival)
        rest = sorted(
            (s for s in pending if s not in hopeless and s.passed < self.config.max_overtakes), key=_Stream.due
        )
        late = sorted(
            (s for s in hopeless if s.passed < self.config.max_overtakes), key=lambda s: (s.arrival, s.seq.seq_id)
        )
        if not (first and rest):
            return _Order(first + rest + late, hopeless, 0)
        # Capped first; what their share left them they may take after the requests that can still be on time.
        return _Order(first + rest + first + late, hopeless, len(first))

    def _given_up(self, streams: list[_Stream], share: float, now: float) -> set[_Stream]:
        """Those of `streams` to give up so that the most of the others meet their next deadline, served in deadline
        order with `share` of the engine's time (Moore and Hodgson's rule; none before the model is ready)."""
        kept: list[tuple[float, int, _Stream]] = []  # a max-heap of work (seconds) by negating it
        hopeless: set[_Stream] = set()
        work = 0.0
        for stream in sorted(streams, key=_Stream.due):
            start = self._next_chunk_start(stream)
            w = self.model.chunk_cost(start, stream.seq.num_tokens - start) / share if share else 0.0
            work += w
            if stream.last is None:  # a stream already delivering (recomputed after preemption) never gives up
                heapq.heappush(kept, (-w, stream.seq.seq_id, stream))
            if now + work > stream.due() and kept:
                w_max, _, dropped = heapq.heappop(kept)
                work += w_max
                hopeless.add(dropped)
        return hopeless

    def _prompt_share(self, decodes: StepShape, budget_s: float) -> float:
        """The share of the engine's time that goes to prompt tokens while steps of budget_s (or of the token cap)
        carry these decodes; 0 before the model is ready (then nothing counts as late)."""
        if not self.model.ready:
            return 0.0
        step = budget_s
        if step == math.inf:
            chunk = max(1, self.config.max_batch_tokens - decodes.decode_seqs)
            step = self.model.predict(decodes.plus_chunk(0, chunk, self.config.kv_window))
        fixed = self.model.predict(decodes)
        return max(MIN_PROMPT_SHARE, 1 - fixed / step) if step > 0 else 1.0


# ---- start-up calibration -------------------------------------------------------------------------------------
CALIBRATION_DECODES = 16  # short requests that decode while the prompts below arrive
CALIBRATION_PROMPTS = (32, 128, 256, 512, 1024)  # prompt lengths, each capped by max_batch_tokens


def calibrate(engine, first_token_id: int = 3) -> None:
    """Seeds the step-time model from a short profile: a few sequences decoding while prompts of several lengths
    arrive, so the steps vary in prompt tokens, decode sequences and context. Runs through `engine` (its scheduler an
    SloScheduler) like any request, on token ids of no meaning: a few seconds on a CPU. A request the engine cannot
    take (a small context or KV pool) is left out."""
    config, vocab = engine.scheduler.config, engine.model_config.vocab_size
    cap = max(1, min(config.max_batch_tokens, config.max_model_len // 2))
    added: list[str] = []

    def add(rid: str, n: int, max_new: int) -> None:
        start = first_token_id + 997 * len(added)  # prompts that share no prefix: each is computed whole
        ids = [(start + (j * 7) % 4999) % vocab for j in range(n)]
        params = SamplingParams(max_new_tokens=max(1, min(max_new, config.max_model_len - n)), ignore_eos=True)
        try:
            engine.add_request(f"calibrate-{rid}", ids, params)
            added.append(rid)
        except ValueError:
            pass

    for i in range(min(CALIBRATION_DECODES, config.max_seqs - 1)):
        add(f"d{i}", min(16, cap), 3 * len(CALIBRATION_PROMPTS) + 4)
    engine.step()
    for i, length in enumerate(CALIBRATION_PROMPTS):
        add(f"p{i}", min(length, cap), 2)
        for _ in range(3):
            engine.step()
    while engine.has_unfinished():
        engine.step()
