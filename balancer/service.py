"""The balancer's fastgen.v1.Generation: each request is proxied to one replica picked by the routing policy.

Retries: a request moves to another replica when its replica fails (UNAVAILABLE: refused connection, the replica
dying or draining) before any output reached the client, at most `max_retries` times. RESOURCE_EXHAUSTED (that
replica's queue is full) also moves once to another replica, since the other may have room; a second full queue
goes back to the client, who should back off, as does a full queue with no other replica to try. Errors about the
request itself (INVALID_ARGUMENT and the like) are never retried and pass through with the replica's message. The
client's deadline and cancellation carry over to the upstream call.

Migration: a stream whose replica fails after output was sent resumes on another replica (journal.py): the prompt
goes there with the tokens already delivered, and the stream continues from the next position. Every sampled
request carries a seed (assigned here when the client gave none), and a seeded draw depends only on (seed,
position), so the continuation is what the first replica would have sent. A call also moves when its replica
leaves health while the call waits (hung, or draining for a restart) and another replica is healthy. At most
`MigrationSettings.limit` moves per request; a stream that cannot move (limit reached, too much output tracked,
no healthy replica) fails as before. A unary call holds no output until its end, so it moves by
running again elsewhere: with the same seed, the answer is the same.

Limits before work: a request over a limit (limits.py) is refused INVALID_ARGUMENT before anything is built for it
(its journal, its prefix key, any upstream call); a prompt long enough to cost is tokenized and hashed for
prefix-aware routing on a worker thread, never on the event loop. Messages to clients name replicas by id, never by
address; GetStatus shows addresses and tokenizer paths to operators only (the deployment's internal token, or every
caller of a deployment without an API key).

`Balancer` holds these rules without any transport; `BalancerService` (gRPC) and `openai_api` (HTTP) call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import grpc

from ..proto import fastgen_pb2, fastgen_pb2_grpc
from ..server.auth import AUTHORIZATION, bearer_token, token_accepted
from ..server.errors import RETRY_AFTER_MS, retry_after_ms, trailing_metadata
from ..server.metrics import BalancerMetrics
from .journal import DEFAULT_MIGRATION, Journal, MigrationSettings, journal_for, unresumable_reason, with_seed
from .limits import DEFAULT_PROMPT_LIMITS, PromptLimits, RequestRefused, check_request
from .policy import Router, estimate_prompt_tokens
from .pool import Replica, ReplicaPool
from .prefix_index import PromptKey
from .tenants import salted_for

log = logging.getLogger("fastgen.balancer")

# A replica reads and checks an adapter between two engine steps: seconds for large ones on a slow disk.
LORA_CHANGE_TIMEOUT_S = 60.0
RETRY_ON_OTHER_REPLICA = frozenset({grpc.StatusCode.UNAVAILABLE})
RETRY_ONCE_ON_OTHER_REPLICA = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})
RETRY_CODES = tuple(sorted(RETRY_ON_OTHER_REPLICA | RETRY_ONCE_ON_OTHER_REPLICA, key=lambda c: c.name))
# Failures after output that move a stream: the replica broke (or, resuming, the next one was full).
MIGRATE_ON = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
# What gRPC's own transport says when it cancels a call its server's event loop fell too far behind to accept: the
# code's name and no message (our services always say why). The replica never saw the call: it is overloaded.
TRANSPORT_CANCELLED_DETAILS = "CANCELLED"
# Prompts (in estimated tokens) up to which prefix-aware routing tokenizes and hashes on the event loop: about a
# millisecond of work. Longer ones go to a worker thread so that other calls keep flowing meanwhile.
INLINE_KEY_TOKENS = 2048
# IP addresses (with a port, or gRPC's ipv4:/ipv6: target prefix) in upstream errors, which clients must not see.
ADDRESS = re.compile(r"(?:ipv[46]:)?(?:\[[0-9a-fA-F:.%]+\]|\b\d{1,3}(?:\.\d{1,3}){3}\b)(?::\d+)?")


class ReplicaLost(Exception):
    """The call's replica left health while the call waited, and the request can go on elsewhere: the call was
    cancelled (so anything the replica still sends is dropped)."""


class RequestFailed(Exception):
    """What the client gets: a status code, a message and, for RESOURCE_EXHAUSTED, the replica's retry hint."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_ms: int = RETRY_AFTER_MS):
        super().__init__(details)
        self.code = code
        self.details = details
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True)
class Route:
    """What one pick decided, carried through the attempt it starts: a retry or a move picks again and gets a route
    of its own, so nothing about an attempt outlives it."""

    replica: Replica
    # Prompt tokens the replica has yet to prefill for this request, which its lease counts as queued work there:
    # prefix_aware's prediction (a cached prefix must not weigh on its holder), else the whole prompt's estimate.
    uncached_tokens: int


