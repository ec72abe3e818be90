"""The slo scheduler (replica/slo_scheduler.py) on scripted scenarios, without torch: a simulated engine whose steps
take exactly what a fixed step-time model says, on an injected clock, so that every check is exact and none reads
the wall clock. Invariants at every step: no decoding sequence is left out of a step, a step's predicted time stays
within the time it was allowed (unless overloaded), every stream's inter-token gaps stay within its floor, and
every request finishes. Then greedy outputs through the engine, the same as under SplitFuse."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from fastgen.replica.block_allocator import BlockAllocator
from fastgen.replica.config import SchedulerConfig, SloConfig
from fastgen.replica.request import SeqStatus, Sequence, Slo
from fastgen.replica.scheduler import Scheduler
from fastgen.replica.slo_scheduler import HEADROOM, OVERLOAD_CHUNK, RETRY_BOUNDS_S, STARVING_SHARE, SloScheduler
from fastgen.replica.step_model import StepModel, StepShape, batch_shape

# Close to SmolLM2 on two CPU cores (benchmarks/RESULTS.md section 6): 25 ms a pass, 0.3 ms a prompt token.
CPU = (0.025, 3e-4, 5e-4, 2e-7, 5e-8)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Sim:
    """A scheduler and what happened to every sequence: arrival, token times."""

    sched: Scheduler
    clock: Clock
    model: StepModel
    seqs: dict[int, Sequence] = field(default_factory=dict)
    arrival: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, list[float]] = field(default_factory=dict)
    batches: list = field(default_factory=list)
    next_id: int = 0

    def add(self, prompt_len: int, max_new: int, slo: Slo | None = None, resumed: int | None = None) -> Sequence:
        """A request; with `resumed`, one resumed from another replica that had delivered that many of its tokens."""
        i = self.next_id
        self.next_id += 1
        tokens = [(i * 7 + j) % 1000 for j in range(prompt_len + (resumed or 0))]
        seq = Sequence(i, tokens, prompt_len, max_new, slo=slo, resumed=resumed is not None)
        self.sched.add(seq)
        self.seqs[i], self.arrival[i], self.tokens[i] = seq, self.clock.now, []
        return seq

    def step(self):
        sched = self.sched
        decoding = [s.seq_id for s in sched.running if s.num_uncomputed == 1]
        batch = sched.schedule()
        assert batch, "work left but nothing scheduled"
        self.batches.append(batch)
        ids = {s.seq_id for s in batch.seqs}
        assert len(ids) == len(batch.seqs) <= sched.config.max_seqs
        assert batch.num_tokens <= sched.config.max_batch_tokens or sched.config.policy == "prefill_first"
        for i in decoding if sched.config.policy in ("slo", "splitfuse") else ():  # decodes never pause
            assert i in ids or i in batch.preempted
        seconds = self.model.predict(batch_shape(batch))
        plan = batch.plan
        if plan is not None:
            assert plan.shape == batch_shape(batch)
            if sched.model.ready:
                assert plan.predicted_s == pytest.approx(sched.model.predict(plan.shape))
            if not plan.overloaded and batch.num_prefill_tokens and sched.model is self.model:
                assert seconds <= plan.budget_s + 1e-9, "the prompt tokens overran the time allowed"
        self.clock.now += seconds
        for s in batch.seqs:
            if s.sample:
                seq = self.seqs[s.seq_id]
                seq.token_ids.append((sum(seq.token_ids) * 31 + len(seq.token_ids)) % 1000)
                self.tokens[s.seq_id].append(self.clock.now)
                if seq.num_generated >= seq.max_new_tokens:
                    sched.finish(seq)
        sched.observe(batch)
        return batch

    def run(self, max_steps: int = 20000, arrivals: dict[int, list] | None = None) -> None:
        """Steps until every sequence finished; arrivals: step -> [(prompt_len, max_new)] added before it."""
        steps = 0
        while self.sched.has_work() or (arrivals and any(k >= steps for k in arrivals)):
            for prompt_len, max_new in (arrivals or {}).get(steps, []):
                self.add(prompt_len, max_new)
            if self.sched.has_work():
                self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        assert all(s.status is SeqStatus.FINISHED for s in self.seqs.values())
        assert self.sched.allocator.num_free == self.sched.allocator.num_blocks

    def ttft(self, i: int) -> float:
        return self.tokens[i][0] - self.arrival[i]

    def gaps(self, i: int) -> list[float]:
        t = self.tokens[i]
        return [b - a for a, b in zip(t, t[1:])]

    def met(self, i: int, prompt_rate: float, token_rate: float) -> bool:
        from fastgen.server.sla import meets_sla

        seq = self.seqs[i]
        return meets_sla(seq.num_prompt_tokens, self.ttft(i), self.tokens[i], prompt_rate, token_rate)


def slo_sim(
    budget: int = 2048,
    max_seqs: int = 64,
    num_blocks: int = 20000,
    block_size: int = 16,
    prompt_rate: float = 100.0,
    token_rate: float = 2.0,
    admission: str = "keep",
    coefficients=CPU,
    max_overtakes: int = 16,
    allow_client_tightening: bool = True,
) -> Sim:
    clock = Clock()
    model = StepModel(coefficients, learn=False)
    config = SchedulerConfig(
        budget,
        max_seqs,
        "slo",
        max_model_len=10**6,
        max_overtakes=max_overtakes,
        # The scenarios give requests deadlines of their own, tighter ones too: as a trusted caller may.
        slo=SloConfig(prompt_rate, token_rate, admission, allow_client_tightening),
    )
    return Sim(SloScheduler(config, BlockAllocator(num_blocks, block_size), model, clock), clock, model)


def fixed_sim(policy: str, budget: int, max_seqs: int = 64, num_blocks: int = 20000) -> Sim:
    config = SchedulerConfig(budget, max_seqs, policy, max_model_len=10**6)
    return Sim(Scheduler(config, BlockAllocator(num_blocks, 16)), Clock(), StepModel(CPU, learn=False))


def test_a_long_prompt_among_many_decodes_is_chunked_within_every_floor():
    sim = slo_sim(token_rate=4.0)
    for _ in range(40):
        sim.add(16, 120)
    while any(not sim.tokens[i] for i in sim.seqs):
        sim.step()
    long = sim.add(4000, 8)  # due in 40 s; a whole pass of it would take over a second
    sim.run()
    floor = 1 / 4.0
    for i in sim.seqs:
        assert max(sim.gaps(i), default=0) <= HEADROOM * floor + 1e-9
    chunks = [s for b in sim.batches for s in b.seqs if s.seq_id == long.seq_id and len(s.token_ids) > 1]
    assert len(chunks) > 1 and all(len(c.token_ids) < 4000 for c in chunks)
    assert sim.met(long.seq_id, 100.0, 4.0)


def test_a_step_serving_no_stream_is_bounded_by_the_token_cap_only():
    sim = slo_sim(budget=1024)
    sim.add(3000, 2)  # nobody decodes: nothing bounds the step but the cap (and the prompt's own deadline)
    batch = sim.step()
    assert batch.num_prefill_tokens == 1024 and batch.plan.budget_s == float("inf")


def test_a_burst_of_prompts_meets_more_deadlines_than_fixed_budgets():
    """48 prompts of 600 tokens at once (C1 at its heaviest, P = 100, R = 2): at most what the machine can do in six
    seconds meets its first-token deadline. The slo scheduler serves in deadline order and gives up the requests that
    cannot make it, instead of letting every one of them miss a little."""
    rng = random.Random(5)
    requests = [(max(60, round(rng.gauss(600, 180))), 60) for _ in range(48)]

    def met(sim: Sim) -> int:
        for prompt_len, max_new in requests:
            sim.add(prompt_len, max_new)
        sim.run()
        return sum(sim.met(i, 100.0, 2.0) for i in sim.seqs)

    slo = slo_sim()
    slo_met = met(slo)
    fixed = {b: met(fixed_sim("splitfuse", b)) for b in (128, 256, 512)} | {"pf": met(fixed_sim("prefill_first", 512))}
    assert slo_met >= max(fixed.values()) and slo_met > 0, (slo_met, fixed)
    plans = [b.plan for b in slo.batches]
    assert any(p.past_deadline for p in plans), "some of the burst could not make its deadline"
    assert not any(p.overloaded for p in plans)
    for i in slo.seqs:  # every stream keeps its floor, met or not
        assert max(slo.gaps(i), default=0) <= HEADROOM * 0.5 + 1e-9


def test_prompt_chunks_go_to_the_nearest_deadline_first():
    sim = slo_sim(budget=256)
    late = sim.add(400, 2, Slo(ttft_s=30.0))
    soon = sim.add(400, 2, Slo(ttft_s=1.0))
    batch = sim.step()
    assert [s.seq_id for s in batch.seqs] == [soon.seq_id]
    sim.run()
    assert sim.ttft(soon.seq_id) <= 1.0 and sim.tokens[soon.seq_id][0] < sim.tokens[late.seq_id][0]


def test_a_request_whose_prompt_is_mostly_cached_is_judged_by_what_is_left_to_compute():
    """A tight first-token deadline that only the cached prefix makes feasible: the request is not given up as
    hopeless (which would put it behind every other waiting request) but served first, in time."""
    sim = slo_sim(budget=512)
    shared = [(j * 13) % 1000 for j in range(2000)]
    first = Sequence(sim.next_id, list(shared), 2000, 1)
    sim.next_id += 1
    sim.sched.add(first)
    sim.seqs[first.seq_id], sim.arrival[first.seq_id], sim.tokens[first.seq_id] = first, 0.0, []
    sim.run()  # computes the shared prefix and leaves it cached
    others = [sim.add(400, 2, Slo(ttft_s=10.0)) for _ in range(5)]
    late = sim.next_id
    sim.next_id += 1
    tight = Sequence(late, [*shared, *range(1, 41)], 2040, 2, slo=Slo(ttft_s=0.1))
    sim.sched.add(tight)
    sim.seqs[late], sim.arrival[late], sim.tokens[late] = tight, sim.clock.now, []
    batch = sim.step()
    assert batch.seqs[0].seq_id == late and batch.seqs[0].start >= 2000  # only the uncached tail is computed
    assert sim.ttft(late) <= 0.1
    sim.run()
    assert all(sim.met(s.seq_id, 100.0, 2.0) for s in others)


def test_a_request_that_cannot_meet_its_deadline_yields_but_is_not_starved():
    sim = slo_sim(budget=64, max_overtakes=4)
    hopeless = sim.add(200, 2, Slo(ttft_s=0.001))  # could never make it
    arrivals = {k: [(64, 1)] for k in range(0, 40)}  # a fresh, feasible request that fills a step, before every step
    first_chunk = None
    steps = 0
    while sim.sched.has_work() or steps < 40:
        for prompt_len, max_new in arrivals.get(steps, []):
            sim.add(prompt_len, max_new)
        batch = sim.step()
        if first_chunk is None and any(s.seq_id == hopeless.seq_id for s in batch.seqs):
            first_chunk = steps
        steps += 1
        assert steps < 1000
    # It yielded, and once overtaken max_overtakes times it went first: by the requests of steps 1-4 (the one before
    # step 0 arrived with it).
    assert first_chunk == 5
    assert hopeless.status is SeqStatus.FINISHED


@pytest.mark.parametrize("policy", ["slo", "splitfuse"])
def test_a_stream_resumed_from_a_failed_replica_goes_ahead_of_requests_not_started(policy):
    """A replica takes over a stream whose replica died while a backlog waits. Its client is mid-stream, so it is
    served as a preempted stream is: first, whatever its first-token deadline as a new request would have been (here
    one it could never meet), and then decoded at its floor."""
    sim = slo_sim(budget=64, max_overtakes=4) if policy == "slo" else fixed_sim("splitfuse", 64)
    for _ in range(6):
        sim.add(200, 4, Slo(ttft_s=5.0))  # the backlog: feasible, and ahead of it in arrival
    sim.step()
    resumed = sim.add(40, 20, Slo(ttft_s=0.001), resumed=10)  # 50 tokens to recompute, then 10 more to generate
    # A completion of the same resumed request that had nothing delivered yet: it waits no longer than its sibling.
    sibling = sim.add(40, 20, Slo(ttft_s=0.001), resumed=0)
    sim.run()
    first = {i: next(k for k, b in enumerate(sim.batches) if i in {s.seq_id for s in b.seqs}) for i in sim.seqs}
    # splitfuse finishes the prompt it started first; slo serves the nearest deadline, and the resumed one is nearest.
    # Either way it is admitted before the backlog, its whole context in one chunk.
    for seq in (resumed, sibling):
        k = first[seq.seq_id]
        assert k <= min(first[i] for i in range(1, 6))
        order = [s.seq_id for s in sim.batches[k].seqs]
        assert all(order.index(seq.seq_id) < order.index(i) for i in range(1, 6) if i in order)
    k = first[resumed.seq_id]
    assert next(len(s.token_ids) for s in sim.batches[k].seqs if s.seq_id == resumed.seq_id) == 50
    if policy == "slo":
        assert first[resumed.seq_id] == 1
        assert max(sim.gaps(resumed.seq_id)) <= 0.5  # within its floor
    assert len(sim.tokens[resumed.seq_id]) == 10


def test_a_backlog_of_starving_requests_leaves_room_for_one_that_can_still_be_on_time():
    """Starving requests go first, but within a share of each step (STARVING_SHARE): behind a backlog (every waiting
    request overtaken in turn) a fresh request gets a chunk in every step and meets its deadline, and the backlog
    moves in every step."""
    sim = slo_sim(max_overtakes=1)
    backlog = [sim.add(600, 2, Slo(ttft_s=0.001)) for _ in range(20)]  # 12,000 prompt tokens no step order can save
    sim.clock.now += 0.001
    sim.add(32, 2)  # a feasible later request is served first: it overtakes every one of them
    sim.step()

    def starving() -> set[int]:
        return {s.seq_id for s in backlog if s.num_uncomputed > 1 and sim.sched._streams[s.seq_id].passed >= 1}

    assert len(starving()) >= 15
    sim.clock.now += 0.01
    fresh = sim.add(600, 2, Slo(ttft_s=1.0))  # at CPU speed its prompt alone takes ~0.2 s
    while fresh.num_generated == 0:
        waiting = starving()
        batch = sim.step()
        carried = {s.seq_id: len(s.token_ids) for s in batch.seqs[batch.num_decodes :]}
        starved = sum(n for i, n in carried.items() if i in waiting)
        assert starved > 0 or not waiting, "the backlog stood still"
        assert fresh.seq_id in carried or fresh.num_uncomputed <= 1, "the backlog held back a request still on time"
    assert sim.ttft(fresh.seq_id) <= 1.0
    sim.run()


def test_while_requests_starve_one_that_can_still_be_on_time_is_judged_on_the_share_left_to_it():
    """Starving requests take their quarter of the prompt time first (STARVING_SHARE): a request that could make its
    deadline only with all of it is given up while they wait (and served after the requests that can), and is not
    given up when none starves."""

    def given_up(starving: int) -> bool:
        sim = slo_sim()
        for _ in range(starving):
            seq = sim.add(600, 2, Slo(ttft_s=100.0))
            sim.sched._streams[seq.seq_id].passed = sim.sched.config.max_overtakes
        alone = sim.sched.model.chunk_cost(0, 600) / sim.sched._prompt_share(StepShape(), math.inf)
        fresh = sim.add(600, 2, Slo(ttft_s=alone / (1 - STARVING_SHARE / 2)))  # within all, not three quarters
        order = sim.sched._order(StepShape(), math.inf, sim.clock.now, admit=True)
        return sim.sched._streams[fresh.seq_id] in order.hopeless

    assert not given_up(0)
    assert given_up(3)


def overloaded(admission: str) -> Sim:
    """R = 20 (50 ms) with 48 decodes that take ~70 ms alone: even a decode-only step breaks the floors."""
    sim = slo_sim(token_rate=20.0, admission=admission)
    for _ in range(48):
        sim.add(16, 200)
    while any(not sim.tokens[i] for i in sim.seqs):
        sim.step()
    return sim


def test_overload_is_declared_and_prompts_still_move():
    sim = overloaded("refuse")
    late = sim.add(600, 4)
    batch = sim.step()
    assert batch.plan.overloaded and sim.sched.overloaded
    assert 0 < batch.num_prefill_tokens <= OVERLOAD_CHUNK
    assert batch.num_decodes == 48
    lo, hi = RETRY_BOUNDS_S
    assert lo <= sim.sched.refuse_for() <= hi
    sim.run()
    assert sim.ttft(late.seq_id) > 0


def test_overloaded_a_stream_recomputed_mid_way_is_restored_in_one_step_while_new_prompts_stay_capped():
    """A stream resumed from a replica that failed is stalled already: overload caps the prompt tokens of requests
    that have sent nothing, not its recompute."""
    sim = overloaded("keep")
    new = sim.add(600, 4)
    resumed = sim.add(250, 60, resumed=50)  # 10 tokens left to generate here
    batch = sim.step()
    assert batch.plan.overloaded and batch.num_decodes == 48
    chunks = {s.seq_id: len(s.token_ids) for s in batch.seqs if s.seq_id in (new.seq_id, resumed.seq_id)}
    assert chunks[resumed.seq_id] == 300  # its whole context, and its next token at the end of this step
    assert chunks.get(new.seq_id, 0) <= OVERLOAD_CHUNK
    sim.run()
    assert len(sim.tokens[resumed.seq_id]) == 10


def test_keep_admits_while_overloaded_and_nothing_refuses_otherwise():
    sim = overloaded("keep")
    sim.step()
    assert sim.sched.overloaded and sim.sched.refuse_for() is None
    calm = slo_sim(admission="refuse")
    calm.add(16, 4)
    calm.step()
    assert calm.sched.refuse_for() is None
    assert Scheduler(SchedulerConfig(), BlockAllocator(10, 16)).refuse_for() is None


def test_a_request_with_its_own_floor_bounds_the_steps_it_decodes_in():
    sim = slo_sim(token_rate=1.0)
    strict = sim.add(16, 30, Slo(token_rate=10.0))
    sim.add(16, 30)
    sim.step()
    sim.add(3000, 2)  # a long prompt arrives while the strict stream decodes
    sim.run()
    assert max(sim.gaps(strict.seq_id)) <= HEADROOM * 0.1 + 1e-9


def test_a_request_may_only_loosen_the_deployments_service_level():
    """One stream asking for 1e9 tokens/s must not hold the replica overloaded, every other prompt at OVERLOAD_CHUNK
    tokens a step, nor a first token due at once go ahead of everyone: unless the replica allows tightening, a
    request's own slo is clamped to the deployment's (token_rate at most its floor, the first token no sooner than
    prompt_tokens / prompt_rate), and may loosen it."""

    def scenario(allow: bool):
        sim = slo_sim(token_rate=2.0, allow_client_tightening=allow)
        greedy = sim.add(16, 40, Slo(prompt_rate=1e9, ttft_s=1e-3, token_rate=1e9))
        loose = sim.add(16, 40, Slo(ttft_s=100.0, token_rate=0.5))
        for _ in range(3):
            sim.step()
        long = sim.add(3000, 2)
        batch = sim.step()
        chunk = sum(len(s.token_ids) for s in batch.seqs if s.seq_id == long.seq_id)
        streams = sim.sched._streams
        return streams[greedy.seq_id], streams[loose.seq_id], batch.plan.overloaded, chunk

    greedy, loose, overloaded, chunk = scenario(allow=False)
    assert (greedy.gap, greedy.first_due) == (1 / 2.0, 16 / 100.0)  # the deployment's floor and first-token time
    assert (loose.gap, loose.first_due) == (1 / 0.5, 100.0)  # looser than the deployment's: as asked
    assert not overloaded and chunk > OVERLOAD_CHUNK
    greedy, _, overloaded, chunk = scenario(allow=True)
    assert (greedy.gap, greedy.first_due) == (1e-9, 1e-3)
    assert overloaded and chunk <= OVERLOAD_CHUNK


def test_without_a_model_it_packs_like_splitfuse():
    clock = Clock()
    config = SchedulerConfig(64, 8, "slo", max_model_len=10**6)
    sched = SloScheduler(config, BlockAllocator(200, 16), StepModel(), clock)
    sim = Sim(sched, clock, StepModel(CPU, learn=False))
    for _ in range(4):
        sim.add(40, 3)
    batch = sim.step()
    assert batch.num_tokens == 64 and not batch.plan.overloaded
    sim.run()


def test_one_client_gets_every_fixed_schedules_decode_steps_and_its_prompts_in_no_more_passes():
    """One request at a time (the 1-client load, closed loop): nothing is there to schedule around, so `slo` can only
    match the fixed schedules, and it must not do worse. Each request gets a decode step per token as under every
    fixed schedule, its prompt in as few passes as the token cap allows, and so the same work in no more time."""
    rng = random.Random(3)
    requests = [(max(60, round(rng.gauss(600, 180))), max(2, round(rng.gauss(60, 20)))) for _ in range(12)]
    assert any(p > 512 for p, _ in requests), "some prompts must need two passes under a 512-token cap"

    def closed_loop(sim: Sim) -> list[tuple[int, float]]:
        """Per request: steps it took and its latency, each sent when the one before has finished."""
        out = []
        for prompt_len, max_new in requests:
            start, steps = sim.clock.now, len(sim.batches)
            sim.add(prompt_len, max_new)
            sim.run()
            out.append((len(sim.batches) - steps, sim.clock.now - start))
        return out

    slo = closed_loop(slo_sim())
    for fixed in (*(fixed_sim("splitfuse", b) for b in (128, 256, 512)), fixed_sim("prefill_first", 512)):
        policy, cap = fixed.sched.config.policy, fixed.sched.config.max_batch_tokens
        for (prompt_len, max_new), (slo_steps, slo_s), (steps, seconds) in zip(requests, slo, closed_loop(fixed)):
            passes = 1 if policy == "prefill_first" else math.ceil(prompt_len / cap)  # prefill-first: a prompt whole
            assert slo_steps == 1 + (max_new - 1), "one prompt pass, then a decode step per token"
            assert steps == passes + (max_new - 1), (policy, cap)
            assert slo_s == pytest.approx(seconds, rel=1e-12) if passes == 1 else slo_s < seconds


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_with_preemption_finish_with_the_same_tokens_as_splitfuse(seed):
    """A small KV pool preempts and recomputes; prefix caching shares blocks; every request finishes with the tokens
    SplitFuse gives it (the fake model's next token depends only on the sequence so far)."""
    rng = random.Random(seed)
    requests = [(rng.randint(1, 150), rng.randint(1, 30)) for _ in range(rng.randint(1, 24))]
    arrivals = {}
    for r in requests:
        arrivals.setdefault(rng.randint(0, 30), []).append(r)
    largest = max(p + n for p, n in requests)
    num_blocks = -(-largest // 16) + rng.randint(0, 20)
    budget, max_seqs = rng.randint(16, 256), rng.randint(1, 8)

    def tokens(sim: Sim) -> dict[int, list[int]]:
        sim.run(arrivals=arrivals)
        return {i: s.token_ids for i, s in sim.seqs.items()}

    slo = slo_sim(budget, max_seqs, num_blocks, token_rate=rng.choice([1.0, 4.0, 50.0]))
    assert tokens(slo) == tokens(fixed_sim("splitfuse", budget, max_seqs, num_blocks))


def test_a_pool_too_small_for_everyone_preempts_and_recomputes():
    requests = {0: [(40, 30)] * 6}
    slo = slo_sim(budget=64, max_seqs=6, num_blocks=12)  # 192 tokens of KV for 6 x 70
    slo.run(arrivals=requests)
    ref = fixed_sim("splitfuse", 64, max_seqs=6, num_blocks=12)
    ref.run(arrivals=requests)
    assert slo.sched.num_preemptions > 0
    assert {i: s.token_ids for i, s in slo.seqs.items()} == {i: s.token_ids for i, s in ref.seqs.items()}


def test_forked_completions_keep_their_parents_deadlines():
    sim = slo_sim()
    parent = sim.add(40, 6)
    sim.step()  # the prompt, and its first token
    children = [Sequence(100 + k, list(parent.token_ids), parent.num_prompt_tokens, 6) for k in range(2)]
    sim.sched.fork(parent, children)
    for child in children:
        sim.seqs[child.seq_id], sim.arrival[child.seq_id] = child, sim.arrival[parent.seq_id]
        sim.tokens[child.seq_id] = list(sim.tokens[parent.seq_id])
    sim.run()
    for child in children:
        assert sim.gaps(child.seq_id) and max(sim.gaps(child.seq_id)) <= HEADROOM * 0.5 + 1e-9


def test_overhead_per_step_is_small_at_256_sequences():
    """Not a timing assertion: counts the model's predictions per step, which bound the scheduler's own work
    beyond SplitFuse's (one per chunk placed, plus a constant)."""
    sim = slo_sim(budget=4096, max_seqs=256)
    calls = 0
    predict = sim.model.predict

    def counting(shape):
        nonlocal calls
        calls += 1
        return predict(shape)

    sim.sched.model.predict = counting
    for _ in range(256):
        sim.add(8, 50)
    for _ in range(5):
        calls = 0
        batch = sim.sched.schedule()
        assert calls <= 4 + sum(1 for s in batch.seqs if len(s.token_ids) > 1)
        sim.sched.observe(batch)
        for s in batch.seqs:
            if s.sample:
                sim.seqs[s.seq_id].token_ids.append(1)


def test_slo_values_are_validated():
    with pytest.raises(ValueError, match="slo.token_rate"):
        Slo(token_rate=0.0).validate()
    with pytest.raises(ValueError, match="slo.prompt_rate"):
        Slo(prompt_rate=float("nan")).validate()
    with pytest.raises(ValueError, match="slo.ttft_s"):
        Slo(ttft_s=1e9).validate()
    Slo(100.0, 2.0, 4.0).validate()
    with pytest.raises(ValueError, match="admission"):
        SloConfig(admission="drop")
    from fastgen.server.sla import DEFAULT_PROMPT_RATE, DEFAULT_TOKEN_RATES

    assert SloConfig() == SloConfig(DEFAULT_PROMPT_RATE, max(DEFAULT_TOKEN_RATES))  # the replica's flags' defaults
    with pytest.raises(ValueError, match="token_rate"):
        SloConfig(token_rate=-1.0)


def test_scheduler_modules_import_no_torch():
    code = (
        "import sys, fastgen.replica.slo_scheduler, fastgen.replica.step_model, fastgen.replica.batch; "
        "assert 'torch' not in sys.modules and 'grpc' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the per-request Slo on the wire --------------------------------------------------------------------------------
def test_the_proto_slo_becomes_the_engine_slo_or_is_refused():
    from fastgen.proto import fastgen_pb2 as pb
    from fastgen.replica.service import slo_from_proto

    assert slo_from_proto(pb.GenerateRequest(text="hi")) is None
    request = pb.GenerateRequest(text="hi", slo=pb.Slo(ttft_ms=1500, token_rate=4.0))
    assert slo_from_proto(request) == Slo(None, 1.5, 4.0)
    assert slo_from_proto(pb.GenerateRequest(text="hi", slo=pb.Slo())) == Slo()  # zeros: the deployment's
    for bad, name in [(pb.Slo(token_rate=-2.0), "token_rate"), (pb.Slo(prompt_rate=float("nan")), "prompt_rate")]:
        with pytest.raises(ValueError, match=f"slo.{name}"):
            slo_from_proto(pb.GenerateRequest(text="hi", slo=bad))
    with pytest.raises(ValueError, match="slo.ttft_s"):
        slo_from_proto(pb.GenerateRequest(text="hi", slo=pb.Slo(ttft_ms=2**32 - 1)))


def test_the_python_client_sends_an_slo():
    from fastgen.server.client import build_request

    request = build_request("hi", None, {"slo": {"ttft_ms": 800, "token_rate": 4.0}})
    assert (request.slo.ttft_ms, request.slo.token_rate) == (800, 4.0)
    assert not build_request("hi", None, {}).HasField("slo")


def test_the_openai_body_carries_an_slo():
    from fastgen.balancer.openai_protocol import MAX_SLO_TTFT_MS, ApiError, parse_chat, parse_completion
    from fastgen.replica.request import MAX_SLO_TTFT_S

    assert MAX_SLO_TTFT_MS == MAX_SLO_TTFT_S * 1000
    body = {"model": "m", "prompt": ["a", "b"], "slo": {"ttft_ms": 2000, "token_rate": 4, "prompt_rate": 50}}
    for request in parse_completion(body, "r").prompts:
        assert (request.slo.ttft_ms, request.slo.token_rate, request.slo.prompt_rate) == (2000, 4.0, 50.0)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "slo": {"token_rate": 2}}, "r")
    assert chat.prompts[0].slo.token_rate == 2.0 and chat.prompts[0].slo.ttft_ms == 0
    assert not parse_completion({"model": "m", "prompt": "a"}, "r").prompts[0].HasField("slo")
    for slo, where in [
        ({"ttft_ms": 0}, "slo.ttft_ms"),
        ({"ttft_ms": 1.5}, "slo.ttft_ms"),
        ({"token_rate": 0}, "slo.token_rate"),
        ({"token_rate": "fast"}, "slo.token_rate"),
        ({"prompt_rate": -1}, "slo.prompt_rate"),
        ({"rate": 2}, "slo"),
        ([2, 4], "slo"),
    ]:
        with pytest.raises(ApiError) as e:
            parse_completion({"model": "m", "prompt": "a", "slo": slo}, "r")
        assert e.value.status == 400 and e.value.body()["error"]["param"] == where, slo


def test_an_overloaded_replica_refuses_with_a_retry_hint():
    import asyncio

    from prometheus_client import CollectorRegistry

    from fastgen.replica.engine_loop import EngineLoop, QueueLimits
    from fastgen.replica.outputs import EngineLoad
    from fastgen.replica.request import SamplingParams
    from fastgen.server.errors import QueueFullError, retry_hint_ms, trailing_metadata
    from fastgen.server.metrics import ReplicaMetrics

    class Overloaded:
        class prompts:
            max_token_bytes = 8

        def load(self):
            return EngineLoad(refuse_for_s=2.5)

        def has_unfinished(self):
            return False

    registry = CollectorRegistry()

    async def run():
        loop = EngineLoop(
            lambda: Overloaded(), ReplicaMetrics(registry, "r0", "fake"), QueueLimits(), asyncio.get_running_loop()
        )
        await loop.start()
        try:
            return await asyncio.wait_for(loop.submit("a", "hi", SamplingParams()).get(), 10)
        finally:
            loop.stop()

    refused = asyncio.run(run())
    assert isinstance(refused, QueueFullError) and "overloaded" in str(refused)
    assert retry_hint_ms(refused) == 2500
    import grpc

    assert trailing_metadata(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_hint_ms(refused)) == (
        ("retry-after-ms", "2500"),
    )
    assert registry.get_sample_value("fastgen_slo_shed_requests_total", {"replica": "r0", "model": "fake"}) == 1


# ---- through the engine, on the tiny random model ------------------------------------------------------------------
def slo_pipeline(model_dir, **kw):
    """A pipeline under the slo scheduler, its model fixed so that prompt chunks stay small while anything decodes
    (1 ms a prompt token against a 20 ms floor): a schedule unlike SplitFuse's, chosen by the wall clock."""
    import dataclasses

    from fastgen.replica import pipeline

    pipe = pipeline(str(model_dir), dtype="float32", scheduler="slo", progress=False, **kw)
    sched = pipe.engine.scheduler
    sched.model = StepModel((0.0, 1e-3, 0.0, 0.0, 0.0), learn=False)
    sched.config = dataclasses.replace(sched.config, slo=SloConfig(100.0, 50.0))
    return pipe


def test_greedy_outputs_are_the_same_as_splitfuse(tiny_model_dir):
    from fastgen.replica import pipeline

    from .helpers import assert_matches, random_prompts

    prompts = random_prompts(10, random.Random(3), 1, 120)
    for kw in (
        {"max_batch_tokens": 64, "num_blocks": 128},
        {"max_batch_tokens": 32, "block_size": 4, "num_blocks": 40},
    ):
        ref = pipeline(str(tiny_model_dir), dtype="float32", progress=False, **kw)(
            prompts, max_new_tokens=10, ignore_eos=True
        )
        pipe = slo_pipeline(tiny_model_dir, **kw)
        outs = pipe(prompts, max_new_tokens=10, ignore_eos=True)
        assert_matches(outs, [o.token_ids for o in ref])
        assert pipe.engine.scheduler.allocator.num_used == 0
        assert pipe.engine.scheduler.model.steps > 0


def test_n_completions_and_resumed_streams_under_slo(tiny_model_dir):
    from fastgen.replica import pipeline
    from fastgen.replica.request import Resume, SamplingParams

    def run(engine, rid, **extra):
        params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=5, n=extra.pop("n", 1))
        engine.add_request(rid, [5, 6, 7, 8, 9], params, **extra)
        outs = {}
        while engine.has_unfinished():
            for o in engine.step().outputs:
                if o.finished:
                    outs[o.index] = o.token_ids
        return [outs[i] for i in sorted(outs)]

    ref = pipeline(str(tiny_model_dir), dtype="float32", num_blocks=64, progress=False).engine
    slo = slo_pipeline(tiny_model_dir, num_blocks=64).engine
    assert run(slo, "n", n=3) == run(ref, "n", n=3)
    [whole] = run(ref, "one")
    assert run(slo, "resumed", resume=(Resume(tuple(whole[:3])),)) == [whole]
    assert slo.scheduler.allocator.num_used == 0 and not slo.scheduler._streams


