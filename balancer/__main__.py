"""python -m fastgen.balancer: the gRPC load balancer in front of FastGen replicas.

    python -m fastgen.balancer --port 50050 --metrics-port 9400 \\
        --replica r0=127.0.0.1:50051 --replica r1=127.0.0.1:50052 --policy least_loaded [--http-port 8000]

Health is SERVING while at least one replica is healthy. With --http-port it also serves the OpenAI-compatible
HTTP API (openai_api.py) from the same event loop; FASTGEN_API_KEY (or --api-key, which `ps` shows) makes it require
`Authorization: Bearer <key>`. SIGTERM (or SIGINT) stops taking new calls, lets calls in flight finish (up to
--grace seconds) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from prometheus_client import CollectorRegistry

from ..server.grpc_server import PortInUseError, create_server, set_serving
from ..server.metrics import BalancerMetrics, BuildInfo, HttpMetrics, record_build_info, start_metrics_server
from .openai_api import API_KEY_ENV, ApiSettings, OpenAIApi, start_http
from .policy import POLICIES, Router
from .pool import ReplicaPool, ReplicaSpec, parse_replica_spec
from .service import RETRY_CODES, BalancerService

log = logging.getLogger("fastgen.balancer")


def _replica_arg(text: str) -> ReplicaSpec:
    try:
        return parse_replica_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastgen.balancer", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=50050, help="gRPC port (default 50050; 0 picks a free one)")
    p.add_argument("--metrics-port", type=_port, default=0, help="Prometheus /metrics port (0 picks a free one)")
    p.add_argument(
        "--replica",
        type=_replica_arg,
        action="append",
        required=True,
        metavar="ID=HOST:PORT",
        help="a replica to balance over; repeat for each",
    )
    p.add_argument("--policy", choices=sorted(POLICIES), default="least_loaded", help="routing policy")
    p.add_argument(
        "--http-port", type=_port, default=0, help="port of the OpenAI-compatible HTTP API (default 0: no HTTP API)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"key the HTTP API requires as Authorization: Bearer <key> (default: ${API_KEY_ENV}; prefer the "
        "environment variable, since ps shows a command line)",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a model name the HTTP API accepts besides the one the replicas report; repeat for each",
    )
    p.add_argument("--health-interval", type=_positive_float, default=0.5, help="seconds between health checks")
    p.add_argument("--health-timeout", type=_positive_float, default=1.0, help="deadline of one health check (s)")
    p.add_argument(
        "--max-retries",
        type=_non_negative_int,
        default=2,
        help="tries on other replicas when a replica fails before any output was sent",
    )
    p.add_argument("--grace", type=_positive_float, default=30.0, help="seconds in-flight calls get on SIGTERM")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    ids = [r.id for r in args.replica]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        p.error(f"argument --replica: duplicate replica id(s) {', '.join(duplicates)}; give each replica its own id")
    return args


async def serve(args: argparse.Namespace) -> int:
    registry = CollectorRegistry()
    ids = tuple(r.id for r in args.replica)
    metrics = BalancerMetrics(registry, ids, args.policy, RETRY_CODES)
    record_build_info(registry, BuildInfo(role="balancer"))

    async def on_health_change() -> None:
        # `health` is bound below, before pool.start() lets any health change happen.
        await set_serving(health, pool.any_healthy())

    pool = ReplicaPool(args.replica, args.health_interval, args.health_timeout, metrics, on_health_change)
    service = BalancerService(pool, Router(args.policy, len(args.replica)), metrics, args.max_retries)
    http = None
    try:
        server, health = create_server(service, args.host, args.port)
        metrics_port = start_metrics_server(registry, args.host, args.metrics_port)
        if args.http_port:
            http = await serve_http(args, service, registry)
    except PortInUseError as e:
        await pool.close()
        print(f"fastgen balancer: error: {e}", file=sys.stderr)
        return 1
    await set_serving(health, False)
    await server.start()
    pool.start()
    log.info(
        "balancing %d replicas (%s) with %s on %s:%d, metrics on port %d%s",
        len(pool.replicas),
        ", ".join(f"{r.id}={r.address}" for r in pool.replicas),
        args.policy,
        args.host,
        args.port,
        metrics_port,
        _http_note(args) if http else "",
    )
    await _wait_for_stop_signal()
    log.info("stopping: no new calls, waiting up to %.0f s for calls in flight", args.grace)
    await set_serving(health, False)
    await asyncio.gather(server.stop(args.grace), *([http.cleanup()] if http else []))
    await pool.close()
    log.info("stopped")
    return 0


async def serve_http(args: argparse.Namespace, service: BalancerService, registry: CollectorRegistry):
    settings = ApiSettings(api_key=args.api_key, served_model_names=tuple(args.served_model_name))
    api = OpenAIApi(service.balancer, settings, HttpMetrics(registry))
    runner, _port = await start_http(api, args.host, args.http_port, shutdown_timeout=args.grace)
    return runner


def _http_note(args: argparse.Namespace) -> str:
    auth = " (API key required)" if args.api_key else ""
    return f", OpenAI-compatible HTTP API on port {args.http_port}{auth}"


async def _wait_for_stop_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
