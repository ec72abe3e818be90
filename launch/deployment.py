"""Starting, inspecting and stopping deployments from the CLI's side. The supervisor (supervisor.py) does the
running; this module launches it, waits for it, and reads what it records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from ..proto import fastgen_pb2
from ..server.client import ChannelSecurity
from . import gpus, probe, processes, prometheus
from .certs import ensure_token_file, local_access
from .config import (
    API_KEY_ENV,
    DEFAULT_MODEL,
    DeployConfig,
    address,
    device_problems,
    grpc_ports,
    http_ports,
    http_url,
    looks_like_path,
    metrics_ports,
    place,
    plan,
    validate,
)
from .state import (
    Paths,
    deployment_names,
    is_live,
    load_config,
    paths_for,
    read_json,
    remove_live_state,
    save_config,
    try_lock,
    write_json_atomic,
)
from .supervisor import FAILED_START_DRAIN_S, log_tail

# Beyond --timeout, how long `start` waits for the supervisor to give up and clean up by itself.
START_GRACE_S = 30.0
# Beyond stop's --timeout (after which the supervisor SIGKILLs its children), how long before we kill it too.
STOP_GRACE_S = 5.0
# How long stop waits for exited processes to be reaped by a parent that is not us (init, after `start`).
REAP_S = 10.0


class DeployError(Exception):
    """A failure to show the user as it is: the message says what went wrong and what to change."""


def prepare(config: DeployConfig, find_gpus: Callable[[], list[str]] = gpus.visible_gpus) -> DeployConfig:
    """Validated settings with a model path made absolute (the supervisor runs elsewhere), --device resolved and,
    on CUDA, a GPU for every replica process out of those find_gpus returns."""
    problems = validate(config)
    if not problems:
        found = find_gpus() if config.device != "cpu" else []
        problems = device_problems(config, found)
        config = place(config, found)
    if problems:
        raise DeployError("invalid settings:\n  " + "\n  ".join(problems))
    if not probe.host_resolves(config.host):
        raise DeployError(f"--host {config.host!r} does not resolve: give an IP address such as 127.0.0.1")
    model = Path(config.model).expanduser()
    if model.exists() and (looks_like_path(config.model) or config.model != DEFAULT_MODEL):
        config = replace(config, model=str(model.resolve()))
    return absolute_security_paths(config)


def absolute_security_paths(config: DeployConfig) -> DeployConfig:
    """The supervisor and its children run in the state directory: relative paths would name other files there."""
    names = ("auth_token_file", "api_keys_file", "tls_cert", "tls_key", "tls_ca")
    return replace(config, **{n: str(Path(v).expanduser().resolve()) for n in names if (v := getattr(config, n))})


def start(
    config: DeployConfig,
    home: Path,
    python: str = sys.executable,
    on_launch: Callable[[DeployConfig], None] | None = None,
    find_gpus: Callable[[], list[str]] = gpus.visible_gpus,
    api_key: str | None = None,
) -> dict:
    """Launches the deployment and waits until every process is SERVING; returns the supervisor's state.
    on_launch runs once the checks have passed and the supervisor is on its way (to tell the user to wait);
    find_gpus lists the GPUs to hand out (tests pass their own); api_key, the key the HTTP API requires, reaches the
    balancer through the environment only."""
    config = prepare(config, find_gpus)
    paths = paths_for(home, config.name)
    lock_fd = try_lock(paths)
    if lock_fd is None:
        raise DeployError(
            f"a deployment named {config.name!r} is already running: stop it first (fastgen-deploy stop --name "
            f"{config.name}) or choose another --name"
        )
    try:
        clear_leftovers(paths)
        problems = port_problems(config, home)
        if problems:
            raise DeployError("ports not available:\n  " + "\n  ".join(problems))
        remove_live_state(paths)
        try:
            config = replace(config, auth_token_file=str(ensure_token_file(paths.root, config.auth_token_file)))
        except ValueError as e:
            raise DeployError(str(e)) from None
        save_config(paths, config)
        write_json_atomic(paths.prometheus_targets, prometheus.targets(config))
        supervisor = spawn_supervisor(paths, lock_fd, python, api_key)
    finally:
        os.close(lock_fd)  # the supervisor holds the lock from now on (inherited fd)
    if on_launch is not None:
        on_launch(config)
    try:
        return wait_for_start(paths, supervisor, config.timeout + START_GRACE_S)
    except BaseException:  # a failure or Ctrl-C: leave nothing running
        try:
            stop(home, config.name, timeout=10.0)
        except DeployError:
            pass
        raise


def port_problems(config: DeployConfig, home: Path) -> list[str]:
    """Ports another live deployment holds (even while it is still loading) or that cannot be bound now."""
    owners = ports_of_live_deployments(home, exclude=config.name)
    problems = []
    roles = [spec.id for spec in plan(config, python="python") if spec.port is not None]
    layout = (
        ("gRPC", "--port", grpc_ports(config)),
        ("metrics", "--metrics-port", metrics_ports(config)),
        ("HTTP", "--http-port", http_ports(config)),
    )
    for kind, flag, ports in layout:
        for role, port in zip(roles, ports):
            if port in owners:
                problems.append(
                    f"port {port} ({role} {kind}) belongs to deployment {owners[port]!r}: choose another {flag}"
                )
            elif not probe.port_free(config.host, port):
                problems.append(f"port {port} ({role} {kind}) on {config.host} is in use: choose another {flag}")
    return problems


def ports_of_live_deployments(home: Path, exclude: str) -> dict[int, str]:
    owners = {}
    for name in deployment_names(home):
        paths = paths_for(home, name)
        config = load_config(paths)
        if name == exclude or config is None or not is_live(paths):
            continue
        for port in grpc_ports(config) + metrics_ports(config) + http_ports(config):
            owners[port] = name
    return owners


def spawn_supervisor(paths: Paths, lock_fd: int, python: str, api_key: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if api_key:  # the supervisor hands it to the balancer alone (supervisor.child_env)
        env[API_KEY_ENV] = api_key
    argv = [python, "-m", "fastgen.launch.supervisor", str(paths.root), "--lock-fd", str(lock_fd)]
    # Its own session: it survives the terminal and Ctrl-C of the shell that ran `start`. Only started here: it is
    # stopped by `stop` (a stop request, then its recorded processes), long after this process has gone.
    supervisor = processes.start(
        "the supervisor", argv, paths.log("supervisor"), env=env, cwd=paths.root, new_session=True, pass_fds=(lock_fd,)
    )
    return supervisor.popen


def wait_for_start(paths: Paths, supervisor: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = read_json(paths.state) or {}
        status = state.get("status")
        if status == "running":
            return state
        if status in ("stopping", "failed", "stopped"):
            try:
                supervisor.wait(FAILED_START_DRAIN_S + 30)  # it stops its children itself
            except subprocess.TimeoutExpired:
                pass  # start()'s clean-up stops what is left
            raise DeployError((read_json(paths.state) or state).get("error") or "stopped during start-up")
        if supervisor.poll() is not None:
            raise DeployError(
                f"the supervisor exited with code {supervisor.returncode} before the deployment came up; the end of "
                f"its log ({paths.log('supervisor')}):\n{log_tail(paths.log('supervisor'))}"
            )
        if time.monotonic() > deadline:
            raise DeployError(f"the deployment did not come up within {timeout:g} s; see fastgen-deploy logs")
        time.sleep(0.2)


@dataclass(frozen=True)
class StopReport:
    stopped: list[int]  # pids that were running when stop began
    forced: list[int]  # pids that needed SIGKILL from the CLI
    unreaped: list[int]  # pids that exited but that their parent (not us) had not reaped after REAP_S


def stop(home: Path, name: str, timeout: float = 60.0) -> StopReport:
    """Drains and stops the deployment, then makes sure none of its processes is left; forgets its state."""
    paths = paths_for(home, name)
    if not paths.config.exists() and not paths.state.exists():
        raise DeployError(f"no deployment named {name!r} (see fastgen-deploy list)")
    state = wait_for_state(paths) if is_live(paths) else read_json(paths.state) or {}
    supervisor = supervisor_ref(state)
    sup_proc = supervisor.process() if supervisor else None
    victims = recorded_processes(state) + (probe.tree(sup_proc) if sup_proc else [])
    if sup_proc is not None:  # it drains its children in order, and SIGKILLs them at the timeout
        write_json_atomic(paths.stop_request, {"timeout": timeout})
        probe.kill_all([sup_proc], signal.SIGTERM)
        probe.wait_gone([sup_proc], timeout + STOP_GRACE_S)
    elif supervisor is not None:  # it died: drain its orphans ourselves, all at once
        victims += supervisor_group(supervisor)
        probe.kill_all(victims, signal.SIGTERM)
        probe.wait_gone(victims, timeout)
    if supervisor is not None:
        victims += supervisor_group(supervisor)  # anything it started that we did not know of
    victims = list({p.pid: p for p in victims}.values())
    stopped = sorted({p.pid for p in victims})
    forced = probe.alive(victims)
    probe.kill_all(forced, signal.SIGKILL)
    left = probe.wait_gone(forced, 5.0)
    if left:
        raise DeployError(f"could not stop pids {[p.pid for p in left]} of deployment {name!r}; kill them by hand")
    # Exited is not yet gone: the supervisor's parent (init, once `start` has returned) reaps it a moment later,
    # and until then its pid answers `kill -0`; a script that stops and starts again must find nothing left.
    unreaped = probe.wait_reaped(victims + ([sup_proc] if sup_proc else []), REAP_S)
    remove_live_state(paths)
    return StopReport(stopped=stopped, forced=sorted(p.pid for p in forced), unreaped=sorted(p.pid for p in unreaped))


def restart(
    home: Path, name: str, rolling: bool, drain_timeout: float = 60.0, on_progress: Callable[[dict], None] | None = None
) -> dict:
    """Asks the supervisor to replace the replicas (rolling: one at a time, with no failed request) and waits until
    it is done; returns its record ({status, done, ...}). on_progress sees the record whenever it changes."""
    state = live_state(home, name)
    paths, config = paths_for(home, name), load_config(paths_for(home, name))
    request_id = uuid.uuid4().hex
    write_json_atomic(paths.restart_request, {"id": request_id, "rolling": rolling, "drain_timeout": drain_timeout})
    # Each replica may take the drain, a start-up and the balancer's next health check.
    batches = config.replicas if rolling else 1
    deadline = time.monotonic() + batches * (drain_timeout + config.timeout + STOP_GRACE_S) + START_GRACE_S
    seen = None
    while True:
        state = read_json(paths.state) or state
        record = state.get("restart") or {}
        if record.get("id") == request_id:
            if record != seen and on_progress is not None:
                on_progress(record)
            seen = record
            if record.get("status") == "done":
                return record
            if record.get("status") == "failed":
                raise DeployError(f"restart of deployment {name!r} failed: {record.get('error')}")
        if not is_live(paths):
            raise DeployError(f"the supervisor of deployment {name!r} exited during the restart; see its log")
        if time.monotonic() > deadline:
            raise DeployError(f"the restart of deployment {name!r} did not finish in time; see fastgen-deploy logs")
        time.sleep(0.2)


def wait_for_state(paths: Paths, timeout: float = 5.0) -> dict:
    """The supervisor writes its state right after launching its children; a stop can arrive just before."""
    deadline = time.monotonic() + timeout
    while (state := read_json(paths.state)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return state or {}


def supervisor_ref(state: dict) -> probe.ProcessRef | None:
    sup = state.get("supervisor")
    return probe.ProcessRef(sup["pid"], sup["create_time"]) if sup else None


def supervisor_group(supervisor: probe.ProcessRef) -> list[psutil.Process]:
    """The live members of the supervisor's process group (it is the group leader: `start` runs it in a new
    session), even orphaned ones. Linux never reuses a pid still naming a process group, so a different process
    holding the supervisor's pid means the group is gone and its number is someone else's."""
    holder = probe.ProcessRef.of(supervisor.pid)
    if holder is not None and abs(holder.create_time - supervisor.create_time) > 0.01:
        return []
    return [p for p in probe.group_members(supervisor.pid) if started_after(p, supervisor.create_time)]


def started_after(p: psutil.Process, t: float) -> bool:
    try:
        return p.create_time() >= t - 0.01
    except psutil.Error:
        return False


def recorded_processes(state: dict) -> list[psutil.Process]:
    """The live processes the state records, with their descendants (TP ranks, helpers)."""
    found = []
    for rec in state.get("processes", []):
        if rec.get("pid") is None:
            continue
        p = probe.ProcessRef(rec["pid"], rec["create_time"]).process()
        if p is not None:
            found += probe.tree(p)
    return found


def clear_leftovers(paths: Paths) -> None:
    """Kills what a crashed supervisor left running (its lock is free, its state says otherwise)."""
    state = read_json(paths.state)
    if state is None:
        return
    supervisor = supervisor_ref(state)
    leftovers = recorded_processes(state) + (supervisor_group(supervisor) if supervisor else [])
    probe.kill_all(leftovers, signal.SIGKILL)
    probe.wait_gone(leftovers, 5.0)


def live_state(home: Path, name: str) -> dict:
    """The state of a running deployment, or a DeployError saying why there is none."""
    paths = paths_for(home, name)
    if not paths.config.exists():
        raise DeployError(f"no deployment named {name!r} (see fastgen-deploy list)")
    if not is_live(paths):
        state = read_json(paths.state) or {}
        why = f": {state['error'].splitlines()[0]}" if state.get("error") else ""
        raise DeployError(
            f"deployment {name!r} is not running (its supervisor exited{why}); see fastgen-deploy logs --name {name} "
            f"supervisor, then fastgen-deploy stop --name {name} to clear it"
        )
    return wait_for_state(paths)


def status(state: dict, timeout: float = 1.0, access: dict[str, ChannelSecurity] | None = None) -> list[dict]:
    """One row per process of a live deployment's state, with live health (grpc.health.v1) and load (GetStatus);
    `access` (access_of) holds the credentials of each role."""
    host = state["host"]
    with ThreadPoolExecutor(max_workers=8) as pool:
        rows = list(pool.map(lambda rec: process_status(rec, host, timeout, access), state["processes"]))
    # A TP rank serves only through its rank 0, so it is as healthy as its group (DOWN when not running itself).
    group_health = {r["replica"]: r["health"] for r in rows if r["role"] == "replica"}
    for r in rows:
        if r["role"] == "tp_rank" and r["pid"]:
            r["health"] = group_health.get(r["replica"], probe.DOWN)
    return rows


def process_status(rec: dict, host: str, timeout: float, access: dict[str, ChannelSecurity] | None = None) -> dict:
    row = {key: rec.get(key) for key in ("id", "role", "pid", "port", "metrics_port")}
    if rec.get("replica") is not None:
        row["replica"] = rec["replica"]
    if rec.get("rank") is not None:
        row["rank"] = rec["rank"]
    if rec.get("gpu") is not None:
        row["gpu"] = rec["gpu"]
    if rec.get("http_port"):
        row["http_port"] = rec["http_port"]
        row["http_url"] = http_url(host, rec["http_port"])
    row["restarts"] = rec.get("restarts", 0)
    if rec["port"] is None:  # a TP rank > 0: status() gives it its group's health
        row["health"] = probe.DOWN
        return row
    target, security = address(host, rec["port"]), (access or {}).get(rec["role"])
    row["health"] = probe.check_health(target, timeout, security) if rec.get("pid") else probe.DOWN
    reply = probe.get_status(target, timeout, security) if row["health"] != probe.DOWN else None
    if reply is not None:
        row.update(load_of(reply))
    return row


def load_of(reply: fastgen_pb2.StatusResponse) -> dict:
    if reply.role == "balancer":
        return {
            "in_flight": sum(r.in_flight for r in reply.replicas),
            "replicas_serving": sum(r.health == fastgen_pb2.HEALTH_SERVING for r in reply.replicas),
        }
    if not reply.replicas:
        return {}
    r = reply.replicas[0]
    return {
        "queued": r.queued_requests,
        "running": r.running_requests,
        "kv_blocks_used": r.kv_blocks_used,
        "kv_blocks_total": r.kv_blocks_total,
    }


def list_deployments(home: Path) -> list[dict]:
    rows = []
    for name in deployment_names(home):
        paths = paths_for(home, name)
        config, state = load_config(paths), read_json(paths.state) or {}
        live = is_live(paths)
        rows.append(
            {
                "name": name,
                "status": state.get("status", "starting") if live else "dead",
                "model": config.model,
                "replicas": config.replicas,
                "tp": config.tp,
                "address": address(config.host, config.port),
                "http_url": http_url(config.host, config.http_port) if config.http_port else None,
                "metrics_ports": f"{config.metrics_port}..{config.metrics_port + config.replicas}",
                "supervisor_pid": (state.get("supervisor") or {}).get("pid") if live else None,
            }
        )
    return rows


def log_path(home: Path, name: str, which: str | None) -> Path:
    """The log of 'supervisor' (default), 'balancer', 'replica-N' or just 'N'."""
    paths = paths_for(home, name)
    process_id = "supervisor" if which is None else (f"replica-{which}" if which.isdigit() else which)
    path = paths.log(process_id)
    if "/" not in process_id and path.is_file():
        return path
    known = sorted(p.stem for p in paths.logs.glob("*.log")) if paths.logs.is_dir() else []
    if not known:
        raise DeployError(f"no logs for a deployment named {name!r} under {paths.root} (see fastgen-deploy list)")
    raise DeployError(f"no log {process_id!r} in deployment {name!r}: choose one of {', '.join(known)}")


def balancer_address(home: Path, name: str) -> str:
    config = load_config(paths_for(home, name))
    if config is None:
        raise DeployError(f"no deployment named {name!r}: start one, or pass --address host:port")
    live_state(home, name)
    return address(config.host, config.port)


def access_of(home: Path, name: str) -> dict[str, ChannelSecurity]:
    """How a local tool reaches each role of the deployment: its internal token (which the balancer accepts as well
    as the API key) and TLS where configured (certs.local_access)."""
    config = load_config(paths_for(home, name))
    if config is None:
        raise DeployError(f"no deployment named {name!r} (see fastgen-deploy list)")
    try:
        return local_access(config)
    except (ValueError, OSError) as e:
        raise DeployError(f"cannot read deployment {name!r}'s credentials: {e}") from None
