"""The tables of benchmarks/RESULTS.md, each built from the tracked summaries under benchmarks/results/.

RESULTS.md holds every generated table between two markers,

    <!-- table: NAME -->
    ...
    <!-- /table -->

where NAME is a key of TABLES. tests/test_results_tables.py rebuilds each one and fails when RESULTS.md's text
differs; after a new run, rewrite the blocks from the summaries instead of by hand:

    python -m fastgen.benchmarks.results_tables            # print every table
    python -m fastgen.benchmarks.results_tables --write    # rewrite RESULTS.md's blocks in place

Ratios of two systems are taken within each repeat and their median reported (the method's rule); a ratio of
medians, where a table shows one, is labelled as such.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from .report import load_repeats

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
RESULTS_MD = BENCH_DIR / "RESULTS.md"
BLOCK = re.compile(r"<!-- table: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /table -->", re.S)


# ---- helpers ----
def load(rel: str) -> dict:
    return json.loads((RESULTS_DIR / rel).read_text())


def rows(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def num(x: float, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return "∞" if math.isinf(x) else f"{x:.{digits}f}"


def med_range(xs: list[float], digits: int = 2) -> str:
    """median (min–max)"""
    return f"{num(statistics.median(xs), digits)} ({num(min(xs), digits)}–{num(max(xs), digits)})"


def div(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else math.nan)


def per_repeat(xs: list[float], digits: int = 2) -> str:
    return ", ".join(num(x, digits) for x in xs)


def median(xs: list[float]) -> float:
    """statistics.median, with NaN (0 ÷ 0) sorted below every number."""
    xs = sorted(xs, key=lambda x: -math.inf if math.isnan(x) else x)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def when(meta: dict) -> str:
    return str(meta.get("date", "?"))[:16].replace("T", " ")


# ---- 1. offline throughput ----
OFFLINE_HF = [("a", "offline_bf16_threads1_interleaved.json"), ("b", "offline_bf16_threads2.json")]


def offline_transformers() -> str:
    body = []
    for run, rel in OFFLINE_HF:
        d = load(rel)
        for w in ("W1", "W2"):
            fg, hf = d[w]["fastgen_s"], d[w]["transformers_s"]
            per = [b / a for a, b in zip(fg, hf)]
            body.append(
                [
                    w,
                    str(d["meta"]["threads"]),
                    med_range(fg, 1) + " s",
                    med_range(hf, 1) + " s",
                    per_repeat(per),
                    f"**{num(statistics.median(per))}×**",
                    f"{num(statistics.median(hf) / statistics.median(fg))}×",
                    run,
                ]
            )
    head = ["workload", "threads", "FastGen", "transformers", "÷ per repeat", "median of per-repeat ratios"]
    return rows(head + ["ratio of medians", "run"], body)


OFFLINE_VLLM = [
    ("c", "offline_vllm_threads2.json", "bfloat16, Xeon-AMX"),
    ("v6", "offline_fp32_vllm_threads2_icelake_v6.json", "float32, Ice Lake"),
    ("v6-W2", "offline_fp32_vllm_threads2_icelake_v6_w2.json", "float32, Ice Lake"),
    ("v6-1t", "offline_fp32_vllm_threads1_icelake_v6.json", "float32, Ice Lake"),
]


def offline_vllm() -> str:
    body = []
    for run, rel, what in OFFLINE_VLLM:
        d = load(rel)
        for w in ("W1", "W2"):
            if w not in d or not d[w].get("vllm_s"):
                continue
            fg, vl = d[w]["fastgen_s"], d[w]["vllm_s"]
            per = [b / a for a, b in zip(fg, vl)]
            body.append(
                [
                    run,
                    what,
                    str(d["meta"].get("threads", "?")),
                    w,
                    str(len(fg)),
                    f"{num(statistics.median(fg), 1)} s",
                    f"{num(statistics.median(vl), 1)} s",
                    per_repeat(per),
                    f"**{num(statistics.median(per))}×**",
                    f"{num(d[w]['speedup_vs_vllm'])}×",
                ]
            )
    head = ["run", "dtype, machine", "threads", "workload", "repeats", "FastGen median", "vLLM median"]
    return rows(head + ["FastGen ÷ vLLM per repeat", "median of per-repeat ratios", "ratio of medians"], body)


def offline_avx2() -> str:
    body = []
    for pair in ("1", "2"):
        before, after = (
            load(f"offline_fp32_avx2_zen3/before{pair}.json"),
            load(f"offline_fp32_avx2_zen3/after{pair}.json"),
        )
        cells = [pair, f"{when(before['meta'])} – {when(after['meta'])[11:]}"]
        for w in ("W1", "W2"):
            a, b = before[w]["fastgen_median_s"], after[w]["fastgen_median_s"]
            cells.append(f"{num(a, 1)} → {num(b, 1)} s ({num(a / b)}×)")
        body.append(cells)
    return rows(["pair", "UTC", "W1 sgemm → kernel (medians of 3)", "W2 sgemm → kernel"], body)


# ---- 2. serving: SplitFuse vs prefill-first ----
SERVING = [("e", "serving-threads"), ("f", "serving-threads-more-clients")]


def serving_splitfuse() -> str:
    body = []
    for run, folder in SERVING:
        systems = load_repeats(RESULTS_DIR / folder)["C1"]
        sf, pf = systems["splitfuse"], systems["prefill_first"]
        for n in sorted(set(sf) & set(pf)):
            ks = sorted(set(sf[n]) & set(pf[n]))
            s = [sf[n][k]["summary"] for k in ks]
            p = [pf[n][k]["summary"] for k in ks]
            eff = [div(a["effective"]["2"], b["effective"]["2"]) for a, b in zip(s, p)]
            itl = [a["inter_token"]["p95"] / b["inter_token"]["p95"] for a, b in zip(s, p)]
            body.append(
                [
                    str(n),
                    str(len(ks)),
                    f"{num(statistics.median(x['throughput'] for x in s), 3)} / "
                    f"{num(statistics.median(x['effective']['2'] for x in s), 3)}",
                    f"{num(statistics.median(x['throughput'] for x in p), 3)} / "
                    f"{num(statistics.median(x['effective']['2'] for x in p), 3)}",
                    f"{statistics.median(x['sla_missed']['2'] for x in p):.0%}",
                    med_range(eff) + "×",
                    med_range(itl) + "×",
                    run,
                ]
            )
    head = ["clients", "repeats", "SplitFuse thr / eff R=2 (req/s, medians)", "prefill-first thr / eff R=2"]
    head += ["prefill-first misses R=2", "eff R=2 ratio per repeat", "P95 inter-token ratio per repeat", "run"]
    return rows(head, body)


# ---- 3. balancer overhead ----
BALANCER = [
    ("g", "balancer_overhead.json", "SmolLM2 bf16, 16-token prompts, 2 generated, 4 clients"),
    ("h", "balancer_overhead_32x8.json", "SmolLM2 bf16, 32-token prompts, 8 generated, 4 clients"),
    ("i", "balancer_overhead_tiny_8x1.json", "tiny random model, 8-token prompts, 1 generated, 1 client"),
]


def balancer_overhead() -> str:
    body = []
    for run, rel, what in BALANCER:
        d = load(rel)
        m, v = d["medians"], d["verdict"]
        drop = v.get("paired_throughput_ratio")
        added = v.get("paired_p50_added_ms")
        body.append(
            [
                f"{what}, {d['meta']['args']['rounds']} rounds",
                f"{num(m['direct']['throughput'])} req/s, p50 {num(m['direct']['p50_ms'], 1)} ms",
                f"{num(m['balancer']['throughput'])} req/s, p50 {num(m['balancer']['p50_ms'], 1)} ms",
                f"{-v['throughput_drop']:+.1%}" + (f" (paired ×{num(drop, 3)})" if drop is not None else ""),
                f"{v['p50_added_ms']:+.1f} ms" + (f" (paired {added:+.1f})" if added is not None else ""),
                "met" if v["throughput_floor_met"] else "**missed**",
                "met" if v["p50_floor_met"] else "**missed**",
                run,
            ]
        )
    head = ["load", "direct", "through the balancer", "throughput", "added p50", "≤ 5% floor", "≤ 2 ms floor", "run"]
    return rows(head, body)


# ---- 4. the HTTP API ----
def http_overhead() -> str:
    body = []
    for run, rel in (("j", "openai_api/http_overhead_tiny_8x1.json"), ("k", "openai_api/http_overhead_16x2.json")):
        d = load(rel)
        args, paired = d["meta"]["args"], d["paired"]["all"]
        n = next(iter(d["medians"]["grpc"]))
        g, h = d["medians"]["grpc"][n], d["medians"]["http"][n]
        body.append(
            [
                f"{args['workload']}, {n} client(s), {paired['pairs']} repeats",
                f"{num(g['throughput'])} req/s, e2e p50 {num(g['e2e_p50_ms'], 1)} ms",
                f"{num(h['throughput'])} req/s, e2e p50 {num(h['e2e_p50_ms'], 1)} ms",
                f"e2e p50 {paired['e2e_p50_added_ms']:+.1f} ms, throughput ×{num(paired['throughput_ratio'], 3)}",
                run,
            ]
        )
    return rows(["load", "gRPC", "HTTP", "HTTP − gRPC (paired medians)", "run"], body)


# ---- 5. prefix caching, chat workload ----
CHAT = [
    "chat_2r.json",
    "chat_2r_pressure.json",
    "chat_2r_pressure_rep2.json",
    "chat_2r_small_cache.json",
    "chat_2r_small_cache_7c.json",
    "skew_2r.json",
    "chat_1r_pa.json",
    "chat_vllm.json",
]


def chat() -> str:
    body = []
    for rel in CHAT:
        d = load(f"chat/{rel}")
        for r in d["runs"]:
            s = r["summary"]
            hit = s.get("prefix_cache", {}).get("all", {}).get("hit_rate")
            body.append(
                [
                    rel.removesuffix(".json"),
                    r["system"],
                    num(s["throughput"], 3),
                    num(s["ttft"]["p50"]),
                    num(s["ttft"]["p99"]),
                    "–" if hit is None else f"{hit:.0%}",
                ]
            )
    return rows(["summary", "system", "req/s", "TTFT p50 s", "TTFT p99 s", "hit rate"], body)


# ---- 6. failover ----
FAILOVER = [
    "kill",
    "stop",
    "kill_n3_zen4_1",
    "kill_n3_zen4_2",
    "kill_n3_zen4_3",
    "stop_n3_zen4",
    "kill_n3_zen4_resumed_first_1",
    "kill_n3_zen4_resumed_first_2",
    "kill_n3_zen4_resumed_first_3",
    "stop_n3_zen4_resumed_first",
    "kill_n3_zen4_v4_1",
    "kill_n3_zen4_v4_2",
    "kill_n3_zen4_v4_3",
    "stop_n3_zen4_v4",
]


def failover() -> str:
    body = []
    for name in FAILOVER:
        d = load(f"failover/{name}.json")
        mig = d.get("balancer_migrations")
        body.append(
            [
                name,
                d["meta"].get("commit", "?"),
                f"{d['completed']} / {d['requests']}",
                f"{d['identical']} / {d['requests']}",
                str(d["streams_moved"]),
                str(d.get("streams_moved_with_several_completions", "–")),
                f"{d['seam_gap_ms']['p50'] / 1e3:.2f} / {d['seam_gap_ms']['max'] / 1e3:.2f} s",
                "–" if not mig else f"{mig['resume_s_mean']:.2f} s ({mig['moves']} moves)",
            ]
        )
    head = ["summary", "commit", "completed", "identical", "streams moved", "of them n = 3", "seam stall p50 / max"]
    return rows(head + ["balancer: failure to resumed token, mean"], body)


def failover_totals() -> str:
    """Streams moved and three-completion streams moved, summed over each set of runs."""
    sets = [("first n = 3 set (006bb2f)", "n3_zen4_"), ("resumed first (53a1e6d)", "n3_zen4_resumed_first")]
    body = []
    for label, key in sets:
        names = [n for n in FAILOVER if key in n and ("resumed" in n) == ("resumed" in key) and "_v" not in n]
        ds = [load(f"failover/{n}.json") for n in names]
        body.append(
            [
                label,
                str(len(ds)),
                str(sum(d["streams_moved"] for d in ds)),
                str(sum(d["streams_moved_with_several_completions"] for d in ds)),
                f"{sum(d['identical'] for d in ds)} / {sum(d['requests'] for d in ds)}",
            ]
        )
    return rows(["set", "runs", "streams moved", "of them with 3 completions", "identical"], body)


# ---- 7. robustness ----
def fuzz() -> str:
    d = load("fuzz/fuzz10k.json")
    by = d["by_target_method_code"]
    body = []
    targets = ("replica/unary", "replica/stream", "balancer/unary", "balancer/stream", "http/chat", "http/completion")
    for tm in (t for t in targets if any(k.startswith(t + "/") for k in by)):
        other = sum(
            v for k, v in by.items() if k.startswith(tm + "/") and k.split("/")[2] not in ("OK", "INVALID_ARGUMENT")
        )
        body.append(
            [
                tm.replace("/", ", "),
                f"{by.get(tm + '/OK', 0):,}",
                f"{by.get(tm + '/INVALID_ARGUMENT', 0):,}",
                str(other),
            ]
        )
    table = rows(["target, method", "OK", "INVALID_ARGUMENT", "other"], body)
    alive = "both alive" if all(d["alive"].values()) else "a process died"
    return table + (
        f"\n\n{d['examples']:,} examples, seed {d['seed']}: {d['failure_count']} failures, {alive}, "
        f"reference request {'identical' if d['recovered'] else 'changed'} after; "
        f"{'PASS' if d['pass'] else 'FAIL'} in {d['wall_s']:.0f} s."
    )


def overload() -> str:
    d = load("overload/overload.json")
    body = []
    for phase in ("before", "burst", "after"):
        p = d["phases"][phase]
        codes = ", ".join(f"{k} {v:,}" for k, v in sorted(p["codes"].items(), key=lambda kv: kv[0] != "OK"))
        body.append(
            [phase, num(p["offered_rps"], 1), num(p["served_rps"], 1), codes, num(p["p50_ms"], 0), num(p["p99_ms"], 0)]
        )
    table = rows(["phase", "offered req/s", "served req/s", "answers", "latency p50 ms", "p99 ms"], body)
    return table + (
        f"\n\nCapacity {d['capacity_rps']:.1f} req/s; unexpected codes: {len(d['unexpected_codes'])}; "
        f"{'PASS' if d['pass'] else 'FAIL'}."
    )


# ---- 8. SLO-aware scheduling (issue 16) ----
# (host, folder, rate): every folder whose runs compare slo with the fixed schedules in three or more repeats.
SLO_SETS = [
    ("Zen 4", "slo_c1_balanced_zen4", "2"),
    ("Zen 4", "slo_c1_balanced2_zen4", "2"),
    ("Zen 4", "slo_zen4_c4_c8", "2"),
    ("Zen 4", "slo_c4_zen4", "2"),
    ("Zen 4", "slo_c4_seed1_zen4", "2"),
    ("Zen 4", "slo_zen4_r4", "4"),
    ("Zen 4", "slo_c2_zen4", "2"),
    ("Zen 4", "slo_zen4", "2"),
    ("Ice Lake", "slo_icelake_drift", "2"),
    ("Zen 3", "slo_c1_fresh_zen3", "2"),
    ("Zen 3", "slo_c2_zen3b", "2"),
    ("Zen 3", "slo_c16_c32_3rep_zen3", "2"),
    ("Zen 3", "slo_c48_zen3b", "2"),
]


def slo_points(folder: str, rate: str):
    """(workload, slo system, clients, repeats, per-repeat slo ÷ best fixed, ÷ prefill_first or None, slo runs)."""
    for workload, systems in sorted(load_repeats(RESULTS_DIR / folder).items()):
        fixed = [s for s in systems if s.split("-")[0] in ("splitfuse", "prefill_first")]
        for name in sorted(s for s in systems if s.startswith("slo")):
            # the set's slo system is the one planned to the rate measured (slo-t4 at R = 4, plain slo at R = 2)
            if (rate == "4") != ("-t4" in name):
                continue
            for n in sorted(systems[name]):
                ks = [k for k in sorted(systems[name][n]) if all(k in systems[f].get(n, {}) for f in fixed)]
                if len(ks) < 3:
                    continue

                def eff(s, k, at=systems, n=n):
                    return at[s][n][k]["summary"]["effective"][rate]

                best = [div(eff(name, k), max(eff(f, k) for f in fixed)) for k in ks]
                pf = [div(eff(name, k), eff("prefill_first", k)) for k in ks] if "prefill_first" in fixed else None
                yield workload, name, n, ks, best, pf, [systems[name][n][k] for k in ks]


def slo_floors() -> str:
    body = []
    for host, folder, rate in SLO_SETS:
        for workload, _name, n, _ks, best, pf, runs in slo_points(folder, rate):
            itl = [r["summary"]["inter_token"]["p95"] * 1e3 for r in runs]
            met = [round(r["summary"]["requests"] * (1 - r["summary"]["sla_missed"][rate])) for r in runs]
            floor_itl = 1e3 / float(rate)
            verdicts = ["≥ 1× best: " + ("met" if median(best) >= 1 else "**not met**")]
            if pf is not None and n >= 32:
                verdicts.append("≥ 1.4× prefill-first: " + ("met" if median(pf) >= 1.4 else "**not met**"))
            verdicts.append(f"P95 ≤ {floor_itl:.0f} ms: {sum(x <= floor_itl for x in itl)} of {len(itl)}")
            body.append(
                [
                    host,
                    f"`{folder}`",
                    f"{workload}, R = {rate}",
                    str(n),
                    f"{', '.join(map(str, met))} of {runs[0]['summary']['requests']}",
                    per_repeat(best, 3),
                    f"**{num(median(best), 3)}**",
                    "–" if pf is None else per_repeat(pf, 3),
                    "–" if pf is None else num(median(pf), 3),
                    f"{max(itl):.0f}",
                    "; ".join(verdicts),
                ]
            )
    head = ["host", "summary", "load", "clients", "`slo` met SLA per repeat", "`slo` ÷ best fixed, per repeat"]
    head += ["median", "÷ prefill-first, per repeat", "median", "`slo` P95 ITL max (ms)", "floors"]
    return rows(head, body)


def slo_provenance() -> str:
    body = []
    for host, folder, _ in SLO_SETS:
        runs = json.loads((RESULTS_DIR / folder / "summary.json").read_text())["runs"]
        dates = sorted(r["meta"]["date"] for r in runs)
        commits = sorted({r["meta"].get("commit", "?") for r in runs})
        body.append(
            [f"`{folder}`", host, ", ".join(commits), f"{dates[0][:16]} – {dates[-1][11:16]}".replace("T", " ")]
        )
    return rows(["summary", "host", "commit(s)", "UTC"], body)


# ---- 9. tensor parallelism ----
def tensor_parallel() -> str:
    d = load("tensor_parallel.json")
    body = []
    for tp in ("tp1", "tp2"):
        t = d[tp]
        ar = "–" if tp == "tp1" else f"{t['all_reduce_ms_per_step']:.1f} / {t['rank1_all_reduce_ms_per_step']:.1f}"
        body.append(
            [tp, ", ".join(f"{x:.2f}" for x in t["seconds"]), f"{t['tok_s']:.0f}", f"{t['ms_per_step']:.1f}", ar]
        )
    return rows(["", "wall s (3 runs)", "tokens/s", "ms per step", "all-reduce ms per step (rank 0 / 1)"], body)


# ---- 13. mixture of experts ----
MOE = [
    "moe/moe_fp32_xeon_amx.json",
    "moe/moe_bf16_xeon_amx.json",
    "moe/moe_bf16_int8_xeon_amx.json",
    "moe/moe_fp32_zen4.json",
    "moe/moe_bf16_zen4.json",
]


def moe() -> str:
    body = []
    for rel in MOE:
        d = load(rel)
        step, off = d["decode_step_ms"], d["offline_s"]
        fg = off["fastgen"]
        cells = [
            host(d["machine"]),
            d["dtype"] + (f", {d['quantization']}" if d.get("quantization", "auto") != "auto" else ""),
            str(d["repeats"]),
            f"{num(statistics.median(step['moe']))} / {num(statistics.median(step['dense']))} ms",
            f"**{num(median([div(m, n) for m, n in zip(step['moe'], step['dense'])]))}×**",
            f"{num(d['offline_tokens'] / statistics.median(fg), 1)} tok/s",
        ]
        for peer in ("transformers", "vllm"):
            per = [div(b, a) for a, b in zip(fg, off.get(peer, []))]
            cells.append(f"{per_repeat(per)}; **{num(median(per))}×**" if per else "–")
        body.append(cells)
    head = ["host", "dtype", "repeats", "decode step MoE / dense (medians)", "MoE ÷ dense (median per repeat)"]
    return rows(head + ["FastGen offline", "FastGen ÷ transformers per repeat; median", "FastGen ÷ vLLM"], body)


MOE_COLD = ["moe/moe_fp32_cold_xeon_amx.json", "moe/moe_bf16_cold_xeon_amx.json"]


def moe_cold() -> str:
    """--cold: each system in a fresh process per repeat, its first batch timed, and its load."""
    body = []
    for rel in MOE_COLD:
        d = load(rel)
        off, loads = d["offline_cold_s"], d["load_s"]
        fg = off["fastgen"]
        cells = [host(d["machine"]), d["dtype"], str(d["repeats"])]
        cells.append(f"{num(d['offline_tokens'] / statistics.median(fg), 1)} tok/s")
        for peer in ("transformers", "vllm"):
            per = [div(b, a) for a, b in zip(fg, off[peer])]
            cells.append(f"{per_repeat(per)}; **{num(median(per))}×**")
        cells.append(" · ".join(f"{num(statistics.median(loads[k]), 1)}" for k in ("fastgen", "transformers", "vllm")))
        body.append(cells)
    head = ["host", "dtype", "repeats", "FastGen cold", "÷ transformers per repeat; median", "÷ vLLM"]
    return rows(head + ["load s: FastGen · transformers · vLLM"], body)


# ---- 12. quantized weights against llama.cpp ----
LLAMA_CPP = [
    "llama_cpp/smollm2_q4_1_xeon_amx.json",
    "llama_cpp/smollm2_q4_1_zen5.json",
    "llama_cpp/smollm2_q4_1_zen4.json",
    "llama_cpp/smollm2_q4_1_zen3.json",
    "llama_cpp/smollm2_q4_k_m_xeon_amx.json",
    "llama_cpp/qwen3moe_random_q4_0_spr.json",
]
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_CPP_MEASURES = {
    "decode": "one stream, decode",
    "concurrent": "8 concurrent streams",
    "prefill": "430-token prefill",
}


def amd_generation(family: int | None, model: int | None) -> str | None:
    """Zen 3 and Zen 4 share family 25 (0x19); Zen 4's models are 0x10-0x1f, 0x60-0x7f and 0xa0-0xaf."""
    if family == 26:
        return "Zen 5"
    if family != 25:
        return None
    if model is None:
        return "Zen 3/4"
    return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF else "Zen 3"