def test_calibration_seeds_the_model_and_steps_carry_the_plan(tiny_model_dir, tmp_path):
    import csv

    from fastgen.replica import pipeline
    from fastgen.replica.request import SamplingParams
    from fastgen.replica.slo_scheduler import calibrate
    from fastgen.replica.step_model import StepTrace

    engine = pipeline(str(tiny_model_dir), dtype="float32", scheduler="slo", num_blocks=256, progress=False).engine
    calibrate(engine)
    model = engine.scheduler.model
    assert model.ready and model.steps >= 8 and all(c >= 0 for c in model.coefficients[1:])
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_used == 0
    engine.add_request(
        "a", list(range(10, 60)), SamplingParams(max_new_tokens=3, ignore_eos=True), slo=Slo(ttft_s=5.0, token_rate=1.0)
    )
    with pytest.raises(ValueError, match="slo.token_rate"):
        engine.add_request("b", [1, 2], SamplingParams(), slo=Slo(token_rate=-1.0))
    trace = StepTrace(tmp_path / "steps.csv")
    while engine.has_unfinished():
        stats = engine.step().stats
        assert stats.plan is not None and stats.plan.predicted_s > 0
        trace.write(0.0, stats)
    trace.close()
    rows = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert len(rows) == 3 and all(float(r["measured_s"]) > 0 for r in rows)


