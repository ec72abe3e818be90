"""The balancer's fastgen.v1.Generation: each request is proxied to one replica picked by the routing policy.

Retries: a request moves to another replica when its replica fails (UNAVAILABLE: refused connection, the replica
dying or draining) before any output reached the client, at most `max_retries` times. RESOURCE_EXHAUSTED (that
replica's queue is full) also moves once to another replica, since the other may have room; a second full queue
goes back to the client, who should back off, as does a full queue with no other replica to try. Nothing is
retried once output was forwarded (the client would see text twice) nor for errors about the request itself
(INVALID_ARGUMENT and the like), which pass through with the replica's message. The client's deadline and
cancellation carry over to the upstream call.

`Balancer` holds these rules without any transport; `BalancerService` (gRPC) and `openai_api` (HTTP) call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from ..proto import fastgen_pb2, fastgen_pb2_grpc
from ..server.errors import trailing_metadata
from ..server.metrics import BalancerMetrics
from .policy import Router, estimate_prompt_tokens
from .pool import Replica, ReplicaPool

log = logging.getLogger("fastgen.balancer")

RETRY_ON_OTHER_REPLICA = frozenset({grpc.StatusCode.UNAVAILABLE})
RETRY_ONCE_ON_OTHER_REPLICA = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})
RETRY_CODES = tuple(sorted(RETRY_ON_OTHER_REPLICA | RETRY_ONCE_ON_OTHER_REPLICA, key=lambda c: c.name))


class RequestFailed(Exception):
    """What the client gets: a status code and a message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass
class Attempts:
    """One client request's tries across replicas."""

    max_retries: int
    tried: set[int] = field(default_factory=set)  # pool positions
    retries: int = 0
    resource_exhausted_retried: bool = False

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

    def __init__(self, pool: ReplicaPool, router: Router, metrics: BalancerMetrics, max_retries: int):
        self.pool = pool
        self._router = router
        self._metrics = metrics
        self._max_retries = max_retries

    async def generate(
        self, request: fastgen_pb2.GenerateRequest, deadline: float | None = None
    ) -> fastgen_pb2.GenerateResponse:
        attempts = Attempts(self._max_retries)
        while True:
            replica = self._pick(attempts)
            try:
                return await self._generate_on(replica, request, deadline)
            except grpc.aio.AioRpcError as e:
                await self._after_failure(replica, e, attempts)

    async def stream(
        self, request: fastgen_pb2.GenerateRequest, deadline: float | None = None
    ) -> AsyncIterator[fastgen_pb2.GenerateChunk]:
        attempts = Attempts(self._max_retries)
        while True:
            replica = self._pick(attempts)
            forwarded = False
            try:
                async with contextlib.aclosing(self._stream_from(replica, request, deadline)) as chunks:
                    async for chunk in chunks:
                        forwarded = True
                        yield chunk
            except grpc.aio.AioRpcError as e:
                if forwarded:
                    raise self._failed_after_output(replica, e) from None
                await self._after_failure(replica, e, attempts)
                continue
            return

    def status(self) -> fastgen_pb2.StatusResponse:
        replicas = [self._replica_status(r) for r in self.pool.replicas]
        return fastgen_pb2.StatusResponse(model=self.model(), role="balancer", replicas=replicas)

    def model(self) -> str:
        """The model the replicas report serving ("" until one has answered GetStatus)."""
        return next((r.model for r in self.pool.replicas if r.model), "")

    # ---- one upstream call ----
    async def _generate_on(self, replica: Replica, request, deadline: float | None) -> fastgen_pb2.GenerateResponse:
        call = replica.stub.Generate(request, timeout=time_left(deadline))
        async with self.pool.lease(replica, estimate_prompt_tokens(request)):
            try:
                response = await call
            except asyncio.CancelledError:
                call.cancel()  # the client went away: stop the replica's work too
                raise
        self._metrics.on_replica_call(replica.id, grpc.StatusCode.OK)
        return response

    async def _stream_from(
        self, replica: Replica, request, deadline: float | None
    ) -> AsyncIterator[fastgen_pb2.GenerateChunk]:
        call = replica.stub.GenerateStream(request, timeout=time_left(deadline))
        async with self.pool.lease(replica, estimate_prompt_tokens(request)):
            try:
                async for chunk in call:
                    yield chunk
            finally:
                call.cancel()  # no-op once finished; stops the replica when the client left mid-stream
        self._metrics.on_replica_call(replica.id, grpc.StatusCode.OK)

    # ---- routing and retries ----
    def _pick(self, attempts: Attempts) -> Replica:
        position = self._router.pick(self.pool.candidates(exclude=attempts.tried))
        if position is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, self._no_replica_message(attempts))
        attempts.tried.add(position)
        replica = self.pool.replicas[position]
        self._metrics.on_route(self._router.policy, replica.id)
        return replica

    async def _after_failure(self, replica: Replica, e: grpc.aio.AioRpcError, attempts: Attempts) -> None:
        """Records a failed upstream call; returns when the request should go to another replica, raises
        RequestFailed when the failure is the client's answer."""
        code = e.code()
        self._metrics.on_replica_call(replica.id, code)
        if code == grpc.StatusCode.UNAVAILABLE:
            await self.pool.mark_failed(replica, f"{code.name}: {e.details()}")
        # A full queue with no other replica to try is the client's answer (back off), not "unavailable".
        nowhere_else = code in RETRY_ONCE_ON_OTHER_REPLICA and not self.pool.candidates(exclude=attempts.tried)
        if nowhere_else or not attempts.may_retry(code):
            raise RequestFailed(code, self._pass_through_message(replica, e, attempts))
        attempts.note_retry(code)
        self._metrics.on_retry(replica.id, code)
        log.info("replica %s failed a request (%s: %s); retrying elsewhere", replica.id, code.name, e.details())

    def _failed_after_output(self, replica: Replica, e: grpc.aio.AioRpcError) -> RequestFailed:
        self._metrics.on_replica_call(replica.id, e.code())
        return RequestFailed(
            e.code(),
            f"replica {replica.id} failed after part of the output was sent ({e.details()}); not retried so no text "
            "is repeated: send the request again",
        )

    def _pass_through_message(self, replica: Replica, e: grpc.aio.AioRpcError, attempts: Attempts) -> str:
        if e.code() in RETRY_ON_OTHER_REPLICA and attempts.retries:
            return f"replica {replica.id} failed: {e.details()} (after {attempts.retries} retries on other replicas)"
        return e.details() or f"replica {replica.id} answered {e.code().name}"

    def _no_replica_message(self, attempts: Attempts) -> str:
        if not self.pool.any_healthy():
            return self.pool.unavailable_message()
        tried = ", ".join(self.pool.replicas[p].id for p in sorted(attempts.tried))
        return f"no other healthy replica to retry on (tried {tried}); retry later"

    def _replica_status(self, replica: Replica) -> fastgen_pb2.ReplicaStatus:
        status = fastgen_pb2.ReplicaStatus()
        status.CopyFrom(replica.status)
        status.replica = replica.id
        status.address = replica.address
        status.health = replica.health_enum()
        status.in_flight = replica.in_flight
        return status


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

    def __init__(self, pool: ReplicaPool, router: Router, metrics: BalancerMetrics, max_retries: int):
        self.balancer = Balancer(pool, router, metrics, max_retries)
        self._metrics = metrics

    async def Generate(self, request, context):
        try:
            response = await self.balancer.generate(request, deadline_of(context))
        except asyncio.CancelledError:
            self._metrics.on_rpc("Generate", grpc.StatusCode.CANCELLED)
            raise
        except RequestFailed as f:
            self._metrics.on_rpc("Generate", f.code)
            await context.abort(f.code, f.details, trailing_metadata(f.code))
        self._metrics.on_rpc("Generate", grpc.StatusCode.OK)
        return response

    async def GenerateStream(self, request, context) -> AsyncIterator[fastgen_pb2.GenerateChunk]:
        try:
            async with contextlib.aclosing(self.balancer.stream(request, deadline_of(context))) as chunks:
                async for chunk in chunks:
                    yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            self._metrics.on_rpc("GenerateStream", grpc.StatusCode.CANCELLED)
            raise
        except RequestFailed as f:
            self._metrics.on_rpc("GenerateStream", f.code)
            await context.abort(f.code, f.details, trailing_metadata(f.code))
        self._metrics.on_rpc("GenerateStream", grpc.StatusCode.OK)

    async def GetStatus(self, request, context):
        self._metrics.on_rpc("GetStatus", grpc.StatusCode.OK)
        return self.balancer.status()
