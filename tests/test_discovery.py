"""Replicas joining and leaving the balancer while it runs (balancer/discovery.py, the pool's add and remove).

In process, against real gRPC health servers on loopback: a replica added takes traffic once it is SERVING; one
removed gets no new request at once and its channel closes only once its in-flight requests are done; a replicas
file is followed, and a bad one changes nothing. End to end, against Debian's dnsmasq serving A records from a file
the test rewrites: replica processes on 127.0.0.2 and 127.0.0.3 (one port, as pods behind a headless Service) join
and leave a balancer process under a closed-loop load, with no failed request, the new replica taking traffic within
10 s of turning healthy, and the removed one finishing its stream before it is closed."""

from __future__ import annotations

import asyncio
import getpass
import grp
import os
import shutil
import signal
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fastgen.balancer.__main__ import parse_args
from fastgen.balancer.discovery import Discovery, DnsSource, FileSource, LookupFailed, parse_replicas_file
from fastgen.balancer.policy import ReplicaLoad, Router
from fastgen.balancer.pool import ReplicaPool, ReplicaSpec
from fastgen.launch.processes import Process, start
from fastgen.proto.fastgen_pb2_grpc import GenerationServicer
from fastgen.server import Client, GenerationError
from fastgen.server.grpc_server import create_server, set_serving
from fastgen.server.metrics import BalancerMetrics

from .helpers import Proc, free_port, health, require_tool, start_balancer, start_replica, wait_serving, wait_until

NAME = "replicas.fastgen.test"
LONG_STREAM = 600  # tokens: seconds of decoding on the tiny model, so the stream is still going when A leaves
SHUTDOWN = grpc.ChannelConnectivity.SHUTDOWN


# ---- parsing ----
def test_a_replicas_file_lists_ids_and_addresses_with_comments():
    text = "# the pool\nr0=10.0.0.1:50051\n\n10.0.0.2:50051  # its id is its address\n[::1]:7000\n"
    assert parse_replicas_file(text) == [
        ReplicaSpec("r0", "10.0.0.1:50051"),
        ReplicaSpec("10.0.0.2:50051", "10.0.0.2:50051"),
        ReplicaSpec("[::1]:7000", "[::1]:7000"),
    ]
    assert parse_replicas_file("") == []
    with pytest.raises(ValueError, match="line 2: .*ID=HOST:PORT"):
        parse_replicas_file("r0=a:1\nnot an address\n")
    with pytest.raises(ValueError, match="line 2: replica id 'r0' appears twice"):
        parse_replicas_file("r0=a:1\nr0=b:2\n")


