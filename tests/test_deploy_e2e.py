"""fastgen-deploy end to end with real processes (balancer + 2 replicas of a tiny random model, 127.0.0.1):
start → status → generate → kill -9 a replica (the supervisor restarts it) → a clashing start fails → stop leaves
nothing behind."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from fastgen.launch.probe import port_free
from fastgen.testing import wait_until

from .helpers import Deploy, alive, free_port, in_process_table, tiny_start

pytestmark = pytest.mark.slow


@pytest.fixture
def deploy(tmp_path):
    d = Deploy(tmp_path / "home")
    yield d
    d("stop", "--name", "e2e", "--timeout", "10")
    state = tmp_path / "home" / "e2e" / "state.json"
    if state.exists():
        d.seen_pids.add(json.loads(state.read_text())["supervisor"]["pid"])
    for pid in d.seen_pids:  # whatever stop missed
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_deployment_lifecycle(deploy, tiny_model_dir):
    port = free_port(3)
    metrics = free_port(3)
    start = tiny_start("e2e", tiny_model_dir, 2, port, metrics)
    done = deploy(*start, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"127.0.0.1:{port}" in done.stdout and f"http://127.0.0.1:{metrics + 2}/metrics" in done.stdout

    rows = deploy.status()
    assert [(r["role"], r.get("replica"), r["port"], r["metrics_port"], r["health"]) for r in rows] == [
        ("balancer", None, port, metrics, "SERVING"),
        ("replica", "replica-0", port + 1, metrics + 1, "SERVING"),
        ("replica", "replica-1", port + 2, metrics + 2, "SERVING"),
    ]
    assert all(alive(r["pid"]) for r in rows)
    assert rows[1]["kv_blocks_total"] > 0 and rows[1]["queued"] == 0

    done = deploy("generate", "Hello, my name is", "--name", "e2e", "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "served by replica-" in done.stderr
    plain = int(re.search(r"(\d+) prompt tokens, 8 generated", done.stderr).group(1))
    # --chat sends the prompt as a user message: the replica renders the chat template around it
    chat = deploy("generate", "Hello, my name is", "--chat", "--name", "e2e", "--max-new-tokens", "3")
    assert chat.returncode == 0, chat.stderr
    assert int(re.search(r"(\d+) prompt tokens, 3 generated", chat.stderr).group(1)) > plain + 4

    # A replica killed outright comes back on the same port under a new pid.
    old_pid = rows[1]["pid"]
    os.kill(old_pid, signal.SIGKILL)

    def replica_back():
        r = deploy.status()[1]
        return r["pid"] not in (None, old_pid) and r["health"] == "SERVING" and r

    back = wait_until(replica_back, 60, "replica-0 to be restarted and SERVING")
    assert back["restarts"] == 1 and not alive(old_pid)
    wait_until(
        lambda: deploy("generate", "Hi", "--name", "e2e", "--max-new-tokens", "2").returncode == 0,
        20,
        "the balancer to route again",
    )

    done = deploy(*start)
    assert done.returncode != 0 and "already running" in done.stderr
    other = ["start", "--name", "other", "--model", str(tiny_model_dir), "--replicas", "1", "--port", str(port)]
    done = deploy(*other, "--metrics-port", str(free_port(2)))
    assert done.returncode != 0 and f"port {port} (balancer gRPC)" in done.stderr

    # restart returns only once the replaced replicas have left the process table
    replaced = {r["pid"] for r in deploy.status() if r["role"] == "replica"}
    done = deploy("restart", "--name", "e2e", "--timeout", "20", timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not [p for p in replaced if in_process_table(p)]

    pids = {r["pid"] for r in deploy.status()} | deploy.seen_pids
    supervisor = json.loads((Path(deploy.env["FASTGEN_HOME"]) / "e2e" / "state.json").read_text())["supervisor"]
    family = [psutil.Process(supervisor["pid"])] + psutil.Process(supervisor["pid"]).children(recursive=True)
    done = deploy("stop", "--name", "e2e", "--timeout", "30")
    assert done.returncode == 0, done.stderr
    # not even a zombie: a script that stops, then starts on the same ports, finds nothing of the old deployment
    assert not [p for p in pids | {q.pid for q in family} if in_process_table(p)]
    assert not (Path(deploy.env["FASTGEN_HOME"]) / "e2e" / "state.json").exists()
    done = deploy(*start, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    done = deploy("stop", "--name", "e2e", "--timeout", "30")
    assert done.returncode == 0, done.stderr
    done = deploy("status", "--name", "e2e")
    assert done.returncode != 0 and "no deployment named 'e2e'" in done.stderr
    assert "no deployments" in deploy("list").stdout
    assert deploy("logs", "--name", "e2e", "balancer").stdout  # logs outlive the deployment


def test_failed_start_reports_why_and_leaves_nothing(deploy, tmp_path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    port = free_port(2)
    done = deploy(*tiny_start("e2e", not_a_model, 1, port, free_port(2)), timeout=180)
    assert done.returncode != 0
    assert "replica-0 exited with code" in done.stderr and "not a Hugging Face model folder" in done.stderr
    assert "no deployments" in deploy("list").stdout
    assert port_free("127.0.0.1", port) and port_free("127.0.0.1", port + 1)


def test_stop_cleans_up_after_a_killed_supervisor(deploy, tiny_model_dir):
    port = free_port(2)
    done = deploy(*tiny_start("e2e", tiny_model_dir, 1, port, free_port(2)), timeout=180)
    assert done.returncode == 0, done.stderr
    pids = [r["pid"] for r in deploy.status()]
    state = json.loads((Path(deploy.env["FASTGEN_HOME"]) / "e2e" / "state.json").read_text())
    os.kill(state["supervisor"]["pid"], signal.SIGKILL)
    wait_until(lambda: not alive(state["supervisor"]["pid"]), 10, "the supervisor to die")
    done = deploy("status", "--name", "e2e")
    assert done.returncode != 0 and "is not running" in done.stderr
    assert "dead" in deploy("list").stdout
    assert all(alive(p) for p in pids)  # orphans still serving
    done = deploy("stop", "--name", "e2e", "--timeout", "20")
    assert done.returncode == 0, done.stderr
    assert not [p for p in pids if alive(p)]