def host(machine: dict) -> str:
    """A table's short name for the CPU a summary ran on."""
    name = machine["cpu"].replace("(R)", "").replace(" Processor", "")
    generation = amd_generation(machine.get("family"), machine.get("model")) if name.startswith("AMD") else None
    return name + (f" ({generation})" if generation else "") + (", AMX" if machine.get("amx") else "")


def llama_cpp() -> str:
    body = []
    for rel in LLAMA_CPP:
        d = load(rel)
        for key, label in LLAMA_CPP_MEASURES.items():
            m = d[key]
            ratio, floor = m["median_ratio"], d["floors"][key]
            body.append(
                [
                    host(d["machine"])
                    + ("" if d["model"] == EMBEDDED_GGUF else f"; {d['model'].removeprefix('SmolLM2-135M-Instruct.')}"),
                    label,
                    f"{num(median(m['fastgen_tokens_per_s']), 1)} tok/s",
                    f"{num(median(m['llama_cpp_tokens_per_s']), 1)} tok/s",
                    f"{per_repeat(m['fastgen_over_llama_cpp'])}; **{num(ratio)}×**",
                    f"≥ {num(floor, 1)}×: {'met' if ratio >= floor else '**unmet**'}",
                ]
            )
    head = ["host", "", "FastGen (median)", "llama.cpp (median)", "FastGen ÷ llama.cpp per repeat; median", "floor"]
    return rows(head, body)


