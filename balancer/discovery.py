"""Replica membership that changes while the balancer runs: a DNS name re-resolved (a Kubernetes headless Service
answers with the addresses of its pods) or a file re-read, every few seconds.

Each source owns the replicas it found and nothing else: a replica it no longer lists leaves the pool (no new
requests at once, closed once its in-flight requests finish: pool.py); a new one joins and takes traffic once its
health check says SERVING. Static `--replica` flags stay as they are. A lookup that fails (the DNS server does not
answer, the file is missing or half written) changes nothing; a DNS name that does not exist, or has no addresses,
means no replicas (a StatefulSet scaled to zero), but only once MISSES_BEFORE_REMOVAL answers in a row say so: one
NXDOMAIN from a resolver restarting, or a record briefly missing while pods roll, must not empty the pool.

    --replicas-dns fastgen-replica:50051     every address of the name is a replica at that port, its id "ADDRESS:PORT"
    --replicas-file replicas.txt             one replica a line, "ID=HOST:PORT" or "HOST:PORT"; '#' starts a comment

Write the file by renaming a complete one over it, so that no read sees it half written."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import dns.asyncresolver
import dns.exception
import dns.resolver

from ..server.metrics import BalancerMetrics
from .pool import ReplicaPool, ReplicaSpec, parse_replica_spec

log = logging.getLogger("fastgen.balancer")

DEFAULT_INTERVAL = 2.0  # seconds between lookups: a Kubernetes DNS record lives 5 s (CoreDNS's default TTL)
DNS_TIMEOUT = 2.0  # seconds one lookup through --dns-server may take
# DNS answers in a row that must leave a replica out before it leaves the pool (a file is read as written: one).
MISSES_BEFORE_REMOVAL = 3
# getaddrinfo's answers for a name that does not exist or has no addresses: no replicas, not a failure.
NO_ADDRESSES = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class LookupFailed(Exception):
    """The source cannot say which replicas there are right now; membership stays as it was."""


class Source(Protocol):
    kind: ClassVar[str]  # the `source` label of the discovery metrics
    misses_before_removal: ClassVar[int]  # lookups in a row without a replica before it is removed

    def describe(self) -> str: ...

    async def lookup(self) -> list[ReplicaSpec]: ...


def host_port(host: str, port: int) -> str:
    """An address gRPC dials: IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' (or, with a default port, the host alone) -> (host, port); ValueError saying what
    is wrong."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest or ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:  # a name or an IPv4 address without a port, or a bare IPv6 literal
        host, port = text, ""
    if not port and default_port is not None:
        port = str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        example = "NAME:PORT (e.g. fastgen-replica:50051)" if default_port is None else "HOST[:PORT]"
        raise ValueError(f"expected {example}, got {text!r}")
    return host, int(port)


