"""The long-running supervisor of one deployment: `python -m fastgen.launch.supervisor DEPLOYMENT_DIR`.

`fastgen-deploy start` launches it detached (own session, stdin closed, output to logs/supervisor.log) holding the
deployment's lock. It starts the balancer and the replicas, waits until all are SERVING (any exit or the timeout
during start-up fails the deployment), then restarts whatever dies, with exponential backoff; the ranks of a
tensor-parallel replica live and die together (when one exits, the others are killed and the group restarts). On
SIGTERM it drains: balancer first (it finishes the requests in flight through it), then the replicas, then SIGKILL
after the timeout. A restart request (restart.json, from `fastgen-deploy restart`) replaces the replicas: with
rolling, one at a time, each drained (it reports NOT_SERVING, so the balancer sends new requests elsewhere and moves
its streams), restarted, and SERVING again as the balancer sees it before the next one goes; zero failed requests.
Only this process writes state.json.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..proto import fastgen_pb2
from ..server.client import ChannelSecurity
from . import probe, processes
from .certs import local_access
from .config import (
    API_KEY_ENV,
    DeployConfig,
    ProcessSpec,
    address,
    device_env,
    grpc_ports,
    http_ports,
    metrics_ports,
    plan,
    rank_env,
)
from .state import Paths, load_config, read_json, write_json_atomic

log = logging.getLogger("fastgen.supervisor")

POLL_S = 0.25
DEFAULT_DRAIN_S = 60.0
FAILED_START_DRAIN_S = 10.0  # nothing is in flight yet when start-up fails
LOG_TAIL_LINES = 30
REAP_S = 10.0  # how long terminate waits for orphaned descendants (TP ranks) to be reaped by init


@dataclass(frozen=True)
class Backoff:
    """Delay before restarting a process that died: 1 s, 2 s, 4 s … capped at 30 s. A run that lasted reset_after
    seconds counts as healthy and starts the schedule over."""

    initial: float = 1.0
    maximum: float = 30.0
    reset_after: float = 60.0

    def delay(self, failures: int) -> float:
        return min(self.maximum, self.initial * 2 ** max(0, failures - 1))

    def failures_after_exit(self, failures: int, uptime: float) -> int:
        return 1 if uptime >= self.reset_after else failures + 1


@dataclass
class Child:
    spec: ProcessSpec
    log_path: Path
    proc: subprocess.Popen | None = None
    create_time: float | None = None
    started_at: float = 0.0  # monotonic
    failures: int = 0  # exits in a row without a healthy run
    restarts: int = 0
    restart_at: float | None = None  # monotonic; set while waiting out the backoff
    last_exit: int | None = None
    master_port: int | None = None  # where a tensor-parallel group's ranks meet, fresh at every start


@dataclass
class StopFlag:
    """Set by SIGTERM/SIGINT; a plain attribute because signal handlers must not take locks."""

    requested: bool = False


def launch(child: Child, env: dict[str, str], first: bool) -> None:
    child.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(child.log_path, "w" if first else "a") as out:  # a header per run: log_tail quotes the latest one
        out.write(
            f"==== fastgen-deploy: starting {child.spec.id} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(child.spec.argv)}\n"
        )
    # Children stay in the supervisor's session and process group, so `stop` can find them even if the supervisor
    # itself was killed; stopping them is terminate's (staged, whole process trees), not processes'.
    child.proc = processes.start(child.spec.id, child.spec.argv, child.log_path, env=env, append=True).popen
    ref = probe.ProcessRef.of(child.proc.pid)
    child.create_time = ref.create_time if ref else None
    child.started_at = time.monotonic()
    child.restart_at = None
    log.info("started %s (pid %d)", child.spec.id, child.proc.pid)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of the latest run recorded in a log."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    run = text[text.rfind("==== fastgen-deploy: starting") :] if "==== fastgen-deploy" in text else text
    return "\n".join(run.splitlines()[-lines:])


def process_record(child: Child) -> dict:
    spec = child.spec
    running = child.proc is not None and child.proc.poll() is None
    return {
        "id": spec.id,
        "role": spec.role,
        "replica": spec.replica,
        "rank": spec.rank,
        "gpu": spec.gpu,
        "pid": child.proc.pid if running else None,
        "create_time": child.create_time if running else None,
        "port": spec.port,
        "metrics_port": spec.metrics_port,
        "http_port": spec.http_port,
        "master_port": child.master_port,
        "log": str(child.log_path),
        "restarts": child.restarts,
        "last_exit": child.last_exit,
        "state": "running" if running else ("restarting" if child.restart_at is not None else "exited"),
    }


def write_state(
    paths: Paths,
    config: DeployConfig,
    children: list[Child],
    status: str,
    error: str | None = None,
    restart: dict | None = None,
):
    write_json_atomic(
        paths.state,
        {
            "name": config.name,
            "status": status,
            "error": error,
            "supervisor": {"pid": os.getpid(), "create_time": probe.ProcessRef.of(os.getpid()).create_time},
            "host": config.host,
            "model": config.model,
            "policy": config.policy,
            "tp": config.tp,
            "device": config.device,
            # on gRPC, and on HTTP where it is served
            "api_key_required": bool(os.environ.get(API_KEY_ENV) or config.api_keys_file),
            "tls": bool(config.tls_cert),
            "mutual_tls": bool(config.tls_ca),
            "updated": time.time(),
            "processes": [process_record(c) for c in children],
            "restart": restart,  # the last restart request's progress, for `fastgen-deploy restart` to follow
        },
    )


def exit_message(child: Child, phase: str) -> str:
    return (
        f"{child.spec.id} exited with code {child.last_exit} {phase}; the end of its log ({child.log_path}):\n"
        + log_tail(child.log_path)
    )


def wait_until_serving(
    children: list[Child], host: str, timeout: float, stop: StopFlag, access: dict[str, ChannelSecurity] | None = None
) -> str | None:
    """None once every child answers SERVING; otherwise why start-up failed. `access`: how to reach each role
    (local_access: TLS where the deployment has it)."""
    access = access or {}
    deadline = time.monotonic() + timeout
    servers = [c for c in children if c.spec.port is not None]  # TP ranks > 0 serve through their rank 0
    health = {c.spec.id: probe.DOWN for c in servers}
    while True:
        for c in children:
            if c.proc.poll() is not None:
                c.last_exit = c.proc.returncode
                return exit_message(c, "during start-up")
        for c in servers:
            if health[c.spec.id] != probe.SERVING:
                target, security = address(host, c.spec.port), access.get(c.spec.role)
                health[c.spec.id] = probe.check_health(target, timeout=1.0, security=security)
        if all(h == probe.SERVING for h in health.values()):
            return None
        if stop.requested:
            return "stopped by a signal during start-up"
        if time.monotonic() > deadline:
            late = [c for c in servers if health[c.spec.id] != probe.SERVING]
            return "\n".join(
                f"{c.spec.id} not SERVING after {timeout:g} s (health {health[c.spec.id]}); raise --timeout if it "
                f"is still loading. The end of its log ({c.log_path}):\n{log_tail(c.log_path)}"
                for c in late
            )
        time.sleep(POLL_S)


def reap(child: Child, backoff: Backoff, now: float) -> bool:
    """Notices a dead child and schedules its restart; True when something changed."""
    if child.proc is None or child.restart_at is not None or child.proc.poll() is None:
        return False
    child.last_exit = child.proc.returncode
    child.failures = backoff.failures_after_exit(child.failures, now - child.started_at)
    child.restart_at = now + backoff.delay(child.failures)
    log.warning(
        "%s (pid %d) exited with code %s; restarting in %.0f s",
        child.spec.id,
        child.proc.pid,
        child.last_exit,
        child.restart_at - now,
    )
    return True


def groups_of(children: list[Child]) -> list[list[Child]]:
    """What starts, dies and restarts together: the ranks of one replica; any other process alone."""
    groups: dict[str, list[Child]] = {}
    for c in children:
        groups.setdefault(c.spec.replica or c.spec.id, []).append(c)
    return list(groups.values())


def launch_group(group: list[Child], env: dict[str, str], config: DeployConfig, first: bool) -> None:
    """Starts a group; the ranks of a tensor-parallel replica get torchrun's variables and a fresh MASTER_PORT (the
    last one may linger in TIME_WAIT, or have been taken meanwhile); on CUDA each process sees only its own GPU."""
    reserved = frozenset(grpc_ports(config) + metrics_ports(config) + http_ports(config))  # not yet bound at start
    master_port = probe.free_port(config.host, reserved) if group[0].spec.rank is not None else None
    for c in group:
        c.master_port = master_port
        ranks = rank_env(c.spec, config.tp, config.host, master_port) if master_port is not None else {}
        launch(c, {**child_env(env, c.spec), **ranks, **device_env(c.spec)}, first)


def child_env(env: dict[str, str], spec: ProcessSpec) -> dict[str, str]:
    """The supervisor's environment for a child; the API key only for the balancer, the one process that checks it."""
    return env if spec.role == "balancer" else {k: v for k, v in env.items() if k != API_KEY_ENV}


