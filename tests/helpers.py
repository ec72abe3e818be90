"""What the tests share: FastGen processes (replicas, balancers, the deployment CLI) started and waited for, and
the transformers reference that greedy outputs are compared with.

    replica = start_replica(tiny_model_dir, "r0", log_dir=tmp_path)
    try:
        wait_serving(replica)
        ...
    finally:
        replica.kill()

Output goes to a log file per process (a pipe nobody reads would block the process once full); failures quote its
tail. Every process runs with one torch/BLAS thread: test machines have two cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastgen.launch.processes import Process, start
from fastgen.testing import free_port, wait_until

SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# Enough KV blocks for 40 concurrent short requests at block size 16 on the tiny model.
REPLICA_DEFAULTS = (
    "--dtype",
    "float32",
    "--max-batch-tokens",
    "256",
    "--max-seqs",
    "32",
    "--block-size",
    "16",
    "--num-blocks",
    "512",
    "--scheduler",
    "splitfuse",
    "--threads",
    "1",
    "--max-queue-requests",
    "256",
)


@dataclass
class Proc:
    """A FastGen server process the tests started, and where it serves."""

    process: Process
    port: int
    metrics_port: int
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def popen(self) -> subprocess.Popen:
        return self.process.popen

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.alive()

    def log_tail(self, chars: int = 3000) -> str:
        return self.process.log_tail(chars)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code (SIGKILL after `timeout`)."""
        return self.process.stop(timeout)

    def kill(self) -> None:
        """SIGKILL (idempotent): for teardown and crash tests."""
        self.process.kill()


def spawn(
    name: str, args: list[str], port: int, metrics_port: int, log_dir: Path, extra_env: Mapping[str, str] | None = None
) -> Proc:
    """`python *args`, its output appended to log_dir/name.log (a process restarted under its name adds to it)."""
    env = {**os.environ, **SINGLE_THREAD_ENV, **(extra_env or {})}
    process = start(name, [sys.executable, *args], Path(log_dir) / f"{name}.log", env=env, append=True)
    return Proc(process, port, metrics_port)


def start_replica(
    model: str | Path, replica_id: str, log_dir: Path, port: int | None = None, extra_args: Iterable[str] = ()
) -> Proc:
    """`python -m fastgen.replica` on a free port (or `port`, to restart one where it was)."""
    port = port or free_port()
    metrics_port = free_port()
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
        replica_id,
        "--model",
        str(model),
        *REPLICA_DEFAULTS,
        *extra_args,
    ]
    return spawn(replica_id, args, port, metrics_port, log_dir)


def start_balancer(
    replicas: Mapping[str, str],
    log_dir: Path,
    policy: str = "round_robin",
    port: int | None = None,
    extra_args: Iterable[str] = (),
    name: str = "balancer",
) -> Proc:
    """`python -m fastgen.balancer` over `replicas` (id -> host:port)."""
    port = port or free_port()
    metrics_port = free_port()
    args = ["-m", "fastgen.balancer", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]
    for rid, address in replicas.items():
        args += ["--replica", f"{rid}={address}"]
    args += ["--policy", policy, "--health-interval", "0.2", *extra_args]
    return spawn(name, args, port, metrics_port, log_dir)


def health(address: str, timeout: float = 1.0) -> str:
    """'SERVING', 'NOT_SERVING', ... or the gRPC error code's name when the check itself fails."""
    # A private subchannel: a shared one may sit in reconnect backoff long after the process came up.
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def wait_health(proc: Proc, want: str = "SERVING", timeout: float = 120.0) -> None:
    """Waits until `proc` answers health `want`; fails early (RuntimeError, with its log) if it exits."""
    last = "not checked"

    def answers() -> bool:
        nonlocal last
        last = health(proc.address)
        return last == want

    try:
        proc.process.wait_ready(answers, timeout, what=f"{want} at {proc.address}")
    except TimeoutError as e:
        e.add_note(f"its last health answer: {last}")
        raise


def wait_serving(proc: Proc, timeout: float = 120.0) -> None:
    wait_health(proc, "SERVING", timeout)


def balancer_health_of_replicas(balancer: Proc) -> dict[str, str]:
    """Replica id -> health as the balancer sees it ("serving", "not_serving", "unknown")."""
    from fastgen.server import Client

    with Client(balancer.address, timeout=5) as client:
        return {r.replica: r.health for r in client.status().replicas}


def wait_balancer_sees(balancer: Proc, want: dict[str, str], timeout: float = 30.0) -> None:
    """Waits until the balancer reports each replica id in `want` with that health."""
    wait_until(
        lambda: all(balancer_health_of_replicas(balancer).get(rid) == h for rid, h in want.items()),
        timeout,
        interval=0.1,
        what=f"balancer seeing {want}",
    )