@dataclass
class Attempts:
    """One client request's tries across replicas."""

    max_retries: int
    tried: set[int] = field(default_factory=set)  # pool positions
    retries: int = 0
    resource_exhausted_retried: bool = False
    request: fastgen_pb2.GenerateRequest | None = None  # what prefix_aware routing hashes
    key: PromptKey | None = None  # the request's prompt hashed for prefix_aware, once per request
    keyed: bool = False

    def may_retry(self, code: grpc.StatusCode) -> bool:
        if self.retries >= self.max_retries:
            return False
        if code in RETRY_ON_OTHER_REPLICA:
            return True
        return code in RETRY_ONCE_ON_OTHER_REPLICA and not self.resource_exhausted_retried

    def note_retry(self, code: grpc.StatusCode) -> None:
        self.retries += 1
        if code in RETRY_ONCE_ON_OTHER_REPLICA:
            self.resource_exhausted_retried = True


class Balancer:
    """The routing and retry core, free of any transport: the gRPC service and the HTTP API both call it.

    `deadline` is a time.monotonic() instant (None: none); failures that are the client's answer raise
    RequestFailed. Cancelling a call (or closing a stream) cancels its upstream call, which stops the replica's work.
    """

    def __init__(
        self,
        pool: ReplicaPool,
        router: Router,
        metrics: BalancerMetrics,
        max_retries: int,
        migration: MigrationSettings = DEFAULT_MIGRATION,
        limits: PromptLimits = DEFAULT_PROMPT_LIMITS,
        per_tenant_salt: bool = False,
    ):
        self.pool = pool
        self._router = router
        self._metrics = metrics
        self._max_retries = max_retries
        self.migration = migration
        self.limits = limits
        self.per_tenant_salt = per_tenant_salt  # API keys are per tenant: each has its own prefix cache (tenants.py)

    async def generate(
        self, request: fastgen_pb2.GenerateRequest, deadline: float | None = None, caller: str | None = None
    ) -> fastgen_pb2.GenerateResponse:
        """`caller`: the API key the request came with (its tenant, when keys are per tenant)."""
        request = with_seed(self._admit(request, caller))  # wherever a retry lands, it draws the same tokens
        attempts = Attempts(self._max_retries, request=request)
        await self._key_prompt(attempts)
        moves = 0
        route = self._pick(attempts)

        def may_move() -> bool:
            return moves < self.migration.limit

        while True:
            try:
                return await self._generate_on(route, request, deadline, may_move)
            except grpc.aio.AioRpcError as e:
                await self._after_failure(route.replica, e, attempts)
                route = self._pick(attempts)
            except ReplicaLost:
                moves += 1
                lost = route.replica
                self._metrics.on_replica_call(lost.id, grpc.StatusCode.CANCELLED)
                self._metrics.on_migration(lost.id, "unhealthy", 0)
                log.info("replica %s left health during a call; running it again elsewhere", lost.id)
                route = self._pick_other_than(lost, attempts, "no healthy replica to move the call to")

    async def stream(
        self, request: fastgen_pb2.GenerateRequest, deadline: float | None = None, caller: str | None = None
    ) -> AsyncGenerator[fastgen_pb2.GenerateChunk, None]:
        request = with_seed(self._admit(request, caller))  # so that another replica can continue the stream
        journal = journal_for(request, self.migration)
        attempts = Attempts(self._max_retries, request=request)
        await self._key_prompt(attempts)
        route, upstream = self._pick(attempts), request
        failed_at = None  # when a replica of this stream failed, until the next one sends a token

        def may_move() -> bool:
            return unresumable_reason(journal, self.migration) is None

        while True:
            try:
                async with contextlib.aclosing(self._stream_from(route, upstream, deadline, may_move)) as chunks:
                    async for chunk in chunks:
                        if failed_at is not None:
                            self._metrics.on_resumed(time.monotonic() - failed_at)
                            failed_at = None
                        yield journal.record(chunk)
                return
            except grpc.aio.AioRpcError as e:
                if not journal.delivered:
                    await self._after_failure(route.replica, e, attempts)
                    route = self._pick(attempts)
                    continue
                if e.code() not in MIGRATE_ON:
                    self._metrics.on_replica_call(route.replica.id, e.code())
                    raise self._failed_after_output(route.replica, e, "not retried so no text is repeated") from None
                failure, cause = e, e.code().name.lower()
            except ReplicaLost:
                failure, cause = None, "unhealthy"
            failed_at = failed_at or time.monotonic()
            route, upstream = await self._move(route.replica, failure, cause, journal, attempts)

    def _admit(self, request: fastgen_pb2.GenerateRequest, caller: str | None) -> fastgen_pb2.GenerateRequest:
        """The request as it goes upstream (its tenant's salt); RequestFailed when it is over a limit, before
        anything is built for it."""
        try:
            check_request(request, self.limits)
        except RequestRefused as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return salted_for(request, caller, self.per_tenant_salt)

    async def _key_prompt(self, attempts: Attempts) -> None:
        """prefix_aware: the prompt's key, computed once per request; a long prompt's on a worker thread."""
        if self._router.policy != "prefix_aware" or attempts.request is None:
            return
        request = attempts.request
        if estimate_prompt_tokens(request) <= INLINE_KEY_TOKENS:
            attempts.key = self.pool.prefix_key(request)
        else:
            attempts.key = await asyncio.to_thread(self.pool.prefix_key, request)
        attempts.keyed = True

    def status(self) -> fastgen_pb2.StatusResponse:
        replicas = [self._replica_status(r) for r in self.pool.replicas]
        return fastgen_pb2.StatusResponse(model=self.model(), role="balancer", replicas=replicas)

    def model(self) -> str:
        """The model the replicas report serving ("" until one has answered GetStatus)."""
        return next((r.model for r in self.pool.replicas if r.model), "")

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters some healthy replica reports serving, sorted."""
        return sorted({a for r in self.pool.replicas if r.healthy for a in r.status.lora_adapters})

    async def change_lora(self, name: str, path: str | None) -> None:
        """Loads (path set) or unloads LoRA adapter `name` on every healthy replica (each reads the folder on its own
        host). RequestFailed with every failing replica's answer; the replicas that succeeded keep the change."""
        replicas = [r for r in self.pool.replicas if r.healthy]
        if not replicas:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, self.pool.unavailable_message())
        results = await asyncio.gather(*(self._change_lora_on(r, name, path) for r in replicas), return_exceptions=True)
        failed: list[tuple[Replica, grpc.aio.AioRpcError]] = []
        for r, e in zip(replicas, results, strict=True):
            if isinstance(e, grpc.aio.AioRpcError):
                failed.append((r, e))
            elif isinstance(e, BaseException):
                raise e
        if failed:
            details = "; ".join(f"{r.id}: {e.details()}" for r, e in failed)
            raise RequestFailed(failed[0][1].code(), details)

    async def _change_lora_on(self, replica: Replica, name: str, path: str | None) -> None:
        if path is None:
            request = fastgen_pb2.UnloadLoraAdapterRequest(lora_name=name)
            response = await replica.stub.UnloadLoraAdapter(request, timeout=LORA_CHANGE_TIMEOUT_S)
        else:
            request = fastgen_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
            response = await replica.stub.LoadLoraAdapter(request, timeout=LORA_CHANGE_TIMEOUT_S)
        del replica.status.lora_adapters[:]  # routing and /v1/models see the change before the next status poll
        replica.status.lora_adapters.extend(response.lora_adapters)

    # ---- one upstream call ----
    async def _generate_on(
        self, route: Route, request, deadline: float | None, may_move: Callable[[], bool]
    ) -> fastgen_pb2.GenerateResponse:
        replica = route.replica
        call = replica.stub.Generate(request, timeout=time_left(deadline))
        async with self.pool.lease(replica, route.uncached_tokens), self._unless_lost(replica, call, may_move):
            try:
                response = await call
            except asyncio.CancelledError:
                call.cancel()  # the client went away: stop the replica's work too
                raise
        self._metrics.on_replica_call(replica.id, grpc.StatusCode.OK)
        return response

    async def _stream_from(
        self, route: Route, request, deadline: float | None, may_move: Callable[[], bool]
    ) -> AsyncGenerator[fastgen_pb2.GenerateChunk, None]:
        replica = route.replica
        call = replica.stub.GenerateStream(request, timeout=time_left(deadline))
        async with self.pool.lease(replica, route.uncached_tokens):
            try:
                async with self._unless_lost(replica, call, may_move):
                    async for chunk in call:
                        yield chunk
            finally:
                call.cancel()  # no-op once finished; stops the replica when the client left mid-stream
        self._metrics.on_replica_call(replica.id, grpc.StatusCode.OK)

    @contextlib.asynccontextmanager
    async def _unless_lost(self, replica: Replica, call, may_move: Callable[[], bool]) -> AsyncIterator[None]:
        """Cancels `call` when its replica leaves health while the call runs, another replica is healthy and the
        request may move (`may_move`); the block then raises ReplicaLost. A hung replica sends no error to move on,
        and a draining one would hold its streams until they end. Cancelling is the fence: whatever the old replica
        still sends goes nowhere."""
        lost = False

        async def watch() -> None:
            nonlocal lost
            while True:
                await asyncio.sleep(self.pool.health_interval)
                if not replica.healthy and self.pool.candidates(exclude={replica.position}) and may_move():
                    lost = True
                    call.cancel()
                    return

        watcher = asyncio.create_task(watch())
        try:
            yield
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            # The call's own cancellation surfaces as CancelledError (or CANCELLED); a real one of ours does not
            # count as lost.
            task = asyncio.current_task()
            assert task is not None, "a call is served in a task of the event loop"
            if lost and not task.cancelling():
                raise ReplicaLost() from None
            raise
        finally:
            watcher.cancel()

    async def _move(
        self, replica: Replica, failure: grpc.aio.AioRpcError | None, cause: str, journal: Journal, attempts: Attempts
    ) -> tuple[Route, fastgen_pb2.GenerateRequest]:
        """The route and request that continue a stream whose replica failed (failure: the call's error; None when
        the replica left health); RequestFailed when the stream cannot move."""
        details = failure.details() if failure is not None else "it left health while the stream waited"
        self._metrics.on_replica_call(replica.id, failure.code() if failure is not None else grpc.StatusCode.CANCELLED)
        if failure is not None and failure.code() == grpc.StatusCode.UNAVAILABLE:
            await self.pool.mark_failed(replica, f"UNAVAILABLE: {details}")
        reason = unresumable_reason(journal, self.migration)
        if reason is not None:
            self._metrics.on_migration_refused(reason)
            raise self._failed_after_output(replica, failure, self._refusal(reason))
        try:
            successor = self._pick_other_than(replica, attempts, "")
        except RequestFailed as f:
            self._metrics.on_migration_refused("no_replica")
            raise self._failed_after_output(replica, failure, f"not resumed: {f.details}") from None
        journal.migrations += 1
        self._metrics.on_migration(replica.id, cause, journal.tokens)
        log.info(
            "replica %s failed a stream after %d tokens (%s); resuming it on %s",
            replica.id,
            journal.tokens,
            details,
            successor.replica.id,
        )
        if not journal.delivered:
            return successor, journal.request
        # The pick's prediction is for the prompt as first sent, not for one resumed after output: that counts whole.
        resumed = journal.resumed_request()
        return replace(successor, uncached_tokens=estimate_prompt_tokens(resumed)), resumed

    # ---- routing and retries ----
    def _pick_other_than(self, replica: Replica, attempts: Attempts, unavailable: str) -> Route:
        """A healthy replica for a request that leaves `replica` mid-call. Only that one is excluded: after a rolling
        restart the replica a long stream started on may be the one to take it back."""
        attempts.tried = {replica.position}
        try:
            return self._pick(attempts)
        except RequestFailed as f:
            if not unavailable:
                raise
            raise RequestFailed(f.code, f"{unavailable}: {f.details}") from None

    def _pick(self, attempts: Attempts) -> Route:
        """Where the request's next attempt goes; RequestFailed when no replica may take it."""
        request = attempts.request
        assert request is not None, "generate and stream build their Attempts with the request"
        key = self._prefix_key(attempts)
        lora = request.lora_name
        loads = self.pool.candidates(exclude=attempts.tried, key=key, lora=lora)
        position = self._router.pick(loads)
        if position is None and lora and self.pool.candidates(exclude=attempts.tried):
            raise RequestFailed(
                grpc.StatusCode.NOT_FOUND, f"no replica serves LoRA adapter {lora!r}: load it first (or check the name)"
            )
        if position is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, self._no_replica_message(attempts))
        attempts.tried.add(position)
        replica = self.pool.at(position)
        assert replica is not None, "the router picked among current members, with no await since"
        self._metrics.on_route(self._router.policy, replica.id)
        if key is None:
            return Route(replica, estimate_prompt_tokens(request))
        cached = loads[position].cached_tokens
        self.pool.note_routed(replica, key)
        self._metrics.on_prefix_route(replica.id, key.tokens, cached)
        return Route(replica, max(0, key.tokens - cached))

    @staticmethod
    def _prefix_key(attempts: Attempts) -> PromptKey | None:
        """The request's prompt hashed as the replicas' cache blocks (prefix_aware only; _key_prompt computed it)."""
        return attempts.key

    async def _after_failure(self, replica: Replica, e: grpc.aio.AioRpcError, attempts: Attempts) -> None:
        """Records a failed upstream call; returns when the request should go to another replica, raises
        RequestFailed when the failure is the client's answer."""
        code = e.code()
        self._metrics.on_replica_call(replica.id, code)
        if code == grpc.StatusCode.CANCELLED and e.details() == TRANSPORT_CANCELLED_DETAILS:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED  # back off or go elsewhere, as from a full queue
        if code == grpc.StatusCode.UNAVAILABLE:
            await self.pool.mark_failed(replica, f"{code.name}: {e.details()}")
        # A full queue with no other replica to try is the client's answer (back off), not "unavailable".
        nowhere_else = code in RETRY_ONCE_ON_OTHER_REPLICA and not self.pool.candidates(exclude=attempts.tried)
        if nowhere_else or not attempts.may_retry(code):
            # The replica knows when it expects room (the slo scheduler's refusals name it): pass its hint on.
            hint = retry_after_ms(e.trailing_metadata()) or RETRY_AFTER_MS
            raise RequestFailed(code, self._pass_through_message(replica, e, attempts, code), hint)
        attempts.note_retry(code)
        self._metrics.on_retry(replica.id, code)
        log.info("replica %s failed a request (%s: %s); retrying elsewhere", replica.id, code.name, e.details())

    def _refusal(self, reason: str) -> str:
        if reason == "limit":
            if self.migration.limit <= 0:
                return "not resumed, as migration is off (--migration-limit 0)"
            return f"not resumed: it moved {self.migration.limit} times already (--migration-limit)"
        return (
            f"not resumed: over {self.migration.max_len} tokens (--migration-max-len) or "
            f"{self.migration.max_bytes} bytes of output were delivered"
        )

    @staticmethod
    def _failed_after_output(replica: Replica, e: grpc.aio.AioRpcError | None, why: str) -> RequestFailed:
        if e is None:
            return RequestFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"replica {replica.id} left health after part of the output was sent; {why}: send the request again",
            )
        return RequestFailed(
            e.code(),
            f"replica {replica.id} failed after part of the output was sent ({without_addresses(e.details() or '')}); "
            f"{why}: send the request again",
        )

    def _pass_through_message(
        self, replica: Replica, e: grpc.aio.AioRpcError, attempts: Attempts, code: grpc.StatusCode
    ) -> str:
        if code != e.code():  # a call the replica's transport cancelled (TRANSPORT_CANCELLED_DETAILS)
            return f"replica {replica.id} is overloaded: its gRPC transport refused the call; retry later"
        details = without_addresses(e.details() or "")
        if e.code() in RETRY_ON_OTHER_REPLICA and attempts.retries:
            return f"replica {replica.id} failed: {details} (after {attempts.retries} retries on other replicas)"
        return details or f"replica {replica.id} answered {e.code().name}"

    def _no_replica_message(self, attempts: Attempts) -> str:
        if not self.pool.any_healthy():
            return self.pool.unavailable_message()
        tried = ", ".join(r.id for r in map(self.pool.at, sorted(attempts.tried)) if r is not None)
        return f"no other healthy replica to retry on (tried {tried}); retry later"

    def _replica_status(self, replica: Replica) -> fastgen_pb2.ReplicaStatus:
        status = fastgen_pb2.ReplicaStatus()
        status.CopyFrom(replica.status)
        status.replica = replica.id
        status.address = replica.address
        status.health = replica.health_enum()
        status.in_flight = replica.in_flight
        return status