def reap_group(group: list[Child], backoff: Backoff, now: float) -> bool:
    """Notices dead members and schedules the group's restart; True when something changed. A replica cannot run
    short of a rank, so its surviving ranks are killed at once: the balancer stops routing to it (rank 0 is gone)
    and the whole group restarts after one backoff."""
    dead = [c for c in group if reap(c, backoff, now)]
    if not dead or len(group) == 1:
        return bool(dead)
    for c in group:
        if c.restart_at is None and c.proc is not None:
            log.warning("stopping %s (pid %d): its group lost %s", c.spec.id, c.proc.pid, dead[0].spec.id)
            c.proc.kill()
            c.proc.wait(10)
            c.last_exit = c.proc.returncode
    failures, restart_at = max(c.failures for c in dead), max(c.restart_at for c in dead)
    for c in group:
        c.failures, c.restart_at = failures, restart_at
    return True


def supervise(
    paths: Paths, config: DeployConfig, children: list[Child], env: dict[str, str], stop: StopFlag, backoff: Backoff
) -> None:
    """Keeps every child running until a stop is requested, and carries out restart requests."""
    groups = groups_of(children)
    restart = None
    while not stop.requested:
        request = take_restart_request(paths)
        if request is not None:
            restart = restart_replicas(paths, config, children, env, stop, request)
        now = time.monotonic()
        changed = [reap_group(g, backoff, now) for g in groups]
        for g in groups:
            if g[0].restart_at is not None and now >= g[0].restart_at:
                for c in g:
                    c.restarts += 1
                launch_group(g, env, config, first=False)
                changed.append(True)
        if any(changed):
            write_state(paths, config, children, "running", restart=restart)
        time.sleep(POLL_S)


