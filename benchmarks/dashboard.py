"""The dashboard's panels as PNGs, drawn from a real deployment scraped by a real Prometheus (docs/metrics.md shows
them; no Grafana server can be installed from a package registry, so the panels are drawn here instead).

    python -m fastgen.benchmarks.dashboard --out docs/img

Starts a two-replica deployment of the embedded model with fastgen-deploy and Debian's `prometheus` (scraping every
second with the config `fastgen-deploy prometheus-config` prints), sends a load that rises and falls over gRPC and the
OpenAI API, restarts one replica half-way (so health, retries and migrations have something to show), then evaluates
every query of every panel of the committed dashboard (launch/grafana/fastgen.json) with Prometheus' query_range,
the dashboard's variables filled in as Grafana would, and draws each row of panels in the dashboard's own layout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..launch import deployment
from ..launch.config import DeployConfig
from ..launch.grafana import DASHBOARD_JSON
from ..launch.processes import start
from ..launch.prometheus import scrape_config
from ..server import Client
from .serving import free_base_port

SCRAPE_S = 1
RATE_WINDOW = "15s"  # Grafana's $__rate_interval at a 1 s scrape and a few minutes on screen
NAME = "dashboard"
PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#96d98d")
CORPUS = Path(__file__).parent / "data" / "corpus.txt"


# ---- the deployment under load ------------------------------------------------------------------------------------
def prometheus(home: Path, work: Path, port: int):
    """Prometheus scraping the deployment every second (its Process, ready) and its URL."""
    config = work / "prometheus.yml"
    config.write_text(
        scrape_config(home, NAME, f"{SCRAPE_S}s").replace("refresh_interval: 30s", "refresh_interval: 1s")
    )
    argv = [
        shutil.which("prometheus") or "prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={work / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    url = f"http://127.0.0.1:{port}"
    process = start("prometheus", argv, work / "prometheus.log")
    process.wait_ready(lambda: _ok(f"{url}/-/ready"), timeout=60)
    return process, url


def _ok(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


def load(grpc_address: str, http_url: str, phases: list[tuple[float, int]], stop: threading.Event) -> None:
    """Closed-loop clients, their number changing by phase (seconds, clients): streams over gRPC, one request in four
    a chat completion over the OpenAI API, prompts cut from the corpus at random lengths."""
    words = CORPUS.read_text().split()
    active = [0]

    def client(index: int) -> None:
        rng = random.Random(index)
        with Client(grpc_address, timeout=120) as c:
            while not stop.is_set():
                if index >= active[0]:
                    time.sleep(0.2)
                    continue
                start = rng.randrange(len(words) - 400)
                prompt = " ".join(words[start : start + rng.randrange(30, 300)])
                try:
                    if rng.random() < 0.25:
                        _chat(http_url, prompt, rng.randrange(16, 48))
                    else:
                        for _ in c.stream_chunks(prompt, max_new_tokens=rng.randrange(16, 64), ignore_eos=True):
                            pass
                except Exception as exc:  # a restarted replica's streams migrate; anything else is shown, not fatal
                    print(f"client {index}: {exc}", file=sys.stderr)

    most = max(n for _, n in phases)
    with ThreadPoolExecutor(most) as pool:
        for i in range(most):
            pool.submit(client, i)
        for seconds, clients in phases:
            active[0] = clients
            if stop.wait(seconds):
                break
        stop.set()


def served_model(http_url: str) -> str:
    with urllib.request.urlopen(f"{http_url}/v1/models", timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def _chat(http_url: str, prompt: str, max_tokens: int) -> None:
    messages = [{"role": "user", "content": prompt}]
    body = {"model": served_model(http_url), "messages": messages, "max_tokens": max_tokens}
    request = urllib.request.Request(
        f"{http_url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        resp.read()


def restart_one_replica(home: Path, after_s: float, stop: threading.Event) -> None:
    """SIGKILLs replica 1 after `after_s`: the supervisor restarts it and the balancer migrates its streams."""
    if stop.wait(after_s):
        return
    state = deployment.live_state(home, NAME)
    replica = [p for p in state["processes"] if p.get("role") == "replica" and p.get("pid")][-1]
    os.kill(replica["pid"], signal.SIGKILL)
    print(f"killed {replica.get('id', 'a replica')} at {after_s:.0f} s", file=sys.stderr)


# ---- the panels ---------------------------------------------------------------------------------------------------
def filled(expr: str, variables: dict[str, str]) -> str:
    for name, value in variables.items():
        expr = expr.replace(f"${name}", value)
    return expr


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{query}", timeout=30) as resp:
        body = json.load(resp)
    if body["status"] != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or json.dumps(labels)


def series_of(url: str, panel: dict, variables: dict[str, str], span: tuple[float, float]) -> list[tuple]:
    """(legend, times from the start in s, values) for each series of each of the panel's queries."""
    out = []
    for target in panel.get("targets", []):
        for result in query_range(url, filled(target["expr"], variables), *span, step=2):
            points = [(float(t) - span[0], float(v)) for t, v in result["values"]]
            values = [v for _, v in points]
            out.append((legend(target.get("legendFormat", ""), result["metric"]), [t for t, _ in points], values))
    return out


