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
from ..server.sla import DEFAULT_PROMPT_RATE, DEFAULT_TOKEN_RATES, SlaConfig
from .config import (
    ADMISSIONS,
    DEPLOYMENT_SCHEDULER,
    DEVICES,
    DTYPES,
    KERNEL_BACKENDS,
    LOAD_FORMATS,
    MAX_FAILED_STEPS,
    MAX_UNSENT_OUTPUTS,
    QUANTIZATIONS,
    SCHEDULERS,
    STALL_TIMEOUT_S,
    TP_TIMEOUT_S,
    CacheConfig,
    EngineConfig,
    LoraConfig,
    SchedulerConfig,
    SloConfig,
    SpeculativeConfig,
    default_max_batch_tokens,
    parse_lora_module,
    parse_size,
    parse_speculative_config,
)

log = logging.getLogger("fastgen.replica")
_SCHEDULER, _CACHE, _ENGINE = SchedulerConfig(), CacheConfig(), EngineConfig()
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
EXIT_ENGINE_FAILED = 4  # the engine thread died, its steps kept failing, or CUDA failed: restart the process


def size(text: str) -> int:
    """'512MiB', '2GiB', '1073741824' -> bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def speculative(text: str) -> SpeculativeConfig | None:
    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastgen.replica", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: pick a free one)")
    p.add_argument("--replica-id", default="replica-0")
    p.add_argument("--model", default=_ENGINE.model, help="alias, preset, Hugging Face folder or .gguf file")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument(
        "--device",
        default=_ENGINE.device,
        help=f"{', '.join(DEVICES)} or cuda:N (auto: cuda where there is a GPU; default: %(default)s)",
    )
    p.add_argument("--kernels", default=_ENGINE.kernels, choices=KERNEL_BACKENDS)
    p.add_argument(
        "--load-format",
        default=_ENGINE.load_format,
        choices=LOAD_FORMATS,
        help="auto: read the checkpoint; dummy: random weights made on the device (any model, and the presets, "
        "which ship without weights)",
    )
    p.add_argument(
        "--quantization",
        default=_ENGINE.quantization,
        choices=QUANTIZATIONS,
        help="auto: serve a GGUF in its own block types (CPU kernels); none: dequantize to --dtype; int8: "
        "weight-only int8, per-channel scales (CPU); fp8: CUDA only (default: %(default)s)",
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs: run every decode step op by op (vLLM's flag)"
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tp: each rank holds whole experts of a mixture-of-experts model instead of a slice of every "
        "expert (vLLM's flag)",
    )
    add_lora_args(p)
    p.add_argument(
        "--speculative-config",
        type=speculative,
        default=None,
        help='speculative decoding, as JSON with vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}\' (optional "disable_by_batch_size": N); default: off',
    )
    p.add_argument(
        "--max-batch-tokens",
        type=positive,
        default=None,
        help=f"tokens of one pass: the slo scheduler's cap (default {default_max_batch_tokens('slo')}), the budget "
        f"of the others (default {default_max_batch_tokens('splitfuse')})",
    )
    p.add_argument("--max-seqs", type=positive, default=_SCHEDULER.max_seqs)
    p.add_argument("--block-size", type=positive, default=_CACHE.block_size)
    p.add_argument("--num-blocks", type=positive, default=None)
    p.add_argument(
        "--kv-cache-memory",
        type=size,
        default=None,
        help=f"KV pool per rank, e.g. 2GiB (default on CPU: {_CACHE.memory_bytes >> 20}MiB; on CUDA: sized from "
        "--gpu-memory-utilization)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=share,
        default=GPU_MEMORY_UTILIZATION,
        help="on CUDA, the share of the device's memory for weights, activations and the KV pool, which gets what "
        "a profiling pass leaves; --kv-cache-memory or --num-blocks override it (default: %(default)g)",
    )
    p.add_argument(
        "--scheduler",
        default=DEPLOYMENT_SCHEDULER,
        choices=SCHEDULERS,
        help="slo: each step's token budget from the requests' deadlines (--sla-prompt-rate, the largest "
        "--sla-token-rate) and a step-time model fitted on this replica; --max-batch-tokens caps it "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--admission",
        default=_SCHEDULER.slo.admission,
        choices=ADMISSIONS,
        help="slo: while even decoding alone would break the token-rate floors, keep admitting new requests or "
        "refuse them with RESOURCE_EXHAUSTED and a retry hint (default: %(default)s)",
    )
    p.add_argument(
        "--step-trace",
        default=None,
        metavar="CSV",
        help="append every step's shape and measured time to this CSV, and under --scheduler slo the step-time "
        "model's prediction and budget",
    )
    p.add_argument("--max-model-len", type=positive, default=None)
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="recompute every prompt from its first token instead of reusing cached KV blocks of equal prefixes",
    )
    p.add_argument("--default-max-new-tokens", type=positive, default=_ENGINE.default_max_new_tokens)
    p.add_argument("--threads", type=positive, default=1, help="torch threads for this process")
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel ranks of this replica")
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
    p.add_argument(
        "--sla-prompt-rate",
        type=positive_float,
        default=DEFAULT_PROMPT_RATE,
        metavar="P",
        help="SLA: first token within prompt_tokens / P seconds (default: %(default)g)",
    )
    p.add_argument(
        "--sla-token-rate",
        type=positive_float,
        nargs="+",
        default=list(DEFAULT_TOKEN_RATES),
        metavar="R",
        help="SLA: inter-token moving average at most 1 / R seconds; every R given is "
        "exported as its own token_rate label (default: 1 2 4)",
    )
    p.add_argument(
        "--allow-client-slo-tightening",
        action="store_true",
        help="let a request's slo ask for more than the SLA (a higher token_rate or prompt_rate, a shorter ttft); by "
        "default the slo scheduler only lets a request loosen it, so that no client can claim the replica for "
        "itself. Turn on only behind a balancer that decides who may ask for more",
    )
    return p.parse_args(argv)


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """Multi-LoRA serving, vLLM's flags (docs/lora.md)."""
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters chosen per request by name")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters to serve from the start: a name and a PEFT adapter folder each (needs --enable-lora)",
    )
    p.add_argument(
        "--max-loras",
        type=positive,
        default=LoraConfig.max_loras,
        help="adapters resident at once; beyond it the least recently used idle one is evicted (default: %(default)s)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=positive,
        default=LoraConfig.max_lora_rank,
        help="the largest adapter rank served; an adapter of higher rank is refused (default: %(default)s)",
    )


