"""The FastGen Grafana dashboard as code (grafana-foundation-sdk). `python -m fastgen.launch.grafana` writes it to
launch/grafana/fastgen.json, the file users import; a test checks that the committed file equals what this builds.

Every query is templated by $deployment (the `deployment` target label of the scrape targets `fastgen-deploy start`
writes) and $replica, and uses only the metric names of fastgen.server.metrics. $token_rate picks the SLA's R.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableOption, VariableRefresh, VariableSort
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

UID = "fastgen"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
REPLICA = 'deployment=~"$deployment", replica=~"$replica"'  # a replica's own metrics
UPSTREAM = REPLICA  # the balancer's per-replica metrics carry the same two labels
DEPLOYMENT = 'deployment=~"$deployment"'
WINDOW = "$__rate_interval"
MET = ', result="met"'
QUANTILES = (0.5, 0.95, 0.99)


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]


@dataclass(frozen=True)
class StatPanel(Panel):
    """A single number (the latest value of each query)."""


@dataclass(frozen=True)
class TablePanel(Panel):
    """The queries' latest values as a table of labels."""


# ---- PromQL helpers ---------------------------------------------------------------------------------------------
def rate(metric: str, selector: str = REPLICA, by: str = "") -> str:
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}(rate({metric}{{{selector}}}[{WINDOW}]))"


def quantiles(histogram: str) -> tuple[Query, ...]:
    """p50/p95/p99 of a histogram over the selected replicas."""
    return tuple(
        Query(f"histogram_quantile({q}, {rate(histogram + '_bucket', by='le')})", f"p{round(q * 100)}")
        for q in QUANTILES
    )


def mean(histogram: str) -> str:
    return f"{rate(histogram + '_sum')} / {rate(histogram + '_count')}"


def sla(extra: str) -> str:
    return f'{REPLICA}, token_rate="$token_rate"{extra}'


# ---- The panels, row by row --------------------------------------------------------------------------------------
SERVICE = (
    StatPanel(
        "Effective throughput",
        "Requests per second that met the SLA at R = $token_rate tokens/s: the paper's effective throughput.",
        "reqps",
        (Query(rate("fastgen_sla_requests_total", sla(MET)), "meets SLA"),),
    ),
    StatPanel(
        "SLA attainment",
        "Fraction of finished requests that met the SLA at R = $token_rate tokens/s.",
        "percentunit",
        (
            Query(
                f"{rate('fastgen_sla_requests_total', sla(MET))} / {rate('fastgen_sla_requests_total', sla(''))}",
                "attainment",
            ),
        ),
    ),
    StatPanel(
        "Request rate",
        "Requests finished per second, all reasons.",
        "reqps",
        (Query(rate("fastgen_requests_finished_total"), "requests"),),
    ),
    Panel(
        "Throughput and effective throughput",
        "Finished requests per second (cancelled ones excluded) and those meeting the SLA, at R = $token_rate.",
        "reqps",
        (
            Query(rate("fastgen_sla_requests_total", sla("")), "throughput"),
            Query(rate("fastgen_sla_requests_total", sla(MET)), "effective throughput"),
        ),
    ),
    Panel(
        "SLA attainment by R",
        "Fraction of requests meeting the SLA, for every generation rate R exported.",
        "percentunit",
        (
            Query(
                f"{rate('fastgen_sla_requests_total', REPLICA + MET, 'token_rate')} / "
                f"{rate('fastgen_sla_requests_total', REPLICA, 'token_rate')}",
                "R = {{token_rate}} tokens/s",
            ),
        ),
    ),
    Panel(
        "Requests by finish reason",
        "Finished requests per second by finish reason.",
        "reqps",
        (Query(rate("fastgen_requests_finished_total", by="reason"), "{{reason}}"),),
    ),
    Panel(
        "Requests by gRPC status",
        "RPCs per second answered by the balancer and by the replicas, by status code.",
        "reqps",
        (
            Query(rate("fastgen_balancer_requests_total", DEPLOYMENT, "code"), "balancer {{code}}"),
            Query(rate("fastgen_requests_total", by="code"), "replicas {{code}}"),
        ),
    ),
)

LATENCY = (
    Panel(
        "Time to first token",
        "Arrival at the replica to first generated token.",
        "s",
        quantiles("fastgen_time_to_first_token_seconds"),
    ),
    Panel(
        "Inter-token latency",
        "Time between consecutive tokens of a request.",
        "s",
        quantiles("fastgen_inter_token_latency_seconds"),
    ),
    Panel(
        "End-to-end latency",
        "Arrival at the replica to the request's last token.",
        "s",
        quantiles("fastgen_e2e_request_latency_seconds"),
    ),
    Panel(
        "Queue time",
        "Arrival to the first forward pass that includes the request.",
        "s",
        quantiles("fastgen_request_queue_time_seconds"),
    ),
)

