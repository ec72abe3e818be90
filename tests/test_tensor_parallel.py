"""Tensor parallelism on the CPU with gloo: the parallel layers equal their single-process versions, a tp=2 engine
gives tp=1's greedy tokens (mixed batches, preemption), the rank processes of a replica start, serve and stop
together, and a lost rank ends its group; fastgen-deploy runs replicas of 2 ranks and restarts them as groups."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from fastgen.launch import cli, supervisor
from fastgen.launch import config as cfg
from fastgen.launch.config import DeployConfig
from fastgen.replica.batch import Batch, ScheduledSeq
from fastgen.replica.batch_broadcast import EXIT_GROUP_BROKEN, INLINE, decode_batch, encode_batch
from fastgen.replica.tp_worker import RankEnv, rank_device
from fastgen.testing import free_port, make_tiny_model, wait_until

from .helpers import REPLICA_DEFAULTS, Proc, assert_matches, hf_greedy, random_prompts, spawn, wait_serving
from .tp_ranks import FINALIZING, broadcast_rank, engine_rank, layers_rank, run_ranks

BATCHES = [
    Batch([ScheduledSeq(7, [5], 40, [3, 1, 4], True), ScheduledSeq(2, [9, 8, 7], 0, [0], False)], 1, []),
    Batch([ScheduledSeq(3, list(range(100)), 16, [2, 6, 5, 8, 9, 11, 12, 13], True)], 0, [7, 2]),
    Batch([], 0, [1]),
    Batch([ScheduledSeq(4, list(range(2000)), 0, list(range(125)), True)], 0, []),  # beyond the first broadcast
    Batch([ScheduledSeq(5, list(range(1010)), 0, [9], False)], 0, []),  # exactly fills the first broadcast
]
# LoRA slots per sequence and the adapters to load (folders as text, any characters)
LORA_BATCH = Batch(
    [ScheduledSeq(1, [5], 3, [0], True, lora_slot=2), ScheduledSeq(2, [6], 3, [1], True)],
    2,
    [],
    lora_loads=[(2, "/tmp/adapters/é x"), (0, "")],
)


# ---- pure parts -----------------------------------------------------------------------------------------------
def test_batch_encoding_round_trips():
    for batch in [*BATCHES, LORA_BATCH]:
        assert decode_batch(encode_batch(batch)) == batch
    assert 1 + len(encode_batch(BATCHES[-1])) == INLINE  # the length, then the batch: the edge case stays one


def test_rank_env_comes_from_torchrun_variables():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert RankEnv.from_env(env, tp=2) == RankEnv(1, 2, 1)
    with pytest.raises(ValueError, match="lacks RANK, WORLD_SIZE.*fastgen-deploy start --tp 2.*torchrun"):
        RankEnv.from_env({"MASTER_ADDR": "x", "MASTER_PORT": "1", "LOCAL_RANK": "0"}, tp=2)
    with pytest.raises(ValueError, match="WORLD_SIZE is 2 but --tp is 4"):
        RankEnv.from_env(env, tp=4)
    assert str(rank_device("cuda", 3)) == "cuda:3" and str(rank_device("cuda:0", 1)) == "cuda:1"
    assert str(rank_device("cpu", 1)) == "cpu"


def test_plan_starts_every_rank_with_torchrun_variables():
    c = DeployConfig(replicas=2, tp=3, port=7000, metrics_port=8000, host="0.0.0.0")
    specs = cfg.plan(c, "PY")
    assert [(s.id, s.role, s.replica, s.rank, s.port, s.metrics_port) for s in specs] == [
        ("balancer", "balancer", None, None, 7000, 8000),
        ("replica-0", "replica", "replica-0", 0, 7001, 8001),
        ("replica-0-rank-1", "tp_rank", "replica-0", 1, None, None),
        ("replica-0-rank-2", "tp_rank", "replica-0", 2, None, None),
        ("replica-1", "replica", "replica-1", 0, 7002, 8002),
        ("replica-1-rank-1", "tp_rank", "replica-1", 1, None, None),
        ("replica-1-rank-2", "tp_rank", "replica-1", 2, None, None),
    ]
    assert specs[1].argv == specs[2].argv and specs[1].argv[specs[1].argv.index("--tp") + 1] == "3"
    balancer = specs[0].argv
    assert [balancer[i + 1] for i, a in enumerate(balancer) if a == "--replica"] == [
        "replica-0=127.0.0.1:7001",
        "replica-1=127.0.0.1:7002",
    ]
    assert cfg.rank_env(specs[3], 3, c.host, 29400) == {
        "RANK": "2",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
    }
    children = [supervisor.Child(s, Path(s.id)) for s in specs]
    assert [[c.spec.id for c in g] for g in supervisor.groups_of(children)] == [
        ["balancer"],
        ["replica-0", "replica-0-rank-1", "replica-0-rank-2"],
        ["replica-1", "replica-1-rank-1", "replica-1-rank-2"],
    ]
    args = cli.build_parser().parse_args(["start", "--replicas", "2", "--tp", "2"])
    assert cli.config_from(args).threads == cfg.default_threads(cli.cpu_count(), 4)  # threads are per rank


def test_supervisor_starts_and_restarts_the_ranks_of_a_replica_together(tmp_path):
    report = (
        "import os, time; print(*(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'MASTER_PORT')), flush=True); "
        "time.sleep(60)"
    )
    config = DeployConfig(replicas=1, tp=2)
    specs = cfg.plan(config, "PY")[1:]
    group = [supervisor.Child(replace(s, argv=[sys.executable, "-c", report]), tmp_path / f"{s.id}.log") for s in specs]

    def started_with(run: int) -> list[list[str]]:
        """What each rank reported in its run-th start (the log gets a header line and a report per start)."""
        wait_until(lambda: all(c.log_path.read_text().count("\n") >= 2 * run for c in group), 20, what="reports")
        return [c.log_path.read_text().splitlines()[-1].split() for c in group]

    try:
        supervisor.launch_group(group, dict(os.environ), config, first=True)
        port = str(group[0].master_port)
        assert started_with(1) == [["0", "2", port], ["1", "2", port]]
        group[1].proc.kill()
        group[1].proc.wait()
        assert supervisor.reap_group(group, supervisor.Backoff(initial=0.1), time.monotonic())
        assert group[0].proc.poll() is not None  # rank 0 was stopped with its group
        assert group[0].restart_at == group[1].restart_at and [c.failures for c in group] == [1, 1]
        assert [supervisor.process_record(c)["state"] for c in group] == ["restarting", "restarting"]
        supervisor.launch_group(group, dict(os.environ), config, first=False)
        assert all(c.proc.poll() is None for c in group)
        port = str(group[0].master_port)
        assert started_with(2) == [["0", "2", port], ["1", "2", port]]
    finally:
        for c in group:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()


# ---- gloo groups of spawned processes ---------------------------------------------------------------------------
@pytest.mark.slow
def test_parallel_layers_match_single_process():
    run_ranks(layers_rank, timeout=90)


@pytest.mark.slow
def test_batch_broadcast_reaches_every_rank():
    run_ranks(broadcast_rank, BATCHES, world=3, timeout=90)


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    return {
        "gqa": make_tiny_model(root / "gqa", heads=4, kv_heads=2, tie=True, seed=3),  # KV heads split
        "qwen2": make_tiny_model(root / "qwen2", arch="qwen2", heads=4, kv_heads=1, tie=False, seed=4),  # replicated
    }


@pytest.mark.slow
def test_tp2_engine_gives_tp1_greedy_tokens(tp_models, tmp_path):
    from fastgen.replica import pipeline

    rng = random.Random(5)
    runs = [  # mixed prefill/decode batches split over steps, then preemption in a 20-block pool of 4 tokens
        dict(model=str(tp_models["gqa"]), prompts=random_prompts(8, rng, 1, 80), new=10, budget=32),
        dict(
            model=str(tp_models["gqa"]),
            prompts=random_prompts(10, rng, 20, 60),
            new=16,
            budget=32,
            block_size=4,
            num_blocks=20,
        ),
        dict(model=str(tp_models["qwen2"]), prompts=random_prompts(8, rng, 1, 80), new=10, budget=24),
    ]
    run_ranks(engine_rank, runs, str(tmp_path / "out"), timeout=150)
    rank0, rank1 = (json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1))
    for run, got, other in zip(runs, rank0, rank1):
        refs = hf_greedy(run["model"], run["prompts"], run["new"])
        single = pipeline(
            run["model"],
            dtype="float32",
            max_batch_tokens=run["budget"],
            progress=False,
            block_size=run.get("block_size", 16),
            num_blocks=run.get("num_blocks", 256),
        )
        tp1 = single(run["prompts"], max_new_tokens=run["new"], min_new_tokens=run["new"])
        tp2 = [SimpleNamespace(token_ids=t) for t in got["tokens"]]
        assert_matches(tp1, refs)
        assert_matches(tp2, refs)  # so tp=2 agrees with tp=1 up to the near-ties transformers itself shows
        assert got["preemptions"] == single.engine.scheduler.num_preemptions
        # Each rank holds half of every split weight (norms are whole; qwen2's single KV head is replicated).
        numel = sum(p.numel() for p in single.engine.runner.model.parameters())
        assert got["numel"] == other["numel"] < 0.6 * numel
        kv_heads = single.engine.runner.model.layers[0].self_attn.kv_heads
        assert got["kv_heads"] == other["kv_heads"] == max(1, kv_heads // 2)
    assert rank0[1]["preemptions"] > 0


# ---- rank processes ---------------------------------------------------------------------------------------------
def start_ranks(model, log_dir: Path, name: str, tp: int = 2) -> list[Proc]:
    """A replica's rank processes as torchrun would start them: same command, RANK etc. in the environment."""
    port, metrics_port, master_port = free_port(), free_port(), free_port()
    args = [
        "-m",
        "fastgen.replica",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--replica-id",
        name,
        "--model",
        str(model),
        *REPLICA_DEFAULTS,
        "--tp",
        str(tp),
    ]
    return [
        spawn(f"{name}-rank-{rank}", args, port, metrics_port, log_dir, rank_vars(rank, tp, master_port))
        for rank in range(tp)
    ]


