"""Prometheus metrics of FastGen: one table of definitions and the recorders that turn replica and balancer
events into them.

Every metric lives on a `CollectorRegistry` the process creates and passes in, so two servers in one process
(tests, the pipeline) never collide and nothing registers behind anyone's back. No torch here: the balancer and
the deployment CLI import this module.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .. import __version__
from .grpc_server import PortInUseError
from .sla import SlaConfig, meets_sla, rate_label

# Latencies span GPU decode steps (a few ms) to CPU requests of many seconds.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
TOKENS_PER_FORWARD_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FILL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0)

REPLICA_LABELS = ("replica", "model")
FINISH_REASONS = ("length", "stop", "eos", "cancelled")
# Label values known before anything happens are exported at 0 from the first scrape, so that rates and ratios over
# them are defined (and no dashboard panel reads "No data") on a healthy deployment. The status codes are the wire
# contract's outcomes; any other code appears when it first happens.
EXPECTED_CODES = ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")
REPLICA_METHODS = ("Generate", "GenerateStream")
BALANCER_METHODS = ("Generate", "GenerateStream", "GetStatus")
# The OpenAI-compatible HTTP API's routes and the statuses it answers them with (499: the client left first).
HTTP_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/health",
    "/version",
)
HTTP_GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
HTTP_EXPECTED_STATUSES = ("200", "400", "401", "404", "429", "499", "500", "503", "504")


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: type  # prometheus_client's Counter, Gauge or Histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only


def _replica(name: str, kind: type, help: str, labels: tuple[str, ...] = (), buckets=None) -> MetricDef:
    return MetricDef(name, kind, help, REPLICA_LABELS + labels, buckets)


# ---- The table. Names are what the Grafana dashboard and users query; change them only together. ----
# Replica process.
TIME_TO_FIRST_TOKEN = _replica(
    "fastgen_time_to_first_token_seconds", Histogram, "Arrival to first generated token.", buckets=LATENCY_BUCKETS
)
INTER_TOKEN_LATENCY = _replica(
    "fastgen_inter_token_latency_seconds",
    Histogram,
    "Time between consecutive tokens of a request.",
    buckets=LATENCY_BUCKETS,
)
E2E_LATENCY = _replica(
    "fastgen_e2e_request_latency_seconds", Histogram, "Arrival to finish of a request.", buckets=REQUEST_LATENCY_BUCKETS
)
QUEUE_TIME = _replica(
    "fastgen_request_queue_time_seconds",
    Histogram,
    "Arrival to first scheduled forward pass.",
    buckets=REQUEST_LATENCY_BUCKETS,
)
PROMPT_TOKENS = _replica("fastgen_prompt_tokens_total", Counter, "Prompt tokens of admitted requests.")
GENERATED_TOKENS = _replica("fastgen_generated_tokens_total", Counter, "Tokens generated.")
REQUESTS_FINISHED = _replica(
    "fastgen_requests_finished_total", Counter, "Finished requests by finish reason.", ("reason",)
)
REQUESTS = _replica(
    "fastgen_requests_total", Counter, "RPCs answered by gRPC method and status code.", ("method", "code")
)
QUEUE_LENGTH = _replica("fastgen_queue_length", Gauge, "Requests waiting for their first forward pass.")
RUNNING_SEQUENCES = _replica("fastgen_running_sequences", Gauge, "Sequences being prefilled or decoded.")
KV_BLOCKS_USED = _replica("fastgen_kv_cache_blocks_used", Gauge, "KV cache blocks in use.")
KV_BLOCKS_TOTAL = _replica("fastgen_kv_cache_blocks_total", Gauge, "KV cache blocks in the pool.")
KV_USAGE = _replica("fastgen_kv_cache_usage_ratio", Gauge, "Fraction of KV cache blocks in use (0..1).")
PREEMPTIONS = _replica("fastgen_preemptions_total", Counter, "Sequences preempted for lack of KV blocks.")
# vLLM's prefix_cache_queries / prefix_cache_hits, in tokens: hits / queries is the share of prefill work saved.
PREFIX_CACHE_QUERIES = _replica(
    "fastgen_prefix_cache_queries_total", Counter, "Tokens of sequences admitted to run, looked up in the prefix cache."
)
PREFIX_CACHE_HITS = _replica(
    "fastgen_prefix_cache_hits_total", Counter, "Tokens found in the prefix cache, so not prefilled."
)
PREFIX_CACHE_BLOCKS = _replica(
    "fastgen_prefix_cache_blocks", Gauge, "KV blocks holding a cached prefix, in use or kept until evicted."
)
PREFIX_CACHE_EVICTIONS = _replica(
    "fastgen_prefix_cache_evictions_total", Counter, "Cached KV blocks given over to other KV when the pool ran short."
)
# Speculative decoding, vLLM's spec_decode counters: accepted / draft tokens is the acceptance rate, and
# accepted_per_pos{position=j} / drafts the rate at which proposal j (0 first) is accepted.
SPEC_DRAFTS = _replica("fastgen_spec_decode_num_drafts_total", Counter, "Decodes that verified proposed tokens.")
SPEC_DRAFT_TOKENS = _replica("fastgen_spec_decode_num_draft_tokens_total", Counter, "Proposed tokens verified.")
SPEC_ACCEPTED_TOKENS = _replica(
    "fastgen_spec_decode_num_accepted_tokens_total", Counter, "Proposed tokens accepted (emitted without a pass each)."
)
SPEC_ACCEPTED_PER_POS = _replica(
    "fastgen_spec_decode_num_accepted_tokens_per_pos_total",
    Counter,
    "Proposed tokens accepted, by their position among a decode's proposals (0 first).",
    ("position",),
)
TOKENS_PER_FORWARD = _replica(
    "fastgen_tokens_per_forward",
    Histogram,
    "Tokens (prefill + decode) in one forward pass.",
    buckets=TOKENS_PER_FORWARD_BUCKETS,
)
BUDGET_FILL = _replica(
    "fastgen_token_budget_fill_ratio",
    Histogram,
    "Tokens in a forward pass over the token budget.",
    buckets=FILL_BUCKETS,
)
FORWARD_TIME = _replica(
    "fastgen_forward_seconds", Histogram, "Model forward and sampling of one engine step.", buckets=LATENCY_BUCKETS
)
STEP_TIME = _replica(
    "fastgen_step_seconds",
    Histogram,
    "One engine step, scheduling and detokenization included.",
    buckets=LATENCY_BUCKETS,
)
# The slo scheduler (replica/slo_scheduler.py): its step-time model against the measured fastgen_step_seconds, the
# time it allowed each step, and where the streams stand against their deadlines. No series move under the others.
STEP_PREDICTED = _replica(
    "fastgen_step_predicted_seconds",
    Histogram,
    "The slo scheduler's step-time model: its prediction of each step's time (measured: fastgen_step_seconds).",
    buckets=LATENCY_BUCKETS,
)
STEP_MODEL_ERROR = _replica(
    "fastgen_step_model_error_ratio",
    Histogram,
    "|predicted - measured| / measured time of each step, for the slo scheduler's step-time model.",
    buckets=ERROR_BUCKETS,
)
STEP_MODEL_DRIFT = _replica(
    "fastgen_step_model_drift_ratio",
    Gauge,
    "The slo scheduler's step-time model: how much longer than its fit the latest steps took (1: on the fit); its "
    "predictions are the fit times this. Away from 1 for long, the device's speed has changed.",
)
STEP_TIME_BUDGET = _replica(
    "fastgen_step_time_budget_seconds",
    Histogram,
    "The time the slo scheduler allowed each step: the least slack of the streams it serves (steps that serve none "
    "are not counted).",
    buckets=LATENCY_BUCKETS,
)
SLO_PAST_DEADLINE = _replica(
    "fastgen_slo_requests_past_deadline",
    Gauge,
    "Requests waiting for a first token they can no longer get by their deadline (slo scheduler): they yield to the "
    "others.",
)
SLO_BEHIND = _replica(
    "fastgen_slo_streams_behind",
    Gauge,
    "Streams whose inter-token moving average went past their token-rate floor (slo scheduler).",
)
SLO_OVERLOADED = _replica(
    "fastgen_slo_overloaded",
    Gauge,
    "1 while even a decode-only step is predicted to break a token-rate floor (slo scheduler), else 0.",
)
SLO_OVERLOADED_STEPS = _replica(
    "fastgen_slo_overloaded_steps_total", Counter, "Steps the slo scheduler ran overloaded."
)
SLO_SHED = _replica(
    "fastgen_slo_shed_requests_total",
    Counter,
    "Requests refused with RESOURCE_EXHAUSTED because the replica was overloaded (--admission refuse).",
)
SLA_REQUESTS = _replica(
    "fastgen_sla_requests_total",
    Counter,
    "Finished requests (not cancelled) scored against the SLA: first token within prompt_tokens / prompt_rate s, "
    "every span-16 moving average of inter-token time at most 1 / token_rate s.",
    ("prompt_rate", "token_rate", "result"),
)

# Balancer process.
BALANCER_REQUESTS = MetricDef(
    "fastgen_balancer_requests_total",
    Counter,
    "RPCs the balancer answered, by method and status code.",
    ("method", "code"),
)
BALANCER_REPLICA_REQUESTS = MetricDef(
    "fastgen_balancer_replica_requests_total",
    Counter,
    "Upstream calls to each replica by status code.",
    ("replica", "code"),
)
BALANCER_IN_FLIGHT = MetricDef(
    "fastgen_balancer_in_flight_requests", Gauge, "Requests the balancer has in flight on each replica.", ("replica",)
)
BALANCER_REPLICA_HEALTHY = MetricDef(
    "fastgen_balancer_replica_healthy", Gauge, "1 when the replica passes health checks, else 0.", ("replica",)
)
BALANCER_RETRIES = MetricDef(
    "fastgen_balancer_retries_total",
    Counter,
    "Requests retried on another replica, by the failed replica.",
    ("replica", "code"),
)
BALANCER_ROUTING = MetricDef(
    "fastgen_balancer_routing_decisions_total", Counter, "Replica picks by routing policy.", ("policy", "replica")
)
# prefix_aware routing: hit / query tokens is the share of prompt tokens the balancer sent where it believed them
# cached (the replicas' fastgen_prefix_cache_hits_total says how many were).
BALANCER_PREFIX_QUERY_TOKENS = MetricDef(
    "fastgen_balancer_prefix_query_tokens_total",
    Counter,
    "Prompt tokens of requests routed by prefix_aware, by the replica chosen.",
    ("replica",),
)
BALANCER_PREFIX_HIT_TOKENS = MetricDef(
    "fastgen_balancer_prefix_hit_tokens_total",
    Counter,
    "Of those, tokens the balancer believed cached on the replica it chose.",
    ("replica",),
)
BALANCER_CACHE_WATCH_LIVE = MetricDef(
    "fastgen_balancer_cache_watch_live",
    Gauge,
    "1 while the replica's prefix-cache event stream is in sync (prefix_aware routing), else 0.",
    ("replica",),
)
BALANCER_CACHED_BLOCKS = MetricDef(
    "fastgen_balancer_replica_cached_blocks",
    Gauge,
    "Cached KV blocks the balancer knows the replica holds, from its event stream.",
    ("replica",),
)
# Stream migration: a request whose replica failed after output was sent, resumed on another replica.
MIGRATION_CAUSES = ("unavailable", "unhealthy")  # the call failed UNAVAILABLE; the replica left health mid-call
MIGRATION_REFUSALS = ("limit", "length", "no_replica")
BALANCER_MIGRATIONS = MetricDef(
    "fastgen_balancer_migrations_total",
    Counter,
    "Requests moved to another replica after their replica failed mid-request, by the failed replica and the cause "
    "(unavailable: the call broke; unhealthy: the replica left health while the call waited).",
    ("replica", "cause"),
)
BALANCER_MIGRATIONS_REFUSED = MetricDef(
    "fastgen_balancer_migrations_refused_total",
    Counter,
    "Requests failed after output instead of resuming, by reason (limit: --migration-limit reached; length: more "
    "output than --migration-max-len; no_replica: no healthy replica to resume on).",
    ("reason",),
)
BALANCER_RESUMED_TOKENS = MetricDef(
    "fastgen_balancer_resumed_tokens_total",
    Counter,
    "Delivered tokens sent again as context to the replica that resumes a request (recomputed there).",
)
BALANCER_MIGRATION_TIME = MetricDef(
    "fastgen_balancer_migration_seconds",
    Histogram,
    "Failure of a request's replica to the first new token from the replica that resumed it (re-prefill of the "
    "prompt and the delivered tokens included).",
    (),
    LATENCY_BUCKETS,
)
# Membership (balancer/discovery.py): static --replica flags, a watched file, or a DNS name re-resolved.
DISCOVERY_SOURCES = ("static", "file", "dns")
BALANCER_DISCOVERED_REPLICAS = MetricDef(
    "fastgen_balancer_discovered_replicas",
    Gauge,
    "Replicas the balancer balances over, by where it learned of them (static: --replica; file: --replicas-file; "
    "dns: --replicas-dns); healthy or not.",
    ("source",),
)
BALANCER_DISCOVERY_ERRORS = MetricDef(
    "fastgen_balancer_discovery_errors_total",
    Counter,
    "Lookups of the replicas that failed (the DNS server did not answer, the file could not be read or parsed); "
    "membership stays as it was.",
    ("source",),
)

# The balancer's OpenAI-compatible HTTP API (when --http-port is set). Unknown paths are one route, "other".
HTTP_REQUESTS = MetricDef(
    "fastgen_http_requests_total",
    Counter,
    "HTTP requests the OpenAI-compatible API answered, by route and status (499: the client disconnected first).",
    ("route", "status"),
)
HTTP_LATENCY = MetricDef(
    "fastgen_http_request_duration_seconds",
    Histogram,
    "Arrival of an HTTP request to the end of its response (a stream's last event included), by route.",
    ("route",),
    REQUEST_LATENCY_BUCKETS,
)

# Every process.
BUILD_INFO = MetricDef(
    "fastgen_build_info",
    Gauge,
    "Always 1; the labels say what the process runs (empty where it does not apply).",
    ("version", "role", "replica", "model", "dtype", "tp"),
)

REPLICA_METRICS = (
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_LATENCY,
    QUEUE_TIME,
    PROMPT_TOKENS,
    GENERATED_TOKENS,
    REQUESTS_FINISHED,
    REQUESTS,
    QUEUE_LENGTH,
    RUNNING_SEQUENCES,
    KV_BLOCKS_USED,
    KV_BLOCKS_TOTAL,
    KV_USAGE,
    PREEMPTIONS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_BLOCKS,
    PREFIX_CACHE_EVICTIONS,
    SPEC_DRAFTS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    SPEC_ACCEPTED_PER_POS,
    TOKENS_PER_FORWARD,
    BUDGET_FILL,
    FORWARD_TIME,
    STEP_TIME,
    STEP_PREDICTED,
    STEP_MODEL_ERROR,
    STEP_MODEL_DRIFT,
    STEP_TIME_BUDGET,
    SLO_PAST_DEADLINE,
    SLO_BEHIND,
    SLO_OVERLOADED,
    SLO_OVERLOADED_STEPS,
    SLO_SHED,
    SLA_REQUESTS,
)
BALANCER_METRICS = (
    BALANCER_REQUESTS,
    BALANCER_REPLICA_REQUESTS,
    BALANCER_IN_FLIGHT,
    BALANCER_REPLICA_HEALTHY,
    BALANCER_RETRIES,
    BALANCER_ROUTING,
    BALANCER_PREFIX_QUERY_TOKENS,
    BALANCER_PREFIX_HIT_TOKENS,
    BALANCER_CACHE_WATCH_LIVE,
    BALANCER_CACHED_BLOCKS,
    BALANCER_MIGRATIONS,
    BALANCER_MIGRATIONS_REFUSED,
    BALANCER_RESUMED_TOKENS,
    BALANCER_MIGRATION_TIME,
    BALANCER_DISCOVERED_REPLICAS,
    BALANCER_DISCOVERY_ERRORS,
)
HTTP_METRICS = (HTTP_REQUESTS, HTTP_LATENCY)
ALL_METRICS = REPLICA_METRICS + BALANCER_METRICS + HTTP_METRICS + (BUILD_INFO,)


def register(registry: CollectorRegistry, defs: tuple[MetricDef, ...]) -> dict[MetricDef, Any]:
    """Creates each metric of `defs` on `registry`; returns them keyed by their definition (each of the type its
    `kind` says, a Counter, Gauge or Histogram, hence Any)."""
    made = {}
    for d in defs:
        kwargs = {"buckets": d.buckets} if d.buckets is not None else {}
        made[d] = d.kind(d.name, d.help, labelnames=d.labels, registry=registry, **kwargs)
    return made


def code_name(code: grpc.StatusCode) -> str:
    return code.name  # "OK", "INVALID_ARGUMENT", ...


@dataclass(frozen=True)
class BuildInfo:
    role: str  # "replica" | "balancer"
    replica: str = ""
    model: str = ""
    dtype: str = ""  # as resolved, e.g. "bfloat16", never "auto"
    tp: int | None = None
    version: str = __version__


def record_build_info(registry: CollectorRegistry, info: BuildInfo) -> None:
    """Exports fastgen_build_info{...} = 1. Nothing in it changes from one start of a process to the next (no pid,
    no start time), so a restarted process continues the same series."""
    gauge = register(registry, (BUILD_INFO,))[BUILD_INFO]
    gauge.labels(
        version=info.version,
        role=info.role,
        replica=info.replica,
        model=info.model,
        dtype=info.dtype,
        tp="" if info.tp is None else str(info.tp),
    ).set(1)


# ---- What the recorders read: duck types of the engine's StepStats and RequestOutput. ----
class StepStatsLike(Protocol):
    num_seqs: int
    num_decode_tokens: int
    num_prefill_tokens: int
    token_budget: int
    num_preempted: int
    forward_s: float
    step_s: float
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_evictions: int
    prefix_cache_blocks: int
    plan: PlanLike | None
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_pos: tuple[int, ...]

    @property
    def num_tokens(self) -> int: ...


class PlanLike(Protocol):
    predicted_s: float
    drift: float
    budget_s: float
    overloaded: bool
    past_deadline: int
    behind: int


class TimingsLike(Protocol):
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None


class OutputLike(Protocol):
    request_id: str
    new_token_ids: list[int]
    finish_reason: object  # an enum whose .value is "length"/"stop"/"eos"/"cancelled", or None
    prompt_tokens: int
    generated_tokens: int
    time: float
    timings: TimingsLike
    index: int  # which of the request's n completions (its prompt was prefilled once, for index 0)

    @property
    def finished(self) -> bool: ...


class ReplicaMetrics:
    """Turns a replica's engine steps, request outputs and RPC results into metrics, and scores every finished
    request against the SLA (one result per token rate of `sla`).

    `on_step` and `on_output` are meant to be called from the one engine thread; prometheus_client's metrics
    themselves are thread safe, so `on_rpc` may be called from the gRPC handlers."""

    def __init__(self, registry: CollectorRegistry, replica_id: str, model: str, sla: SlaConfig = SlaConfig()):
        self._replica_labels = {"replica": replica_id, "model": model}
        self._sla = sla
        metrics = register(registry, REPLICA_METRICS)
        # Bind the constant labels once; per-event label values (reason, code) are bound when they occur.
        self._bound = {d: m.labels(**self._replica_labels) for d, m in metrics.items() if d.labels == REPLICA_LABELS}
        self._by_reason = metrics[REQUESTS_FINISHED]
        self._by_code = metrics[REQUESTS]
        self._by_position = metrics[SPEC_ACCEPTED_PER_POS]
        for reason in FINISH_REASONS:
            self._by_reason.labels(**self._replica_labels, reason=reason)
        for method in REPLICA_METHODS:
            for code in EXPECTED_CODES:
                self._by_code.labels(**self._replica_labels, method=method, code=code)
        # (token rate, met?) -> its counter, every one present at 0 from the start for the same reason.
        self._sla_counters = {
            (rate, met): metrics[SLA_REQUESTS].labels(
                **self._replica_labels,
                prompt_rate=rate_label(sla.prompt_rate),
                token_rate=rate_label(rate),
                result="met" if met else "missed",
            )
            for rate in sla.token_rates
            for met in (True, False)
        }
        # request_id -> arrival times (time.monotonic()) of its tokens; present from its first token to its finish.
        self._token_times: dict[str, list[float]] = {}

    def on_step(self, stats: StepStatsLike) -> None:
        m = self._bound
        m[QUEUE_LENGTH].set(stats.num_waiting)
        m[RUNNING_SEQUENCES].set(stats.num_running)
        m[KV_BLOCKS_USED].set(stats.kv_blocks_used)
        m[KV_BLOCKS_TOTAL].set(stats.kv_blocks_total)
        m[KV_USAGE].set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        if stats.num_preempted:
            m[PREEMPTIONS].inc(stats.num_preempted)
        self._record_prefix_cache(stats)
        if stats.spec_drafts:
            self._record_speculation(stats)
        if stats.num_tokens:
            m[TOKENS_PER_FORWARD].observe(stats.num_tokens)
            if stats.token_budget:
                m[BUDGET_FILL].observe(stats.num_tokens / stats.token_budget)
            m[FORWARD_TIME].observe(stats.forward_s)
            m[STEP_TIME].observe(stats.step_s)
        if stats.plan is not None:
            self._record_plan(stats.plan, stats.step_s)

    def _record_plan(self, plan: PlanLike, step_s: float) -> None:
        m = self._bound
        if plan.predicted_s == plan.predicted_s:  # not nan: the model predicts
            m[STEP_PREDICTED].observe(plan.predicted_s)
            if step_s > 0:
                m[STEP_MODEL_ERROR].observe(abs(plan.predicted_s - step_s) / step_s)
            m[STEP_MODEL_DRIFT].set(plan.drift)
        if plan.budget_s < float("inf"):
            m[STEP_TIME_BUDGET].observe(max(0.0, plan.budget_s))
        m[SLO_PAST_DEADLINE].set(plan.past_deadline)
        m[SLO_BEHIND].set(plan.behind)
        m[SLO_OVERLOADED].set(1 if plan.overloaded else 0)
        if plan.overloaded:
            m[SLO_OVERLOADED_STEPS].inc()

    def on_shed(self) -> None:
        """A request was refused because the replica was overloaded (the slo scheduler's --admission refuse)."""
        self._bound[SLO_SHED].inc()

    def _record_speculation(self, stats: StepStatsLike) -> None:
        m = self._bound
        m[SPEC_DRAFTS].inc(stats.spec_drafts)
        m[SPEC_DRAFT_TOKENS].inc(stats.spec_draft_tokens)
        m[SPEC_ACCEPTED_TOKENS].inc(stats.spec_accepted_tokens)
        for position, n in enumerate(stats.spec_accepted_per_pos):
            self._by_position.labels(**self._replica_labels, position=str(position)).inc(n)

    def _record_prefix_cache(self, stats: StepStatsLike) -> None:
        m = self._bound
        m[PREFIX_CACHE_BLOCKS].set(stats.prefix_cache_blocks)
        for metric, n in (
            (PREFIX_CACHE_QUERIES, stats.prefix_cache_queries),
            (PREFIX_CACHE_HITS, stats.prefix_cache_hits),
            (PREFIX_CACHE_EVICTIONS, stats.prefix_cache_evictions),
        ):
            if n:
                m[metric].inc(n)

    def on_output(self, out: OutputLike) -> None:
        if out.new_token_ids:
            self._record_tokens(out)
        if out.finished:
            self._record_finish(out)

    def on_rpc(self, method: str, code: grpc.StatusCode) -> None:
        self._by_code.labels(**self._replica_labels, method=method, code=code_name(code)).inc()

    def _record_tokens(self, out: OutputLike) -> None:
        m = self._bound
        n = len(out.new_token_ids)
        m[GENERATED_TOKENS].inc(n)
        times = self._token_times.get(out.request_id)
        if times is None:
            first = out.timings.first_token if out.timings.first_token is not None else out.time
            m[TIME_TO_FIRST_TOKEN].observe(max(0.0, first - out.timings.arrival))
            self._count_prompt(out)
            times = self._token_times[out.request_id] = [first]
            n -= 1  # the first token has no predecessor to measure from
        # Tokens that arrive together share the gap evenly, so the histogram counts every token once.
        if n > 0:
            gap = max(0.0, out.time - times[-1]) / n
            for _ in range(n):
                m[INTER_TOKEN_LATENCY].observe(gap)
        # A client sees the tokens of one output together, so the SLA scores them at the output's time.
        times.extend([out.time] * n)

    def _record_finish(self, out: OutputLike) -> None:
        m = self._bound
        times = self._token_times.pop(out.request_id, None)
        if times is None:
            self._count_prompt(out)  # finished without a token (cancelled): count its prompt now
        t = out.timings
        finished = t.finished if t.finished is not None else out.time
        m[E2E_LATENCY].observe(max(0.0, finished - t.arrival))
        if t.first_scheduled is not None:
            m[QUEUE_TIME].observe(max(0.0, t.first_scheduled - t.arrival))
        reason = str(getattr(out.finish_reason, "value", out.finish_reason))
        self._by_reason.labels(**self._replica_labels, reason=reason).inc()
        if reason != "cancelled":  # the client gave up: neither a success nor the server's miss
            self._score(out, times or [])

    def _count_prompt(self, out: OutputLike) -> None:
        # The n completions of one request share one prompt; counting it per completion would claim n prefills.
        if out.index == 0:
            self._bound[PROMPT_TOKENS].inc(out.prompt_tokens)

    def _score(self, out: OutputLike, times: list[float]) -> None:
        ttft = max(0.0, times[0] - out.timings.arrival) if times else None
        for rate in self._sla.token_rates:
            met = meets_sla(out.prompt_tokens, ttft, times, self._sla.prompt_rate, rate)
            self._sla_counters[rate, met].inc()


class BalancerMetrics:
    """The balancer's view: calls per replica, in flight, health, retries and routing decisions.

    Every series whose labels are known at start (the replicas, the routing policy, the codes the balancer retries
    on) is exported from the first scrape: counters at 0, replicas unhealthy until their first health check."""

    def __init__(
        self,
        registry: CollectorRegistry,
        replicas: tuple[str, ...] = (),
        policy: str | None = None,
        retry_codes: tuple[grpc.StatusCode, ...] = (),
    ):
        self._m = m = register(registry, BALANCER_METRICS)
        self._policy, self._retry_codes = policy, retry_codes
        for method in BALANCER_METHODS:
            for code in EXPECTED_CODES:
                m[BALANCER_REQUESTS].labels(method=method, code=code)
        for reason in MIGRATION_REFUSALS:
            m[BALANCER_MIGRATIONS_REFUSED].labels(reason=reason)
        for source in DISCOVERY_SOURCES:
            m[BALANCER_DISCOVERED_REPLICAS].labels(source=source).set(0)
            m[BALANCER_DISCOVERY_ERRORS].labels(source=source)
        for replica in replicas:
            self.add_replica(replica)

    def _replica_series(self, replica: str) -> list[tuple[MetricDef, dict[str, str]]]:
        """Every series of `replica` whose labels are known in advance."""
        series = [(BALANCER_REPLICA_REQUESTS, {"code": code}) for code in EXPECTED_CODES]
        series += [(BALANCER_RETRIES, {"code": code_name(code)}) for code in self._retry_codes]
        series += [(BALANCER_MIGRATIONS, {"cause": cause}) for cause in MIGRATION_CAUSES]
        series += [(BALANCER_ROUTING, {"policy": self._policy})] if self._policy is not None else []
        series += [(d, {}) for d in (BALANCER_IN_FLIGHT, BALANCER_REPLICA_HEALTHY, BALANCER_CACHE_WATCH_LIVE)]
        series += [(d, {}) for d in (BALANCER_CACHED_BLOCKS, BALANCER_PREFIX_QUERY_TOKENS, BALANCER_PREFIX_HIT_TOKENS)]
        return [(d, {"replica": replica, **labels}) for d, labels in series]

    def add_replica(self, replica: str) -> None:
        """Exports the replica's series from now on: counters at 0, gauges at 0 (unhealthy until checked)."""
        for d, labels in self._replica_series(replica):
            self._m[d].labels(**labels)

    def remove_replica(self, replica: str) -> None:
        """Drops the series of a replica that left the pool, so that replicas coming and going (pods rescheduled
        under new addresses) do not grow the exposition without bound. Series of codes first seen later stay."""
        for d, labels in self._replica_series(replica):
            with contextlib.suppress(KeyError):
                self._m[d].remove(*(labels[name] for name in d.labels))

    def set_discovered(self, source: str, count: int) -> None:
        self._m[BALANCER_DISCOVERED_REPLICAS].labels(source=source).set(count)

    def on_discovery_error(self, source: str) -> None:
        self._m[BALANCER_DISCOVERY_ERRORS].labels(source=source).inc()

    def on_rpc(self, method: str, code: grpc.StatusCode) -> None:
        """A client-facing RPC finished with `code`."""
        self._m[BALANCER_REQUESTS].labels(method=method, code=code_name(code)).inc()

    def on_replica_call(self, replica: str, code: grpc.StatusCode) -> None:
        """An upstream call to `replica` finished with `code`."""
        self._m[BALANCER_REPLICA_REQUESTS].labels(replica=replica, code=code_name(code)).inc()

    def set_in_flight(self, replica: str, n: int) -> None:
        self._m[BALANCER_IN_FLIGHT].labels(replica=replica).set(n)

    def set_healthy(self, replica: str, healthy: bool) -> None:
        self._m[BALANCER_REPLICA_HEALTHY].labels(replica=replica).set(1 if healthy else 0)

    def on_retry(self, failed_replica: str, code: grpc.StatusCode) -> None:
        self._m[BALANCER_RETRIES].labels(replica=failed_replica, code=code_name(code)).inc()

    def on_route(self, policy: str, replica: str) -> None:
        self._m[BALANCER_ROUTING].labels(policy=policy, replica=replica).inc()

    def on_prefix_route(self, replica: str, prompt_tokens: int, cached_tokens: int) -> None:
        """prefix_aware sent a prompt of prompt_tokens to `replica`, believing cached_tokens of it cached there."""
        self._m[BALANCER_PREFIX_QUERY_TOKENS].labels(replica=replica).inc(prompt_tokens)
        if cached_tokens:
            self._m[BALANCER_PREFIX_HIT_TOKENS].labels(replica=replica).inc(cached_tokens)

    def set_cache_view(self, replica: str, live: bool, blocks: int) -> None:
        self._m[BALANCER_CACHE_WATCH_LIVE].labels(replica=replica).set(1 if live else 0)
        self._m[BALANCER_CACHED_BLOCKS].labels(replica=replica).set(blocks)

    def on_migration(self, failed_replica: str, cause: str, resumed_tokens: int) -> None:
        """A request left `failed_replica` for another, re-sending `resumed_tokens` delivered tokens."""
        self._m[BALANCER_MIGRATIONS].labels(replica=failed_replica, cause=cause).inc()
        self._m[BALANCER_RESUMED_TOKENS].inc(resumed_tokens)

    def on_migration_refused(self, reason: str) -> None:
        self._m[BALANCER_MIGRATIONS_REFUSED].labels(reason=reason).inc()

    def on_resumed(self, seconds: float) -> None:
        """The first new token of a resumed request arrived `seconds` after its replica failed."""
        self._m[BALANCER_MIGRATION_TIME].observe(seconds)


class HttpMetrics:
    """The HTTP API's requests by route and status, and its latency by route. The generation routes' expected
    statuses and every route's histogram are exported from the first scrape."""

    def __init__(self, registry: CollectorRegistry):
        self._m = m = register(registry, HTTP_METRICS)
        for route in HTTP_ROUTES:
            m[HTTP_LATENCY].labels(route=route)
            for status in HTTP_EXPECTED_STATUSES if route in HTTP_GENERATION_ROUTES else ("200",):
                m[HTTP_REQUESTS].labels(route=route, status=status)

    def on_request(self, route: str, status: int, seconds: float) -> None:
        """A request to `route` ("other" for unknown paths) was answered with `status` after `seconds`."""
        self._m[HTTP_REQUESTS].labels(route=route, status=str(status)).inc()
        self._m[HTTP_LATENCY].labels(route=route).observe(seconds)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serves `registry` at http://host:port/metrics on a daemon thread; port 0 picks a free port. Returns the
    bound port."""
    try:
        httpd, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise PortInUseError(f"cannot serve metrics on {host}:{port} ({e}): is the port in use? choose another") from e
    return httpd.server_port