QUANTIZATION = ["quantization/smollm2_zen5.json", "quantization/smollm2_zen4.json"]


def quantization() -> str:
    body = []
    for rel in QUANTIZATION:
        d = load(rel)
        for mode, entry in d["modes"].items():
            cells = [host(d["meta"]["machine"]), f"`{mode}`", f"{num(entry['weight_bytes'] / 2**20, 0)} MiB"]
            for key in LLAMA_CPP_MEASURES:
                m = entry[key]
                cells.append(f"{num(median(m['tokens_per_s']), 1)} tok/s; **{num(m['median_ratio'])}×**")
            body.append(cells)
    head = ["host", "--quantization", "weights held"]
    return rows(head + [f"{label}; ÷ `none`" for label in LLAMA_CPP_MEASURES.values()], body)


# ---- 14. speculative decoding ----
SPECULATIVE = ["speculative/smollm2_ngram_spr.json", "speculative/smollm2_ngram_f32_spr.json"]


def speculative() -> str:
    body = []
    for rel in SPECULATIVE:
        d = load(rel)
        for level, r in d["levels"].items():
            plain, spec = r["plain"], r["speculative"]
            per = [div(a, b) for a, b in zip(spec["tokens_per_s"], plain["tokens_per_s"])]
            body.append(
                [
                    d["dtype"],
                    level,
                    f"{num(plain['median_tokens_per_s'], 1)} / {num(spec['median_tokens_per_s'], 1)}",
                    f"{per_repeat(per)}; **{num(median(per))}×**",
                    f"{num(spec['acceptance_rate'])}, {num(spec['accepted_per_verify'])}",
                    "yes" if r["same_tokens"] else "no",
                ]
            )
    head = ["dtype", "streams", "tok/s plain / n-gram", "n-gram ÷ plain per repeat; median"]
    return rows(head + ["acceptance, accepted per verify", "same greedy tokens"], body)


