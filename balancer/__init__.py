"""The load balancer: replica pool, health checks, routing policies, retries, its gRPC and HTTP services."""

from fastgen import toplevel

if toplevel.is_bare(__name__):  # imported as bare `balancer` from the repository root: see fastgen/toplevel.py
    toplevel.hand_over(__name__, __file__)