@pytest.mark.slow
def test_smollm2_greedy_under_slo_is_splitfuses_after_a_real_calibration():
    from fastgen.replica import pipeline
    from fastgen.replica.slo_scheduler import calibrate

    prompts = ["The capital of France is", "def fibonacci(n):\n", "Write a haiku about the sea.\n", "List: red,"]
    ref = pipeline("smollm2-135m", dtype="float32", max_batch_tokens=32, progress=False)
    want = [o.token_ids for o in ref(prompts, max_new_tokens=16, min_new_tokens=16)]
    pipe = pipeline("smollm2-135m", dtype="float32", max_batch_tokens=256, scheduler="slo", progress=False)
    calibrate(pipe.engine)
    assert pipe.engine.scheduler.model.ready
    assert [o.token_ids for o in pipe(prompts, max_new_tokens=16, min_new_tokens=16)] == want


# ---- launch: the flags reach the replicas ---------------------------------------------------------------------------
def test_deploy_flags_reach_the_replica_and_its_engine_config(tmp_path):
    from fastgen.launch import cli
    from fastgen.launch import config as cfg
    from fastgen.replica.__main__ import engine_config, parse_args

    start = "start --scheduler slo --admission refuse --sla-prompt-rate 50 --sla-token-rate 1 3 --step-trace-dir"
    args = cli.build_parser().parse_args([*start.split(), str(tmp_path)])
    config = cli.config_from(args)
    assert (config.scheduler, config.admission, config.step_trace_dir) == ("slo", "refuse", str(tmp_path))
    argv = cfg.plan(config, "PY")[2].argv[3:]
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--scheduler"] == "slo" and flags["--admission"] == "refuse"
    assert flags["--step-trace"] == str(tmp_path / "replica-1.csv")
    engine = engine_config(parse_args(argv))
    assert engine.scheduler.policy == "slo"
    assert engine.scheduler.slo == SloConfig(prompt_rate=50.0, token_rate=3.0, admission="refuse")  # the strictest R
    assert "--admission" not in cfg.plan(cfg.DeployConfig(replicas=1), "PY")[1].argv  # keep: the replica's default
    assert any("--admission 'drop'" in p for p in cfg.validate(cfg.DeployConfig(admission="drop")))