UNIT_FORMATS = {"percentunit": lambda v: f"{100 * v:.0f}%", "reqps": lambda v: f"{v:.2f} req/s"}


def draw_row(title: str, panels: list[dict], data: list[list[tuple]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = min(p["gridPos"]["y"] for p in panels)
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) - top
    unit_px, title_px = 30, 40  # a grid unit is 30 px tall in Grafana; 24 columns span the width
    fig_h = height * unit_px + title_px
    fig = plt.figure(figsize=(16, fig_h / 80), dpi=80, facecolor="#111217")
    fig.text(0.005, 1 - 12 / fig_h, title, color="#ccccdc", fontsize=13, va="top")
    for panel, series in zip(panels, data):
        g = panel["gridPos"]
        # Room inside each grid cell for the title above and the tick labels left and below.
        left, right = g["x"] / 24 + 0.035, (g["x"] + g["w"]) / 24 - 0.008
        top_y = 1 - (title_px + (g["y"] - top) * unit_px + 22) / fig_h
        bottom_y = 1 - (title_px + (g["y"] - top + g["h"]) * unit_px - 20) / fig_h
        ax = fig.add_axes((left, bottom_y, right - left, top_y - bottom_y), facecolor="#181b1f")
        ax.set_title(panel["title"], color="#ccccdc", fontsize=10, loc="left")
        ax.tick_params(colors="#8e8e8e", labelsize=7)
        for side in ax.spines.values():
            side.set_color("#2c3235")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        if panel["type"] == "stat":
            last = [v[-1] for _, _, v in series if v]
            text = UNIT_FORMATS.get(unit, lambda v: f"{v:.3g}")(last[0]) if last else "No data"
            ax.text(0.5, 0.45, text, color=PALETTE[0], fontsize=26, ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for i, (name, t, v) in enumerate(series[:8]):
            ax.plot(t, v, color=PALETTE[i % len(PALETTE)], linewidth=1.2, label=name[:40])
        if not series:
            ax.text(0.5, 0.5, "No data", color="#8e8e8e", ha="center", va="center", transform=ax.transAxes)
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.grid(color="#2c3235", linewidth=0.5)
        ax.set_xlabel("seconds into the load", color="#8e8e8e", fontsize=7)
        if unit not in ("short", "none", "percentunit"):
            ax.set_ylabel(unit, color="#8e8e8e", fontsize=7)
        if series:
            ax.legend(fontsize=6, facecolor="#181b1f", edgecolor="#2c3235", labelcolor="#ccccdc", loc="upper left")
    fig.savefig(path, facecolor=fig.get_facecolor())
    plt.close(fig)


def rows(dashboard: dict) -> list[tuple[str, list[dict]]]:
    """The dashboard's rows with their graph panels (the processes table is left out: it is a list of versions)."""
    out: list[tuple[str, list[dict]]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.append((panel["title"], []))
        elif panel["type"] in ("stat", "timeseries") and out:
            out[-1][1].append(panel)
    return [(title, panels) for title, panels in out if panels]


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/img"), help="folder for dashboard-<row>.png")
    p.add_argument("--model", default=DeployConfig.model)
    p.add_argument("--seconds", type=float, default=150.0, help="length of the load")
    p.add_argument("--start-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if shutil.which("prometheus") is None:
        p.error("the prometheus binary is missing: apt-get install prometheus")
    args.out.mkdir(parents=True, exist_ok=True)
    phase = args.seconds / 5
    phases = [(phase, 1), (phase, 4), (phase, 8), (phase, 4), (phase, 1)]

    with tempfile.TemporaryDirectory(prefix="fastgen-dashboard-") as tmp:
        work = Path(tmp)
        home = work / "home"
        base = free_base_port(8)
        config = DeployConfig(
            name=NAME,
            model=args.model,
            replicas=2,
            port=base,
            metrics_port=base + 3,
            http_port=base + 6,
            timeout=args.start_timeout,
            prefix_caching=True,
        )
        deployment.start(config, home)
        try:
            server, url = prometheus(home, work, base + 7)
            with server:
                stop = threading.Event()
                begin = time.time()
                killer = threading.Thread(target=restart_one_replica, args=(home, 0.5 * args.seconds, stop))
                killer.start()
                load(f"127.0.0.1:{base}", f"http://127.0.0.1:{base + 6}", phases, stop)
                killer.join()
                time.sleep(3 * SCRAPE_S)
                span = (begin, time.time())
                dashboard = json.loads(DASHBOARD_JSON.read_text())
                variables = {"deployment": NAME, "replica": ".*", "token_rate": "2", "__rate_interval": RATE_WINDOW}
                for title, panels in rows(dashboard):
                    data = [series_of(url, panel, variables, span) for panel in panels]
                    path = args.out / f"dashboard-{slug(title)}.png"
                    draw_row(title, panels, data, path)
                    print(f"{path}: {sum(bool(d) for d in data)}/{len(panels)} panels with data")
        finally:
            deployment.stop(home, NAME, timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