def without_addresses(text: str) -> str:
    """An upstream error's message as a client may see it: IP addresses (gRPC's own connection errors name them)
    replaced; the balancer's log keeps the original."""
    return ADDRESS.sub("<replica address>", text)


def status_for_caller(status: fastgen_pb2.StatusResponse, operator: bool) -> fastgen_pb2.StatusResponse:
    """GetStatus as a caller may see it: an operator everything; any other caller no replica address or path."""
    if operator:
        return status
    shown = fastgen_pb2.StatusResponse()
    shown.CopyFrom(status)
    for replica in shown.replicas:
        replica.ClearField("address")
        replica.ClearField("tokenizer_path")
    return shown


def caller_token(context: grpc.aio.ServicerContext) -> str | None:
    """The bearer token a call came with (the auth interceptor has already accepted it), or None."""
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION:
            return bearer_token(value.decode(errors="replace") if isinstance(value, bytes) else value)
    return None


def time_left(deadline: float | None) -> float | None:
    """Seconds an upstream call may take; RequestFailed once the deadline has passed."""
    if deadline is None:
        return None
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it ran")
    return remaining


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class BalancerService(fastgen_pb2_grpc.GenerationServicer):
    """fastgen.v1.Generation over the core: thin handlers that add the client's deadline, the RPC metrics and the
    gRPC status of a failure."""

    def __init__(
        self,
        pool: ReplicaPool,
        router: Router,
        metrics: BalancerMetrics,
        max_retries: int,
        migration: MigrationSettings = DEFAULT_MIGRATION,
        limits: PromptLimits = DEFAULT_PROMPT_LIMITS,
        per_tenant_salt: bool = False,
        operator_tokens: tuple[str, ...] | None = None,
    ):
        """operator_tokens: the callers GetStatus shows replica addresses to (None: every caller, as a deployment
        without an API key has no tenants to hide them from)."""
        self.balancer = Balancer(pool, router, metrics, max_retries, migration, limits, per_tenant_salt)
        self._metrics = metrics
        self._operator_tokens = operator_tokens

    async def Generate(self, request, context):
        try:
            response = await self.balancer.generate(request, deadline_of(context), caller_token(context))
        except asyncio.CancelledError:
            self._metrics.on_rpc("Generate", grpc.StatusCode.CANCELLED)
            raise
        except RequestFailed as f:
            self._metrics.on_rpc("Generate", f.code)
            await context.abort(f.code, f.details, trailing_metadata(f.code, f.retry_after_ms))
        self._metrics.on_rpc("Generate", grpc.StatusCode.OK)
        return response

    async def GenerateStream(self, request, context) -> AsyncIterator[fastgen_pb2.GenerateChunk]:
        try:
            stream = self.balancer.stream(request, deadline_of(context), caller_token(context))
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            self._metrics.on_rpc("GenerateStream", grpc.StatusCode.CANCELLED)
            raise
        except RequestFailed as f:
            self._metrics.on_rpc("GenerateStream", f.code)
            await context.abort(f.code, f.details, trailing_metadata(f.code, f.retry_after_ms))
        self._metrics.on_rpc("GenerateStream", grpc.StatusCode.OK)

    async def GetStatus(self, request, context):
        self._metrics.on_rpc("GetStatus", grpc.StatusCode.OK)
        return status_for_caller(self.balancer.status(), self._is_operator(context))

    def _is_operator(self, context: grpc.aio.ServicerContext) -> bool:
        if self._operator_tokens is None:
            return True
        token = caller_token(context)
        return (
            bool(self._operator_tokens)
            and token is not None
            and token_accepted(f"Bearer {token}", self._operator_tokens)
        )