def rank_vars(rank: int, tp: int, master_port: int) -> dict[str, str]:
    """What torchrun sets for a rank."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(tp),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }


def assert_exit(procs: list[Proc], codes: list[int], timeout: float = 30.0) -> None:
    """Each process exits with its code within timeout; otherwise fails with their logs."""
    deadline = time.monotonic() + timeout
    got = []
    for proc in procs:
        try:
            got.append(proc.popen.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            got.append(None)
    logs = "\n".join(f"---- {p.name}:\n{p.log_tail()}" for p in procs)
    assert got == codes, f"exit codes {got}, expected {codes} (None: still running after {timeout} s)\n{logs}"


@pytest.mark.slow
def test_ranks_that_leave_a_broken_group_exit_at_once_with_their_status(tmp_path):
    """Five groups of two rank processes (model and server stubbed out, see tp_ranks.exit_rank): rank 0 killed
    while rank 1 waits for a batch; rank 1 failing on a batch; rank 0 failing; an orderly end (rank 0 drains and
    tells rank 1 to stop); rank 0 dying while the group forms. Every rank exits with its status and without
    interpreter finalization, where a gloo worker thread that still held the last collective's tensors aborted ranks
    (SIGABRT) in loaded test runs, after a failure and after an orderly stop alike."""
    modes = ("idle", "step", "fail", "orderly", "forming")
    groups = []
    for mode in modes:
        port, args = free_port(), ["-m", "fastgen.tests.tp_ranks", mode]
        groups.append(
            [spawn(f"{mode}-rank-{rank}", args, 0, 0, tmp_path, rank_vars(rank, 2, port)) for rank in range(2)]
        )
    idle, step, fail, orderly, forming = groups
    try:
        wait_until(lambda: all("ready" in p.log_tail() for p in idle), 60, what="the idle group's ranks")
        idle[0].kill()
        assert_exit(step[1:], [EXIT_GROUP_BROKEN], timeout=60)  # out of step: it leaves; rank 0 still serves
        step[0].kill()
        assert_exit(idle, [-signal.SIGKILL, EXIT_GROUP_BROKEN])
        assert_exit(step, [-signal.SIGKILL, EXIT_GROUP_BROKEN])
        assert_exit(fail, [2, EXIT_GROUP_BROKEN])
        assert_exit(orderly, [0, 0])
        assert_exit(forming, [9, EXIT_GROUP_BROKEN], timeout=60)
        for p in (idle[1], step[1], fail[0], fail[1], orderly[0], orderly[1], forming[1]):
            assert FINALIZING not in p.log_tail(), f"{p.name} exited through interpreter finalization"
        assert "left its tensor-parallel group: RuntimeError" in idle[1].log_tail()
        assert "left its tensor-parallel group: ValueError: cannot run" in step[1].log_tail()
    finally:
        for p in (p for g in groups for p in g):
            p.kill()


@pytest.mark.slow
def test_rank_processes_serve_stop_together_and_exit_when_a_peer_is_lost(tiny_model_dir, tmp_path):
    from fastgen.replica import pipeline
    from fastgen.server import Client, GenerationError

    expected = pipeline(str(tiny_model_dir), dtype="float32", progress=False)([[5, 6, 7, 8]], max_new_tokens=6)
    groups = [start_ranks(tiny_model_dir, tmp_path, name) for name in ("a", "b", "c")]
    try:
        for group in groups:
            wait_serving(group[0], timeout=120)
        a, b, c = groups
        with Client(a[0].address, timeout=30) as client:
            assert client.generate([5, 6, 7, 8], max_new_tokens=6).token_ids == expected[0].token_ids
        a[0].popen.send_signal(signal.SIGTERM)  # rank 0 drains, then tells rank 1 to stop
        assert_exit(a, [0, 0])

        b[1].kill()  # a lost worker: rank 0 notices at its next step and exits, for the launcher to restart both
        with Client(b[0].address, timeout=30) as client, pytest.raises(GenerationError):
            client.generate([5, 6, 7], max_new_tokens=4)
        assert_exit(b, [EXIT_GROUP_BROKEN, -signal.SIGKILL])

        c[0].kill()  # a lost rank 0: the idle worker notices at once
        assert_exit(c, [-signal.SIGKILL, EXIT_GROUP_BROKEN])
    finally:
        for p in (p for g in groups for p in g):
            p.kill()


# ---- fastgen-deploy ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_deploy_replicas_of_two_ranks(tiny_model_dir, tmp_path):
    from .helpers import Deploy, alive, free_port, tiny_start

    deploy = Deploy(tmp_path / "home")
    port = free_port(3)
    metrics = free_port(3)
    try:
        done = deploy(
            *tiny_start(
                "e2e", tiny_model_dir, 2, port, metrics, "--tp", "2", "--num-blocks", "128", "--timeout", "150"
            ),
            timeout=200,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "replica-1-rank-1" in done.stdout and "tp rank 1 of replica-1" in done.stdout
        rows = deploy.status()
        assert [(r["id"], r["role"], r.get("rank"), r["port"], r["health"]) for r in rows] == [
            ("balancer", "balancer", None, port, "SERVING"),
            ("replica-0", "replica", 0, port + 1, "SERVING"),
            ("replica-0-rank-1", "tp_rank", 1, None, "SERVING"),
            ("replica-1", "replica", 0, port + 2, "SERVING"),
            ("replica-1-rank-1", "tp_rank", 1, None, "SERVING"),
        ]
        assert all(alive(r["pid"]) for r in rows) and rows[1]["kv_blocks_total"] == 128
        table = deploy("status", "--name", "e2e")
        assert table.returncode == 0 and "tp rank 1 of replica-0" in table.stdout, table.stderr
        served = set()
        for i in range(4):
            done = deploy("generate", f"Hello {i}", "--name", "e2e", "--max-new-tokens", "6")
            assert done.returncode == 0, done.stderr
            served.add(done.stderr.split("served by ")[1].split(":")[0])
        assert served == {"replica-0", "replica-1"}

        # Killing rank 1 takes replica-0 out of rotation and restarts both of its ranks.
        old = {r["id"]: r["pid"] for r in rows}
        os.kill(old["replica-0-rank-1"], signal.SIGKILL)
        wait_until(lambda: not alive(old["replica-0"]), 10, "replica-0's rank 0 to be stopped with its group")

        def group_back():
            now = {r["id"]: r for r in deploy.status()}
            group = [now["replica-0"], now["replica-0-rank-1"]]
            return all(r["pid"] not in (None, old[r["id"]]) and r["health"] == "SERVING" for r in group) and group

        back = wait_until(group_back, 90, "replica-0's ranks to be restarted and SERVING")
        assert [r["restarts"] for r in back] == [1, 1]
        assert deploy.status()[3]["pid"] == old["replica-1"]  # the other replica kept running
        wait_until(
            lambda: deploy("generate", "Hi", "--name", "e2e", "--max-new-tokens", "2").returncode == 0,
            20,
            "the balancer to route again",
        )

        pids = {r["pid"] for r in deploy.status()} | deploy.seen_pids | set(old.values())
        done = deploy("stop", "--name", "e2e", "--timeout", "30")
        assert done.returncode == 0, done.stderr
        assert not [p for p in pids if alive(p)]
        assert "needed SIGKILL" not in done.stdout  # every rank ended by itself: rank 0 drained, then said stop
    finally:
        deploy("stop", "--name", "e2e", "--timeout", "10")
        for pid in deploy.seen_pids:
            if alive(pid):
                psutil.Process(pid).kill()
