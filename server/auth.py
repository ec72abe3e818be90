"""Bearer tokens on gRPC: the server interceptor that checks them, the stub wrapper that sends them, and token files.

A deployment has two secrets. The API key (FASTGEN_API_KEY) is what clients send to the balancer, over gRPC as
`authorization: Bearer <key>` metadata and over HTTP as the same header. The internal token, generated into the
deployment's state directory (0600), is what the balancer sends to the replicas, which accept nothing else, so a
client holding the API key cannot reach a replica around the balancer. The health service and reflection stay open
(load balancers, orchestrators and grpcurl need them before they hold any secret).
"""

from __future__ import annotations

import functools
import hmac
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import grpc

AUTHORIZATION = "authorization"  # gRPC metadata keys are lower-case
OPEN_SERVICES = frozenset(
    {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"}
)
TOKEN_BYTES = 32


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (scheme case-insensitive), or None."""
    scheme, _, token = (header or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def token_accepted(header: str | None, accepted: Sequence[str]) -> bool:
    """Whether the header carries one of the accepted tokens. compare_digest takes as long whatever prefix matches,
    so a token cannot be guessed byte by byte; every accepted token is compared, so timing does not tell which."""
    token = bearer_token(header)
    if token is None:
        return False
    given = token.encode()
    return sum(hmac.compare_digest(given, t.encode()) for t in accepted) > 0


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none without one)."""
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()


def service_of(method: str) -> str:
    """'/fastgen.v1.Generation/Generate' -> 'fastgen.v1.Generation'."""
    return method.lstrip("/").partition("/")[0]


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to every service but OPEN_SERVICES unless their metadata carries one of `accepted` as a bearer
    token: UNAUTHENTICATED with `hint` (what to send) as the message."""

    def __init__(self, accepted: Sequence[str], hint: str):
        if not accepted or not all(accepted):
            raise ValueError("BearerAuthInterceptor needs at least one non-empty token")
        self.accepted = tuple(accepted)
        self.hint = hint

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or service_of(handler_call_details.method) in OPEN_SERVICES:
            return handler
        header = dict(handler_call_details.invocation_metadata or ()).get(AUTHORIZATION)
        if isinstance(header, bytes):
            header = header.decode(errors="replace")
        if token_accepted(header, self.accepted):
            return handler
        return refusal_like(handler, self.hint)


def refusal_like(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary or streaming) that answers UNAUTHENTICATED without running the method."""

    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached: makes this an async generator, as a streaming handler is

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    streaming = (handler.request_streaming, handler.response_streaming)
    return kinds[streaming](
        refuse_stream if handler.response_streaming else refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class AuthorizedStub:
    """A generated stub whose every call sends `metadata` (a bearer token): `stub.Generate(req, timeout=...)` as
    before, for code that should not have to know about credentials."""

    def __init__(self, stub, metadata: Sequence[tuple[str, str]]):
        self._stub = stub
        self._metadata = tuple(metadata)

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)
        return functools.partial(method, metadata=self._metadata) if self._metadata else method


# ---- token files ----
def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def write_token_file(path: str | os.PathLike, token: str | None = None) -> str:
    """Writes a token (a new one unless given) to `path`, readable by its owner only, atomically; returns it."""
    token = token or new_token()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from its first byte, whatever the umask
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def read_token_file(path: str | os.PathLike) -> str:
    """The token in `path` (surrounding whitespace dropped); ValueError saying what is wrong."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the auth token file {path}: {e.strerror or e}") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"the auth token file {path} must hold one token (no spaces), got {len(token)} characters")
    return token