def take_restart_request(paths: Paths) -> dict | None:
    """The pending restart request, taken (so it runs once); None when there is none or it is not JSON (the CLI
    writes atomically: such a file is not its)."""
    try:
        request = read_json(paths.restart_request)
    except ValueError:
        request = None
        paths.restart_request.unlink(missing_ok=True)
    if request is not None:
        paths.restart_request.unlink(missing_ok=True)
    return request if isinstance(request, dict) else None


def restart_replicas(
    paths: Paths, config: DeployConfig, children: list[Child], env: dict[str, str], stop: StopFlag, request: dict
) -> dict:
    """Replaces the replicas as `request` asks ({id, rolling, drain_timeout}); returns the record of how it went,
    which state.json carries. Rolling: one replica at a time, the next only once the balancer sees the new one
    SERVING, so that one is always there to take the requests and the streams of the one being drained. Otherwise
    all at once (requests in flight finish first, new ones fail until the replicas are back). Processes that die
    meanwhile are restarted after it, as ever."""
    record = {"id": request.get("id"), "rolling": bool(request.get("rolling")), "status": "running", "done": []}
    groups = [g for g in groups_of(children) if g[0].spec.role != "balancer"]
    batches = [[g] for g in groups] if record["rolling"] else [groups]
    access = local_access(config)
    timeout = float(request.get("drain_timeout", DEFAULT_DRAIN_S))
    for batch in batches:
        names = [g[0].spec.replica for g in batch]
        record["replica"] = ", ".join(names)
        write_state(paths, config, children, "running", restart=record)
        members = [c for g in batch for c in g]
        log.info("restart: draining %s (SIGKILL after %g s)", record["replica"], timeout)
        terminate(members, timeout)
        for c in members:
            c.restarts += 1
            c.last_exit = c.proc.returncode if c.proc is not None else None
        for g in batch:
            launch_group(g, env, config, first=False)
        write_state(paths, config, children, "running", restart=record)
        error = wait_until_serving(members, config.host, config.timeout, stop, access) or wait_balancer_sees(
            config, names, config.timeout, stop, access.get("balancer")
        )
        if error is not None:
            log.error("restart of %s failed: %s", record["replica"], error)
            record.update(status="failed", error=error)
            break
        record["done"].extend(names)
        log.info("restart: %s SERVING again", record["replica"])
    else:
        record["status"] = "done"
    record.pop("replica", None)
    write_state(paths, config, children, "running", restart=record)
    return record


