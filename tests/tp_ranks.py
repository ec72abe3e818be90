"""What each rank runs in the tensor-parallel tests: gloo groups of spawned processes on the CPU.

`run_ranks(fn, *args)` starts `world` processes that each call fn(rank, world, port, *args) and waits for all of
them within a deadline; an exception in any rank fails the test with that rank's traceback.

`python -m fastgen.tests.tp_ranks MODE` (RANK etc. in the environment) runs one rank of a replica through
tp_worker.run_tensor_parallel, as `python -m fastgen.replica --tp 2` does, with the model and the server stubbed
out (see exit_rank)."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fastgen.replica.batch_broadcast import exit_now
from fastgen.testing import free_port


def rank_main(rank: int, fn, *args) -> None:
    """fn(rank, *args), then the process's end without interpreter finalization, as a replica's rank ends
    (replica/tp_worker.py): a gloo worker thread may still be releasing the last collective when finalization
    begins, and dies of SIGABRT asking for the GIL (batch_broadcast.exit_now), which failed a test about once in 20
    runs on a loaded 2-core host. An exception in fn still reaches the parent with its traceback."""
    fn(rank, *args)
    exit_now(0)


def run_ranks(fn, *args, world: int = 2, timeout: float = 120.0) -> None:
    ctx = mp.start_processes(
        rank_main, args=(fn, world, free_port(), *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):  # raises ProcessRaisedException / ProcessExitedException on a failure
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} ranks still running after {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)


def init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


# ---- layers ---------------------------------------------------------------------------------------------------
def layers_rank(rank: int, world: int, port: int) -> None:
    """Every parallel layer against its single-process version on the same full weights."""
    from fastgen.replica.parallel import TPGroup

    init(rank, world, port)
    tp, single = TPGroup(rank, world), TPGroup(0, 1)
    torch.manual_seed(0)  # every rank draws the same full weights and inputs
    check_column(tp, single)
    for heads, kv_heads in ((4, 2), (4, 4), (4, 1), (2, 1)):  # split, split, replicated, replicated
        check_qkv(tp, single, heads, kv_heads)
    check_row(tp, single)
    check_embedding_and_head(tp, single, vocab=11)  # not divisible by the ranks: the last shard is padded
    check_embedding_and_head(tp, single, vocab=12)
    assert tp.agree_min(100 + rank) == 100
    assert tp.agree_min(7 - rank, dist.new_group(backend="gloo")) == 6  # a group of its own, as the broadcast's
    dist.destroy_process_group()


def check_column(tp, single) -> None:
    from fastgen.replica.parallel import ColumnParallelLinear

    gate, up, bias_gate, bias_up = torch.randn(24, 16), torch.randn(24, 16), torch.randn(24), torch.randn(24)
    x = torch.randn(5, 16)
    full, part = ColumnParallelLinear(16, [24, 24], True, single), ColumnParallelLinear(16, [24, 24], True, tp)
    for layer in (full, part):
        for i, (w, b) in enumerate(((gate, bias_gate), (up, bias_up))):
            layer.load("weight", w, i)
            layer.load("bias", b, i)
    y, y_local = full(x), part(x)  # (5, 48), (5, 48 / tp)
    n = 24 // tp.size
    g, u = y[:, :24], y[:, 24:]
    expected = torch.cat([g[:, tp.rank * n : (tp.rank + 1) * n], u[:, tp.rank * n : (tp.rank + 1) * n]], dim=-1)
    torch.testing.assert_close(y_local, expected)
    assert part.weight.shape == (48 // tp.size, 16)  # only this rank's shard is held


def check_qkv(tp, single, heads: int, kv_heads: int, head_dim: int = 4, hidden: int = 16) -> None:
    from fastgen.replica.parallel import QKVParallelLinear

    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    bq, bk, bv = (torch.randn(n * head_dim) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(3, hidden)
    full = QKVParallelLinear(hidden, heads, kv_heads, head_dim, True, single)
    part = QKVParallelLinear(hidden, heads, kv_heads, head_dim, True, tp)
    for layer in (full, part):
        for i, (w, b) in enumerate(((q, bq), (k, bk), (v, bv))):
            layer.load("weight", w, i)
            layer.load("bias", b, i)
    yq, yk, yv = full(x).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    local_heads, local_kv = heads // tp.size, max(1, kv_heads // tp.size)
    assert (part.heads, part.kv_heads) == (local_heads, local_kv)
    pq, pk, pv = part(x).split([local_heads * head_dim, local_kv * head_dim, local_kv * head_dim], -1)
    torch.testing.assert_close(pq, yq[:, tp.rank * local_heads * head_dim : (tp.rank + 1) * local_heads * head_dim])
    # The KV heads this rank's query heads attend to: its share, or with fewer KV heads than ranks, a replica.
    first_kv = tp.rank * local_kv if kv_heads >= tp.size else tp.rank * kv_heads // tp.size
    group = heads // kv_heads
    assert all((tp.rank * local_heads + h) // group in range(first_kv, first_kv + local_kv) for h in range(local_heads))
    span = slice(first_kv * head_dim, (first_kv + local_kv) * head_dim)
    torch.testing.assert_close(pk, yk[:, span])
    torch.testing.assert_close(pv, yv[:, span])


def check_row(tp, single) -> None:
    from fastgen.replica.parallel import RowParallelLinear

    w, b, x = torch.randn(16, 32), torch.randn(16), torch.randn(7, 32)
    full, part = RowParallelLinear(32, 16, True, single), RowParallelLinear(32, 16, True, tp)
    for layer in (full, part):
        layer.load("weight", w), layer.load("bias", b)
    n = 32 // tp.size
    torch.testing.assert_close(part(x[:, tp.rank * n : (tp.rank + 1) * n]), full(x))  # all-reduced partial sums
    torch.testing.assert_close(full(x), F.linear(x, w, b))


def check_embedding_and_head(tp, single, vocab: int, hidden: int = 8) -> None:
    from fastgen.replica.parallel import ParallelLMHead, VocabParallelEmbedding

    table, head = torch.randn(vocab, hidden), torch.randn(vocab, hidden)
    ids, h = torch.arange(vocab), torch.randn(4, hidden)
    full, part = VocabParallelEmbedding(vocab, hidden, single), VocabParallelEmbedding(vocab, hidden, tp)
    for layer in (full, part):
        layer.load("weight", table)
    torch.testing.assert_close(part(ids.flip(0)), full(ids.flip(0)))
    torch.testing.assert_close(full(ids), table)
    assert part.weight.shape[0] == -(-vocab // tp.size)
    for tied in (True, False):
        full_head, part_head = ParallelLMHead(full, tied, single), ParallelLMHead(part, tied, tp)
        if not tied:
            full_head.load("weight", head), part_head.load("weight", head)
        expected = F.linear(h, table if tied else head)  # (4, vocab)
        torch.testing.assert_close(full_head(h), expected)
        torch.testing.assert_close(part_head(h), expected)  # gathered: every rank sees the whole row


# ---- batch broadcast ------------------------------------------------------------------------------------------
def broadcast_rank(rank: int, world: int, port: int, batches: list) -> None:
    from fastgen.replica.batch_broadcast import BatchBroadcast

    init(rank, world, port)
    channel = BatchBroadcast(rank)
    if rank == 0:
        for batch in batches:
            channel.send(batch)
        channel.stop()
    else:
        received = []
        while (batch := channel.receive()) is not None:
            received.append(batch)
        assert received == batches, received
    dist.destroy_process_group()


# ---- the engine -----------------------------------------------------------------------------------------------
def engine_rank(rank: int, world: int, port: int, runs: list[dict], out: str) -> None:
    """Rank 0 runs each run's prompts through a tensor-parallel engine; the other ranks follow. Rank 0 writes the
    tokens (and preemptions), every rank what it holds, to out (JSON)."""
    from fastgen.replica.batch_broadcast import BatchBroadcast
    from fastgen.replica.builder import build_engine, build_runner
    from fastgen.replica.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
    from fastgen.replica.offline import Pipeline
    from fastgen.replica.parallel import TPGroup

    init(rank, world, port)
    tp, channel = TPGroup(rank, world), BatchBroadcast(rank)
    results = []
    for run in runs:
        lora = run.get("lora")  # LoRA adapters: modules [[name, folder]], max_loras, max_rank, names (one per prompt)
        lora_config = LoraConfig()
        if lora is not None:
            modules = tuple(map(tuple, lora["modules"]))
            lora_config = LoraConfig(True, modules, lora["max_loras"], lora["max_rank"])
        config = EngineConfig(
            model=run["model"],
            dtype="float32",
            progress=False,
            scheduler=SchedulerConfig(max_batch_tokens=run["budget"], max_seqs=min(64, run["budget"])),
            cache=CacheConfig(block_size=run.get("block_size", 16), num_blocks=run.get("num_blocks", 256)),
            enable_expert_parallel=run.get("expert_parallel", False),
            lora=lora_config,
            quantization=run.get("quantization", EngineConfig.quantization),
            kernels=run.get("kernels", EngineConfig.kernels),
        )
        if rank == 0:
            engine = build_engine(config, tp, channel)
            names = lora["names"] if lora is not None else ""
            outs = Pipeline(engine)(run["prompts"], lora=names, max_new_tokens=run["new"], min_new_tokens=run["new"])
            channel.stop()
            runner = engine.runner
            results.append({"tokens": [o.token_ids for o in outs], "preemptions": engine.scheduler.num_preemptions})
        else:
            runner, _ = build_runner(config, tp, channel)
            runner.follow()
            results.append({})
        results[-1]["numel"] = sum(p.numel() for p in runner.model.parameters())
        results[-1]["kv_heads"] = runner.model.layers[0].self_attn.kv_heads
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()


def engine_tokens(runs: list[dict], out: Path, timeout: float = 300) -> list[list[list[int]]]:
    """Each run's tokens from a two-rank engine_rank: rank 0's results, one list of token ids per prompt."""
    run_ranks(engine_rank, runs, str(out), timeout=timeout)
    return [result["tokens"] for result in json.loads(Path(f"{out}.0").read_text())]


# ---- how a rank process ends --------------------------------------------------------------------------------------
FINALIZING = "interpreter finalization"  # what an exit_rank process prints if it ends through Py_Finalize


def exit_rank(mode: str) -> None:
    """One rank through run_tensor_parallel and follow, ending the process as fastgen.replica's main does. Rank 0
    stands in for the server: "idle" serves until killed, "step" sends one batch then does the same, "fail" returns
    status 2 at once, "orderly" sends one batch and drains (status 0), "forming" dies (status 9) before the batch
    broadcast's group has formed. Rank 1 runs ModelRunner.follow's loop, and in "step" fails on the batch (out of
    step).

    Each process prints FINALIZING if it exits through interpreter finalization, which no rank may: a gloo worker
    thread may still hold the last collective (failed, or the stop message), and when it frees the collective's
    tensors during Py_Finalize, the GIL ends it with pthread_exit, which aborts the process (SIGABRT) instead of its
    status."""
    from fastgen.replica import tp_worker
    from fastgen.replica.batch import Batch

    atexit.register(print, FINALIZING, flush=True)

    class Runner:
        def __init__(self, broadcast) -> None:
            self.broadcast = broadcast

        def follow(self) -> None:
            while (batch := self.broadcast.receive()) is not None:
                if mode == "step":
                    raise ValueError(f"cannot run {batch}")

    def build_runner(config, tp, broadcast):
        print("ready", flush=True)
        return Runner(broadcast), 0

    def run_replica(args, tp, broadcast) -> int:
        print("ready", flush=True)
        if mode == "fail":
            return 2
        if mode in ("step", "orderly"):
            broadcast.send(Batch([], 0, []))
        if mode != "orderly":
            time.sleep(300)
        return 0

    def die_forming(*args, **kwargs):  # BatchBroadcast(rank, ...): rank 0 dies as the group forms
        os._exit(9)

    tp_worker.build_runner = build_runner
    if mode == "forming" and os.environ["RANK"] == "0":
        tp_worker.BatchBroadcast = die_forming
    args = argparse.Namespace(tp=2, device="cpu", threads=1)
    sys.exit(tp_worker.run_tensor_parallel(args, run_replica, lambda args: None))


if __name__ == "__main__":
    exit_rank(sys.argv[1])
