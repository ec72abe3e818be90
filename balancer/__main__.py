"""python -m fastgen.balancer: the gRPC load balancer in front of FastGen replicas.

    python -m fastgen.balancer --port 50050 --metrics-port 9400 \\
        --replica r0=127.0.0.1:50051 --replica r1=127.0.0.1:50052 --policy least_loaded [--http-port 8000]

    python -m fastgen.balancer --replicas-dns fastgen-replica:50051   # every address of the name (Kubernetes)
    python -m fastgen.balancer --replicas-file replicas.txt         # one ID=HOST:PORT or HOST:PORT a line

--replicas-dns and --replicas-file are looked up again every --discovery-interval seconds: replicas that appear take
traffic once healthy, and those that disappear take no new requests and are closed once their requests finish
(discovery.py). Health is SERVING while at least one replica is healthy; the grpc.health.v1 service "liveness" is
SERVING as long as the process answers. With --http-port it also serves the OpenAI-compatible
HTTP API (openai_api.py) from the same event loop. FASTGEN_API_KEY (or --api-key, which `ps` shows) makes gRPC and
HTTP require `authorization: Bearer <key>` (health checks excepted); --auth-token-file names the deployment's internal
token, which the balancer sends to the replicas (and also accepts). --tls-cert/--tls-key serve gRPC and HTTP over
TLS; --tls-ca makes the calls to the replicas mutual TLS. SIGTERM (or SIGINT) stops taking new calls, lets calls in
flight finish (up to --grace seconds) and exits 0.

--api-keys-file gives one key per tenant (one a line): with more than one client key, each tenant's requests get their
own prefix-cache salt (tenants.py), so tenants cannot probe each other's cached prompts; with a single key every caller
shares the cache, as before. Serving without any key on an address other than loopback is logged as a warning.
--max-model-len tells the balancer the replicas' context, so that longer prompts are refused before any work
(limits.py); without it only prompts no model takes are.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from ..server.auth import bearer_metadata
from ..server.client import ChannelSecurity
from ..server.grpc_server import (
    PortInUseError,
    ServerSecurity,
    add_security_args,
    create_server,
    set_serving,
    tls_from_args,
    token_from_args,
)
from ..server.metrics import BalancerMetrics, BuildInfo, HttpMetrics, record_build_info, start_metrics_server
from ..server.tls import TlsFiles, server_ssl_context
from .discovery import DEFAULT_INTERVAL, Discovery, DnsSource, FileSource, Source, split_host_port
from .journal import DEFAULT_MIGRATION_LIMIT, DEFAULT_MIGRATION_MAX_LEN, MigrationSettings
from .limits import PromptLimits
from .openai_api import API_KEY_ENV, ApiSettings, OpenAIApi, start_http
from .policy import POLICIES, Router
from .pool import ReplicaPool, ReplicaSpec, parse_replica_spec
from .reasoning import REASONING_PARSERS
from .service import RETRY_CODES, BalancerService
from .tools import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS

log = logging.getLogger("fastgen.balancer")

API_KEY_HINT = f"missing or wrong API key: send the metadata authorization: Bearer <the deployment's {API_KEY_ENV}>"
TOKEN_HELP = (
    "file holding the deployment's internal token: sent to the replicas on every call, and accepted from callers as "
    "well as the API key (fastgen-deploy start generates it)"
)
CA_HELP = (
    "CA of the deployment: the replicas' certificates are verified against it and --tls-cert is presented to them "
    "as a client certificate (mutual TLS inside the deployment)"
)
CERT_HELP = "certificate chain to serve gRPC and the HTTP API over TLS with"


@dataclass(frozen=True)
class Security:
    """The balancer's side of the deployment's security, read from its flags and files."""

    server: ServerSecurity  # what callers of the balancer must present
    upstream: ChannelSecurity  # what the balancer presents to the replicas
    http_tls: TlsFiles | None  # the HTTP API's certificate (clients need none)
    api_keys: tuple[str, ...] = ()  # the clients' keys: --api-key and --api-keys-file
    operator_tokens: tuple[str, ...] | None = None  # who sees replica addresses in GetStatus (None: every caller)

    @property
    def per_tenant(self) -> bool:
        return len(self.api_keys) > 1


def security_from_args(args: argparse.Namespace) -> Security:
    """ValueError for a missing or unusable file."""
    tls, token = tls_from_args(args), token_from_args(args)
    keys = client_keys(args)
    # The internal token opens the balancer too: whoever can read it can already call the replicas directly.
    tokens = tuple(t for t in (*keys, token) if t) if keys else ()
    public = TlsFiles(tls.cert, tls.key) if tls else None  # public callers present no certificate
    upstream = ChannelSecurity(bearer_metadata(token), tls if tls and tls.ca else None)
    operators = tuple(t for t in (token,) if t) if keys else None
    return Security(ServerSecurity(tokens, API_KEY_HINT, public), upstream, public, keys, operators)


def client_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key and the keys of --api-keys-file (one a line, '#' comments), in order, each once."""
    keys = [args.api_key] if args.api_key else []
    if args.api_keys_file:
        try:
            text = Path(args.api_keys_file).read_text()
        except OSError as e:
            raise ValueError(f"cannot read the API keys file {args.api_keys_file}: {e.strerror or e}") from None
        lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        if any(" " in line for line in lines):
            raise ValueError(f"the API keys file {args.api_keys_file} must hold one key a line, without spaces")
        keys += [line for line in lines if line]
    return tuple(dict.fromkeys(keys))