def wait_balancer_sees(
    config: DeployConfig, replicas: list[str], timeout: float, stop: StopFlag, security: ChannelSecurity | None
) -> str | None:
    """None once the balancer reports every one of `replicas` SERVING; otherwise why not. A replica that answers
    health checks is not yet one the balancer routes to: it finds out at its next check."""
    deadline = time.monotonic() + timeout
    target = address(config.host, config.port)
    while True:
        reply = probe.get_status(target, 1.0, security)
        health = {r.replica: r.health for r in reply.replicas} if reply is not None else {}
        if all(health.get(r) == fastgen_pb2.HEALTH_SERVING for r in replicas):
            return None
        if stop.requested:
            return "stopped by a signal during the restart"
        if time.monotonic() > deadline:
            return f"the balancer at {target} does not see {', '.join(replicas)} SERVING after {timeout:g} s"
        time.sleep(POLL_S)


def drain_timeout(paths: Paths) -> float:
    request = read_json(paths.stop_request) or {}
    return float(request.get("timeout", DEFAULT_DRAIN_S))


def terminate(children: list[Child], timeout: float) -> None:
    """SIGTERM the balancer, wait for it, then the replicas; SIGKILL whatever is left when timeout runs out."""
    deadline = time.monotonic() + timeout
    stages = [[c for c in children if c.spec.role == "balancer"], [c for c in children if c.spec.role != "balancer"]]
    everyone = []
    for stage in stages:
        procs = [p for c in stage if (p := live_process(c)) is not None]
        # Descendants (e.g. TP ranks) are collected now: once their parent exits they are reparented away.
        family = [q for p in procs for q in probe.tree(p)]
        everyone += family
        probe.kill_all(procs, signal.SIGTERM)
        left = probe.wait_gone(family, max(0.0, deadline - time.monotonic()))
        if left:
            log.warning("SIGKILL after %g s: pids %s", timeout, [p.pid for p in left])
            probe.kill_all(left, signal.SIGKILL)
            probe.wait_gone(left, 5.0)
    for c in children:
        if c.proc is not None:
            c.proc.poll()  # reap, so no zombie outlives us
        c.restart_at = None
    # Orphaned descendants are reaped by init: wait for that too, so that whoever waits on us (stop, restart) finds
    # none of the old pids left.
    if unreaped := probe.wait_reaped(everyone, REAP_S):
        log.warning("pids %s exited but were not reaped within %g s", [p.pid for p in unreaped], REAP_S)


def live_process(child: Child):
    if child.proc is None or child.proc.poll() is not None or child.create_time is None:
        return None
    return probe.ProcessRef(child.proc.pid, child.create_time).process()


def start_and_supervise(
    paths: Paths, config: DeployConfig, children: list[Child], env: dict[str, str], stop: StopFlag, backoff: Backoff
) -> str | None:
    """Runs until a stop is requested; returns why start-up failed, or None."""
    for g in groups_of(children):
        launch_group(g, env, config, first=True)
    write_state(paths, config, children, "starting")
    error = wait_until_serving(children, config.host, config.timeout, stop, local_access(config))
    if error is not None:
        log.error("start-up failed: %s", error)
        return error
    write_state(paths, config, children, "running")
    log.info("all %d processes SERVING", len(children))
    supervise(paths, config, children, env, stop, backoff)
    return None


def run(paths: Paths, backoff: Backoff = Backoff()) -> int:
    config = load_config(paths)
    stop = StopFlag()

    def request_stop(signum, frame):
        stop.requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    children = [Child(spec, paths.log(spec.id)) for spec in plan(config, sys.executable)]
    try:
        error = start_and_supervise(paths, config, children, env, stop, backoff)
    except BaseException:
        terminate(children, DEFAULT_DRAIN_S / 4)  # never leave orphans behind, even on a bug of ours
        raise
    write_state(paths, config, children, "stopping", error)
    timeout = drain_timeout(paths) if error is None else FAILED_START_DRAIN_S
    log.info("stopping: draining the balancer, then the replicas (SIGKILL after %g s)", timeout)
    terminate(children, timeout)
    write_state(paths, config, children, "failed" if error else "stopped", error)
    log.info("stopped")
    return 1 if error else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastgen.launch.supervisor", description=__doc__)
    parser.add_argument("deployment_dir", type=Path)
    # The CLI passes its flock-ed lock fd down; keeping it open is what holds the lock for our whole life.
    parser.add_argument("--lock-fd", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    try:
        return run(Paths(args.deployment_dir))
    except Exception:
        log.exception("supervisor crashed")
        return 2


if __name__ == "__main__":
    sys.exit(main())
