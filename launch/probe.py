"""Looking at running things: free ports, grpc.health.v1 checks, GetStatus, and processes by pid (psutil)."""

from __future__ import annotations

import os
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..proto import fastgen_pb2, fastgen_pb2_grpc
from ..server.client import ChannelSecurity
from ..server.tls import open_channel

SERVING, NOT_SERVING, DOWN = "SERVING", "NOT_SERVING", "DOWN"
# A private subchannel pool: otherwise every channel to an address shares one connection whose reconnect backoff
# (up to minutes) would hide a process that has just come up.
_CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now. gRPC servers set SO_REUSEPORT, so a second server on a used
    port would start silently and share the traffic: this check (without SO_REUSEPORT) is what catches it."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            # Like the servers: a port whose old connections linger in TIME_WAIT is still usable.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
            except OSError:
                return False
    return True


_draw = random.SystemRandom()  # not the module's generator: a test that seeds it must not make two processes agree


def ephemeral_ports() -> range:
    """The ports the kernel hands outgoing connections as their source (Linux's setting; IANA's range elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 49152, 65535
    return range(low, high + 1)


def free_port(host: str, avoid: frozenset[int] = frozenset(), count: int = 1) -> int:
    """The first of `count` consecutive ports free on host now, none in avoid (ports others will bind soon).
    Drawn outside the ephemeral range: a port from bind(0) is one the kernel may give any outgoing connection's
    source (a health check's, say) before our server binds it. A process binding the port later still races other
    processes choosing the same way, a 1 in ~16,000 chance."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ephemeral = ephemeral_ports()
    below, above = range(1024, ephemeral.start), range(ephemeral.stop, 65536)
    pool = max(below, above, key=len)
    pool = pool[-16384:] if pool is below else pool[:16384]
    for _ in range(200):
        base = _draw.choice(pool[: len(pool) - count + 1])
        ports = range(base, base + count)
        if avoid.isdisjoint(ports) and all(_bindable(family, host, port) for port in ports):
            return base
    raise RuntimeError(f"no {count} free consecutive ports on {host} outside {ephemeral} and {sorted(avoid)}")


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def host_resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return True


def _channel(target: str, security: ChannelSecurity | None) -> grpc.Channel:
    security = security or ChannelSecurity()
    return open_channel(target, _CHANNEL_OPTIONS, security.tls, security.server_name)


def check_health(target: str, timeout: float = 1.0, security: ChannelSecurity | None = None) -> str:
    """SERVING, NOT_SERVING (up but loading, draining or failing) or DOWN (no answer). `security`: TLS where the
    deployment has it (health needs no token)."""
    with _channel(target, security) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return DOWN
    return SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING


def get_status(
    target: str, timeout: float = 1.0, security: ChannelSecurity | None = None
) -> fastgen_pb2.StatusResponse | None:
    metadata = security.metadata if security else ()
    with _channel(target, security) as channel:
        try:
            stub = fastgen_pb2_grpc.GenerationStub(channel)
            return stub.GetStatus(fastgen_pb2.StatusRequest(), timeout=timeout, metadata=metadata)
        except grpc.RpcError:
            return None


@dataclass(frozen=True)
class ProcessRef:
    """A pid plus its start time, so a recycled pid is never mistaken for ours."""

    pid: int
    create_time: float

    @staticmethod
    def of(pid: int) -> ProcessRef | None:
        try:
            return ProcessRef(pid, psutil.Process(pid).create_time())
        except psutil.Error:
            return None

    def process(self) -> psutil.Process | None:
        """The live process, or None when it has exited (zombies count as exited)."""
        try:
            p = psutil.Process(self.pid)
            if abs(p.create_time() - self.create_time) > 0.01 or p.status() == psutil.STATUS_ZOMBIE:
                return None
            return p
        except psutil.Error:
            return None


def tree(p: psutil.Process) -> list[psutil.Process]:
    """p and all its descendants."""
    try:
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return [p]


def group_members(pgid: int) -> list[psutil.Process]:
    """Processes in a process group: children the supervisor started stay in its group even once orphaned."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def wait_reaped(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Waits until every process has left the process table (a zombie still holds its pid: `kill -0` and pgrep
    see it until its parent, often init, reaps it) or timeout passes; returns those still there."""
    deadline = time.monotonic() + timeout
    left = [p for p in procs if p.is_running()]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if p.is_running()]
    return left


def kill_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            continue


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Waits until every process has exited or timeout passes; returns those still alive."""
    deadline = time.monotonic() + timeout
    left = alive(procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive(left)
    return left