def test_the_plan_becomes_metrics():
    from prometheus_client import CollectorRegistry

    from fastgen.replica.batch import StepPlan
    from fastgen.replica.outputs import StepStats
    from fastgen.replica.step_model import StepShape
    from fastgen.server.metrics import ReplicaMetrics

    registry = CollectorRegistry()
    metrics = ReplicaMetrics(registry, "r0", "tiny")
    labels = {"replica": "r0", "model": "tiny"}
    plan = StepPlan(StepShape(100, 4, 400, 5050), 0.08, 0.425, True, 3, 1, 1.25)
    metrics.on_step(StepStats(5, 4, 100, 2048, 0, 0.09, 0.1, 2, 5, 10, 100, plan=plan))
    metrics.on_step(StepStats(1, 1, 0, 2048, 0, 0.01, 0.01, 0, 1, 1, 100))  # another scheduler's step: no plan
    metrics.on_shed()

    def value(name: str) -> float:
        return registry.get_sample_value(name, labels)

    assert value("fastgen_step_predicted_seconds_sum") == pytest.approx(0.08)
    assert value("fastgen_step_model_error_ratio_sum") == pytest.approx(0.2)
    assert value("fastgen_step_model_drift_ratio") == 1.25
    assert value("fastgen_step_time_budget_seconds_sum") == pytest.approx(0.425)
    assert value("fastgen_slo_requests_past_deadline") == 3 and value("fastgen_slo_streams_behind") == 1
    assert value("fastgen_slo_overloaded") == 1 and value("fastgen_slo_overloaded_steps_total") == 1
    assert value("fastgen_slo_shed_requests_total") == 1
    assert value("fastgen_step_seconds_count") == 2


