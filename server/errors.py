"""Status codes and messages: how failures reach clients."""

from __future__ import annotations

import grpc


class QueueFullError(Exception):
    """The server's bounded queue is full: the client should back off and retry."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a server answers for an exception raised while admitting or running a request."""
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INTERNAL