# ---- 15. multi-LoRA ----
LORA = ["lora/smollm2_amx_tiles_nopc.json", "lora/smollm2_zen4_nopc.json"]


def lora() -> str:
    body = []
    for rel in LORA:
        d = load(rel)
        seconds, tokens = d["seconds"], d["tokens_per_s_median"]
        cache = "off" if d["settings"].get("no_prefix_caching") else "on"
        for name in seconds:
            per = [div(b, a) for a, b in zip(seconds[name], seconds["base"])]  # throughput against the base's
            loss = "" if name == "base" else f"{per_repeat(per)}; **{num(100 * (1 - median(per)), 0)}%**"
            k = name.removeprefix("lora-")
            mix = name if name == "base" else f"{k} adapter{'' if k == '1' else 's'}"
            cells = [host(d["info"]["machine"]), cache, mix, str(len(seconds[name])), f"{num(tokens[name], 1)} tok/s"]
            body.append(cells + [loss])
    head = ["host", "prefix cache", "mix", "repeats", "generated tok/s (median)", "÷ base per repeat; throughput lost"]
    return rows(head, body)


# ---- 16. structured output ----
STRUCTURED = ["structured/smollm2_zen5.json"]


def structured() -> str:
    body = []
    for rel in STRUCTURED:
        d = load(rel)
        off, on = d["decode_step_ms_off"], d["decode_step_ms_on"]
        lost = per_repeat([100 * x for x in d["throughput_lost"]], 1)
        body.append(
            [
                host(d["meta"]["machine"]),
                f"{num(d['fill_ms_per_step'])} + {num(d['apply_ms_per_step'])} ms",
                f"{num(d['compile_ms_per_schema'], 1)} ms",
                f"{num(median(off), 1)} → {num(median(on), 1)} ms",
                f"{lost}; **{num(100 * d['median_throughput_lost'], 1)}%**",
            ]
        )
    head = ["host", "mask per step (fill + apply), 64 schemas", "compile per schema", "decode step off → on"]
    return rows(head + ["throughput lost per repeat; median"], body)


