"""What every FastGen gRPC server shares: the Generation service, grpc.health.v1, reflection, binding, security
(bearer tokens and TLS; health and reflection stay open) and graceful shutdown (grpc.aio)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import grpc
from grpc_health.v1 import _async as health_aio  # pyright: ignore[reportAttributeAccessIssue]  # not in typeshed
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..proto import fastgen_pb2, fastgen_pb2_grpc
from .auth import BearerAuthInterceptor, read_token_file
from .errors import add_generation_servicer
from .tls import TlsFiles, server_credentials

SERVICE_NAME = fastgen_pb2.DESCRIPTOR.services_by_name["Generation"].full_name  # "fastgen.v1.Generation"
# The grpc.health.v1 service name a liveness probe checks (Kubernetes: livenessProbe.grpc.service).
LIVENESS_SERVICE = "liveness"
# Large enough for long prompts given as token ids or long completions.
MESSAGE_LIMIT = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MESSAGE_LIMIT), ("grpc.max_receive_message_length", MESSAGE_LIMIT)]
# gRPC sets SO_REUSEPORT by default, so a second server on a busy port would bind "successfully" and steal
# connections: turn it off so a port in use is an error.
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)]


class PortInUseError(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerSecurity:
    """Who may call a server: with `tokens`, only callers sending one of them as a bearer token (`hint` tells the
    others what to send); with `tls`, over TLS only (mutual TLS when tls.ca is set)."""

    tokens: tuple[str, ...] = ()
    hint: str = ""
    tls: TlsFiles | None = None

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [BearerAuthInterceptor(self.tokens, self.hint)] if self.tokens else []


def add_security_args(
    p: argparse.ArgumentParser, token_help: str, ca_help: str, cert_help: str = "certificate chain to serve TLS with"
) -> None:
    """--auth-token-file and --tls-cert/--tls-key/--tls-ca, shared by the replica and the balancer."""
    p.add_argument("--auth-token-file", default=None, metavar="FILE", help=token_help)
    p.add_argument("--tls-cert", default=None, metavar="PEM", help=cert_help)
    p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help=ca_help)


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS files the flags name (ValueError when they do not fit together), or None for plaintext."""
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca).check("server")
    return tls if tls.cert else None


def token_from_args(args: argparse.Namespace) -> str | None:
    return read_token_file(args.auth_token_file) if args.auth_token_file else None


def create_server(
    servicer: fastgen_pb2_grpc.GenerationServicer, host: str, port: int, security: ServerSecurity | None = None
) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """A grpc.aio server with Generation, Health (NOT_SERVING until `set_serving`) and reflection, bound to
    host:port, as `security` says. Call from inside the event loop that will run it."""
    security = security or ServerSecurity()
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=security.interceptors())
    add_generation_servicer(servicer, server)  # a request that does not parse is INVALID_ARGUMENT, not UNKNOWN
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        if security.tls is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", server_credentials(security.tls))
    except RuntimeError as e:  # grpc raises when the address cannot be bound
        raise PortInUseError(f"cannot listen on {host}:{port} ({e}): is the port in use? choose another") from e
    if bound == 0:
        raise PortInUseError(f"cannot listen on {host}:{port}: is the port in use? choose another")
    return server, health


async def set_serving(health: health_aio.HealthServicer, serving: bool) -> None:
    """Health of the server ("" and the Generation service). The liveness service says SERVING whatever this says:
    the process answers, which is all a liveness probe should ask (a replica loading its model or draining, or a
    balancer whose replicas are all down, must not be restarted for it)."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health.set(name, status)
    await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)


REPLICA_TOKEN_HINT = (
    "this replica serves its deployment's balancer only: call the balancer, or send the metadata authorization: "
    "Bearer <the token in the replica's --auth-token-file>"
)
REPLICA_TOKEN_HELP = (
    "file holding the token callers must send as authorization: Bearer <token> (fastgen-deploy start generates one "
    "for its balancer; health checks need none). Default: anyone may call"
)
REPLICA_CA_HELP = "require client certificates signed by this CA (mutual TLS; needs --tls-cert and --tls-key)"


def add_replica_security_args(p: argparse.ArgumentParser) -> None:
    add_security_args(p, REPLICA_TOKEN_HELP, REPLICA_CA_HELP)


def replica_security(args: argparse.Namespace) -> ServerSecurity:
    """What a replica's flags ask for; ValueError for a missing or unusable file."""
    token = token_from_args(args)
    return ServerSecurity(tokens=(token,) if token else (), hint=REPLICA_TOKEN_HINT, tls=tls_from_args(args))
