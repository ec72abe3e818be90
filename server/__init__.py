"""What the balancer and replica services share and what clients use: the Python client, status mapping, metrics
and the common gRPC server setup."""

from fastgen import toplevel

if toplevel.is_bare(__name__):  # imported as bare `server` from the repository root: see fastgen/toplevel.py
    toplevel.hand_over(__name__, __file__)
else:
    from .client import AsyncClient, Client, GenerationChunk, GenerationError, GenerationResult, Status

__all__ = ["Client", "AsyncClient", "GenerationError", "GenerationResult", "GenerationChunk", "Status"]
