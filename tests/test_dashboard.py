"""The Grafana dashboard and the Prometheus wiring, without running either: the committed JSON is what the code
generates, every query uses only defined metrics and is templated, the scrape targets are stable."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess

import yaml

from fastgen.launch import cli, prometheus, state
from fastgen.launch.config import DeployConfig
from fastgen.launch.grafana import DASHBOARD_JSON
from fastgen.server.metrics import ALL_METRICS

from .helpers import require_tool

SUFFIXES = {"Histogram": ("_bucket", "_sum", "_count"), "Counter": ("",), "Gauge": ("",)}


def dashboard() -> dict:
    return json.loads(DASHBOARD_JSON.read_text())


def queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel."""
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def test_committed_dashboard_is_what_the_code_generates():
    require_tool(
        importlib.util.find_spec("grafana_foundation_sdk"),
        'grafana-foundation-sdk not installed: pip install -e ".[test]"',
    )
    from fastgen.launch.grafana.dashboard import render

    assert DASHBOARD_JSON.read_text() == render(), "stale dashboard: run python -m fastgen.launch.grafana"


def test_queries_use_only_defined_metrics_and_are_templated():
    known = {d.name + s for d in ALL_METRICS for s in SUFFIXES[d.kind.__name__]} | {"up"}
    for title, expr in queries(dashboard()):
        used = set(re.findall(r"\b(fastgen_\w+|up)\{", expr))
        assert used and used <= known, (title, used - known)
        assert expr.count("{") == expr.count('deployment=~"$deployment"'), (title, expr)


def test_the_dashboard_shows_what_operators_act_on():
    board = dashboard()
    titles = {p["title"] for p in board["panels"]}
    assert {
        "Request rate",
        "Effective throughput",
        "SLA attainment",
        "Time to first token",
        "Inter-token latency",
        "End-to-end latency",
        "Tokens per second",
        "Queued requests",
        "Running sequences",
        "KV cache usage",
        "Preemptions",
        "Prefix cache hit rate",
        "Prefix cache blocks and evictions",
        "Token-budget fill",
        "Traffic per replica",
        "Replica health",
        "Replica membership",
        "Retries",
        "Routed to a cached prefix",
        "Cache event streams",
        "HTTP requests",
        "HTTP latency",
    } <= titles
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "deployment", "replica", "token_rate"]
    exprs = " ".join(e for _, e in queries(board))
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(fastgen_inter_token_latency_seconds_bucket" in exprs


def test_targets_are_fixed_ports_labelled_with_the_deployment():
    c = DeployConfig(name="prod", replicas=2, metrics_port=9100, host="0.0.0.0")
    assert prometheus.targets(c) == [
        {"targets": ["127.0.0.1:9100", "127.0.0.1:9101", "127.0.0.1:9102"], "labels": {"deployment": "prod"}}
    ]
    assert prometheus.targets(c) == prometheus.targets(DeployConfig(**json.loads(json.dumps(c.__dict__))))


def test_scrape_config_reads_every_deployments_targets(tmp_path):
    config = yaml.safe_load(prometheus.scrape_config(tmp_path, scrape_interval="1s"))
    (job,) = config["scrape_configs"]
    assert job["scrape_interval"] == "1s"
    assert job["file_sd_configs"][0]["files"] == [str(tmp_path / "_prometheus" / "*.json")]
    one = yaml.safe_load(prometheus.scrape_config(tmp_path, name="prod"))
    assert one["scrape_configs"][0]["file_sd_configs"][0]["files"] == [str(tmp_path / "_prometheus" / "prod.json")]


def test_promtool_accepts_the_scrape_config_and_targets(tmp_path):
    require_tool(shutil.which("promtool"), "promtool not installed (Debian package prometheus)")
    paths = state.paths_for(tmp_path, "prod")
    state.write_json_atomic(paths.prometheus_targets, prometheus.targets(DeployConfig(name="prod")))
    (tmp_path / "prometheus.yml").write_text(prometheus.scrape_config(tmp_path))
    done = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_cli_prints_the_config_and_stop_forgets_the_targets(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTGEN_HOME", str(tmp_path))
    assert cli.main(["prometheus-config", "--scrape-interval", "2s"]) == 0
    assert "scrape_interval: 2s" in capsys.readouterr().out
    paths = state.paths_for(tmp_path, "prod")
    state.write_json_atomic(paths.prometheus_targets, prometheus.targets(DeployConfig(name="prod")))
    state.remove_live_state(paths)
    assert not paths.prometheus_targets.exists()


def test_cli_passes_the_sla_through():
    args = cli.build_parser().parse_args(["start", "--sla-prompt-rate", "512", "--sla-token-rate", "2", "4", "6"])
    c = cli.config_from(args)
    assert (c.sla_prompt_rate, c.sla_token_rates) == (512, (2, 4, 6))
    argv = cli.deployment.plan(c, "PY")[1].argv
    assert argv[argv.index("--sla-prompt-rate") :][:6] == [
        "--sla-prompt-rate",
        "512",
        "--sla-token-rate",
        "2",
        "4",
        "6",
    ]


def test_tp_ranks_are_not_targets():
    c = DeployConfig(name="tp", replicas=2, tp=2, metrics_port=9100)
    assert prometheus.targets(c)[0]["targets"] == ["127.0.0.1:9100", "127.0.0.1:9101", "127.0.0.1:9102"]


def test_the_panel_pictures_cover_every_graph_and_fill_every_variable():
    """benchmarks/dashboard.py draws docs/metrics.md's pictures from Prometheus: each graph panel in a row it draws,
    each query sent with every dashboard variable filled in, and each row's picture linked from the page."""
    from fastgen.benchmarks import dashboard as pictures

    board = dashboard()
    drawn = [p["title"] for _, panels in pictures.rows(board) for p in panels]
    graphs = [p["title"] for p in board["panels"] if p["type"] in ("stat", "timeseries")]
    assert drawn == graphs
    variables = {"deployment": "d", "replica": ".*", "token_rate": "2", "__rate_interval": pictures.RATE_WINDOW}
    for title, expr in queries(board):
        assert "$" not in pictures.filled(expr, variables), (title, expr)
    page = (DASHBOARD_JSON.parents[2] / "docs" / "metrics.md").read_text()
    for title, _ in pictures.rows(board):
        assert f"img/dashboard-{pictures.slug(title)}.png" in page, title
    assert pictures.legend("{{replica}} hit", {"replica": "r0"}) == "r0 hit"