# ---- the deployment CLI ----
class Deploy:
    """Runs the CLI as a user would (its own process) against a private FASTGEN_HOME."""

    def __init__(self, home: Path):
        # One BLAS thread per process: the test machine has two cores.
        self.env = dict(
            os.environ, FASTGEN_HOME=str(home), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"
        )
        self.seen_pids: set[int] = set()

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "fastgen.launch", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def status(self, name: str = "e2e") -> list[dict]:
        done = self("status", "--name", name, "--json")
        assert done.returncode == 0, done.stderr
        rows = json.loads(done.stdout)
        self.seen_pids |= {r["pid"] for r in rows if r["pid"]}
        return rows


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def in_process_table(pid: int) -> bool:
    """Alive or a zombie not yet reaped: what `kill -0` and pgrep see."""
    return psutil.pid_exists(pid)


# What every end-to-end deployment of the tiny model shares: float32, a small KV pool, one thread, a bounded start.
TINY_DEPLOYMENT = ("--dtype", "float32", "--kv-cache-memory", "8MiB", "--threads", "1", "--timeout", "120")


def tiny_start(
    name: str, model: Path, replicas: int, port: int, metrics_port: int, *extra: str, http_port: int = 0
) -> list[str]:
    """`fastgen-deploy start` arguments for a deployment of the tiny model on the given ports (no HTTP API unless
    http_port: the default 8000 would clash between tests); `extra` comes last, so its flags override the shared
    ones."""
    what = ["--name", name, "--model", str(model), "--replicas", str(replicas)]
    where = ["--port", str(port), "--metrics-port", str(metrics_port), "--http-port", str(http_port)]
    return ["start", *what, *where, *TINY_DEPLOYMENT, *extra]


# ---- the reference for greedy outputs ----
def hf_greedy(model_dir, prompts, max_new, attn_implementation=None):
    """Reference tokens per prompt, cut where transformers' own top-2 logits are within 1e-4 (a near-tie
    that float rounding may break either way). attn_implementation: e.g. "eager" (default: transformers' choice)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    ).eval()
    refs = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        tokens = out.sequences[0, len(ids) :].tolist()
        for step, scores in enumerate(out.scores):
            top2 = scores[0].topk(2).values
            if top2[0] - top2[1] < 1e-4:
                tokens = tokens[: step + 1]  # the tied step itself may go either way: keep up to it
                break
        refs.append(tokens)
    return refs


def assert_matches(outs, refs):
    assert len(outs) == len(refs), f"{len(outs)} outputs for {len(refs)} prompts"
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        n = len(ref) - 1 if len(ref) < len(out.token_ids) else len(ref)  # skip a tied last step
        assert out.token_ids[:n] == ref[:n], f"prompt {i}: {out.token_ids} != {ref}"


def random_prompts(n, rng, lo=1, hi=80):
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


REQUIRE_TOOLS = "FASTGEN_REQUIRE_TOOLS"


def require_tool(present: object, what: str) -> None:
    """Skips the calling test when a tool or package it needs is missing (`what` says which and how to get it) —
    except where FASTGEN_REQUIRE_TOOLS is set, as .ci/run sets it, where every test that can run on a CPU must run
    and a missing tool fails the test."""
    if present:
        return
    if os.environ.get(REQUIRE_TOOLS):
        pytest.fail(f"{what} ({REQUIRE_TOOLS} is set: CI runs every test that can run on a CPU)")
    pytest.skip(what)


@contextlib.asynccontextmanager
async def in_process_replica(build):
    """A ReplicaService on a real gRPC server in this process, its engine made by `build` on an EngineLoop: yields
    (port, the loop); both stop on exit."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from fastgen.replica.engine_loop import EngineLoop, QueueLimits
    from fastgen.replica.service import ReplicaService
    from fastgen.server.grpc_server import create_server
    from fastgen.server.metrics import ReplicaMetrics

    metrics = ReplicaMetrics(CollectorRegistry(), "r0", "tiny")
    service = ReplicaService("r0", "tiny", metrics)
    port = free_port()
    server, _ = create_server(service, "127.0.0.1", port)
    await server.start()
    loop = EngineLoop(build, metrics, QueueLimits(), asyncio.get_running_loop())
    await loop.start()
    service.engine_loop = loop
    try:
        yield port, loop
    finally:
        await server.stop(None)
        loop.stop()


def run_on_triton(script: str, *args: object, timeout: float = 600) -> object:
    """Runs `script` (python -c, its arguments JSON) in a subprocess on the Triton kernels: compiled on a GPU, under
    TRITON_INTERPRET=1 on a CPU (set before triton is first imported, which a subprocess guarantees); returns the JSON
    its last line prints."""
    import torch

    pytest.importorskip("triton")
    env = dict(os.environ) if torch.cuda.is_available() else dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", script, *(json.dumps(a) for a in args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