# ---- the serving benchmark: slo as a system, and its steps kept per run ---------------------------------------------
def test_benchmark_systems_name_budgets_floors_and_replicas():
    from fastgen.benchmarks.serving import parse_system

    s = parse_system("slo-t4-b1024")
    assert (s.scheduler, s.token_rate, s.budget, s.replicas) == ("slo", 4.0, 1024, 1)
    s = parse_system("splitfuse-b256-r2")
    assert (s.scheduler, s.budget, s.replicas, s.token_rate) == ("splitfuse", 256, 2, None)
    assert parse_system("prefill_first").budget is None
    for bad in ("slo-x", "splitfuse-b", "slo-t4x", "fifo-b128"):
        with pytest.raises(ValueError, match="unknown system"):
            parse_system(bad)


def test_each_run_keeps_the_steps_its_replicas_traced(tmp_path):
    from fastgen.benchmarks.report import read_steps, steps_report
    from fastgen.benchmarks.serving import StepSlice
    from fastgen.replica.batch import StepPlan
    from fastgen.replica.outputs import StepStats
    from fastgen.replica.step_model import StepShape, StepTrace

    folder = tmp_path / "raw" / "steps" / "slo"
    trace = StepTrace(folder / "replica-0.csv")

    def step(predicted: float, measured: float) -> None:
        plan = StepPlan(StepShape(10, 1, 20, 55), predicted, 0.4, False, 0, 0)
        trace.write(1.0, StepStats(2, 1, 10, 512, 0, measured, measured, 0, 1, 1, 10, plan=plan))

    step(0.5, 0.5)  # before the run: not its
    steps = StepSlice(str(folder))
    step(0.09, 0.1)
    step(0.11, 0.1)
    saved = steps.save(tmp_path / "raw" / "C1" / "slo" / "c1-0.json")
    assert saved.name == "c1-0.steps.csv"
    assert read_steps(tmp_path / "raw")[("C1", "slo")] == [(0.09, 0.1), (0.11, 0.1)]
    assert "| C1 | slo | 2 | 10.0% |" in steps_report(tmp_path / "raw", tmp_path, plots=False)
    assert StepSlice(None).save(tmp_path / "x.json") is None
    assert StepSlice(str(folder)).save(tmp_path / "y.json") is None  # nothing new


