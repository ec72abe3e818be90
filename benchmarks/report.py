"""Tables, the SplitFuse-vs-prefill-first check and PNG plots, built from a results folder's summary file
(OUT/summary.json, one line per run: workload, system, clients, repeat, meta and summary; written by
`python -m fastgen.benchmarks.serving run`). The raw per-request records are not needed: they go to benchmarks/out/.

    python -m fastgen.benchmarks.report benchmarks/results/serving-threads            # serving tables + PNGs
    python -m fastgen.benchmarks.report benchmarks/results/offline_bf16_threads2.json  # an offline summary's table
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

# Order of systems in tables and legends; others follow alphabetically.
SYSTEM_ORDER = ("slo", "splitfuse", "prefill_first", "static", "hf", "vllm")
SUMMARY_FILE = "summary.json"
PLOT_DPI = 80


# ---- the summary file ----
def run_key(run: dict) -> tuple:
    return (run["workload"], run["system"], run["clients"], -1 if run.get("repeat") is None else run["repeat"])


def read_summary(out: Path) -> dict:
    """{"runs": [...], and any notes}; empty when the folder has none."""
    path = Path(out) / SUMMARY_FILE
    return json.loads(path.read_text()) if path.exists() else {"runs": []}


def write_summary(out: Path, data: dict) -> Path:
    """One run per line, sorted, so that a new run is a one-line diff."""
    path = Path(out) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = sorted(data.get("runs", []), key=run_key)
    head = {k: v for k, v in data.items() if k != "runs"}
    lines = [json.dumps(head, ensure_ascii=False)[:-1] + (', "runs": [' if head else '"runs": [')]
    lines.append(",\n".join(json.dumps(r, ensure_ascii=False) for r in runs))
    text = "\n".join(lines) + "\n]}\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a run killed half-way leaves the previous summary
    return path


def add_run(out: Path, workload: str, system: str, clients: int, repeat: int | None, result: dict) -> Path:
    """Records one run ({"meta", "summary"}) in OUT/summary.json, replacing an earlier run of the same point."""
    data = read_summary(out)
    run = {"workload": workload, "system": system, "clients": clients, "repeat": repeat} | result
    data["runs"] = [r for r in data["runs"] if run_key(r) != run_key(run)] + [run]
    return write_summary(out, data)


def has_run(out: Path, workload: str, system: str, clients: int, repeat: int | None = None) -> bool:
    key = run_key({"workload": workload, "system": system, "clients": clients, "repeat": repeat})
    return any(run_key(r) == key for r in read_summary(out)["runs"])


def load_runs(out: Path) -> dict[str, dict[str, dict[int, dict]]]:
    """workload -> system -> clients -> run (meta + summary), single runs."""
    runs: dict = defaultdict(lambda: defaultdict(dict))
    for r in read_summary(out)["runs"]:
        if r.get("repeat") is None:
            runs[r["workload"]][r["system"]][r["clients"]] = r
    return runs


def load_repeats(out: Path) -> dict[str, dict[str, dict[int, dict[int, dict]]]]:
    """workload -> system -> clients -> repeat -> run, from `run --repeats K`."""
    runs: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in read_summary(out)["runs"]:
        if r.get("repeat") is not None:
            runs[r["workload"]][r["system"]][r["clients"]][r["repeat"]] = r
    return runs


def machine_text(m) -> str:
    if isinstance(m, dict):
        from .provenance import machine_name

        return machine_name(m)
    return str(m)


def provenance(out: Path) -> str:
    """Dates, commits and machines of a folder's runs: a table's source line."""
    runs = read_summary(out)["runs"]
    if not runs:
        return ""
    dates = sorted(r["meta"].get("date", "?") for r in runs)
    commits = sorted({r["meta"].get("commit", "?") for r in runs})
    machines = sorted({machine_text(r["meta"].get("machine", "?")) for r in runs})
    return f"{len(runs)} runs, {dates[0]} to {dates[-1]}; commit(s) {', '.join(commits)}; machine {'; '.join(machines)}"


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
    fig.savefig(curve, dpi=PLOT_DPI)
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
    fig.savefig(eff, dpi=PLOT_DPI)
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
        parts += slo_check(workload, systems)
        parts.append("")
    return "\n".join(parts)


def slo_check(workload: str, systems: dict) -> list[str]:
    """Issue 16's check, for every slo system of a repeated comparison: its effective throughput at its own floor R
    against the best fixed schedule (every splitfuse budget and prefill_first) and against prefill_first, within
    each repeat, and its P95 inter-token latency against 1 / R."""
    fixed = [name for name in systems if name.split("-")[0] in ("splitfuse", "prefill_first")]
    lines = []
    for name in sorted(s for s in systems if s.split("-")[0] == "slo"):
        for n in sorted(systems[name]):
            line = slo_line(workload, {s: runs.get(n, {}) for s, runs in systems.items()}, name, n, fixed)
            lines += [line] if line else []
    return lines


def slo_line(workload: str, at_n: dict, name: str, n: int, fixed: list[str]) -> str | None:
    """slo_check's line for one slo system at n clients; at_n: system -> repeat -> run at n clients."""
    by_k = at_n[name]
    settings = next(iter(by_k.values()))["meta"].get("settings", {})
    rate = f"{(settings.get('sla_token_rates') or [2])[0]:g}"
    ks = [k for k in sorted(by_k) if all(k in at_n[f] for f in fixed)]
    if not fixed or not ks or rate not in by_k[ks[0]]["summary"]["effective"]:
        return None
    eff = {s: [at_n[s][k]["summary"]["effective"][rate] for k in ks] for s in [name, *fixed]}
    best = [max(eff[f][i] for f in fixed) for i in range(len(ks))]
    line = (
        f"- {workload}, {n} clients, {name} at R = {rate}: effective {spread(eff[name], '{:.3f}')} req/s, "
        f"÷ best fixed schedule {spread([ratio(a, b) for a, b in zip(eff[name], best)], '{:.2f}')}× (floor ≥ 1×)"
    )
    if "prefill_first" in eff:
        pf = [ratio(a, b) for a, b in zip(eff[name], eff["prefill_first"])]
        line += f", ÷ prefill_first {spread(pf, '{:.2f}')}×" + (" (floor ≥ 1.4×)" if n >= 32 else "")
    itl = [by_k[k]["summary"]["inter_token"]["p95"] * 1e3 for k in ks]
    return line + f"; P95 inter-token {spread(itl, '{:.0f}')} ms (floor {1e3 / float(rate):.0f} ms)"


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def report(out: Path, headline_workload: str = "C1", plots: bool = True) -> str:
    runs = load_runs(out)
    reps = load_repeats(out)
    if not runs and not reps:
        return f"no runs under {out}"
    parts = [f"Source: {provenance(out)}\n"]
    parts += [repeats_report(reps)] if reps else []
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


