"""One replica process: `python -m fastgen.replica --port 50051 --replica-id replica-0 [engine knobs]`.

Binds its port first (health answers NOT_SERVING while the model loads), loads and warms the model, then
serves until SIGTERM, which drains: no new requests, in-flight ones finish, then exit 0."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

from ..server.grpc_server import PortInUseError, add_replica_security_args, create_server, replica_security, set_serving
from ..server.sla import SlaConfig
from .config import MAX_FAILED_STEPS, MAX_UNSENT_OUTPUTS, STALL_TIMEOUT_S, TP_TIMEOUT_S, EngineConfig
from .engine_args import add_arguments, from_namespace, positive, positive_float

log = logging.getLogger("fastgen.replica")
EXIT_ENGINE_FAILED = 4  # the engine thread died, its steps kept failing, or CUDA failed: restart the process


def build_parser() -> argparse.ArgumentParser:
    """This process's own flags around the engine's, which fastgen-deploy start shares (engine_args.EngineArgs)."""
    p = argparse.ArgumentParser(prog="python -m fastgen.replica", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: pick a free one)")
    p.add_argument("--replica-id", default="replica-0")
    p.add_argument(
        "--step-trace",
        default=None,
        metavar="CSV",
        help="append every step's shape and measured time to this CSV, and under --scheduler slo the step-time "
        "model's prediction and budget",
    )
    p.add_argument("--max-queue-requests", type=positive, default=256)
    p.add_argument("--max-queue-tokens", type=positive, default=262144)
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds SIGTERM waits for in-flight requests")
    p.add_argument(
        "--max-unsent-outputs",
        type=positive,
        default=MAX_UNSENT_OUTPUTS,
        help="outputs per completion a stream may leave unsent before it is cancelled RESOURCE_EXHAUSTED as too slow "
        "a reader (default: %(default)s)",
    )
    p.add_argument(
        "--stall-timeout",
        type=positive_float,
        default=STALL_TIMEOUT_S,
        metavar="S",
        help="health is NOT_SERVING while requests wait and no engine step has completed for S seconds "
        "(default: %(default)g)",
    )
    p.add_argument(
        "--max-failed-steps",
        type=positive,
        default=MAX_FAILED_STEPS,
        help="the process exits (status 4, for its supervisor to restart it) after this many engine steps failed in "
        "a row, or at once on a CUDA error (default: %(default)s)",
    )
    p.add_argument(
        "--tp-timeout",
        type=positive_float,
        default=TP_TIMEOUT_S,
        metavar="S",
        help="with --tp: a collective that waits longer than S seconds for a peer fails, and the group restarts "
        "(default: %(default)g)",
    )
    add_replica_security_args(p)  # --auth-token-file, --tls-cert, --tls-key, --tls-ca
    add_arguments(p.add_argument_group("engine (fastgen-deploy start takes the same flags)"))
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return from_namespace(args).engine_config()


def build_info(args: argparse.Namespace):
    """What fastgen_build_info says of this replica: the dtype as resolved, not "auto"."""
    import torch

    from ..server.metrics import BuildInfo
    from .weights import parse_dtype

    dtype = str(parse_dtype(args.dtype, torch.device(args.device)))
    return BuildInfo(
        role="replica", replica=args.replica_id, model=args.model, dtype=dtype.removeprefix("torch."), tp=args.tp
    )


def warm_up(engine) -> None:
    """One short request through every stage, so the first real request does not pay for lazy set-up; with the
    slo scheduler, then the short profile that seeds its step-time model."""
    from .request import SamplingParams
    from .slo_scheduler import SloScheduler, calibrate

    engine.add_request("warm-up", list(range(1, 9)), SamplingParams(max_new_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    if isinstance(engine.scheduler, SloScheduler):
        calibrate(engine)
        model = engine.scheduler.model
        log.info(
            "step-time model after %d calibration steps: %s (median error %.1f%%)",
            model.steps,
            ", ".join(f"{n} {c:.3g}" for n, c in zip(model.features, model.coefficients or ())),
            100 * model.median_error(),
        )


async def serve(args: argparse.Namespace, tp=None, broadcast=None) -> int:
    """Serves until SIGTERM. With tensor parallelism this is rank 0, and tp/broadcast connect it to the other ranks."""
    import torch
    from prometheus_client import CollectorRegistry

    from ..server.metrics import ReplicaMetrics, record_build_info, start_metrics_server
    from .builder import build_engine
    from .engine_loop import EngineLoop, QueueLimits, Watchdog
    from .parallel import TPGroup
    from .service import ReplicaService, watch_engine
    from .step_model import StepTrace

    torch.set_num_threads(args.threads)
    config = engine_config(args)  # flag errors surface before anything binds
    registry = CollectorRegistry()
    metrics = ReplicaMetrics(
        registry, args.replica_id, args.model, SlaConfig(args.sla_prompt_rate, args.sla_token_rates)
    )
    record_build_info(registry, build_info(args))
    service = ReplicaService(args.replica_id, args.model, metrics)
    server, health = create_server(service, args.host, args.port, replica_security(args))
    await server.start()
    await set_serving(health, False)
    metrics_port = start_metrics_server(registry, args.host, args.metrics_port)
    log.info(
        "replica %s listening on %s:%d (metrics on %d); loading %s",
        args.replica_id,
        args.host,
        args.port,
        metrics_port,
        args.model,
    )

    started = time.monotonic()

    def build():
        engine = build_engine(config, tp or TPGroup(), broadcast)
        warm_up(engine)
        return engine

    stop = asyncio.Event()
    failed: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        failed.append(exc)
        stop.set()

    loop = EngineLoop(
        build,
        metrics,
        QueueLimits(args.max_queue_requests, args.max_queue_tokens, args.max_unsent_outputs),
        asyncio.get_running_loop(),
        StepTrace(args.step_trace) if args.step_trace else None,
        Watchdog(args.stall_timeout, args.max_failed_steps),
        on_fatal,
    )
    try:
        await loop.start()
    except BaseException:
        # A model that will not load, or settings it cannot run with: the server is stopped here, while its event
        # loop still runs, rather than left for asyncio.run to close the loop under it.
        await server.stop(grace=None)
        raise
    service.engine_loop = loop
    await set_serving(health, True)
    log.info("replica %s SERVING after %.1f s", args.replica_id, time.monotonic() - started)

    watchdog = asyncio.create_task(watch_engine(service, health))
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    watchdog.cancel()

    if failed:  # its requests have failed UNAVAILABLE (the balancer moves them); a new process starts afresh
        await set_serving(health, False)
        await server.stop(grace=1.0)
        log.critical("replica %s exits: its engine failed: %s", args.replica_id, failed[0])
        return EXIT_ENGINE_FAILED
    log.info("draining %d in-flight requests", loop.in_flight)
    service.draining = True
    await set_serving(health, False)
    deadline = time.monotonic() + args.drain_timeout
    while loop.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(grace=2.0)
    loop.stop()
    log.info("replica %s stopped", args.replica_id)
    return 0


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.device == "auto":
        from .weights import resolve_device

        args.device = resolve_device(args.device)
    if args.tp > 1:
        from .tp_worker import run_tensor_parallel

        return run_tensor_parallel(args, run_replica, engine_config)
    return run_replica(args)


def run_replica(args: argparse.Namespace, tp=None, broadcast=None) -> int:
    """serve() to its end; exit status 2 for settings the replica cannot run with."""
    try:
        return asyncio.run(serve(args, tp, broadcast))
    except PortInUseError as exc:
        print(f"fastgen.replica: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # bad model, bad engine settings
        print(f"fastgen.replica: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