def test_a_fixed_budget_run_keeps_its_steps_too_and_its_decode_time_is_summarised(tmp_path):
    from fastgen.benchmarks.report import read_steps
    from fastgen.benchmarks.serving import StepSlice, engine_steps
    from fastgen.replica.outputs import StepStats
    from fastgen.replica.step_model import StepTrace

    folder = tmp_path / "raw" / "steps" / "splitfuse-b512"
    steps = StepSlice(str(folder))
    trace = StepTrace(folder / "replica-0.csv")
    for prompt, seconds in ((600, 2.4), (0, 0.07), (0, 0.06), (0, 0.08)):  # StepStats without a plan
        trace.write(1.0, StepStats(1, 1 if not prompt else 0, prompt, 512, 0, seconds, seconds, 0, 1, 1, 10))
    saved = steps.save(tmp_path / "raw" / "C1" / "splitfuse-b512" / "c1-0.json")
    summary = engine_steps(saved)
    assert (summary["steps"], summary["decode_steps"]) == (4, 3)
    assert summary["decode_p50_ms"] == pytest.approx(70.0) and summary["busy_s"] == pytest.approx(2.61)
    assert read_steps(tmp_path / "raw") == {}  # no predictions: nothing for the model's error


def test_the_schedule_simulation_serves_every_request_and_fits_its_model_from_a_trace(tmp_path):
    """benchmarks/schedule_sim: closed-loop clients against the schedulers on a simulated engine. At one client
    every schedule meets every request's SLA; runs are reproducible; a step trace gives back the coefficients its
    steps were timed with."""
    import random

    from fastgen.benchmarks.schedule_sim import fit, simulate
    from fastgen.benchmarks.serving import parse_system
    from fastgen.benchmarks.workload import parse_workload
    from fastgen.replica.batch import StepPlan
    from fastgen.replica.outputs import StepStats
    from fastgen.replica.step_model import StepShape, StepTrace

    c1 = parse_workload("C1")
    for name in ("slo-b2048", "splitfuse-b128", "prefill_first"):
        one = simulate(parse_system(name), c1, 1, 5, list(CPU))
        assert (one.requests, one.met) == (5, 5) and one.duration_s > 0
    busy = [simulate(parse_system("slo-b2048"), c1, 16, 28, list(CPU), seed=1) for _ in range(2)]
    assert busy[0] == busy[1] and 0 < busy[0].met <= 28

    trace = StepTrace(tmp_path / "replica-0.csv")
    rng = random.Random(0)
    for _ in range(300):
        shape = StepShape(rng.randrange(0, 512), rng.randrange(0, 32), rng.randrange(0, 20000), rng.randrange(0, 10**5))
        seconds = sum(c * x for c, x in zip(CPU, shape.vector()))
        trace.write(
            0.0, StepStats(1, 1, 1, 512, 0, seconds, seconds, 0, 1, 1, 10, plan=StepPlan(shape, 0, 1, False, 0, 0))
        )
    trace.close()
    assert fit(str(tmp_path / "replica-0.csv")) == pytest.approx(list(CPU), rel=1e-3, abs=1e-9)
