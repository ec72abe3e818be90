"""`fastgen-deploy restart --rolling` under a steady closed-loop load (real processes: a deployment of 2 replicas of
the tiny model): every request completes, with the tokens and text it has without a restart, and each replica is
replaced once. The throughput dip is printed (pytest -s shows it)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from fastgen.launch import cli
from fastgen.launch.state import Paths, write_json_atomic
from fastgen.launch.supervisor import take_restart_request
from fastgen.server import Client, GenerationError

from .helpers import Deploy, alive, free_port, tiny_start

WORKERS = 4
JOBS = 8


@pytest.fixture
def deploy(tmp_path):
    d = Deploy(tmp_path / "home")
    yield d
    d("stop", "--name", "rolling", "--timeout", "10")
    state = tmp_path / "home" / "rolling" / "state.json"
    if state.exists():
        d.seen_pids.add(json.loads(state.read_text())["supervisor"]["pid"])
    for pid in d.seen_pids:  # whatever stop missed
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def job(i: int) -> tuple[list[int], dict]:
    """Greedy and seeded sampling requests, long enough to be mid-stream when their replica drains."""
    params = dict(max_new_tokens=128, ignore_eos=True)
    if i % 2:
        params.update(temperature=0.8, seed=500 + i)
    return [300 + i, 11, 12, 13], params


def difference(got: tuple[list[int], str], ref) -> str:
    tokens, text = got
    if tokens != ref.token_ids:
        at = next(
            (k for k, (a, b) in enumerate(zip(tokens, ref.token_ids)) if a != b), min(len(tokens), len(ref.token_ids))
        )
        return f"token {at} differs from the run before ({tokens[at : at + 3]} != {ref.token_ids[at : at + 3]})"
    return f"the text differs from the run before ({text!r} != {ref.text!r})"


@dataclass
class ClosedLoop:
    """WORKERS clients, each sending its next request as soon as the last one answered: streams and unary calls in
    turn, each checked against the answer the same request had before the restart."""

    address: str
    refs: list
    done: list[tuple[float, str]] = field(default_factory=list)  # (finish time, replica of the last chunk)
    failures: list[str] = field(default_factory=list)
    seeded_differences: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, worker: int) -> None:
        with Client(self.address, timeout=120) as c:
            n = worker
            while not self.stop.is_set():
                i = n % JOBS
                prompt, params = job(i)
                try:
                    if n % 2:
                        chunks = list(c.stream_chunks(prompt, **params))
                        got = ([t for ch in chunks for t in ch.token_ids], "".join(ch.text for ch in chunks))
                        replicas = "+".join(dict.fromkeys(ch.replica for ch in chunks))
                    else:
                        result = c.generate(prompt, **params)
                        got, replicas = (result.token_ids, result.text), result.replica
                except GenerationError as e:
                    self.failures.append(f"request {i}: {e.code.name} {e.details}")
                else:
                    if len(got[0]) != len(self.refs[i].token_ids):
                        self.failures.append(f"request {i} on {replicas}: {len(got[0])} tokens")
                    elif got != (self.refs[i].token_ids, self.refs[i].text):
                        # Greedy must match exactly. A seeded draw inverts the CDF of a nearly flat distribution (a
                        # tiny random model), so where the logits' last bits depend on what else was in the pass it
                        # can land on the neighbouring token: counted here, and failed below where the float32
                        # kernel is batch-invariant (the guarantee holds there).
                        (self.seeded_differences if "seed" in params else self.failures).append(
                            f"request {i} on {replicas}: {difference(got, self.refs[i])}"
                        )
                    self.done.append((time.monotonic(), replicas))
                n += WORKERS

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t, _ in self.done) / max(end - start, 1e-9)


def test_restart_flags_and_the_request_file(tmp_path):
    args = cli.build_parser().parse_args(["restart", "--rolling", "--name", "n", "--timeout", "5"])
    assert (args.command, args.rolling, args.name, args.timeout) == ("restart", True, "n", 5.0)
    assert not cli.build_parser().parse_args(["restart"]).rolling
    paths = Paths(tmp_path)
    assert take_restart_request(paths) is None
    write_json_atomic(paths.restart_request, {"id": "x", "rolling": True})
    assert take_restart_request(paths) == {"id": "x", "rolling": True}
    assert take_restart_request(paths) is None  # taken once
    paths.restart_request.write_text("{half")
    assert take_restart_request(paths) is None and not paths.restart_request.exists()


@pytest.mark.slow
def test_rolling_restart_under_load_fails_no_request(deploy, tiny_model_dir):
    port = free_port(3)
    metrics = free_port(3)
    done = deploy(*tiny_start("rolling", tiny_model_dir, 2, port, metrics), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    before = {r["id"]: r["pid"] for r in deploy.status("rolling")}
    address = f"127.0.0.1:{port}"
    with Client(address, timeout=120) as c:
        refs = [c.generate(job(i)[0], **job(i)[1]) for i in range(JOBS)]

    load = ClosedLoop(address, refs)
    threads = [threading.Thread(target=load.run, args=(w,), daemon=True) for w in range(WORKERS)]
    for t in threads:
        t.start()
    time.sleep(5)
    restart_start = time.monotonic()
    done = deploy("restart", "--rolling", "--name", "rolling", "--timeout", "60", timeout=400)
    restart_end = time.monotonic()
    time.sleep(5)
    load.stop.set()
    for t in threads:
        t.join(150)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "restarted replica-0, replica-1 (one at a time)" in done.stdout
    assert not load.failures, load.failures[:5]
    rows = deploy.status("rolling")
    replicas = [r for r in rows if r["role"] == "replica"]
    assert [r["restarts"] for r in replicas] == [1, 1] and all(r["health"] == "SERVING" for r in replicas)
    assert all(r["pid"] != before[r["id"]] for r in replicas)
    moved = sum("+" in replicas for _, replicas in load.done)
    baseline = load.rate(restart_start - 5, restart_start)
    during = load.rate(restart_start, restart_end)
    print(
        f"\nrolling restart of 2 replicas took {restart_end - restart_start:.1f} s under {WORKERS} closed-loop "
        f"clients: {len(load.done)} requests, 0 failed, {moved} streams moved mid-way; throughput "
        f"{baseline:.2f} req/s before, {during:.2f} req/s during ({100 * (1 - during / max(baseline, 1e-9)):.0f}% "
        "dip); "
        f"seeded outputs differing from the run before the restart: {len(load.seeded_differences)} "
        f"{sorted(set(load.seeded_differences))[:3]}"
    )
    assert during > 0
    from fastgen.kernels import cpu

    # The guarantee, exactly: seeded outputs equal the run before token for token wherever the float32 linear layers
    # are batch-invariant (the C kernel); under torch's sgemm a draw may move to a neighbouring token.
    if cpu.pack_f32(torch.ones(8, 8)) is not None:
        assert not load.seeded_differences, load.seeded_differences[:5]
