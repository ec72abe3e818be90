"""What the balancer and replica services share and what clients use: the Python client, status mapping, metrics
and the common gRPC server setup."""

from .client import AsyncClient, Client, GenerationChunk, GenerationError, GenerationResult, Status

__all__ = ["Client", "AsyncClient", "GenerationError", "GenerationResult", "GenerationChunk", "Status"]
