"""fastgen-deploy without a model: settings, sizes, ports, state files, backoff, and the supervisor's mechanics with a
stand-in child (a few-line gRPC health server). Fast: no torch in any process started here."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from fastgen.launch import cli, deployment, probe, state, supervisor
from fastgen.launch import config as cfg
from fastgen.launch.config import DeployConfig, ProcessSpec
from fastgen.replica.config import parse_size
from fastgen.testing import free_port

STAND_IN = textwrap.dedent(
    """
    # A stand-in server: NOT_SERVING for --delay s, then SERVING; exits 0 on SIGTERM after --drain s.
    import argparse, signal, sys, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int); p.add_argument("--delay", type=float, default=0)
    p.add_argument("--drain", type=float, default=0); p.add_argument("--marker", default="")
    a = p.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    h = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    server.add_insecure_port(f"127.0.0.1:{a.port}")
    h.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    def bye(*_):
        time.sleep(a.drain)
        if a.marker:
            open(a.marker, "a").write(f"{time.time()}\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    time.sleep(a.delay)
    h.set("", health_pb2.HealthCheckResponse.SERVING)
    print("serving", flush=True)
    while True:
        time.sleep(1)
    """
)


# ---- settings ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("1073741824", 1 << 30),
        ("1.5g", 3 << 29),
        ("64KiB", 65536),
        ("1GB", 10**9),
        (" 16 mib ", 16 << 20),
        ("100b", 100),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-1GiB", "0", "1.5.2M", "MiB"])
def test_parse_size_rejects_with_a_hint(text):
    with pytest.raises(ValueError, match="512MiB"):
        parse_size(text)


def test_format_size_round_trips():
    for n in (512 << 20, 2 << 30, 1000, 3 << 10):
        assert parse_size(cfg.format_size(n)) == n


def test_defaults_are_valid():
    assert cfg.validate(DeployConfig()) == []


@pytest.mark.parametrize(
    "change, flag",
    [
        (dict(replicas=0), "--replicas"),
        (dict(tp=0), "--tp"),
        (dict(threads=0), "--threads"),
        (dict(name="a b"), "--name"),
        (dict(name="../x"), "--name"),
        (dict(name=""), "--name"),
        (dict(port=0), "--port"),
        (dict(port=65535), "--port"),
        (dict(metrics_port=70000), "--metrics-port"),
        (dict(port=9400, metrics_port=9401), "overlap"),
        (dict(policy="random"), "--policy"),
        (dict(dtype="int8"), "--dtype"),
        (dict(scheduler="fifo"), "--scheduler"),
        (dict(max_seqs=5000), "--max-seqs"),
        (dict(block_size=0), "--block-size"),
        (dict(num_blocks=0), "--num-blocks"),
        (dict(max_model_len=1), "--max-model-len"),
        (dict(timeout=0), "--timeout"),
        (dict(model="/no/such/model"), "--model"),
        (dict(model="missing.gguf"), "--model"),
        (dict(device="tpu"), "--device"),
        (dict(kernels="cuda"), "--kernels"),
        (dict(load_format="pt"), "--load-format"),
        (dict(model="llama-3-8b"), "--load-format dummy"),
        (dict(http_port=70000), "--http-port"),
        (dict(http_port=-1), "--http-port"),
        (dict(http_port=50051), "--http-port"),
        (dict(http_port=9400), "--http-port"),
    ],
)
def test_validate_names_the_flag(change, flag):
    problems = cfg.validate(replace(DeployConfig(), **change))
    assert len(problems) == 1 and flag in problems[0], problems


def test_validate_reports_every_problem():
    assert len(cfg.validate(DeployConfig(replicas=0, tp=0, name="?"))) == 3


def test_default_threads():
    assert cfg.default_threads(16, 2) == 8
    assert cfg.default_threads(2, 4) == 1
    assert cfg.default_threads(1, 1) == 1


def test_port_layout_and_commands():
    c = DeployConfig(
        replicas=3,
        port=7000,
        metrics_port=8000,
        dtype="float32",
        num_blocks=64,
        max_model_len=256,
        kv_cache_memory=1 << 20,
        threads=2,
    )
    specs = cfg.plan(c, python="PY")
    assert [(s.id, s.role, s.port, s.metrics_port) for s in specs] == [
        ("balancer", "balancer", 7000, 8000),
        ("replica-0", "replica", 7001, 8001),
        ("replica-1", "replica", 7002, 8002),
        ("replica-2", "replica", 7003, 8003),
    ]
    bal = specs[0].argv
    assert bal[:3] == ["PY", "-m", "fastgen.balancer"]
    assert [bal[i + 1] for i, a in enumerate(bal) if a == "--replica"] == [
        "replica-0=127.0.0.1:7001",
        "replica-1=127.0.0.1:7002",
        "replica-2=127.0.0.1:7003",
    ]
    assert bal[bal.index("--policy") + 1] == "least_loaded"
    rep = specs[2].argv
    sla = rep.index("--sla-prompt-rate")  # last, as --sla-token-rate takes several values
    rep, sla = rep[:sla], rep[sla:]
    assert sla == ["--sla-prompt-rate", "100", "--sla-token-rate", "1", "2", "4"]
    flags = dict(zip(rep[3::2], rep[4::2]))
    assert rep[:3] == ["PY", "-m", "fastgen.replica"]
    assert flags == {
        "--host": "127.0.0.1",
        "--port": "7002",
        "--metrics-port": "8002",
        "--replica-id": "replica-1",
        "--model": "smollm2-135m",
        "--device": "auto",
        "--kernels": "auto",
        "--load-format": "auto",
        "--quantization": "auto",
        "--dtype": "float32",
        "--max-batch-tokens": "2048",  # the slo scheduler's cap: it is the default
        "--max-seqs": "64",
        "--block-size": "16",
        "--num-blocks": "64",
        "--kv-cache-memory": str(1 << 20),
        "--gpu-memory-utilization": "0.9",
        "--scheduler": "slo",
        "--max-model-len": "256",
        "--threads": "2",
    }


def test_the_budget_follows_the_scheduler_unless_given():
    def budget(**change):
        rep = cfg.plan(DeployConfig(replicas=1, **change), "PY")[1].argv
        return rep[rep.index("--scheduler") + 1], rep[rep.index("--max-batch-tokens") + 1]

    assert budget() == ("slo", "2048")
    assert budget(scheduler="splitfuse") == ("splitfuse", "512")
    assert budget(scheduler="splitfuse", max_batch_tokens=256) == ("splitfuse", "256")
    assert budget(max_batch_tokens=1024) == ("slo", "1024")
    args = cli.build_parser().parse_args(["start", "--scheduler", "prefill_first"])
    assert cli.config_from(args).batch_tokens == 512 and cli.config_from(args).max_batch_tokens is None


def test_optional_flags_left_out_and_tp_passed_through():
    rep = cfg.plan(DeployConfig(replicas=1), "PY")[1].argv
    assert "--dtype" not in rep and "--num-blocks" not in rep and "--max-model-len" not in rep and "--tp" not in rep
    rep = cfg.plan(DeployConfig(replicas=1, tp=2), "PY")[1].argv
    assert rep[rep.index("--tp") + 1] == "2"


def test_prompt_length_and_tenant_keys_reach_the_balancer():
    bal = cfg.plan(DeployConfig(replicas=1), "PY")[0].argv
    assert "--max-model-len" not in bal and "--api-keys-file" not in bal
    bal = cfg.plan(DeployConfig(replicas=1, max_model_len=4096, api_keys_file="/keys"), "PY")[0].argv
    assert bal[bal.index("--max-model-len") + 1] == "4096" and bal[bal.index("--api-keys-file") + 1] == "/keys"
    args = cli.build_parser().parse_args(["start", "--api-keys-file", "keys.txt"])
    assert cli.config_from(args).api_keys_file == "keys.txt"


def test_wildcard_host_is_reached_on_loopback():
    bal = cfg.plan(DeployConfig(host="0.0.0.0", replicas=1), "PY")[0].argv
    assert "replica-0=127.0.0.1:50051" in bal and bal[bal.index("--host") + 1] == "0.0.0.0"
    assert cfg.address("::", 5) == "[::1]:5"


def test_cli_builds_the_config():
    args = cli.build_parser().parse_args(["start", "--replicas", "4", "--kv-cache-memory", "2GiB", "--name", "x"])
    c = cli.config_from(args)
    assert (c.name, c.replicas, c.kv_cache_memory, c.port) == ("x", 4, 2 << 30, 50050)
    assert c.threads == cfg.default_threads(cli.cpu_count(), 4)
    default = cli.config_from(cli.build_parser().parse_args(["start"]))
    assert default.kv_cache_memory is None and default.gpu_memory_utilization == 0.9
    replica = cfg.plan(default, "python")[1]
    assert "--kv-cache-memory" not in replica.argv and "--gpu-memory-utilization" in replica.argv


def test_http_api_flags_reach_the_balancer_and_the_key_stays_off_its_command_line(monkeypatch):
    monkeypatch.setenv(cfg.API_KEY_ENV, "sk-from-env")
    args = cli.build_parser().parse_args(["start", "--replicas", "1", "--model", "smollm2-135m"])
    assert (args.http_port, args.api_key) == (8000, "sk-from-env")
    assert cli.build_parser().parse_args(["start", "--api-key", "sk-flag"]).api_key == "sk-flag"
    balancer = cfg.plan(cli.config_from(args), "PY")[0]
    argv = balancer.argv
    assert argv[argv.index("--http-port") + 1] == "8000" and balancer.http_port == 8000
    assert argv[argv.index("--served-model-name") + 1] == "smollm2-135m"
    assert not any("sk-" in a for a in argv)
    off = cfg.plan(DeployConfig(replicas=1, http_port=0), "PY")[0]
    assert "--http-port" not in off.argv and off.http_port is None
    assert (
        cfg.http_ports(DeployConfig(http_port=0)) == [] and cfg.http_url("0.0.0.0", 8000) == "http://127.0.0.1:8000/v1"
    )


def test_only_the_balancer_gets_the_api_key():
    env = {"PATH": "/bin", cfg.API_KEY_ENV: "sk-x"}
    balancer, replica = cfg.plan(DeployConfig(replicas=1), "PY")
    assert supervisor.child_env(env, balancer)[cfg.API_KEY_ENV] == "sk-x"
    assert supervisor.child_env(env, replica) == {"PATH": "/bin"}
    record = supervisor.process_record(supervisor.Child(balancer, Path("/nonexistent.log")))
    assert record["http_port"] == 8000 and record["pid"] is None


def test_the_balancer_and_the_cli_agree_on_the_key_variable():
    from fastgen.balancer.openai_api import API_KEY_ENV

    assert API_KEY_ENV == cfg.API_KEY_ENV


def test_status_shows_the_http_url():
    rec = {"id": "balancer", "role": "balancer", "pid": None, "port": 1, "metrics_port": 2, "http_port": 8000}
    row = deployment.process_status(rec, "0.0.0.0", timeout=0.1)
    assert (row["http_port"], row["http_url"], row["health"]) == (8000, "http://127.0.0.1:8000/v1", probe.DOWN)


def test_cli_rejects_a_bad_size(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["start", "--kv-cache-memory", "lots"])
    assert e.value.code == 2 and "512MiB" in capsys.readouterr().err


def test_cli_imports_no_torch_and_of_the_replica_only_its_config():
    code = (
        "import sys, fastgen.launch.cli, fastgen.launch.supervisor; print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'transformers') or m.startswith('fastgen.replica')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['fastgen.replica', 'fastgen.replica.config', 'fastgen.replica.engine_args']"


# ---- state and ports --------------------------------------------------------------------------------------------


def test_atomic_json(tmp_path):
    path = tmp_path / "d" / "state.json"
    state.write_json_atomic(path, {"a": 1})
    state.write_json_atomic(path, {"a": 2})
    assert state.read_json(path) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]  # no temporary files left
    assert state.read_json(tmp_path / "missing.json") is None


def test_config_round_trip_and_names(tmp_path):
    paths = state.paths_for(tmp_path, "one")
    state.save_config(paths, DeployConfig(name="one", replicas=3))
    assert state.load_config(paths) == DeployConfig(name="one", replicas=3)
    (tmp_path / "stray").mkdir()
    assert state.deployment_names(tmp_path) == ["one"]
    assert state.deployment_names(tmp_path / "nothing") == []
    state.remove_live_state(paths)
    assert state.deployment_names(tmp_path) == []


def test_lock_marks_a_live_deployment(tmp_path):
    paths = state.paths_for(tmp_path, "x")
    assert not state.is_live(paths)
    fd = state.try_lock(paths)
    assert fd is not None and state.is_live(paths) and state.try_lock(paths) is None
    os.close(fd)
    assert not state.is_live(paths)


def test_port_free():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not probe.port_free("127.0.0.1", port)
    assert probe.port_free("127.0.0.1", port)


def listening_above_a_free_port() -> socket.socket:
    """A listening socket on 127.0.0.1 whose port's lower neighbour is free: the suite's own servers may hold any
    port, and one holding the neighbour made a test of two adjacent ports fail once."""
    while True:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        if probe.port_free("127.0.0.1", s.getsockname()[1] - 1):
            return s
        s.close()


def test_free_ports_are_drawn_outside_the_ephemeral_range():
    # A port from bind(0) is one the kernel may give a health check's outgoing connection before the server binds
    # it: CI once lost a replica to exactly that ("cannot serve metrics ... Address already in use").
    ephemeral = probe.ephemeral_ports()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] in ephemeral  # what the old way drew from
    taken = probe.free_port("127.0.0.1", count=3)
    for _ in range(50):
        base = probe.free_port("127.0.0.1", avoid=frozenset(range(taken, taken + 3)), count=3)
        ports = set(range(base, base + 3))
        assert ports.isdisjoint(ephemeral) and ports.isdisjoint(range(taken, taken + 3))
        assert all(probe.port_free("127.0.0.1", p) for p in ports)
    with socket.socket() as s:  # a listener's port is never handed out
        s.bind(("127.0.0.1", taken))
        s.listen()
        draws = {probe.free_port("127.0.0.1") for _ in range(200)}
        assert taken not in draws


def test_this_process_never_draws_a_port_twice():
    drawn = [free_port(2) for _ in range(300)]
    ports = [p for base in drawn for p in (base, base + 1)]
    assert len(set(ports)) == len(ports)


def test_port_problems_name_the_flag(tmp_path):
    with listening_above_a_free_port() as s:  # the replica's port (--port + 1) taken, the balancer's free
        port = s.getsockname()[1]
        c = DeployConfig(replicas=1, port=port - 1, metrics_port=free_port(2), http_port=0)
        problems = deployment.port_problems(c, tmp_path)
    assert len(problems) == 1 and str(port) in problems[0] and "replica-0" in problems[0] and "--port" in problems[0]


def test_ports_of_other_live_deployments_are_taken(tmp_path):
    # Bases of free ranges: a deployment of one replica holds --port and --metrics-port and the port after each.
    port = free_port(2)
    metrics = free_port(2)
    http = free_port(1)
    other = DeployConfig(name="other", replicas=1, port=port, metrics_port=metrics, http_port=http)
    paths = state.paths_for(tmp_path, "other")
    state.save_config(paths, other)
    fd = state.try_lock(paths)  # stands for its supervisor
    try:
        problems = deployment.port_problems(replace(other, name="mine"), tmp_path)
        assert problems and all("deployment 'other'" in p for p in problems)
    finally:
        os.close(fd)
    assert deployment.port_problems(replace(other, name="mine"), tmp_path) == []


def test_http_port_in_use_names_its_flag(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        base = free_port(2)  # --port and --metrics-port each hold the port after them too
        c = DeployConfig(replicas=1, port=base, metrics_port=free_port(2), http_port=port)
        problems = deployment.port_problems(c, tmp_path)
    assert problems == [f"port {port} (balancer HTTP) on 127.0.0.1 is in use: choose another --http-port"]


def test_health_of_nothing_is_down():
    assert probe.check_health(f"127.0.0.1:{free_port()}", timeout=0.5) == probe.DOWN
    assert probe.get_status(f"127.0.0.1:{free_port()}", timeout=0.5) is None


# ---- CLI on missing deployments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["status"], ["status", "--json"], ["stop"], ["logs"], ["generate", "hi"]])
def test_missing_deployment_is_a_clear_error(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTGEN_HOME", str(tmp_path))
    assert cli.main(argv + ["--name", "nope"]) == 1
    assert "'nope'" in capsys.readouterr().err


def test_list_empty(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTGEN_HOME", str(tmp_path))
    assert cli.main(["list"]) == 0 and "no deployments" in capsys.readouterr().out
    assert cli.main(["list", "--json"]) == 0 and json.loads(capsys.readouterr().out) == []


def test_start_validates_before_launching(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTGEN_HOME", str(tmp_path))
    assert cli.main(["start", "--replicas", "0"]) == 1
    assert "--replicas must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "default").exists()


def test_start_refuses_a_used_port(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTGEN_HOME", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["start", "--port", str(port), "--replicas", "1", "--metrics-port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert f"port {port} (balancer gRPC)" in err and "choose another --port" in err
    assert state.deployment_names(tmp_path) == []


def test_logs_tail_and_unknown(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTGEN_HOME", str(tmp_path))
    logs = state.paths_for(tmp_path, "default").logs
    logs.mkdir(parents=True)
    (logs / "replica-1.log").write_text("".join(f"line {i}\n" for i in range(100)))
    assert cli.main(["logs", "1", "-n", "3"]) == 0
    assert capsys.readouterr().out == "line 97\nline 98\nline 99\n"
    assert cli.main(["logs", "replica-7"]) == 1
    assert "choose one of replica-1" in capsys.readouterr().err


# ---- supervision mechanics with a stand-in child ----------------------------------------------------------------


def test_backoff_schedule():
    b = supervisor.Backoff()
    assert [b.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert b.failures_after_exit(5, uptime=1.0) == 6
    assert b.failures_after_exit(5, uptime=b.reset_after) == 1  # a long healthy run starts over


def stand_in(tmp_path: Path, pid: str, role: str, port: int, *extra: str) -> supervisor.Child:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    spec = ProcessSpec(
        id=pid, role=role, port=port, metrics_port=0, argv=[sys.executable, str(script), "--port", str(port), *extra]
    )
    return supervisor.Child(spec, tmp_path / "logs" / f"{pid}.log")


@pytest.mark.slow
def test_wait_until_serving_then_restart_then_drain_in_order(tmp_path):
    marker = tmp_path / "order"
    children = [
        stand_in(tmp_path, "balancer", "balancer", free_port(), "--drain", "0.5", "--marker", str(marker)),
        stand_in(tmp_path, "replica-0", "replica", free_port(), "--delay", "0.5", "--marker", str(marker)),
    ]
    env = dict(os.environ)
    try:
        for c in children:
            supervisor.launch(c, env, first=True)
        assert supervisor.wait_until_serving(children, "127.0.0.1", 30, supervisor.StopFlag()) is None
        replica = children[1]
        old_pid = replica.proc.pid
        replica.proc.kill()
        replica.proc.wait()
        backoff = supervisor.Backoff(initial=0.2)
        assert supervisor.reap(replica, backoff, time.monotonic())
        assert replica.restart_at is not None and replica.failures == 1
        assert supervisor.process_record(replica)["state"] == "restarting"
        time.sleep(0.2)
        supervisor.launch(replica, env, first=False)
        assert replica.proc.pid != old_pid
        assert supervisor.wait_until_serving([replica], "127.0.0.1", 30, supervisor.StopFlag()) is None
        assert replica.log_path.read_text().count("==== fastgen-deploy: starting") == 2
        pids = [c.proc.pid for c in children]
        supervisor.terminate(children, timeout=20)
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
        # The balancer drained (0.5 s) before the replica got SIGTERM.
        assert len(marker.read_text().split()) == 2
        assert [c.proc.returncode for c in children] == [0, 0]
    finally:
        for c in children:
            if c.proc and c.proc.poll() is None:
                c.proc.kill()


@pytest.mark.slow
def test_start_up_fails_with_the_log_tail_when_a_child_exits(tmp_path):
    child = stand_in(tmp_path, "replica-0", "replica", free_port())
    child = supervisor.Child(
        replace(child.spec, argv=[sys.executable, "-c", "raise SystemExit('model not found')"]), child.log_path
    )
    supervisor.launch(child, dict(os.environ), first=True)
    error = supervisor.wait_until_serving([child], "127.0.0.1", 30, supervisor.StopFlag())
    assert "replica-0 exited with code 1 during start-up" in error and "model not found" in error


@pytest.mark.slow
def test_start_up_times_out_with_the_health(tmp_path):
    child = stand_in(tmp_path, "replica-0", "replica", free_port(), "--delay", "60")
    supervisor.launch(child, dict(os.environ), first=True)
    try:
        error = supervisor.wait_until_serving([child], "127.0.0.1", 1.5, supervisor.StopFlag())
        assert "not SERVING after 1.5 s" in error and "--timeout" in error
    finally:
        supervisor.terminate([child], timeout=5)


@pytest.mark.slow
def test_terminate_kills_what_ignores_sigterm(tmp_path):
    child = stand_in(tmp_path, "replica-0", "replica", free_port())
    child = supervisor.Child(
        replace(
            child.spec,
            argv=[
                sys.executable,
                "-c",
                "import signal, time; signal.signal(signal.SIGTERM, "
                "signal.SIG_IGN); print('up', flush=True); time.sleep(60)",
            ],
        ),
        child.log_path,
    )
    supervisor.launch(child, dict(os.environ), first=True)
    deadline = time.monotonic() + 10
    while "\nup\n" not in child.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.terminate([child], timeout=1.0)
    assert child.proc.returncode == -signal.SIGKILL  # it ignored SIGTERM: killed at the timeout, and reaped


def test_lora_flags_reach_the_replica_engine_config():
    from fastgen.replica.__main__ import engine_config, parse_args
    from fastgen.replica.config import LoraConfig

    flags = [
        "start",
        "--enable-lora",
        "--lora-modules",
        "a=/ad/a",
        "b=/ad/b",
        "--max-loras",
        "3",
        "--max-lora-rank",
        "32",
    ]
    c = cli.config_from(cli.build_parser().parse_args(flags))
    assert cfg.validate(c) == []
    argv = cfg.plan(c, "PY")[1].argv
    lora = engine_config(parse_args(argv[3:])).lora
    assert lora == LoraConfig(True, (("a", "/ad/a"), ("b", "/ad/b")), 3, 32)
    assert "--enable-lora" not in cfg.plan(DeployConfig(replicas=1), "PY")[1].argv
    bad = cfg.validate(replace(c, enable_lora=False))
    assert bad == ["--lora-modules needs --enable-lora"]
    assert cfg.validate(replace(c, lora_modules=("nopath",))) == ["--lora-modules takes name=path, got 'nopath'"]