ENGINE = (
    Panel(
        "Tokens per second",
        "Generated tokens and admitted prompt tokens per second.",
        "short",
        (
            Query(rate("fastgen_generated_tokens_total"), "generated"),
            Query(rate("fastgen_prompt_tokens_total"), "prompt"),
        ),
    ),
    Panel(
        "Queued requests",
        "Requests waiting for their first forward pass.",
        "short",
        (Query(f"sum by (replica) (fastgen_queue_length{{{REPLICA}}})", "{{replica}}"),),
    ),
    Panel(
        "Running sequences",
        "Sequences being prefilled or decoded.",
        "short",
        (Query(f"sum by (replica) (fastgen_running_sequences{{{REPLICA}}})", "{{replica}}"),),
    ),
    Panel(
        "KV cache usage",
        "Fraction of the KV block pool in use.",
        "percentunit",
        (Query(f"max by (replica) (fastgen_kv_cache_usage_ratio{{{REPLICA}}})", "{{replica}}"),),
    ),
    Panel(
        "Preemptions",
        "Sequences preempted per second for lack of KV blocks (recomputed later).",
        "short",
        (Query(rate("fastgen_preemptions_total", by="replica"), "{{replica}}"),),
    ),
    Panel(
        "Prefix cache hit rate",
        "Share of the prompt tokens of admitted sequences found in the prefix cache, so not prefilled.",
        "percentunit",
        (
            Query(
                f"{rate('fastgen_prefix_cache_hits_total', by='replica')} / "
                f"{rate('fastgen_prefix_cache_queries_total', by='replica')}",
                "{{replica}}",
            ),
        ),
    ),
    Panel(
        "Prefix cache blocks and evictions",
        "KV blocks holding cached prefixes, and cached blocks evicted per second when the pool ran short.",
        "short",
        (
            Query(f"sum by (replica) (fastgen_prefix_cache_blocks{{{REPLICA}}})", "{{replica}} cached"),
            Query(rate("fastgen_prefix_cache_evictions_total", by="replica"), "{{replica}} evicted/s"),
        ),
    ),
    Panel(
        "Speculative decoding acceptance",
        "Share of proposed tokens accepted (each one a token without a forward pass of its own), and per proposal "
        "position the share of verified decodes that accepted it. Empty without --speculative-config.",
        "percentunit",
        (
            Query(
                f"{rate('fastgen_spec_decode_num_accepted_tokens_total', by='replica')} / "
                f"{rate('fastgen_spec_decode_num_draft_tokens_total', by='replica')}",
                "{{replica}}",
            ),
            Query(
                f"{rate('fastgen_spec_decode_num_accepted_tokens_per_pos_total', by='position')} / ignoring(position) "
                f"group_left {rate('fastgen_spec_decode_num_drafts_total')}",
                "position {{position}}",
            ),
        ),
    ),
    Panel(
        "Token-budget fill",
        "Tokens in a forward pass over the token budget: how tightly Dynamic SplitFuse packs the batch (1 = full).",
        "percentunit",
        (
            Query(mean("fastgen_token_budget_fill_ratio"), "mean"),
            Query(f"histogram_quantile(0.5, {rate('fastgen_token_budget_fill_ratio_bucket', by='le')})", "p50"),
        ),
    ),
    Panel(
        "Tokens per forward pass",
        "Prefill and decode tokens in one forward pass.",
        "short",
        (
            Query(mean("fastgen_tokens_per_forward"), "mean"),
            Query(f"histogram_quantile(0.95, {rate('fastgen_tokens_per_forward_bucket', by='le')})", "p95"),
        ),
    ),
    Panel(
        "Forward-pass time", "Model forward and sampling of one engine step.", "s", quantiles("fastgen_forward_seconds")
    ),
    Panel(
        "Step time: predicted and measured (slo)",
        "The slo scheduler's step-time model against the measured step, the time it allowed a step (the least "
        "slack of the streams served), the model's median relative error, and its recent miss (drift: the factor "
        "its fit is scaled by; away from 1 for long, the device's speed changed).",
        "s",
        (
            Query(f"histogram_quantile(0.5, {rate('fastgen_step_seconds_bucket', by='le')})", "measured p50"),
            Query(
                f"histogram_quantile(0.5, {rate('fastgen_step_predicted_seconds_bucket', by='le')})", "predicted p50"
            ),
            Query(
                f"histogram_quantile(0.5, {rate('fastgen_step_time_budget_seconds_bucket', by='le')})", "allowed p50"
            ),
            Query(f"histogram_quantile(0.5, {rate('fastgen_step_model_error_ratio_bucket', by='le')})", "error p50"),
            Query(f"max by (replica) (fastgen_step_model_drift_ratio{{{REPLICA}}})", "{{replica}} drift"),
        ),
    ),
    Panel(
        "Deadlines and overload (slo)",
        "Requests that can no longer meet their first-token deadline, streams below their token-rate floor, "
        "whether a replica is overloaded (a decode-only step breaks a floor), and requests it refused for it.",
        "short",
        (
            Query(f"sum by (replica) (fastgen_slo_requests_past_deadline{{{REPLICA}}})", "{{replica}} past deadline"),
            Query(f"sum by (replica) (fastgen_slo_streams_behind{{{REPLICA}}})", "{{replica}} behind"),
            Query(f"max by (replica) (fastgen_slo_overloaded{{{REPLICA}}})", "{{replica}} overloaded"),
            Query(rate("fastgen_slo_shed_requests_total", by="replica"), "{{replica}} refused/s"),
        ),
    ),
)

