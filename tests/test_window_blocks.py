"""KV blocks outside every layer's attention window are given back: a model whose every layer has a sliding window
(Mistral v0.1) runs a sequence far longer than its KV pool, at bounded memory, and still equals transformers; the
scheduler never holds more than window + budget tokens of blocks for a sequence, leaks none, and its step-time model
counts only the key rows a window lets a token read."""

from __future__ import annotations

import pytest

from fastgen.replica.block_allocator import BlockAllocator
from fastgen.replica.config import SchedulerConfig
from fastgen.replica.request import Sequence
from fastgen.replica.scheduler import Scheduler
from fastgen.replica.slo_scheduler import SloScheduler
from fastgen.replica.step_model import StepModel, chunk_context, decode_context

WINDOW = 8


def fake_token(seq: Sequence) -> int:
    return (sum(seq.token_ids) * 31 + len(seq.token_ids)) % 1000


def check_table(sched: Scheduler, seq: Sequence) -> int:
    """The invariants of a table that gave blocks back; returns the blocks it holds."""
    alloc, table, released = sched.allocator, seq.block_table, seq.num_released
    held = table[released:]
    assert all(alloc.refs(b) > 0 for b in held)
    assert all(b == table[released] for b in table[:released]), "released entries alias the first held block"
    if seq.num_computed:  # every key a next query may read lies in a held block
        first_key = max(0, seq.num_computed - WINDOW + 1)
        assert first_key // alloc.block_size >= released
    return len(held)


def run(sched: Scheduler, seqs: list[Sequence], max_steps: int = 5000) -> tuple[int, int]:
    """Steps a simulated engine until every sequence is done; returns (steps, the most blocks one sequence held)."""
    most = steps = 0
    while sched.has_work():
        steps += 1
        assert steps < max_steps, "no progress"
        batch = sched.schedule()
        by_id = {s.seq_id: s for s in seqs}
        for s in sched.running:
            most = max(most, check_table(sched, s))
        for scheduled in batch.seqs:
            seq = by_id[scheduled.seq_id]
            if scheduled.sample:
                seq.token_ids.append(fake_token(seq))
                if seq.num_generated >= seq.max_new_tokens:
                    sched.finish(seq)
        sched.observe(batch)
    return steps, most


@pytest.mark.parametrize("policy", ["splitfuse", "slo"])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("block_size", [4, 5])
def test_a_sequence_runs_past_the_pool_holding_only_its_window(policy, prefix_caching, block_size):
    budget, num_blocks = 8, 6
    config = SchedulerConfig(budget, 4, policy, max_model_len=10**4, kv_window=WINDOW)
    alloc = BlockAllocator(num_blocks, block_size, prefix_caching)
    sched = (SloScheduler if policy == "slo" else Scheduler)(config, alloc)
    seqs = [Sequence(i, [(7 * i + j) % 1000 for j in range(20 + i)], 20 + i, 150) for i in range(3)]
    for s in seqs:
        sched.add(s)
    _, most = run(sched, seqs)
    assert all(s.num_tokens > 5 * num_blocks * block_size for s in seqs)  # far past what the pool holds
    assert most <= alloc.blocks_for(WINDOW + budget) + 1  # the bound check_fits admits on
    assert alloc.num_free == num_blocks and all(alloc.refs(b) == 0 for b in range(num_blocks))
    assert all(s.num_released == 0 and not s.block_table for s in seqs)


def test_without_a_window_such_a_sequence_is_refused():
    config = SchedulerConfig(8, 4, "splitfuse", max_model_len=10**4)
    sched = Scheduler(config, BlockAllocator(6, 4))
    with pytest.raises(ValueError, match="needs 43 KV blocks but the whole pool has 6"):
        sched.add(Sequence(0, list(range(20)), 20, 150))


def test_whole_prompt_schedules_keep_the_whole_sequence_bound():
    """prefill_first and static compute a prompt in one pass: its blocks all at once, window or not."""
    config = SchedulerConfig(64, 4, "prefill_first", max_model_len=10**4, kv_window=WINDOW)
    sched = Scheduler(config, BlockAllocator(6, 4))
    with pytest.raises(ValueError, match="whole pool has 6"):
        sched.add(Sequence(0, list(range(40)), 40, 10))


