"""The replicas behind the balancer: one grpc.aio channel each, a health watch each (grpc.health.v1 Check plus
GetStatus polling for load), and the balancer's own in-flight accounting. Every call but the health check carries the
deployment's internal token, over mutual TLS when the deployment has a CA.

For prefix-aware routing the pool also keeps one WatchCache stream per replica that reports prefix caching, feeding
that replica's CacheView (prefix_index.py), and hashes prompts with the replicas' tokenizer: the one given on the
command line, else the one the first replica reports (its folder must be readable here).

Membership changes while the balancer runs (discovery.py): an added replica takes traffic once its health check
says SERVING; a removed one takes no new request at once, keeps its health watch (so its streams can still move if
it drains) and is closed once its in-flight requests have finished. Positions are never reused, so a request's set
of tried positions stays meaningful across changes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..proto import fastgen_pb2, fastgen_pb2_grpc
from ..server.auth import AuthorizedStub
from ..server.client import ChannelSecurity
from ..server.grpc_server import CHANNEL_OPTIONS
from ..server.metrics import BalancerMetrics
from ..server.tls import open_channel
from .policy import ReplicaLoad
from .prefix_index import CacheView, PromptHasher, PromptKey
from .tokenizer import load_prompt_tokenizer

log = logging.getLogger("fastgen.balancer")

# A restarted replica should be found again within a health interval or two, not after gRPC's default
# reconnect backoff (up to two minutes).
UPSTREAM_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.use_local_subchannel_pool", 1),  # our own connection, not one shared with (and backed off by) others
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# A replica that answers checks too slowly (busy, not dead) leaves rotation only after this many in a row;
# refused connections and NOT_SERVING take it out at once.
SLOW_CHECKS_BEFORE_UNHEALTHY = 3
DEFAULT_BLOCK_SIZE = 16  # the replicas' default --block-size


@dataclass(frozen=True)
class ReplicaSpec:
    id: str
    address: str  # host:port


def parse_replica_spec(text: str) -> ReplicaSpec:
    """'ID=HOST:PORT' -> ReplicaSpec; ValueError saying what is wrong."""
    rid, sep, address = text.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not rid or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected ID=HOST:PORT (e.g. r0=127.0.0.1:50051), got {text!r}")
    return ReplicaSpec(rid, address)


@dataclass
class Replica:
    spec: ReplicaSpec
    position: int  # index in the pool: the rotation order of the routing policies
    channel: grpc.aio.Channel
    stub: AuthorizedStub  # a GenerationStub that sends the internal token where there is one
    health_stub: health_pb2_grpc.HealthStub
    checked: bool = False  # False until the first health check answered or failed
    healthy: bool = False
    last_error: str = "not checked yet"
    slow_checks: int = 0
    status: fastgen_pb2.ReplicaStatus = field(default_factory=fastgen_pb2.ReplicaStatus)
    model: str = ""
    in_flight: int = 0
    unreported_prompt_tokens: int = 0  # see ReplicaLoad
    in_flight_at_report: int = 0
    reports: int = 0  # GetStatus answers received: tells a lease whether its tokens are in a report yet
    dispatched: int = 0  # requests ever sent
    cache: CacheView = field(default_factory=CacheView)  # its prefix cache as far as the balancer knows
    watches: list[asyncio.Task] = field(default_factory=list)  # its health (and cache) watch, once started

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def address(self) -> str:
        return self.spec.address

    def serves(self, lora: str) -> bool:
        """Whether it may serve LoRA adapter `lora` ("": the base model, which every replica serves): it said so, or
        it has not reported yet (the replica itself answers NOT_FOUND for a name it does not know)."""
        return not lora or self.reports == 0 or lora in self.status.lora_adapters

    def load(self, key: PromptKey | None = None, lora: str = "") -> ReplicaLoad:
        """Its load; with a prompt's key, also how much of that prompt it is believed to hold; with a LoRA adapter,
        whether that adapter sits in one of its weight slots."""
        # A replica that said it does not cache holds nothing, whatever was routed to it.
        caching_off = self.status.kv_block_size > 0 and not self.status.prefix_caching
        cached = self.cache.cached_tokens(key) if key is not None and not caching_off else 0
        return ReplicaLoad(
            in_flight=self.in_flight,
            unreported_prompt_tokens=self.unreported_prompt_tokens,
            pending_prompt_tokens=self.status.pending_prompt_tokens,
            running_requests=self.status.running_requests,
            queued_requests=self.status.queued_requests,
            in_flight_at_report=self.in_flight_at_report,
            prefill_tokens_per_second=self.status.prefill_tokens_per_second,
            prompt_tokens=key.tokens if key is not None else 0,
            cached_tokens=cached,
            lora_resident=bool(lora) and lora in self.status.resident_lora_adapters,
        )

    def health_enum(self) -> fastgen_pb2.Health:
        if not self.checked:
            return fastgen_pb2.HEALTH_UNKNOWN
        return fastgen_pb2.HEALTH_SERVING if self.healthy else fastgen_pb2.HEALTH_NOT_SERVING


class ReplicaPool:
    """Owns the upstream channels and what the balancer knows about each replica. All methods run on the
    balancer's event loop; nothing here blocks."""

    def __init__(
        self,
        specs: list[ReplicaSpec],
        health_interval: float,
        health_timeout: float,
        metrics: BalancerMetrics | None = None,
        on_health_change: Callable[[], Awaitable[None]] | None = None,
        security: ChannelSecurity | None = None,
        prefix_routing: bool = False,
        tokenizer: str | None = None,
    ):
        self.security = security or ChannelSecurity()
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self._metrics = metrics
        self._on_health_change = on_health_change
        self.replicas: list[Replica] = []  # the members, in position order
        self._leaving: list[Replica] = []  # removed, waiting for their in-flight requests to finish
        self._closers: set[asyncio.Task] = set()
        self._next_position = 0
        self._started = False
        for spec in specs:
            self._add(spec)
        self._watches: list[asyncio.Task] = []
        self.prefix_routing = prefix_routing
        # An explicit tokenizer is loaded now (a bad path is the operator's to fix); else the replicas' is, later.
        self.hasher = PromptHasher(load_prompt_tokenizer(tokenizer) if tokenizer else None)
        self._tokenizer_wanted = prefix_routing and not tokenizer
        self._tokenizer_loading = False

    # ---- lifecycle ----
    def start(self) -> None:
        self._started = True
        for replica in self.replicas:
            self._start_watches(replica)

    async def close(self) -> None:
        members = self.replicas + self._leaving
        tasks = self._watches + list(self._closers) + [t for r in members for t in r.watches]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(r.channel.close() for r in members))

    # ---- membership ----
    def add(self, spec: ReplicaSpec) -> Replica:
        """A new member: out of rotation until its first health check says SERVING. ValueError when the id is taken."""
        if any(r.id == spec.id for r in self.replicas):
            raise ValueError(f"replica id {spec.id!r} is already in the pool")
        replica = self._add(spec)
        if self._metrics:
            self._metrics.add_replica(spec.id)
        if self._started:
            self._start_watches(replica)
        log.info("replica %s at %s added: in rotation once healthy", spec.id, spec.address)
        return replica

    async def remove(self, replica_id: str) -> None:
        """Takes the replica out of rotation now and closes it once its in-flight requests have finished."""
        replica = next((r for r in self.replicas if r.id == replica_id), None)
        if replica is None:
            return
        self.replicas.remove(replica)
        self._leaving.append(replica)
        log.info(
            "replica %s at %s removed: no new requests; closed after its %d in flight",
            replica.id,
            replica.address,
            replica.in_flight,
        )
        closer = asyncio.create_task(self._close_when_idle(replica), name=f"remove-{replica.id}")
        self._closers.add(closer)
        closer.add_done_callback(self._closers.discard)
        if replica.healthy and self._on_health_change:
            await self._on_health_change()

    def at(self, position: int) -> Replica | None:
        """The member at `position` (None once it has been removed)."""
        return next((r for r in self.replicas if r.position == position), None)

    async def _close_when_idle(self, replica: Replica) -> None:
        # Picks only see members, and a pick enters its lease without yielding to the event loop, so no request
        # can reach the replica once in_flight reads 0 here. Its health watch keeps running meanwhile: a call on a
        # replica that drains still moves when it leaves health.
        while replica.in_flight:
            await asyncio.sleep(self.health_interval)
        for task in replica.watches:
            task.cancel()
        await asyncio.gather(*replica.watches, return_exceptions=True)
        await replica.channel.close()
        self._leaving.remove(replica)
        if self._metrics and not any(r.id == replica.id for r in self.replicas):
            self._metrics.remove_replica(replica.id)
        log.info("replica %s at %s closed", replica.id, replica.address)

    # ---- routing support ----
    def candidates(self, exclude: set[int], key: PromptKey | None = None, lora: str = "") -> dict[int, ReplicaLoad]:
        """Loads of the healthy replicas not in `exclude` that serve LoRA adapter `lora` ("": any), keyed by
        position; with a prompt's key, each also says how much of the prompt that replica holds."""
        return {
            r.position: r.load(key, lora)
            for r in self.replicas
            if r.healthy and r.position not in exclude and r.serves(lora)
        }

    def prefix_key(self, request) -> PromptKey | None:
        """The request's prompt hashed in the replicas' blocks (before any replica reported its block size, or with
        replicas too old to report it, in the default's: keys then match only what was routed recently)."""
        block_size = next((r.status.kv_block_size for r in self.replicas if r.status.kv_block_size), 0)
        return self.hasher.key(request, block_size or DEFAULT_BLOCK_SIZE)

    def note_routed(self, replica: Replica, key: PromptKey) -> None:
        """The request with this key went to `replica`: until its events say so, guess that it holds the prompt."""
        replica.cache.note_routed(key)

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def unavailable_message(self) -> str:
        if not self.replicas:
            return "no healthy replica: none configured or discovered yet; retry later or check the balancer's log"
        # Clients see each replica's id and the kind of failure; its address and the full error are in the log.
        reasons = "; ".join(f"{r.id}: {r.last_error.partition(':')[0]}" for r in self.replicas)
        n = len(self.replicas)
        return (
            f"no healthy replica: {n} replica{'s' if n != 1 else ''} configured, all failing health checks "
            f"({reasons}); retry later or check the balancer's and replicas' logs"
        )

    @contextlib.asynccontextmanager
    async def lease(self, replica: Replica, prompt_tokens: int) -> AsyncIterator[Replica]:
        """Counts a request as in flight on `replica` for the duration of the block."""
        reports_before = replica.reports
        replica.dispatched += 1
        replica.in_flight += 1
        replica.unreported_prompt_tokens += prompt_tokens
        self._publish_in_flight(replica)
        try:
            yield replica
        finally:
            replica.in_flight -= 1
            if replica.reports == reports_before:  # no report has counted its prompt yet: take it back
                replica.unreported_prompt_tokens = max(0, replica.unreported_prompt_tokens - prompt_tokens)
            self._publish_in_flight(replica)

    async def mark_failed(self, replica: Replica, reason: str) -> None:
        """A call found the replica unreachable: take it out of rotation now rather than at the next check."""
        await self._set_health(replica, False, reason)

    # ---- health watch ----
    async def _watch(self, replica: Replica) -> None:
        while True:
            await self._check(replica)
            if replica.healthy:
                await self._poll_status(replica)
            await asyncio.sleep(self.health_interval)

    async def _check(self, replica: Replica) -> None:
        try:
            # typeshed's HealthStub omits the methods the generated __init__ sets
            check = replica.health_stub.Check  # pyright: ignore[reportAttributeAccessIssue]
            resp = await check(health_pb2.HealthCheckRequest(), timeout=self.health_timeout)
        except grpc.aio.AioRpcError as e:
            await self._on_check_error(replica, e)
            return
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            replica.slow_checks = 0
            await self._set_health(replica, True, "")
        else:
            await self._set_health(replica, False, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    async def _on_check_error(self, replica: Replica, e: grpc.aio.AioRpcError) -> None:
        reason = f"{e.code().name}: {e.details()}"
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            replica.slow_checks += 1
            if replica.slow_checks < SLOW_CHECKS_BEFORE_UNHEALTHY and replica.checked:
                return
        await self._set_health(replica, False, reason)

    async def _poll_status(self, replica: Replica) -> None:
        # What the report will already include: the prompts sent so far; and which of the requests it counts
        # can be ours: those live now or sent while it is under way.
        sent_tokens, in_flight, dispatched = replica.unreported_prompt_tokens, replica.in_flight, replica.dispatched
        try:
            resp = await replica.stub.GetStatus(fastgen_pb2.StatusRequest(), timeout=self.health_timeout)
        except grpc.aio.AioRpcError as e:
            log.debug("GetStatus of %s failed: %s", replica.id, e.details())
            return  # load stays at its last value; health is the Check's business
        replica.unreported_prompt_tokens = max(0, replica.unreported_prompt_tokens - sent_tokens)
        replica.in_flight_at_report = in_flight + replica.dispatched - dispatched
        replica.reports += 1
        replica.model = resp.model
        if resp.replicas:
            replica.status = resp.replicas[0]
            if replica.status.kv_blocks_total:  # it cannot hold more than its pool: neither can the guesses
                replica.cache.recent_capacity = replica.status.kv_blocks_total
            if self._tokenizer_wanted and replica.status.tokenizer_path and not self._tokenizer_loading:
                self._tokenizer_loading = True
                load = self._load_tokenizer(replica.status.tokenizer_path)
                self._watches.append(asyncio.create_task(load, name="load-tokenizer"))

    async def _load_tokenizer(self, path: str) -> None:
        """Loads the tokenizer a replica reported, off the event loop; once."""
        tokenizer = await asyncio.to_thread(load_prompt_tokenizer, path)
        self.hasher = PromptHasher(tokenizer)
        self._tokenizer_wanted = False
        if tokenizer is not None:
            log.info("prefix-aware routing hashes text and chat prompts with the tokenizer in %s", path)

    # ---- prefix cache watch ----
    async def _watch_cache(self, replica: Replica) -> None:
        """One WatchCache stream to the replica while it is healthy and caches prefixes; watched anew after a gap
        or a broken stream (a fresh snapshot), the view falling back to routed guesses in between."""
        while True:
            if not (replica.healthy and replica.status.prefix_caching):
                await asyncio.sleep(self.health_interval)
                continue
            call = replica.stub.WatchCache(fastgen_pb2.CacheWatchRequest())
            pause = self.health_interval
            try:
                async for events in call:
                    in_sync = replica.cache.apply(
                        events.seq, events.stored, events.removed, events.reset, events.snapshot
                    )
                    self._publish_cache_view(replica)
                    if not in_sync:
                        log.info("cache events of replica %s skipped a batch: watching anew", replica.id)
                        break
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
                    pause = 20 * self.health_interval  # it cannot stream now; ask again now and then
                log.debug("cache watch of %s ended: %s: %s", replica.id, e.code().name, e.details())
            finally:
                call.cancel()
                replica.cache.drop()
                self._publish_cache_view(replica)
            await asyncio.sleep(pause)

    def _publish_cache_view(self, replica: Replica) -> None:
        if self._metrics:
            self._metrics.set_cache_view(replica.id, replica.cache.live, len(replica.cache.blocks))

    async def _set_health(self, replica: Replica, healthy: bool, reason: str) -> None:
        was_checked, was_healthy = replica.checked, replica.healthy
        replica.checked, replica.healthy = True, healthy
        replica.last_error = reason if not healthy else ""
        if was_checked and was_healthy == healthy:
            return
        if healthy:
            log.info("replica %s at %s is healthy: in rotation", replica.id, replica.address)
        else:
            log.warning("replica %s at %s is unhealthy (%s): out of rotation", replica.id, replica.address, reason)
            replica.status = fastgen_pb2.ReplicaStatus()  # its last load no longer means anything
            replica.in_flight_at_report = 0
        if self._metrics:
            self._metrics.set_healthy(replica.id, healthy)
        if self._on_health_change:
            await self._on_health_change()

    # ---- helpers ----
    def _add(self, spec: ReplicaSpec) -> Replica:
        replica = self._connect(spec, self._next_position)
        self._next_position += 1
        self.replicas.append(replica)
        return replica

    def _start_watches(self, replica: Replica) -> None:
        replica.watches.append(asyncio.create_task(self._watch(replica), name=f"health-{replica.id}"))
        if self.prefix_routing:
            replica.watches.append(asyncio.create_task(self._watch_cache(replica), name=f"cache-{replica.id}"))

    def _connect(self, spec: ReplicaSpec, position: int) -> Replica:
        security = self.security
        channel = open_channel(spec.address, UPSTREAM_CHANNEL_OPTIONS, security.tls, security.server_name, aio=True)
        replica = Replica(
            spec=spec,
            position=position,
            channel=channel,
            stub=AuthorizedStub(fastgen_pb2_grpc.GenerationStub(channel), security.metadata),
            health_stub=health_pb2_grpc.HealthStub(channel),
        )
        if self._metrics:
            self._metrics.set_healthy(spec.id, False)
            self._metrics.set_in_flight(spec.id, 0)
        return replica

    def _publish_in_flight(self, replica: Replica) -> None:
        if self._metrics:
            self._metrics.set_in_flight(replica.id, replica.in_flight)
