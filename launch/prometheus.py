"""How Prometheus finds a deployment: a file-based service-discovery targets file per deployment, and the
prometheus.yml snippet that reads them all.

Each process of a deployment serves /metrics on a port fixed by the deployment's settings (config.metrics_ports),
so a process restarted by the supervisor is the same target as before: its counters restart from 0 in the same
series, which rate() and increase() treat as a counter reset, and no stale series of the old process is left to be
summed twice. The `deployment` label is attached here, as a target label, rather than exported by each process.
Pure: no sockets, no processes.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import DeployConfig, address, plan
from .state import paths_for, prometheus_targets_dir

JOB = "fastgen"


def targets(config: DeployConfig) -> list[dict]:
    """The file_sd entries of a deployment: every balancer and replica metrics endpoint, labelled with the
    deployment's name (not `role` or `replica`: the processes export those themselves, and a target label of the
    same name would rename theirs to exported_*)."""
    specs = plan(config, python="python")
    endpoints = [address(config.host, s.metrics_port) for s in specs if s.metrics_port is not None]  # not TP ranks
    return [{"targets": endpoints, "labels": {"deployment": config.name}}]


def scrape_config(home: Path, name: str | None = None, scrape_interval: str = "5s") -> str:
    """A complete prometheus.yml (only scrape_configs) that scrapes every deployment under `home`, or only `name`;
    the targets files appear and vanish with `fastgen-deploy start` and `stop`, and Prometheus follows them."""
    files = str(paths_for(home, name).prometheus_targets if name else prometheus_targets_dir(home) / "*.json")
    return "\n".join(
        [
            f"# FastGen deployments under {home} (targets written by `fastgen-deploy start`, removed by `stop`).",
            "scrape_configs:",
            f"  - job_name: {JOB}",
            f"    scrape_interval: {scrape_interval}",
            "    file_sd_configs:",
            f"      - files: [{json.dumps(files)}]",
            "        refresh_interval: 30s",
            "",
        ]
    )
