"""Scheduler and block allocator, without torch or weights: a simulated engine drives random workloads."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen.replica.block_allocator import BlockAllocator
from fastgen.replica.config import SchedulerConfig
from fastgen.replica.request import SeqStatus, Sequence
from fastgen.replica.scheduler import Scheduler


def fake_token(seq: Sequence) -> int:
    """A deterministic 'model': the next token depends only on the sequence's tokens so far."""
    return (sum(seq.token_ids) * 31 + len(seq.token_ids)) % 1000


def simulate(policy, budget, max_seqs, num_blocks, block_size, requests, max_steps=20000):
    """Runs requests [(prompt_len, max_new)] to completion, checking invariants at every step.
    Returns (final tokens per request, steps, batches)."""
    sched = Scheduler(
        SchedulerConfig(budget, max_seqs, policy, max_model_len=10**6), BlockAllocator(num_blocks, block_size)
    )
    seqs = []
    for i, (prompt_len, max_new) in enumerate(requests):
        seq = Sequence(i, [(i * 7 + j) % 1000 for j in range(prompt_len)], prompt_len, max_new)
        sched.add(seq)
        seqs.append(seq)
    by_id = {s.seq_id: s for s in seqs}
    batches = []
    steps = 0
    while sched.has_work():
        steps += 1
        assert steps < max_steps, "no progress: the scheduler stalled"
        decoding_before = [s for s in sched.running if s.num_uncomputed == 1]
        batch = sched.schedule()
        batches.append(batch)
        assert batch.num_tokens <= budget or (policy != "splitfuse" and batch.num_decodes == 0)
        assert len(batch.seqs) <= max_seqs
        assert len({s.seq_id for s in batch.seqs}) == len(batch.seqs)
        scheduled = {s.seq_id for s in batch.seqs}
        if policy == "splitfuse":
            # Decodes are never skipped while they keep their blocks.
            for s in decoding_before:
                assert s.seq_id in scheduled or s.seq_id in batch.preempted
            assert all(len(s.token_ids) == 1 for s in batch.seqs[: batch.num_decodes])
        used = set().union(*(s.block_table for s in sched.running))
        assert len(used) == sched.allocator.num_used <= num_blocks
        for s in batch.seqs:
            seq = by_id[s.seq_id]
            assert seq.token_ids[s.start : s.start + len(s.token_ids)] == s.token_ids
            assert len(s.block_table) * block_size >= s.start + len(s.token_ids)
            if s.sample:
                seq.token_ids.append(fake_token(seq))
                if seq.num_generated >= seq.max_new_tokens:
                    sched.finish(seq)
    assert sched.allocator.num_free == num_blocks
    assert all(s.status is SeqStatus.FINISHED for s in seqs)
    return [s.token_ids for s in seqs], steps, batches