BALANCER = (
    Panel(
        "Traffic per replica",
        "Calls the balancer sent to each replica per second.",
        "reqps",
        (Query(rate("fastgen_balancer_replica_requests_total", UPSTREAM, "replica"), "{{replica}}"),),
    ),
    Panel(
        "In flight per replica",
        "Requests the balancer has in flight on each replica.",
        "short",
        (Query(f"sum by (replica) (fastgen_balancer_in_flight_requests{{{UPSTREAM}}})", "{{replica}}"),),
    ),
    Panel(
        "Replica health",
        "1 while the balancer's health checks pass for the replica, else 0.",
        "short",
        (Query(f"max by (replica) (fastgen_balancer_replica_healthy{{{UPSTREAM}}})", "{{replica}}"),),
    ),
    Panel(
        "Replica membership",
        "Replicas the balancer balances over, by where it learned of them (--replica, --replicas-file, "
        "--replicas-dns), and failed lookups per second (membership then stays as it was).",
        "short",
        (
            Query(f"sum by (source) (fastgen_balancer_discovered_replicas{{{DEPLOYMENT}}})", "{{source}}"),
            Query(rate("fastgen_balancer_discovery_errors_total", DEPLOYMENT, "source"), "{{source}} errors/s"),
        ),
    ),
    Panel(
        "Scrape targets up",
        "1 while Prometheus can scrape the process's /metrics.",
        "short",
        (Query(f"up{{{DEPLOYMENT}}}", "{{instance}}"),),
    ),
    # `or`: a replica without retries has no retry series yet; show it at 0 rather than "no data".
    Panel(
        "Retries",
        "Requests retried on another replica per second, by the replica that failed.",
        "reqps",
        (
            Query(
                f"{rate('fastgen_balancer_retries_total', UPSTREAM, 'replica')} or "
                f"0 * max by (replica) (fastgen_balancer_replica_healthy{{{UPSTREAM}}})",
                "{{replica}}",
            ),
        ),
    ),
    Panel(
        "Stream migrations",
        "Requests moved to another replica after theirs failed mid-request, per second, by the failed replica and the "
        "cause (unavailable: the call broke; unhealthy: the replica left health while the call waited); and requests "
        "that failed instead, by reason (limit, length, n, no_replica).",
        "reqps",
        (
            Query(rate("fastgen_balancer_migrations_total", UPSTREAM, "replica, cause"), "{{replica}} {{cause}}"),
            Query(rate("fastgen_balancer_migrations_refused_total", DEPLOYMENT, "reason"), "refused: {{reason}}"),
        ),
    ),
    Panel(
        "Migration delay",
        "Failure of a request's replica to the first new token from the replica that resumed it: the re-prefill of "
        "the prompt and the tokens already delivered, and the wait for a healthy replica.",
        "s",
        tuple(
            Query(
                f"histogram_quantile({q}, {rate('fastgen_balancer_migration_seconds_bucket', DEPLOYMENT, 'le')})",
                f"p{round(q * 100)}",
            )
            for q in QUANTILES
        ),
    ),
    Panel(
        "Resumed tokens",
        "Tokens already delivered that the balancer sent again, as context, to the replicas resuming streams.",
        "short",
        (Query(rate("fastgen_balancer_resumed_tokens_total", DEPLOYMENT), "tokens/s"),),
    ),
    Panel(
        "Routing decisions",
        "Replica picks per second, by routing policy.",
        "short",
        (
            Query(
                rate("fastgen_balancer_routing_decisions_total", UPSTREAM, "policy, replica"),
                "{{policy}} → {{replica}}",
            ),
        ),
    ),
    Panel(
        "Routed to a cached prefix",
        "prefix_aware: share of the prompt tokens routed that the balancer believed cached on the replica it chose "
        "(from the replicas' cache events), and each replica's measured hit rate for comparison.",
        "percentunit",
        (
            Query(
                f"{rate('fastgen_balancer_prefix_hit_tokens_total', UPSTREAM, 'replica')} / "
                f"{rate('fastgen_balancer_prefix_query_tokens_total', UPSTREAM, 'replica')}",
                "{{replica}} routed",
            ),
            Query(
                f"{rate('fastgen_prefix_cache_hits_total', by='replica')} / "
                f"{rate('fastgen_prefix_cache_queries_total', by='replica')}",
                "{{replica}} hit",
            ),
        ),
    ),
    Panel(
        "Cache event streams",
        "prefix_aware: 1 while a replica's prefix-cache events reach the balancer in sync (0: routing falls back to "
        "where prompts were sent recently), and the cached blocks the balancer knows of.",
        "short",
        (
            Query(f"max by (replica) (fastgen_balancer_cache_watch_live{{{UPSTREAM}}})", "{{replica}} live"),
            Query(f"max by (replica) (fastgen_balancer_replica_cached_blocks{{{UPSTREAM}}})", "{{replica}} blocks"),
        ),
    ),
)