def warn_if_exposed(args: argparse.Namespace) -> None:
    """A warning when anyone who reaches the host can use the deployment: no API key on a non-loopback address."""
    if args.api_key or getattr(args, "api_keys_file", None) or is_loopback(args.host):
        return
    log.warning(
        "serving on %s without an API key: anyone who can reach this address can generate and read the deployment's "
        "status; set %s (or --api-keys-file), or listen on 127.0.0.1",
        args.host,
        API_KEY_ENV,
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def _replica_arg(text: str) -> ReplicaSpec:
    try:
        return parse_replica_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dns_arg(text: str) -> tuple[str, int]:
    try:
        return split_host_port(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _nameserver_arg(text: str) -> tuple[str, int]:
    try:
        return split_host_port(text, default_port=53)
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
    p = argparse.ArgumentParser(prog="python -m fastgen.balancer", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=50050, help="gRPC port (default 50050; 0 picks a free one)")
    p.add_argument("--metrics-port", type=_port, default=0, help="Prometheus /metrics port (0 picks a free one)")
    p.add_argument(
        "--replica",
        type=_replica_arg,
        action="append",
        default=[],
        metavar="ID=HOST:PORT",
        help="a replica to balance over; repeat for each",
    )
    p.add_argument(
        "--replicas-dns",
        type=_dns_arg,
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="every address NAME resolves to is a replica listening on PORT (e.g. a Kubernetes headless Service); "
        "resolved again every --discovery-interval, replicas joining and leaving live",
    )
    p.add_argument(
        "--replicas-file",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="a file of replicas, one ID=HOST:PORT or HOST:PORT a line ('#' comments), read again every "
        "--discovery-interval; replace it by renaming a complete file over it",
    )
    p.add_argument(
        "--dns-server",
        type=_nameserver_arg,
        default=None,
        metavar="HOST[:PORT]",
        help="ask this DNS server for --replicas-dns (default: the system's resolver)",
    )
    p.add_argument(
        "--discovery-interval",
        type=_positive_float,
        default=DEFAULT_INTERVAL,
        help="seconds between lookups of --replicas-dns and --replicas-file (default: %(default)s)",
    )
    p.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default="least_loaded",
        help="routing policy (default: %(default)s); prefix_aware routes a prompt where its prefix is cached unless "
        "the wait there costs more than the prefill it saves",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="FOLDER",
        help="prefix_aware: Hugging Face folder (tokenizer.json) to hash text and chat prompts with (default: the one "
        "the replicas report, when this host can read it)",
    )
    p.add_argument(
        "--http-port", type=_port, default=0, help="port of the OpenAI-compatible HTTP API (default 0: no HTTP API)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"key gRPC and the HTTP API require as authorization: Bearer <key> (default: ${API_KEY_ENV}; prefer "
        "the environment variable, since ps shows a command line)",
    )
    p.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="more client keys, one a line ('#' comments): one per tenant. With more than one key in all, each "
        "tenant's prompts are cached apart from the others'",
    )
    add_security_args(p, TOKEN_HELP, CA_HELP, CERT_HELP)
    p.add_argument(
        "--max-model-len",
        type=_non_negative_int,
        default=0,
        help="the replicas' context length: longer prompts are refused at the balancer before any work (default 0: "
        "unknown; only prompts no model takes are refused here, the replicas refuse the rest)",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a model name the HTTP API accepts besides the one the replicas report; repeat for each",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=DEFAULT_TOOL_CALL_PARSER,
        help="how the HTTP API finds tool calls in a model's output with tool_choice auto: the model family's format",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a reasoning model's <think> block into the HTTP API's reasoning_content (default: off)",
    )
    p.add_argument("--health-interval", type=_positive_float, default=0.5, help="seconds between health checks")
    p.add_argument("--health-timeout", type=_positive_float, default=1.0, help="deadline of one health check (s)")
    p.add_argument(
        "--max-retries",
        type=_non_negative_int,
        default=2,
        help="tries on other replicas when a replica fails before any output was sent",
    )
    p.add_argument(
        "--migration-limit",
        type=_non_negative_int,
        default=DEFAULT_MIGRATION_LIMIT,
        help="times a request may move to another replica after its replica failed mid-request (streams resume "
        "where they were; 0: off; default %(default)s)",
    )
    p.add_argument(
        "--migration-max-len",
        type=_non_negative_int,
        default=DEFAULT_MIGRATION_MAX_LEN,
        help="tokens of a stream's output the balancer keeps to resume it elsewhere; a longer stream fails with its "
        "replica (default %(default)s)",
    )
    p.add_argument("--grace", type=_positive_float, default=30.0, help="seconds in-flight calls get on SIGTERM")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    if not (args.replica or args.replicas_dns or args.replicas_file):
        p.error("no replicas: give --replica ID=HOST:PORT, --replicas-dns NAME:PORT or --replicas-file PATH")
    ids = [r.id for r in args.replica]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        p.error(f"argument --replica: duplicate replica id(s) {', '.join(duplicates)}; give each replica its own id")
    return args


async def serve(args: argparse.Namespace) -> int:
    try:
        security = security_from_args(args)
    except ValueError as e:
        print(f"fastgen balancer: error: {e}", file=sys.stderr)
        return 2
    registry = CollectorRegistry()
    ids = tuple(r.id for r in args.replica)
    metrics = BalancerMetrics(registry, ids, args.policy, RETRY_CODES)
    record_build_info(registry, BuildInfo(role="balancer"))

    async def on_health_change() -> None:
        # `health` is bound below, before pool.start() lets any health change happen.
        await set_serving(health, pool.any_healthy())

    pool = ReplicaPool(
        args.replica,
        args.health_interval,
        args.health_timeout,
        metrics,
        on_health_change,
        security.upstream,
        prefix_routing=args.policy == "prefix_aware",
        tokenizer=args.tokenizer,
    )
    discovery = Discovery(pool, discovery_sources(args), args.discovery_interval, metrics)
    metrics.set_discovered("static", len(args.replica))
    migration = MigrationSettings(args.migration_limit, args.migration_max_len)
    service = BalancerService(
        pool,
        Router(args.policy, len(args.replica)),
        metrics,
        args.max_retries,
        migration,
        PromptLimits.for_model_len(args.max_model_len),
        security.per_tenant,
        security.operator_tokens,
    )
    http = None
    try:
        server, health = create_server(service, args.host, args.port, security.server)
        metrics_port = start_metrics_server(registry, args.host, args.metrics_port)
        if args.http_port:
            http = await serve_http(args, service, registry, security)
    except PortInUseError as e:
        await pool.close()
        print(f"fastgen balancer: error: {e}", file=sys.stderr)
        return 1
    warn_if_exposed(args)
    await set_serving(health, False)
    await server.start()
    pool.start()
    discovery.start()
    log.info(
        "balancing %s with %s on %s:%d%s, metrics on port %d%s",
        _members_note(args, discovery),
        args.policy,
        args.host,
        args.port,
        _security_note(security),
        metrics_port,
        _http_note(args) if http else "",
    )
    await _wait_for_stop_signal()
    log.info("stopping: no new calls, waiting up to %.0f s for calls in flight", args.grace)
    await set_serving(health, False)
    await asyncio.gather(server.stop(args.grace), *([http.cleanup()] if http else []))
    await discovery.close()
    await pool.close()
    log.info("stopped")
    return 0


async def serve_http(
    args: argparse.Namespace, service: BalancerService, registry: CollectorRegistry, security: Security
):
    settings = ApiSettings(
        api_key=args.api_key,
        served_model_names=tuple(args.served_model_name),
        api_keys=security.api_keys,
        limits=service.balancer.limits,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    api = OpenAIApi(service.balancer, settings, HttpMetrics(registry))
    tls = security.http_tls
    ssl_context = server_ssl_context(tls) if tls else None
    runner, _port = await start_http(api, args.host, args.http_port, args.grace, ssl_context)
    return runner


def discovery_sources(args: argparse.Namespace) -> list[Source]:
    sources: list[Source] = [DnsSource(name, port, args.dns_server) for name, port in args.replicas_dns]
    return sources + [FileSource(path) for path in args.replicas_file]


def _members_note(args: argparse.Namespace, discovery: Discovery) -> str:
    static = [f"{r.id}={r.address}" for r in args.replica]
    parts = [f"{len(static)} replicas ({', '.join(static)})"] if static else []
    return " and ".join(parts + [s.describe() for s in discovery.sources])


def _security_note(security: Security) -> str:
    notes = ["TLS"] if security.server.tls else []
    notes += ["API key required"] if security.server.tokens else []
    notes += [f"{len(security.api_keys)} tenants' keys, prefix caches apart"] if security.per_tenant else []
    notes += ["mutual TLS to the replicas"] if security.upstream.tls else []
    return f" ({', '.join(notes)})" if notes else ""


def _http_note(args: argparse.Namespace) -> str:
    auth = " (API key required)" if args.api_key or args.api_keys_file else ""
    scheme = "HTTPS" if args.tls_cert else "HTTP"
    return f", OpenAI-compatible {scheme} API on port {args.http_port}{auth}"


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