def test_balancer_flags_take_dns_and_file_sources_and_need_one_source(tmp_path, capsys):
    args = parse_args(["--replicas-dns", "svc:50051", "--dns-server", "127.0.0.1:5353", "--replicas-file", "f"])
    assert args.replicas_dns == [("svc", 50051)] and args.dns_server == ("127.0.0.1", 5353)
    assert args.replicas_file == [Path("f")] and args.replica == []
    assert parse_args(["--replicas-dns", "svc:1", "--dns-server", "10.0.0.10"]).dns_server == ("10.0.0.10", 53)
    for bad in ([], ["--replicas-dns", "svc"], ["--replicas-dns", "svc:0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--replicas-dns NAME:PORT" in capsys.readouterr().err


def test_round_robin_rotates_over_positions_that_only_grow():
    router, idle = Router("round_robin", 2), ReplicaLoad()
    assert [router.pick({0: idle, 1: idle}) for _ in range(3)] == [0, 1, 0]
    # replica 0 left, 2 and 5 joined: the rotation continues after the last pick, over whoever is there
    assert [router.pick({1: idle, 2: idle, 5: idle}) for _ in range(6)] == [1, 2, 5, 1, 2, 5]
    assert Router("round_robin", 0).pick({3: idle}) == 3  # a pool that started empty


# ---- in process: a pool over real health servers ----
@dataclass
class HealthServers:
    """gRPC servers with only the health service, on 127.0.0.1, one per id."""

    servers: dict = field(default_factory=dict)

    async def start(self, rid: str, serving: bool = True) -> ReplicaSpec:
        port = free_port()
        server, health = create_server(GenerationServicer(), "127.0.0.1", port)
        await server.start()
        await set_serving(health, serving)
        self.servers[rid] = (server, health)
        return ReplicaSpec(rid, f"127.0.0.1:{port}")

    async def close(self) -> None:
        await asyncio.gather(*(s.stop(None) for s, _ in self.servers.values()))


def sample(registry: CollectorRegistry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, labels)


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_pool_adds_a_replica_once_serving_and_closes_a_removed_one_after_its_requests():
    async def run() -> None:
        servers, registry = HealthServers(), CollectorRegistry()
        metrics = BalancerMetrics(registry, (), "round_robin")
        changes = []

        async def on_health_change() -> None:
            changes.append(pool.any_healthy())

        pool = ReplicaPool([], 0.05, 1.0, metrics, on_health_change)
        pool.start()
        try:
            a = pool.add(await servers.start("a"))
            b = pool.add(await servers.start("b", serving=False))
            with pytest.raises(ValueError, match="already"):
                pool.add(ReplicaSpec("a", "127.0.0.1:1"))
            await until(lambda: pool.candidates(set()) == {a.position: a.load()})
            await until(lambda: b.checked)
            assert not b.healthy and changes[-1] is True  # the balancer serves: a is healthy
            await set_serving(servers.servers["b"][1], True)
            await until(lambda: set(pool.candidates(set())) == {a.position, b.position})

            async with pool.lease(a, 10):  # a request in flight on a
                await pool.remove("a")
                assert set(pool.candidates(set())) == {b.position} and pool.at(a.position) is None
                await asyncio.sleep(0.3)  # several health intervals: still open for its request
                assert a.channel.get_state() != SHUTDOWN and a.watches and not a.watches[0].done()
                assert sample(registry, "fastgen_balancer_in_flight_requests", replica="a") == 1
            await until(lambda: all(t.done() for t in a.watches))
            assert a.channel.get_state() == SHUTDOWN
            assert sample(registry, "fastgen_balancer_in_flight_requests", replica="a") is None
            assert sample(registry, "fastgen_balancer_replica_healthy", replica="b") == 1

            await pool.remove("b")  # the last one: the balancer stops serving at once
            assert changes[-1] is False and "none configured or discovered" in pool.unavailable_message()
        finally:
            await pool.close()
            await servers.close()

    asyncio.run(run())


def test_a_watched_file_adds_and_removes_replicas_and_a_bad_one_changes_nothing(tmp_path):
    async def run() -> None:
        servers, registry = HealthServers(), CollectorRegistry()
        metrics = BalancerMetrics(registry, ("static",), "round_robin")
        pool = ReplicaPool([ReplicaSpec("static", "127.0.0.1:1")], 0.05, 1.0, metrics)
        path = tmp_path / "replicas.txt"
        discovery = Discovery(pool, [FileSource(path)], interval=0.05, metrics=metrics)
        pool.start()
        try:
            specs = [await servers.start(rid) for rid in ("f0", "f1")]
            await discovery.refresh(0)  # no file yet: nothing changes
            assert [r.id for r in pool.replicas] == ["static"]
            assert sample(registry, "fastgen_balancer_discovery_errors_total", source="file") == 1

            write_atomically(path, "".join(f"{s.id}={s.address}\n" for s in specs) + "static=127.0.0.1:2\n")
            await discovery.refresh(0)
            assert [r.id for r in pool.replicas] == ["static", "f0", "f1"]  # a taken id stays the flag's
            assert sample(registry, "fastgen_balancer_discovered_replicas", source="file") == 2
            await until(lambda: len(pool.candidates(set())) == 2)

            write_atomically(path, "f1=127.0.0.1:oops\n")  # half edited: keep what we have
            await discovery.refresh(0)
            assert [r.id for r in pool.replicas] == ["static", "f0", "f1"]

            write_atomically(path, f"# f0 is gone\nf1={specs[1].address}\n")
            await discovery.refresh(0)
            assert [r.id for r in pool.replicas] == ["static", "f1"]
            assert sample(registry, "fastgen_balancer_discovered_replicas", source="file") == 1

            discovery.start()  # the watch itself: an address change is a removal and an addition
            moved = await servers.start("f1b")
            write_atomically(path, f"f1={moved.address}\n")
            await until(lambda: [r.address for r in pool.replicas] == ["127.0.0.1:1", moved.address])
        finally:
            await discovery.close()
            await pool.close()
            await servers.close()

    asyncio.run(run())


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_the_system_resolver_finds_localhost():
    async def lookup() -> list[ReplicaSpec]:
        return await DnsSource("localhost", 50051).lookup()

    addresses = {s.address for s in asyncio.run(lookup())}
    assert "127.0.0.1:50051" in addresses and addresses <= {"127.0.0.1:50051", "[::1]:50051"}


# ---- a real DNS server ----
@dataclass
class Dnsmasq:
    """dnsmasq answering for *.test from a hosts file only (anything else under .test: NXDOMAIN)."""

    process: Process
    port: int
    hosts: Path

    def set_addresses(self, addresses: list[str]) -> None:
        self.hosts.write_text("".join(f"{a} {NAME}\n" for a in addresses))
        self.process.send(signal.SIGHUP)  # re-reads the hosts file

    def answers(self, addresses: list[str]) -> bool:
        async def lookup() -> list[str]:
            return [s.address for s in await DnsSource(NAME, 1, ("127.0.0.1", self.port)).lookup()]

        try:
            return sorted(asyncio.run(lookup())) == sorted(f"{a}:1" for a in addresses)
        except LookupFailed:
            return False


def dnsmasq_binary() -> str | None:
    return shutil.which("dnsmasq") or next((p for p in ("/usr/sbin/dnsmasq",) if os.access(p, os.X_OK)), None)


@pytest.fixture(scope="module")
def dnsmasq(tmp_path_factory):
    binary = dnsmasq_binary()
    if binary is None:
        require_tool(False, "dnsmasq is not installed (apt-get install dnsmasq-base; .ci/run does)")
    folder = tmp_path_factory.mktemp("dns")
    hosts, port = folder / "hosts", udp_port()
    hosts.write_text("")
    argv = [
        binary,
        "--keep-in-foreground",
        "--conf-file=/dev/null",
        "--no-resolv",
        "--no-hosts",
        f"--addn-hosts={hosts}",
        "--local=/test/",  # authoritative for .test: an unknown name is NXDOMAIN, not a failure
        "--listen-address=127.0.0.1",
        "--bind-interfaces",
        f"--port={port}",
        f"--pid-file={folder / 'pid'}",
        f"--user={getpass.getuser()}",  # stay who we are: the hosts file is re-read after SIGHUP
        f"--group={grp.getgrgid(os.getgid()).gr_name}",
        "--log-facility=-",
    ]
    with start("dnsmasq", argv, folder / "dnsmasq.log") as process:
        server = Dnsmasq(process, port, hosts)
        process.wait_ready(lambda: server.answers([]), 10, what="answering")
        yield server


def udp_port() -> int:
    """A port free for TCP and UDP on 127.0.0.1 (dnsmasq listens on both), outside the ephemeral range."""
    for _ in range(50):
        port = free_port()
        if bindable_on(["127.0.0.1"], port, socket.SOCK_DGRAM):
            return port
    raise RuntimeError("no port free for both TCP and UDP")


def bindable_on(hosts: list[str], port: int, kind: socket.SocketKind = socket.SOCK_STREAM) -> bool:
    try:
        for host in hosts:
            with socket.socket(socket.AF_INET, kind) as s:
                s.bind((host, port))
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_dns_answers_become_replica_specs_and_no_such_name_is_no_replicas(dnsmasq):
    dnsmasq.set_addresses(["127.0.0.3", "127.0.0.2"])
    wait_until(lambda: dnsmasq.answers(["127.0.0.2", "127.0.0.3"]), 10, "dnsmasq serving the new file")

    async def lookups():
        source = DnsSource(NAME, 50051, ("127.0.0.1", dnsmasq.port))
        missing = DnsSource("nothing-here.fastgen.test", 50051, ("127.0.0.1", dnsmasq.port))
        silent = DnsSource(NAME, 50051, ("127.0.0.1", udp_port()))  # nobody answers there
        failed = None
        try:
            await silent.lookup()
        except LookupFailed as e:
            failed = str(e)
        return await source.lookup(), await missing.lookup(), failed

    found, missing, failed = asyncio.run(lookups())
    assert found == [ReplicaSpec(f"127.0.0.{i}:50051", f"127.0.0.{i}:50051") for i in (2, 3)]
    assert missing == [] and failed and NAME in failed


# ---- end to end: replicas come and go under load ----
def free_port_on(hosts: list[str]) -> int:
    """A TCP port free on every one of `hosts` (all loopback on Linux)."""
    for _ in range(50):
        port = free_port()
        if bindable_on(hosts, port):
            return port
    raise RuntimeError(f"no port free on all of {hosts}")


@dataclass
class Served:
    started: float
    finished: float
    replicas: tuple[str, ...]  # the replica ids that sent its output, in order


@dataclass
class ClosedLoop:
    """Clients sending their next request as soon as the last one answered, unary and streams in turn."""

    address: str
    workers: int = 3
    done: list[Served] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self.run, args=(w,), daemon=True) for w in range(self.workers)]
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def run(self, worker: int) -> None:
        with Client(self.address, timeout=60) as c:
            n = worker
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    if n % 2:
                        chunks = list(c.stream_chunks([100 + n % 50, 7, 8], max_new_tokens=12, ignore_eos=True))
                        replicas = tuple(dict.fromkeys(ch.replica for ch in chunks))
                        tokens = sum(len(ch.token_ids) for ch in chunks)
                    else:
                        result = c.generate([100 + n % 50, 7, 8], max_new_tokens=12, ignore_eos=True)
                        replicas, tokens = (result.replica,), len(result.token_ids)
                except GenerationError as e:
                    self.failures.append(f"{e.code.name}: {e.details}")
                else:
                    if tokens != 12:
                        self.failures.append(f"{tokens} tokens from {replicas}")
                    self.done.append(Served(started, time.monotonic(), replicas))
                n += self.workers

    def first_from(self, replica: str, after: float) -> float | None:
        return min((s.finished for s in list(self.done) if replica in s.replicas and s.finished >= after), default=None)