request_lists = st.lists(st.tuples(st.integers(1, 120), st.integers(1, 24)), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(
    requests=request_lists,
    budget=st.integers(8, 96),
    max_seqs=st.integers(1, 8),
    block_size=st.sampled_from([1, 4, 16]),
    spare_blocks=st.integers(0, 40),
    policy=st.sampled_from(["splitfuse", "prefill_first", "static"]),
)
def test_random_workloads_finish_with_invariants(requests, budget, max_seqs, block_size, spare_blocks, policy):
    largest = max(p + n for p, n in requests)
    num_blocks = -(-largest // block_size) + spare_blocks
    tokens, _, _ = simulate(policy, budget, max_seqs, num_blocks, block_size, requests)
    # Preemption and recompute never change what is generated: compare with an unconstrained run.
    reference, _, _ = simulate(policy, 10**4, 64, 10**5, block_size, requests)
    assert tokens == reference


def test_budget_is_filled_exactly_by_packing_and_splitting():
    _, _, batches = simulate("splitfuse", 64, 16, 1000, 16, [(100, 4), (30, 4), (10, 4), (50, 4)])
    first = batches[0]
    assert first.num_tokens == 64 and [len(s.token_ids) for s in first.seqs] == [64]
    second = batches[1]
    # Rest of the long prompt (36), then the next prompts packed and the last one split to fill the budget.
    assert [len(s.token_ids) for s in second.seqs] == [36, 28]
    assert second.num_tokens == 64


def test_long_prompt_spans_steps_and_decodes_go_first():
    _, _, batches = simulate("splitfuse", 32, 8, 1000, 16, [(8, 20), (200, 2)])
    # Once the short request decodes, every later batch starts with its decode token.
    mixed = [b for b in batches if b.num_decodes and b.num_prefill_tokens]
    assert len(mixed) >= 5  # the 200-token prompt is spread over several passes beside the decode
    assert all(b.num_tokens == 32 for b in mixed[:-1])  # full budgets until the prompt's tail


def test_preemption_happens_and_recomputes():
    sched_tokens, _, batches = simulate("splitfuse", 64, 8, 12, 4, [(20, 20)] * 4)
    preempted = [(i, seq_id) for i, b in enumerate(batches) for seq_id in b.preempted]
    assert preempted
    for i, seq_id in preempted:
        # its next pass recomputes it as a prompt from a block boundary (those before it may be prefix-cache hits),
        # not as a decode of its next token
        again = next(s for b in batches[i + 1 :] for s in b.seqs if s.seq_id == seq_id)
        assert again.start % 4 == 0 and len(again.token_ids) > 1
    roomy_tokens, _, roomy = simulate("splitfuse", 64, 8, 1000, 4, [(20, 20)] * 4)
    assert not any(b.preempted for b in roomy)
    assert sched_tokens == roomy_tokens  # and every request ends exactly as it does without preemption


def test_big_request_is_not_starved_by_a_stream_of_small_ones():
    # Pool of 40 blocks of 4 tokens; a 120-token prompt needs 30 blocks for its first 64-token chunk... it must
    # eventually run even though many small requests keep arriving behind it.
    sched = Scheduler(SchedulerConfig(64, 8, "splitfuse", 10**6), BlockAllocator(40, 4))
    small = [Sequence(i, [1] * 8, 8, 30) for i in range(8)]
    for s in small:
        sched.add(s)
    big = Sequence(100, [2] * 120, 120, 10)
    sched.add(big)
    next_id = 200
    for _ in range(2000):
        if big.status is SeqStatus.RUNNING:
            break
        sched.add(Sequence(next_id, [3] * 8, 8, 30))  # a new small request every step
        next_id += 1
        for s in sched.schedule().seqs:
            seq = next(q for q in sched.running if q.seq_id == s.seq_id)
            if s.sample:
                seq.token_ids.append(5)
                if seq.num_generated >= seq.max_new_tokens:
                    sched.finish(seq)
    assert big.status is SeqStatus.RUNNING, "the big request was starved"


def test_request_that_can_never_fit_is_refused():
    sched = Scheduler(SchedulerConfig(64, 8, "splitfuse", 100), BlockAllocator(10, 4))
    with pytest.raises(ValueError, match="exceeds the context of 100 tokens"):
        sched.add(Sequence(0, [1] * 90, 90, 20))
    with pytest.raises(ValueError, match="needs 13 KV blocks but the whole pool has 10"):
        sched.add(Sequence(1, [1] * 40, 40, 10))
    sched.add(Sequence(2, [1] * 30, 30, 10))  # exactly the pool


def test_prefill_first_runs_whole_prompts_and_decodes_wait():
    _, _, batches = simulate("prefill_first", 64, 8, 1000, 16, [(40, 5), (100, 5), (10, 5)])
    assert [len(s.token_ids) for s in batches[0].seqs] == [40]  # 40 + 100 exceeds the budget
    assert [len(s.token_ids) for s in batches[1].seqs] == [100]  # decodes of the first wait
    assert all(b.num_decodes in (0, len(b.seqs)) for b in batches)  # never mixed


def test_static_batches_run_to_completion_before_admitting():
    _, _, batches = simulate("static", 512, 2, 1000, 16, [(10, 3), (10, 6), (10, 2)])
    assert {s.seq_id for s in batches[0].seqs} == {0, 1}
    third = next(i for i, b in enumerate(batches) if any(s.seq_id == 2 for s in b.seqs))
    assert all(s.seq_id != 0 and s.seq_id != 1 for b in batches[third:] for s in b.seqs)
    assert third == 6  # the first batch ran its longest request's 6 tokens first


def test_allocator_free_list():
    alloc = BlockAllocator(4, 16)
    table: list[int] = []
    assert alloc.allocate(table, 33) == table and len(table) == 3 and alloc.num_free == 1
    assert alloc.allocate(table, 40) == [] and len(table) == 3
    assert alloc.allocate(table, 65) is None and len(table) == 3 and alloc.num_free == 1
    assert alloc.allocate(table, 64) == table[3:] and alloc.num_free == 0
    alloc.free(table)
    assert table == [] and alloc.num_free == 4


def test_scheduler_modules_import_no_torch():
    code = "import sys, fastgen.replica.scheduler, fastgen.replica.block_allocator; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("max_overtakes, small_admitted", [(16, True), (0, False)])
def test_max_overtakes_bounds_how_often_a_waiting_request_is_passed(max_overtakes, small_admitted):
    config = SchedulerConfig(64, 8, "splitfuse", 10**6, max_overtakes=max_overtakes, watermark=0.0)
    sched = Scheduler(config, BlockAllocator(10, 4))
    sched.add(Sequence(0, [1] * 32, 32, 4))  # takes 8 of the 10 blocks
    sched.schedule()
    big, small = Sequence(1, [2] * 16, 16, 4), Sequence(2, [3] * 4, 4, 4)  # 4 blocks (do not fit) and 1 block
    sched.add(big)
    sched.add(small)
    scheduled = {s.seq_id for s in sched.schedule().seqs}
    assert (small.seq_id in scheduled) is small_admitted and big.seq_id not in scheduled


@pytest.mark.parametrize("field, value", [("max_overtakes", -1), ("watermark", 1.0), ("watermark", -0.1)])
def test_scheduler_config_refuses_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


# ---- forks: the n completions of one prompt -------------------------------------------------------------------
def fork_setup(num_blocks: int, max_seqs: int = 8, prompt: int = 10):
    """A scheduler whose one sequence has just computed its prompt, and three children to fork from it."""
    sched = Scheduler(SchedulerConfig(64, max_seqs, "splitfuse", 1000), BlockAllocator(num_blocks, 4))
    parent = Sequence(0, list(range(prompt)), prompt, 5)
    sched.add(parent)
    sched.schedule()
    children = [Sequence(i, list(parent.token_ids), prompt, 5) for i in (1, 2, 3)]
    return sched, parent, children


def sample_all(seqs) -> None:
    for seq in seqs:
        seq.token_ids.append(fake_token(seq))


def test_fork_shares_full_blocks_and_copies_the_partial_one_in_the_next_batch():
    sched, parent, children = fork_setup(num_blocks=20)
    assert sched.fork(parent, children) == 3
    assert all(c.status is SeqStatus.RUNNING and c.num_computed == 10 and len(c.block_table) == 3 for c in children)
    assert all(c.block_table[:2] == parent.block_table[:2] for c in children)  # 10 tokens: 2 full blocks of 4
    assert [sched.allocator.refs(b) for b in parent.block_table] == [4, 4, 1]
    sample_all([parent, *children])
    batch = sched.schedule()
    assert batch.copies == [(parent.block_table[2], c.block_table[2]) for c in children]
    assert [s.seq_id for s in batch.seqs] == [0, 1, 2, 3] and batch.num_decodes == 4
    assert all(s.start == 10 for s in batch.seqs)
    sample_all([parent, *children])
    assert sched.schedule().copies == []  # carried once


def test_fork_short_of_blocks_or_seats_leaves_children_to_be_recomputed():
    # 6 blocks: the parent holds 3, two children take one each for the partial block, the watermark keeps one.
    sched, parent, children = fork_setup(num_blocks=6)
    assert sched.fork(parent, children) == 2
    waiting = children[2]
    assert waiting.status is SeqStatus.WAITING and waiting.num_computed == 0 and waiting.block_table == []
    assert list(sched.waiting) == [waiting]
    sched, parent, children = fork_setup(num_blocks=40, max_seqs=2)
    assert sched.fork(parent, children) == 1
    assert list(sched.waiting) == children[1:]  # in index order, ahead of newer requests


def test_copies_into_freed_blocks_are_dropped():
    sched, parent, children = fork_setup(num_blocks=20)
    sched.fork(parent, children)
    sched.finish(children[0])  # e.g. its first token was EOS: its blocks may serve anyone now
    sample_all([parent, *children[1:]])
    batch = sched.schedule()
    assert {d for _, d in batch.copies} == {children[1].block_table[2], children[2].block_table[2]}
    assert [sched.allocator.refs(b) for b in parent.block_table] == [3, 3, 1]  # the shared blocks lost one holder


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(1, 4)), min_size=1, max_size=8),
    budget=st.integers(8, 64),
    max_seqs=st.integers(1, 8),
    spare_blocks=st.integers(0, 30),
)
def test_random_workloads_with_forks_finish_and_free_every_block(requests, budget, max_seqs, spare_blocks):
    block_size = 4
    num_blocks = -(-max(p + m for p, m, _ in requests) // block_size) + spare_blocks
    sched = Scheduler(SchedulerConfig(budget, max_seqs, "splitfuse", 10**6), BlockAllocator(num_blocks, block_size))
    seqs, pending = {}, {}
    for i, (p, m, n) in enumerate(requests):
        seqs[i] = Sequence(i, [(i * 7 + j) % 1000 for j in range(p)], p, m)
        pending[i] = n
        sched.add(seqs[i])
    next_id, children_of = len(requests), {}
    for _ in range(20000):
        if not sched.has_work():
            break
        batch = sched.schedule()
        running = {s.seq_id: s for s in sched.running}
        dsts = [d for _, d in batch.copies]
        assert len(set(dsts)) == len(dsts)
        assert all(any(d in running[c].block_table for c in running if c in children_of) for d in dsts)
        for s in batch.seqs:
            seq = seqs[s.seq_id]
            if not s.sample:
                continue
            if pending.pop(seq.seq_id, 1) > 1:
                kids = [
                    Sequence(next_id + k, list(seq.token_ids), seq.num_prompt_tokens, seq.max_new_tokens)
                    for k in range(requests[seq.seq_id][2] - 1)
                ]
                next_id += len(kids)
                seqs.update({k.seq_id: k for k in kids})
                children_of.update({k.seq_id: seq.seq_id for k in kids})
                sched.fork(seq, kids)
                for kid in kids:
                    kid.token_ids.append(fake_token(kid))
            seq.token_ids.append(fake_token(seq))
        for seq in list(seqs.values()):
            if seq.status is not SeqStatus.FINISHED and seq.num_generated >= seq.max_new_tokens:
                sched.finish(seq)
    assert not sched.has_work() and sched.allocator.num_free == num_blocks
    for kid, parent in children_of.items():
        assert seqs[kid].token_ids == seqs[parent].token_ids  # the fake model continues a copy identically
