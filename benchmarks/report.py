"""Tables, the SplitFuse-vs-prefill-first check and PNG plots from a folder of serving runs
(OUT/<workload>/<system>/c<N>.json, as `python -m fastgen.benchmarks.serving run` writes them)."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from .stats import SLA, RequestRecord, summarize

# Order of systems in tables and legends; others follow alphabetically.
SYSTEM_ORDER = ("splitfuse", "prefill_first", "static", "hf", "vllm")


def load_runs(out: Path) -> dict[str, dict[str, dict[int, dict]]]:
    """workload -> system -> clients -> run (meta + summary; raw records dropped)."""
    runs: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(out.glob("*/*/c*.json")):
        runs[path.parent.parent.name][path.parent.name][int(path.stem[1:])] = load_run(path)
    return runs


def load_repeats(out: Path) -> dict[str, dict[str, dict[int, dict[int, dict]]]]:
    """workload -> system -> clients -> repeat -> run, from `run --repeats K`."""
    runs: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for path in sorted(out.glob("*/*/repeats/c*-*.json")):
        n, k = (int(x) for x in path.stem[1:].split("-"))
        runs[path.parent.parent.parent.name][path.parent.parent.name][n][k] = load_run(path)
    return runs


def load_run(path: Path) -> dict:
    data = json.loads(path.read_text())
    records = data.pop("records", None)
    if records:  # rescore from the raw timings: the tables follow the current statistics code
        sla = data["summary"].get("sla") or {}
        sla = SLA(sla.get("prompt_rate", 100.0), tuple(sla.get("token_rates", (1.0, 2.0, 4.0))), sla.get("span", 16))
        data["summary"] = asdict(summarize([RequestRecord(**r) for r in records], sla)) | {"sla": asdict(sla)}
    return data


def system_key(name: str) -> tuple:
    base = name.split("-")[0]
    return (SYSTEM_ORDER.index(base) if base in SYSTEM_ORDER else len(SYSTEM_ORDER), name)


def fmt(x: float, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def table(systems: dict[str, dict[int, dict]]) -> str:
    rates = next(iter(next(iter(systems.values())).values()))["summary"]["effective"].keys()
    head = ["system", "clients", "req", "thr (req/s)"] + [f"eff R={r}" for r in rates] + [f"miss R={r}" for r in rates]
    head += ["late 1st token"]
    head += ["TTFT p50/p95 (s)", "ITL p50/p95/p99 (ms)", "E2E p50/p95 (s)", "others' cores"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in sorted(systems, key=system_key):
        for n, run in sorted(systems[name].items()):
            s = run["summary"]
            cells = [name, str(n), f"{s['requests'] - s['failed']}/{s['requests']}", fmt(s["throughput"])]
            cells += [fmt(s["effective"][r]) for r in rates] + [f"{s['sla_missed'][r]:.0%}" for r in rates]
            cells.append(f"{s.get('ttft_missed', 0.0):.0%}")
            cells.append(f"{fmt(s['ttft']['p50'], 2)} / {fmt(s['ttft']['p95'], 2)}")
            itl = s["inter_token"]
            cells.append(" / ".join(fmt(itl[q] * 1e3, 0) for q in ("p50", "p95", "p99")))
            cells.append(f"{fmt(s['latency']['p50'], 2)} / {fmt(s['latency']['p95'], 2)}")
            # CPU that other processes used during the run (not recorded by older runs): > 0.2 means disturbed.
            cells.append(fmt(run["meta"].get("cpu", {}).get("others_cores"), 2))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline(systems: dict[str, dict[int, dict]], rate: str = "2") -> str:
    """The issue's floor: at the client count where prefill_first's throughput peaks, SplitFuse's effective
    throughput at R = 2 is at least 1.5x prefill-first's and its P95 inter-token latency at most half."""
    sf, pf = systems.get("splitfuse", {}), systems.get("prefill_first", {})
    common = sorted(set(sf) & set(pf))
    if not common:
        return "(no client count has both splitfuse and prefill_first runs)"
    peak = max(common, key=lambda n: pf[n]["summary"]["throughput"])
    lines = [f"prefill_first peaks (throughput) at {peak} clients among {common}."]
    for n in common:
        a, b = sf[n]["summary"], pf[n]["summary"]
        eff_a, eff_b = a["effective"][rate], b["effective"][rate]
        eff_ratio = eff_a / eff_b if eff_b > 0 else math.inf
        itl_ratio = a["inter_token"]["p95"] / b["inter_token"]["p95"]
        mark = " ← peak" if n == peak else ""
        verdict = ("MET" if eff_ratio >= 1.5 and itl_ratio <= 0.5 else "NOT MET") if n == peak else ""
        lines.append(
            f"- {n} clients: effective R={rate} {fmt(eff_a)} vs {fmt(eff_b)} req/s ({fmt(eff_ratio, 2)}×, "
            f"floor 1.5×); P95 inter-token {fmt(a['inter_token']['p95'] * 1e3, 0)} vs "
            f"{fmt(b['inter_token']['p95'] * 1e3, 0)} ms ({fmt(itl_ratio, 2)}×, floor 0.5×){mark} {verdict}"
        )
    return "\n".join(lines)