def balancer_replicas(balancer: Proc) -> dict[str, str]:
    with Client(balancer.address, timeout=5) as c:
        return {r.replica: r.health for r in c.status().replicas}


def metric_samples(proc: Proc, name: str) -> dict[tuple, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == name
    }


@pytest.mark.slow
def test_replicas_join_and_leave_by_dns_under_load_without_a_failed_request(dnsmasq, tiny_model_dir, tmp_path):
    hosts = ["127.0.0.2", "127.0.0.3"]
    port = free_port_on(hosts)
    ids = {host: f"{host}:{port}" for host in hosts}  # the balancer's ids: the DNS answer's address and the port
    procs: list[Proc] = []
    load = None

    def replica(host: str, name: str) -> Proc:
        proc = start_replica(tiny_model_dir, name, tmp_path, port=port, extra_args=["--host", host])
        proc.host = host
        procs.append(proc)
        return proc

    try:
        dnsmasq.set_addresses(hosts[:1])
        wait_until(lambda: dnsmasq.answers(hosts[:1]), 10, "dnsmasq serving replica A only")
        a = replica(hosts[0], "rA")
        flags = ["--replicas-dns", f"{NAME}:{port}", "--dns-server", f"127.0.0.1:{dnsmasq.port}"]
        balancer = start_balancer({}, tmp_path, extra_args=[*flags, "--discovery-interval", "0.5"])
        procs.append(balancer)
        wait_serving(a)
        wait_serving(balancer, timeout=30)
        load = ClosedLoop(balancer.address)
        load.start()
        wait_until(lambda: len(load.done) >= 6, 60, "traffic on replica A")

        # Scale out as a StatefulSet does: the pod's address is in DNS before the replica serves.
        dnsmasq.set_addresses(hosts)
        b = replica(hosts[1], "rB")
        wait_until(lambda: set(balancer_replicas(balancer)) == set(ids.values()), 15, "the balancer seeing B")
        wait_until(lambda: health(b.address, 0.5) == "SERVING" or not b.alive(), 120, "replica B serving", 0.05)
        healthy_at = time.monotonic()
        assert b.alive(), b.log_tail()
        served_at = wait_until(lambda: load.first_from("rB", healthy_at), 30, "traffic on replica B", 0.05)

        # Scale in: a stream in flight on A when it leaves DNS finishes there; new requests go to B only.
        in_flight, a_key = "fastgen_balancer_in_flight_requests", (("replica", ids[hosts[0]]),)
        with Client(balancer.address, timeout=60) as c:
            for i in range(30):  # round robin: a stream lands on A within a few tries
                stream = c.stream_chunks([200 + i, 9], max_new_tokens=LONG_STREAM, ignore_eos=True)
                first = next(stream)
                if first.replica == "rA":
                    break
                stream.close()
            assert first.replica == "rA", "no stream landed on replica A"
            dnsmasq.set_addresses(hosts[1:])
            wait_until(lambda: set(balancer_replicas(balancer)) == {ids[hosts[1]]}, 15, "the balancer dropping A")
            dropped_at = time.monotonic()
            still_in_flight = metric_samples(balancer, in_flight).get(a_key)
            rest = list(stream)
        assert all(ch.replica == "rA" for ch in rest)
        assert len(first.token_ids) + sum(len(ch.token_ids) for ch in rest) == LONG_STREAM
        wait_until(lambda: a_key not in metric_samples(balancer, in_flight), 10, "the balancer closing A")
        wait_until(lambda: sum(s.started > dropped_at for s in load.done) >= 6, 60, "traffic after A left")
        load.finish()

        assert not load.failures, load.failures[:5]
        after = [s.replicas for s in load.done if s.started > dropped_at]
        assert after and all(r == ("rB",) for r in after), after
        assert a.alive()  # it left the balancer, not the world: its own requests ended normally
        discovered = metric_samples(balancer, "fastgen_balancer_discovered_replicas")
        assert discovered[(("source", "dns"),)] == 1 and discovered[(("source", "static"),)] == 0
        print(
            f"\n{len(load.done)} requests, none failed; replica B served {served_at - healthy_at:.2f} s after turning "
            f"healthy; {len(after)} requests after A left, all on B; A's stream was "
            f"{'still' if still_in_flight else 'no longer'} in flight when A left DNS, and ended there"
        )
    finally:
        if load is not None:
            load.finish()
        for proc in procs:
            proc.kill()