# ---- the slo scheduler's step-time model (python -m fastgen.benchmarks.serving steps) ----
def read_steps(raw: Path) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(workload, system) -> (predicted, measured) seconds of every step the replicas traced during the runs under
    raw (RAW/<workload>/<system>/*.steps.csv); steps the model did not predict yet are left out."""
    import csv

    pairs: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for path in sorted(Path(raw).glob("*/*/*.steps.csv")):
        key = (path.parent.parent.name, path.parent.name)
        with path.open() as f:
            for row in csv.DictReader(f):
                predicted, measured = float(row["predicted_s"]), float(row["measured_s"])
                if not math.isnan(predicted) and measured > 0:
                    pairs[key].append((predicted, measured))
    return pairs


def steps_report(raw: Path, out: Path, plots: bool = True) -> str:
    """The step-time model's median absolute percentage error per workload and system, and a predicted-against-
    measured scatter plot of each (OUT/steps_<workload>_<system>.png)."""
    pairs = read_steps(raw)
    if not pairs:
        return f"no step traces under {raw} (slo systems record them)"
    lines = ["| workload | system | steps | MdAPE | P90 APE |", "|---|---|---|---|---|"]
    figures = []
    for (workload, system), xs in sorted(pairs.items()):
        errors = sorted(abs(p - m) / m for p, m in xs)
        p90 = errors[min(len(errors) - 1, int(0.9 * len(errors)))]
        lines.append(f"| {workload} | {system} | {len(xs)} | {statistics.median(errors):.1%} | {p90:.1%} |")
        if plots:
            try:
                figures.append(str(plot_steps(xs, f"{workload} {system}", out / f"steps_{workload}_{system}.png")))
            except ImportError:
                plots = False
    return "\n".join(lines) + (f"\n\nPlots: {', '.join(figures)}" if figures else "")


def plot_steps(pairs: list[tuple[float, float]], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    xs, ys = [m * 1e3 for _, m in pairs], [p * 1e3 for p, _ in pairs]
    ax.scatter(xs, ys, s=4, alpha=0.4)
    lo, hi = min(x for x in xs + ys if x > 0), max(xs + ys)
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)  # exact predictions
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="measured step (ms)", ylabel="predicted step (ms)", title=f"step-time model, {title}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path


# ---- other benchmarks' summaries ----
def offline_table(data: dict) -> str:
    """An offline summary (python -m fastgen.benchmarks.offline --json): medians (min–max) and ratios."""

    def cell(xs: list[float]) -> str:
        return spread(xs, "{:.1f}") + " s" if xs else "–"

    def first(xs: list[float]) -> str:
        return f"{xs[0]:.1f} s" if xs else "–"

    meta = data.get("meta", {})
    head = ["workload", "threads", "FastGen", "first", "transformers", "× transformers", "per repeat", "vLLM", "first"]
    head += ["× vLLM", "× vLLM first"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in sorted(k for k in data if k.startswith("W")):
        w = data[name]
        per = ", ".join(f"{x:.2f}×" for x in w.get("speedup_per_repeat", []))
        cells = [name, str(meta.get("threads", "?")), cell(w["fastgen_s"]), first(w["fastgen_s"])]
        cells += [cell(w.get("transformers_s", []))]
        cells += [fmt(w.get("speedup"), 2) + "×" if "speedup" in w else "–", per or "–"]
        cells += [cell(w.get("vllm_s", [])), first(w.get("vllm_s", []))]
        cells += [fmt(w.get("speedup_vs_vllm"), 2) + "×" if "vllm_s" in w else "–"]
        cells += [fmt(w.get("speedup_vs_vllm_first"), 2) + "×" if "speedup_vs_vllm_first" in w else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    for key in sorted((k for k in data if k.startswith("prefill_")), key=lambda k: int(k.removeprefix("prefill_"))):
        pf = data[key]
        lines.append(
            f"\n{key.removeprefix('prefill_')}-token prefill: {pf['model_flops'] / 1e9:.0f} GFLOP/s of model FLOPs "
            f"against {pf['matmul_flops'] / 1e9:.0f} GFLOP/s for a large matmul "
            f"({pf['model_flops'] / pf['matmul_flops']:.0%})."
        )
    if meta.get("machine"):
        lines.append(f"\nMachine: {machine_text(meta['machine'])}.")
    return "\n".join(lines)


def source_line(meta: dict) -> str:
    parts = [f"`{meta['command']}`"] if meta.get("command") else []
    parts += [f"{k} {meta[k]}" for k in ("commit", "date") if meta.get(k)]
    if meta.get("machine"):
        parts.append("machine " + machine_text(meta["machine"]))
    return "Source: " + "; ".join(parts) if parts else ""


def report_path(path: Path, plots: bool = True) -> str:
    if path.is_dir():
        return report(path, plots=plots)
    data = json.loads(path.read_text())
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    if isinstance(data, dict) and any(k.startswith("W") for k in data):
        body = offline_table(data)
    elif isinstance(data, dict) and "medians" in data:
        from .balancer_overhead import markdown

        body = markdown(data["medians"], data["verdict"])
    else:
        body = json.dumps(data, indent=1)
    return "\n\n".join(x for x in (source_line(meta), body) if x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastgen.benchmarks.report", description=__doc__)
    p.add_argument("paths", nargs="+", type=Path, help="results folders (serving) or summary JSON files")
    p.add_argument("--no-plots", action="store_true", help="serving folders: tables only, no PNGs")
    args = p.parse_args(argv)
    for path in args.paths:
        print(f"## {path}\n\n{report_path(path, plots=not args.no_plots)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