# ---- 17. served against vLLM ----
SERVED_VLLM = [
    "against_vllm/defaults_xeon_amx.json",
    "against_vllm/defaults_xeon_amx_int8.json",
    "against_vllm/defaults_zen4.json",
]
SERVED_FLOORS = {"throughput": (1.0, 1.2), "ttft_p50_ms": 0.8}  # (at 1 client, from 4 up); TTFT from 4 up


def served_vllm() -> str:
    """Per summary and FastGen system, a row with its figures over vLLM's defaults at each client count (cells read
    1 / 4 / 16 / 64 clients): the paired ratios of requests/s and effective requests/s, TTFT p50 and the inter-token
    p95 of both, and the issue's floors each count misses."""
    body = []
    for rel in SERVED_VLLM:
        d = load(rel)
        for pair, by_clients in d["ratios"].items():
            fastgen, vllm = pair.split("/")
            cells: dict[str, list[str]] = {"req/s": [], "effective": [], "ttft": [], "gap": []}
            unmet_at = []
            for clients, r in by_clients.items():
                f, v = d["medians"][fastgen][clients], d["medians"][vllm][clients]
                c = int(clients)
                floor = SERVED_FLOORS["throughput"][c > 1]
                unmet = [label for k, label in (("throughput", "req/s"), ("effective", "eff")) if r[k] < floor]
                unmet += ["gap"] if f["itl_p95_ms"] > v["itl_p95_ms"] else []
                unmet += ["TTFT"] if c > 1 and r["ttft_p50_ms"] > SERVED_FLOORS["ttft_p50_ms"] else []
                cells["req/s"].append(num(r["throughput"]))
                cells["effective"].append(num(r["effective"]))
                cells["ttft"].append(f"{num(f['ttft_p50_ms'], 0)}·{num(v['ttft_p50_ms'], 0)}")
                cells["gap"].append(f"{num(f['itl_p95_ms'], 0)}·{num(v['itl_p95_ms'], 0)}")
                unmet_at += [f"{clients} {'+'.join(unmet)}"] if unmet else []
            body.append(
                [f"{fastgen}, {host(d['meta']['machine'])}, {d['meta']['commit']}"]
                + [" / ".join(cells[k]) for k in cells]
                + ["met" if not unmet_at else "**unmet**: " + "; ".join(unmet_at)]
            )
    head = ["FastGen, host", "req/s ÷ vLLM", "effective ÷ vLLM", "TTFT p50 ms, FastGen·vLLM", "gap p95 ms"]
    return rows(head + ["floors"], body)