HTTP_API = (
    Panel(
        "HTTP requests",
        "Requests per second the balancer's OpenAI-compatible API answered, by route and status (499: the client "
        "disconnected first).",
        "reqps",
        (Query(rate("fastgen_http_requests_total", DEPLOYMENT, "route, status"), "{{route}} {{status}}"),),
    ),
    Panel(
        "HTTP latency",
        "Arrival of an HTTP request to the end of its response (a stream's last event included), all routes.",
        "s",
        tuple(
            Query(
                f"histogram_quantile({q}, {rate('fastgen_http_request_duration_seconds_bucket', DEPLOYMENT, 'le')})",
                f"p{round(q * 100)}",
            )
            for q in QUANTILES
        ),
    ),
)

PROCESSES = (
    TablePanel(
        "Processes",
        "fastgen_build_info of every process: version, role, model, dtype, tensor parallelism.",
        "short",
        (Query(f"fastgen_build_info{{{DEPLOYMENT}}}", ""),),
    ),
)

ROWS = (
    ("Service level", SERVICE),
    ("Latency", LATENCY),
    ("Throughput and engine", ENGINE),
    ("Balancer", BALANCER),
    ("OpenAI-compatible HTTP API", HTTP_API),
    ("Processes", PROCESSES),
)


# ---- Building the dashboard ---------------------------------------------------------------------------------------
def target(query: Query, ref: str, instant: bool):
    q = prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(ref)
    return q.instant().format(PromQueryFormat.TABLE) if instant else q.range()


def panel(spec: Panel, panel_id: int):
    if isinstance(spec, TablePanel):
        builder, width, height, instant = table.Panel(), 24, 6, True
    elif isinstance(spec, StatPanel):
        builder, width, height, instant = stat.Panel(), 8, 4, False
    else:
        builder, width, height, instant = timeseries.Panel(), 12, 8, False
    builder.id(panel_id).title(spec.title).description(spec.description).unit(spec.unit).datasource(DATASOURCE)
    builder.span(width).height(height)
    for i, query in enumerate(spec.queries):
        builder.with_target(target(query, chr(ord("A") + i), instant))
    return builder


def variables() -> list:
    def query_variable(name: str, label: str, query: str):
        return (
            dashboard.QueryVariable(name)
            .label(label)
            .query(query)
            .datasource(DATASOURCE)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
        )

    default_rate = VariableOption(text="2", value="2", selected=True)
    return [
        dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        query_variable("deployment", "Deployment", "label_values(fastgen_build_info, deployment)")
        .multi(True)
        .include_all(True)
        .all_value(".*"),
        query_variable(
            "replica", "Replica", 'label_values(fastgen_build_info{deployment=~"$deployment", role="replica"}, replica)'
        )
        .multi(True)
        .include_all(True)
        .all_value(".*"),
        query_variable(
            "token_rate",
            "SLA R (tokens/s)",
            'label_values(fastgen_sla_requests_total{deployment=~"$deployment"}, token_rate)',
        ).current(default_rate),
    ]


def build():
    board = (
        dashboard.Dashboard("FastGen")
        .uid(UID)
        .tags(["fastgen", "llm-serving"])
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .description("FastGen deployments: SLA attainment, latency, engine packing and the load balancer.")
    )
    for v in variables():
        board.with_variable(v)
    next_id = 1
    for title, panels in ROWS:
        board.with_row(dashboard.Row(title).id(next_id))
        next_id += 1
        for spec in panels:
            board.with_panel(panel(spec, next_id))
            next_id += 1
    return board.build()


def render() -> str:
    """The dashboard as the JSON committed in launch/grafana/fastgen.json."""
    return json.dumps(build(), cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