def lora_config(args: argparse.Namespace) -> LoraConfig:
    modules = tuple(parse_lora_module(m) for m in args.lora_modules)
    return LoraConfig(args.enable_lora, modules, args.max_loras, args.max_lora_rank)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=None if args.dtype == "auto" else args.dtype,
        device=args.device,
        kernels=args.kernels,
        load_format=args.load_format,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        enable_expert_parallel=args.enable_expert_parallel,
        speculative_config=args.speculative_config,
        lora=lora_config(args),
        scheduler=SchedulerConfig(
            max_batch_tokens=args.max_batch_tokens or default_max_batch_tokens(args.scheduler),
            max_seqs=args.max_seqs,
            policy=args.scheduler,
            # The floor the scheduler holds is the strictest R the deployment is scored against.
            slo=SloConfig(
                args.sla_prompt_rate, max(args.sla_token_rate), args.admission, args.allow_client_slo_tightening
            ),
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            memory_bytes=args.kv_cache_memory or _CACHE.memory_bytes,
            # An explicit --kv-cache-memory is the budget on every device; num_blocks overrides both in the builder.
            gpu_memory_utilization=None if args.kv_cache_memory else args.gpu_memory_utilization,
            prefix_caching=args.prefix_caching,
        ),
        max_model_len=args.max_model_len,
        default_max_new_tokens=args.default_max_new_tokens,
    )


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
    from .parallel import TPGroup
    from .service import EngineLoop, QueueLimits, ReplicaService, Watchdog, watch_engine
    from .step_model import StepTrace

    torch.set_num_threads(args.threads)
    config = engine_config(args)  # flag errors surface before anything binds
    registry = CollectorRegistry()
    metrics = ReplicaMetrics(
        registry, args.replica_id, args.model, SlaConfig(args.sla_prompt_rate, tuple(args.sla_token_rate))
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