def plot_workload(workload: str, systems: dict[str, dict[int, dict]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(systems, key=system_key)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name in names:
        pts = sorted(systems[name].items())
        xs = [r["summary"]["throughput"] for _, r in pts]
        ys = [r["summary"]["latency"]["p50"] for _, r in pts]
        ax.plot(xs, ys, marker="o", label=name)
        for (n, _), x, y in zip(pts, xs, ys):
            ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set(
        xlabel="throughput (requests/s)",
        ylabel="end-to-end latency p50 (s)",
        title=f"{workload}: latency vs throughput (labels: clients)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    curve = out / f"{workload}_latency_throughput.png"
    fig.tight_layout()
    fig.savefig(curve, dpi=110)
    plt.close(fig)

    rates = list(next(iter(systems[names[0]].values()))["summary"]["effective"])
    fig, axes = plt.subplots(1, len(rates), figsize=(4 * len(rates), 3.6), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for name in names:
            pts = sorted(systems[name].items())
            ax.plot([n for n, _ in pts], [r["summary"]["effective"][rate] for _, r in pts], marker="o", label=name)
        ax.set(xlabel="clients", ylabel="effective throughput (req/s)", title=f"{workload}, R = {rate} tok/s")
        ax.set_xscale("log", base=2)
        clients = sorted({n for runs in systems.values() for n in runs})
        ax.set_xticks(clients, [str(n) for n in clients])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    eff = out / f"{workload}_effective_throughput.png"
    fig.tight_layout()
    fig.savefig(eff, dpi=110)
    plt.close(fig)
    return [curve, eff]


METRICS = {  # name -> (how to read it from a summary, format)
    "thr": (lambda s: s["throughput"], "{:.3f}"),
    "eff R=2": (lambda s: s["effective"]["2"], "{:.3f}"),
    "eff R=4": (lambda s: s["effective"]["4"], "{:.3f}"),
    "miss R=2": (lambda s: s["sla_missed"]["2"], "{:.0%}"),
    "ITL p95 (ms)": (lambda s: s["inter_token"]["p95"] * 1e3, "{:.0f}"),
    "TTFT p95 (s)": (lambda s: s["ttft"]["p95"], "{:.2f}"),
}


def spread(values: list[float], form: str) -> str:
    """median (min–max)"""
    med = statistics.median(values)
    return f"{form.format(med)} ({form.format(min(values))}–{form.format(max(values))})"


def repeats_report(reps: dict) -> str:
    parts = []
    for workload in sorted(reps):
        systems = reps[workload]
        head = ["system", "clients", "repeats"] + list(METRICS)
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in sorted(systems, key=system_key):
            for n, by_k in sorted(systems[name].items()):
                sums = [r["summary"] for r in by_k.values()]
                cells = [name, str(n), str(len(sums))]
                cells += [spread([get(s) for s in sums], form) for get, form in METRICS.values()]
                lines.append("| " + " | ".join(cells) + " |")
        parts.append(f"### {workload}, repeated (median, min–max)\n\n" + "\n".join(lines) + "\n")
        sf, pf = systems.get("splitfuse", {}), systems.get("prefill_first", {})
        for n in sorted(set(sf) & set(pf)):
            ks = sorted(set(sf[n]) & set(pf[n]))
            eff = [ratio(sf[n][k]["summary"]["effective"]["2"], pf[n][k]["summary"]["effective"]["2"]) for k in ks]
            itl = [sf[n][k]["summary"]["inter_token"]["p95"] / pf[n][k]["summary"]["inter_token"]["p95"] for k in ks]
            parts.append(
                f"- {workload}, {n} clients, splitfuse ÷ prefill_first within each repeat: effective R=2 "
                f"{spread(eff, '{:.2f}')}× (floor ≥ 1.5×); P95 inter-token {spread(itl, '{:.2f}')}× (floor ≤ 0.5×)"
            )
        parts.append("")
    return "\n".join(parts)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def report(out: Path, headline_workload: str = "C1", plots: bool = True) -> str:
    runs = load_runs(out)
    reps = load_repeats(out)
    if not runs and not reps:
        return f"no runs under {out}"
    parts = [repeats_report(reps)] if reps else []
    for workload in sorted(runs):
        systems = runs[workload]
        parts.append(f"### {workload}\n\n{table(systems)}\n")
        if "splitfuse" in systems and "prefill_first" in systems:
            title = "Check (the issue's floor)" if workload == headline_workload else "SplitFuse vs prefill-first"
            parts.append(f"{title}:\n{headline(systems)}\n")
        if plots:
            try:
                paths = plot_workload(workload, systems, out)
                parts.append("Plots: " + ", ".join(str(p) for p in paths) + "\n")
            except ImportError:
                parts.append("(matplotlib is not installed: no plots; pip install -e .[bench])\n")
    return "\n".join(parts)
