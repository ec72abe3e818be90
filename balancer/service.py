"""The balancer's fastgen.v1.Generation: each request is proxied to one replica picked by the routing policy.

Retries: a request moves to another replica when its replica fails (UNAVAILABLE: refused connection, the replica
dying or draining) before any output reached the client, at most `max_retries` times. RESOURCE_EXHAUSTED (that
replica's queue is full) also moves once to another replica, since the other may have room; a second full queue
goes back to the client, who should back off. Nothing is retried once output was forwarded (the client would see
text twice) nor for errors about the request itself (INVALID_ARGUMENT and the like), which pass through with the
replica's message. The client's deadline and cancellation carry over to the upstream call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from ..proto import fastgen_pb2, fastgen_pb2_grpc
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


class BalancerService(fastgen_pb2_grpc.GenerationServicer):
    def __init__(self, pool: ReplicaPool, router: Router, metrics: BalancerMetrics, max_retries: int):
        self._pool = pool
        self._router = router
        self._metrics = metrics
        self._max_retries = max_retries

    async def Generate(self, request, context):
        attempts = Attempts(self._max_retries)
        try:
            while True:
                replica = self._pick(attempts)
                try:
                    response = await self._generate_on(replica, request, context)
                except asyncio.CancelledError:
                    self._metrics.on_rpc("Generate", grpc.StatusCode.CANCELLED)
                    raise
                except grpc.aio.AioRpcError as e:
                    await self._after_failure(replica, e, attempts)
                    continue
                self._metrics.on_rpc("Generate", grpc.StatusCode.OK)
                return response
        except RequestFailed as f:
            self._metrics.on_rpc("Generate", f.code)
            await context.abort(f.code, f.details)

    async def GenerateStream(self, request, context) -> AsyncIterator[fastgen_pb2.GenerateChunk]:
        attempts = Attempts(self._max_retries)
        try:
            while True:
                replica = self._pick(attempts)
                forwarded = False
                try:
                    async with contextlib.aclosing(self._stream_from(replica, request, context)) as chunks:
                        async for chunk in chunks:
                            forwarded = True
                            yield chunk
                except (asyncio.CancelledError, GeneratorExit):
                    self._metrics.on_rpc("GenerateStream", grpc.StatusCode.CANCELLED)
                    raise
                except grpc.aio.AioRpcError as e:
                    if forwarded:
                        raise self._failed_after_output(replica, e) from None
                    await self._after_failure(replica, e, attempts)
                    continue
                self._metrics.on_rpc("GenerateStream", grpc.StatusCode.OK)
                return
        except RequestFailed as f:
            self._metrics.on_rpc("GenerateStream", f.code)
            await context.abort(f.code, f.details)

    async def GetStatus(self, request, context):
        replicas = [self._replica_status(r) for r in self._pool.replicas]
        model = next((r.model for r in self._pool.replicas if r.model), "")
        self._metrics.on_rpc("GetStatus", grpc.StatusCode.OK)
        return fastgen_pb2.StatusResponse(model=model, role="balancer", replicas=replicas)

    # ---- one upstream call ----
    async def _generate_on(self, replica: Replica, request, context) -> fastgen_pb2.GenerateResponse:
        call = replica.stub.Generate(request, timeout=self._time_left(context))
        async with self._pool.lease(replica, estimate_prompt_tokens(request)):
            try:
                response = await call
            except asyncio.CancelledError:
                call.cancel()  # the client went away: stop the replica's work too
                raise
        self._metrics.on_replica_call(replica.id, grpc.StatusCode.OK)
        return response

    async def _stream_from(self, replica: Replica, request, context) -> AsyncIterator[fastgen_pb2.GenerateChunk]:
        call = replica.stub.GenerateStream(request, timeout=self._time_left(context))
        async with self._pool.lease(replica, estimate_prompt_tokens(request)):
            try:
                async for chunk in call:
                    yield chunk
            finally:
                call.cancel()  # no-op once finished; stops the replica when the client left mid-stream
        self._metrics.on_replica_call(replica.id, grpc.StatusCode.OK)

    # ---- routing and retries ----
    def _pick(self, attempts: Attempts) -> Replica:
        position = self._router.pick(self._pool.candidates(exclude=attempts.tried))
        if position is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, self._no_replica_message(attempts))
        attempts.tried.add(position)
        replica = self._pool.replicas[position]
        self._metrics.on_route(self._router.policy, replica.id)
        return replica

    async def _after_failure(self, replica: Replica, e: grpc.aio.AioRpcError, attempts: Attempts) -> None:
        """Records a failed upstream call; returns when the request should go to another replica, raises
        RequestFailed when the failure is the client's answer."""
        code = e.code()
        self._metrics.on_replica_call(replica.id, code)
        if code == grpc.StatusCode.UNAVAILABLE:
            await self._pool.mark_failed(replica, f"{code.name}: {e.details()}")
        if not attempts.may_retry(code):
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
        if not self._pool.any_healthy():
            return self._pool.unavailable_message()
        tried = ", ".join(self._pool.replicas[p].id for p in sorted(attempts.tried))
        return f"no other healthy replica to retry on (tried {tried}); retry later"

    @staticmethod
    def _time_left(context) -> float | None:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it ran")
        return remaining

    def _replica_status(self, replica: Replica) -> fastgen_pb2.ReplicaStatus:
        status = fastgen_pb2.ReplicaStatus()
        status.CopyFrom(replica.status)
        status.replica = replica.id
        status.address = replica.address
        status.health = replica.health_enum()
        status.in_flight = replica.in_flight
        return status