def test_children_forked_past_the_window_share_only_the_held_blocks():
    config = SchedulerConfig(8, 4, "splitfuse", max_model_len=10**4, kv_window=WINDOW)
    alloc = BlockAllocator(20, 4, prefix_caching=True)
    sched = Scheduler(config, alloc)
    parent = Sequence(0, list(range(30)), 30, 40)
    sched.add(parent)
    while parent.num_computed < 30:  # the prompt, in chunks of 8: the last began at 24, past two blocks' window
        sched.schedule()
    assert parent.num_released == (24 - WINDOW) // 4
    # As the engine forks n completions: each draws its own first token from the prompt's last logits.
    children = [Sequence(i, list(parent.token_ids), 30, 40) for i in (1, 2)]
    for i, seq in enumerate([parent, *children]):
        seq.token_ids.append(100 + i)
    assert sched.fork(parent, children) == 2
    for child in children:
        assert child.num_released == parent.num_released
        check_table(sched, child)
    _, most = run(sched, [parent, *children])
    assert most <= alloc.blocks_for(WINDOW + 8) + 1
    assert alloc.num_free == 20 and all(alloc.refs(b) == 0 for b in range(20))


def test_the_step_model_counts_only_the_rows_a_window_lets_a_token_read():
    for window in (None, 5, 37):
        for start in range(0, 90, 7):
            for n in range(0, 50, 3):
                rows = sum(p + 1 if window is None else min(p + 1, window) for p in range(start, start + n))
                assert chunk_context(start, n, window) == rows
        assert decode_context([0, 10, 100], window) == sum(
            s + 1 if window is None else min(s + 1, window) for s in (0, 10, 100)
        )
    # chunk_fitting: the most tokens whose cost fits, on each side of the window
    for window in (None, 40):
        model = StepModel((0.01, 1e-4, 1e-3, 1e-6, 1e-6), learn=False, window=window)
        for start in (0, 10, 39, 40, 500):
            for seconds in (1e-3, 1e-2, 0.1):
                n = model.chunk_fitting(start, seconds)
                assert model.chunk_cost(start, n) <= seconds < model.chunk_cost(start, n + 1)
    late = StepModel((0.01, 1e-4, 1e-3, 1e-6, 1e-6), learn=False, window=40).chunk_fitting(500, 0.01)
    assert late > StepModel((0.01, 1e-4, 1e-3, 1e-6, 1e-6), learn=False).chunk_fitting(500, 0.01)


@pytest.mark.slow
def test_mistral_runs_past_its_pool_and_equals_transformers(tmp_path):
    """A tiny Mistral with an 8-token window on every layer generates 60 tokens after its prompt from a pool of 24
    tokens (6 blocks of 4), on the torch and the C kernels, prefix caching on (a second run finds the first's blocks
    the window gave back still cached) and off: transformers' eager greedy tokens, token for token."""
    from fastgen.replica import pipeline

    from .helpers import assert_matches
    from .test_model_families import hf_greedy_eager, make_family_model, prompts_for

    folder = make_family_model(tmp_path / "mistral", "mistral-window")
    prompts = prompts_for(3, n=2)
    new = 60
    refs = hf_greedy_eager(folder, prompts, new)
    for kernels in ("torch", "cpu"):
        for prefix_caching in (True, False):
            pipe = pipeline(
                str(folder),
                dtype="float32",
                kernels=kernels,
                progress=False,
                max_batch_tokens=8,
                max_seqs=4,
                block_size=4,
                num_blocks=6,
                prefix_caching=prefix_caching,
            )
            assert pipe.engine.scheduler.config.kv_window == WINDOW
            for _ in range(2):
                outs = pipe(prompts, max_new_tokens=new, min_new_tokens=new)
                assert_matches(outs, refs)
            assert all(len(p) + new > 6 * 4 for p in prompts)
            assert pipe.engine.scheduler.allocator.num_free == 6
