"""Status codes and messages: how failures reach clients.

Every failure a request's content can cause is INVALID_ARGUMENT with a message saying what to change, a full queue
is RESOURCE_EXHAUSTED with a retry hint in the trailing metadata, and a message that does not even parse (a string
field that is not UTF-8, a corrupt or truncated message) is INVALID_ARGUMENT too: gRPC's own handling of a failed
deserialization would answer UNKNOWN.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from ..proto import fastgen_pb2 as pb
from ..proto import fastgen_pb2_grpc

# Trailing metadata of a RESOURCE_EXHAUSTED answer: how long to wait before retrying, in milliseconds. A replica's
# queue drains in about a second under full load; the HTTP API sends the same hint as Retry-After.
RETRY_AFTER_KEY = "retry-after-ms"
RETRY_AFTER_MS = 1000


class QueueFullError(Exception):
    """The server's bounded queue is full, or it sheds load: the client should back off and retry after
    `retry_after_ms`."""

    def __init__(self, message: str, retry_after_ms: int = RETRY_AFTER_MS) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a server answers for an exception raised while admitting or running a request."""
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INTERNAL


def trailing_metadata(code: grpc.StatusCode, retry_ms: int = RETRY_AFTER_MS) -> tuple[tuple[str, str], ...]:
    """What an answer with `code` carries besides its message: the retry hint for RESOURCE_EXHAUSTED."""
    return ((RETRY_AFTER_KEY, str(retry_ms)),) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else ()


def retry_hint_ms(exc: BaseException) -> int:
    """The retry hint an exception's answer carries (RESOURCE_EXHAUSTED only)."""
    return exc.retry_after_ms if isinstance(exc, QueueFullError) else RETRY_AFTER_MS


def retry_after_ms(metadata) -> int | None:
    """The retry hint in a call's trailing metadata (None without one)."""
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            with contextlib.suppress(ValueError):
                return int(value)
    return None


# ---- requests that do not parse -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MalformedRequest:
    """Stands in for a request whose bytes did not parse, so the handler can answer INVALID_ARGUMENT."""

    details: str


def lenient(message_class):
    """A request deserializer that returns a MalformedRequest instead of raising."""

    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return MalformedRequest(
                f"the request is not a valid {message_class.DESCRIPTOR.full_name} ({e}); string fields must be UTF-8"
            )

    return deserialize


def _unary(behaviour):
    async def handler(request, context):
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return await behaviour(request, context)

    return handler


def _server_stream(behaviour):
    async def handler(request, context):
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        # aclosing: a client that leaves closes the servicer's generator at once, which cancels its request.
        async with contextlib.aclosing(behaviour(request, context)) as items:
            async for item in items:
                yield item

    return handler


def _overrides(servicer, method: str) -> bool:
    """Whether the servicer implements `method` itself (not the generated base's UNIMPLEMENTED one)."""
    return getattr(type(servicer), method, None) not in (None, getattr(fastgen_pb2_grpc.GenerationServicer, method))


def add_generation_servicer(servicer, server: grpc.aio.Server) -> None:
    """fastgen_pb2_grpc.add_GenerationServicer_to_server, with requests that do not parse answered
    INVALID_ARGUMENT."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            _unary(servicer.Generate),
            request_deserializer=lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            _server_stream(servicer.GenerateStream),
            request_deserializer=lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateChunk.SerializeToString,
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            _unary(servicer.GetStatus),
            request_deserializer=lenient(pb.StatusRequest),
            response_serializer=pb.StatusResponse.SerializeToString,
        ),
    }
    # Replicas only: a servicer without its own WatchCache or LoRA calls (the balancer's) leaves them UNIMPLEMENTED.
    if _overrides(servicer, "WatchCache"):
        handlers["WatchCache"] = grpc.unary_stream_rpc_method_handler(
            _server_stream(servicer.WatchCache),
            request_deserializer=lenient(pb.CacheWatchRequest),
            response_serializer=pb.CacheEvents.SerializeToString,
        )
    if _overrides(servicer, "LoadLoraAdapter"):
        for method, request in (
            ("LoadLoraAdapter", pb.LoadLoraAdapterRequest),
            ("UnloadLoraAdapter", pb.UnloadLoraAdapterRequest),
        ):
            handlers[method] = grpc.unary_unary_rpc_method_handler(
                _unary(getattr(servicer, method)),
                request_deserializer=lenient(request),
                response_serializer=pb.LoraAdaptersResponse.SerializeToString,
            )
    name = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    # typeshed's grpcio stubs lack Server.add_registered_method_handlers (which grpcio has).
    server.add_registered_method_handlers(name, handlers)  # pyright: ignore[reportAttributeAccessIssue]