# ---- 18. block tables ----
def block_tables() -> str:
    d = load("block_tables.json")
    body = [
        [
            f"{r['seqs']} × {r['blocks']}",
            f"{num(r['whole_us'], 0)} · {num(r['kept_us'], 0)}; **{num(r['whole_us'] / r['kept_us'])}×**",
            f"{num(r['encode_whole_us'], 0)} · {num(r['encode_kept_us'], 0)}",
            f"{r['broadcast_whole']} · {r['broadcast_kept']}",
        ]
        for r in d["rows"]
    ]
    head = ["sequences × blocks", "tables µs, whole · kept; ratio", "broadcast encoding µs", "numbers broadcast"]
    return rows(head, body)


TABLES: dict[str, Callable[[], str]] = {
    "offline-transformers": offline_transformers,
    "offline-vllm": offline_vllm,
    "offline-avx2": offline_avx2,
    "serving-splitfuse": serving_splitfuse,
    "balancer-overhead": balancer_overhead,
    "http-overhead": http_overhead,
    "chat": chat,
    "failover": failover,
    "failover-totals": failover_totals,
    "fuzz": fuzz,
    "overload": overload,
    "slo-floors": slo_floors,
    "slo-provenance": slo_provenance,
    "tensor-parallel": tensor_parallel,
    "llama-cpp": llama_cpp,
    "quantization": quantization,
    "moe": moe,
    "moe-cold": moe_cold,
    "speculative": speculative,
    "lora": lora,
    "structured": structured,
    "served-vllm": served_vllm,
    "block-tables": block_tables,
}


def blocks(text: str) -> dict[str, str]:
    """NAME -> the text between a block's markers (without its final newline)."""
    return {m["name"]: m["body"].rstrip("\n") for m in BLOCK.finditer(text)}


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: f"<!-- table: {m['name']} -->\n{TABLES[m['name']]()}\n<!-- /table -->", text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastgen.benchmarks.results_tables", description=__doc__)
    p.add_argument("--write", action="store_true", help="rewrite RESULTS.md's table blocks from the summaries")
    p.add_argument("names", nargs="*", help="tables to print (default: all)")
    args = p.parse_args(argv)
    if args.write:
        RESULTS_MD.write_text(rewrite(RESULTS_MD.read_text()))
        return 0
    for name in args.names or TABLES:
        print(f"<!-- table: {name} -->\n{TABLES[name]()}\n<!-- /table -->\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