@dataclass(frozen=True)
class DnsSource:
    """Every address a DNS name resolves to is a replica at `port`. Without a nameserver the system's resolver
    answers (in a pod: the cluster's DNS, with the namespace's search domains); with one, that server is asked
    directly for A and AAAA records."""

    name: str
    port: int
    nameserver: tuple[str, int] | None = None
    kind: ClassVar[str] = "dns"
    misses_before_removal: ClassVar[int] = MISSES_BEFORE_REMOVAL

    def describe(self) -> str:
        via = f" via {host_port(*self.nameserver)}" if self.nameserver else ""
        return f"DNS {self.name}:{self.port}{via}"

    async def lookup(self) -> list[ReplicaSpec]:
        addresses = await (self._ask_nameserver() if self.nameserver else self._ask_system())
        specs = {host_port(a, self.port) for a in addresses}
        return [ReplicaSpec(a, a) for a in sorted(specs)]

    async def _ask_system(self) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno in NO_ADDRESSES:
                return []
            raise LookupFailed(f"resolving {self.name}: {e}") from None
        return [str(info[4][0]) for info in infos]  # an IPv4 or IPv6 address (typeshed's sockaddr also allows int)

    async def _ask_nameserver(self) -> list[str]:
        assert self.nameserver is not None, "asked only where there is one (lookup)"
        host, port = self.nameserver
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [host]
        resolver.port = port
        resolver.lifetime = DNS_TIMEOUT
        via = host_port(host, port)
        answers = await asyncio.gather(*(self._records(resolver, kind, via) for kind in ("A", "AAAA")))
        return [address for records in answers for address in records]

    async def _records(self, resolver: dns.asyncresolver.Resolver, kind: str, via: str) -> list[str]:
        try:
            answer = await resolver.resolve(self.name, kind, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as e:
            raise LookupFailed(f"asking {via} for {self.name}: {e}") from None
        return [record.address for record in answer]


def parse_replicas_file(text: str) -> list[ReplicaSpec]:
    """One replica a line: 'ID=HOST:PORT', or 'HOST:PORT' (its id is the address); blank lines and '#' comments
    are skipped. ValueError naming the line that is wrong."""
    specs: dict[str, ReplicaSpec] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            spec = parse_replica_spec(line if "=" in line else f"{line}={line}")
        except ValueError as e:
            raise ValueError(f"line {number}: {e}") from None
        if spec.id in specs:
            raise ValueError(f"line {number}: replica id {spec.id!r} appears twice; give each replica its own id")
        specs[spec.id] = spec
    return list(specs.values())


@dataclass(frozen=True)
class FileSource:
    """The replicas a file lists (parse_replicas_file), re-read at every lookup."""

    path: Path
    kind: ClassVar[str] = "file"
    misses_before_removal: ClassVar[int] = 1

    def describe(self) -> str:
        return f"file {self.path}"

    async def lookup(self) -> list[ReplicaSpec]:
        try:
            return parse_replicas_file(self.path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise LookupFailed(f"reading {self.path}: {e}") from None


class Discovery:
    """Keeps the pool's members in step with `sources`, looking each up every `interval` seconds."""

    def __init__(
        self,
        pool: ReplicaPool,
        sources: list[Source],
        interval: float = DEFAULT_INTERVAL,
        metrics: BalancerMetrics | None = None,
    ):
        self.pool, self.sources, self.interval, self._metrics = pool, sources, interval, metrics
        self._owned: list[dict[str, ReplicaSpec]] = [{} for _ in sources]  # per source: the replicas it added
        self._misses: list[dict[str, int]] = [{} for _ in sources]  # per source: lookups in a row without a replica
        self._errors: list[str | None] = [None for _ in sources]  # per source: its last failure, logged once
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow(i), name=f"discovery-{s.kind}-{i}") for i, s in enumerate(self.sources)
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _follow(self, index: int) -> None:
        while True:
            try:
                await self.refresh(index)
            except Exception:  # a bug must not stop the balancer following its replicas for good
                log.exception("looking up %s failed", self.sources[index].describe())
            await asyncio.sleep(self.interval)

    async def refresh(self, index: int) -> None:
        """One lookup of source `index` and the membership changes it calls for."""
        source = self.sources[index]
        try:
            specs = await source.lookup()
        except LookupFailed as e:
            if self._metrics:
                self._metrics.on_discovery_error(source.kind)
            if self._errors[index] != str(e):
                log.warning("%s: %s; keeping its %d replicas", source.describe(), e, len(self._owned[index]))
            self._errors[index] = str(e)
            return
        if self._errors[index] is not None:
            log.info("%s answers again", source.describe())
            self._errors[index] = None
        await self._apply(index, specs)

    async def _apply(self, index: int, specs: list[ReplicaSpec]) -> None:
        owned, wanted, misses = self._owned[index], {s.id: s for s in specs}, self._misses[index]
        needed = getattr(self.sources[index], "misses_before_removal", 1)
        for rid, spec in list(owned.items()):
            if wanted.get(rid) == spec:
                misses.pop(rid, None)
                continue
            misses[rid] = misses.get(rid, 0) + 1
            if rid in wanted or misses[rid] >= needed:  # its address changed, or it is gone for good
                del owned[rid]
                misses.pop(rid, None)
                await self.pool.remove(rid)
            else:
                log.info(
                    "%s no longer lists %s (%d of %d lookups)", self.sources[index].describe(), rid, misses[rid], needed
                )
        for rid, spec in wanted.items():
            if rid in owned:
                continue
            try:
                self.pool.add(spec)
            except ValueError:
                continue  # another source (or a --replica flag) has it already
            owned[rid] = spec
        if self._metrics:
            kind = self.sources[index].kind
            count = sum(len(o) for s, o in zip(self.sources, self._owned) if s.kind == kind)
            self._metrics.set_discovered(kind, count)
