"""What every FastGen gRPC server shares: the Generation service, grpc.health.v1, reflection, binding
and graceful shutdown (grpc.aio)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..proto import fastgen_pb2, fastgen_pb2_grpc

SERVICE_NAME = fastgen_pb2.DESCRIPTOR.services_by_name["Generation"].full_name  # "fastgen.v1.Generation"
# Large enough for long prompts given as token ids or long completions.
MESSAGE_LIMIT = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MESSAGE_LIMIT), ("grpc.max_receive_message_length", MESSAGE_LIMIT)]
# gRPC sets SO_REUSEPORT by default, so a second server on a busy port would bind "successfully" and steal
# connections: turn it off so a port in use is an error.
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)]


class PortInUseError(RuntimeError):
    pass


def create_server(
    servicer: fastgen_pb2_grpc.GenerationServicer, host: str, port: int
) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """A grpc.aio server with Generation, Health (NOT_SERVING until `set_serving`) and reflection, bound to
    host:port. Call from inside the event loop that will run it."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    fastgen_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:  # grpc raises when the address cannot be bound
        raise PortInUseError(f"cannot listen on {host}:{port} ({e}): is the port in use? choose another") from e
    if bound == 0:
        raise PortInUseError(f"cannot listen on {host}:{port}: is the port in use? choose another")
    return server, health


async def set_serving(health: health_aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health.set(name, status)
