"""The serving benchmark's load generator: statistics and SLA on synthetic timings, closed- and open-loop drivers
on a fake backend, the OpenAI streaming backend against a fake server, and a smoke run of the comparison
command on the tiny model."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from fastgen.benchmarks import balancer_overhead, provenance, report
from fastgen.benchmarks.backends import OpenAIBackend
from fastgen.benchmarks.loadgen import RunResult, closed_loop, open_loop
from fastgen.benchmarks.serving import default_raw, parse_system, run_tag
from fastgen.benchmarks.stats import (
    SLA,
    RequestRecord,
    back_to_back,
    inter_token_times,
    meets_sla,
    percentile,
    summarize,
)
from fastgen.benchmarks.workload import BenchRequest, make_requests, parse_workload, sample_length

from .helpers import require_tool


def record(start: float, ttft: float, gaps: list[float], prompt: int = 100) -> RequestRecord:
    times = [start + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(start=start, token_times=times, prompt_tokens=prompt, end=times[-1])


# ---- statistics ----
def test_each_repeat_of_a_serving_run_sends_fresh_prompts():
    """Repeats run against deployments that stay up, whose prefix caches would otherwise serve every prompt of a
    repeat from the one before: no two repeats of a point share a prompt's first block (16 tokens), and a repeat's
    prompts are the same whenever it is run again."""
    from fastgen.replica.weights import resolve_model

    model, system = resolve_model("smollm2-135m"), parse_system("slo-b2048")
    firsts = []
    for repeat in (None, 0, 1, 2):
        tag = run_tag("C2", system, 8, 0, repeat)
        assert tag == run_tag("C2", system, 8, 0, repeat)
        firsts.append({tuple(r.prompt[:16]) for r in make_requests(parse_workload("C2"), 6, model, 0, tag)})
    assert firsts[0] == firsts[1]  # a single run is repeat 0
    assert all(not (a & b) for i, a in enumerate(firsts[1:]) for b in firsts[i + 2 :])
    assert run_tag("C2", parse_system("vllm"), 8, 0, 1) != run_tag("C2", parse_system("vllm"), 8, 0, 1)


def test_percentile_matches_numpy():
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 50, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert math.isnan(percentile([], 50))


def test_sla_first_token_deadline_is_prompt_over_p():
    # P = 100 tokens/s: a 200-token prompt may take 2 s to its first token.
    assert meets_sla(200, 1.99, [0, 0.1, 0.2], 100.0, 2.0)
    assert not meets_sla(200, 2.01, [0, 0.1, 0.2], 100.0, 2.0)


def test_sla_ema_tolerates_one_stall_but_not_a_slow_stream():
    fast = [0.1] * 30
    one_stall = fast[:15] + [1.5] + fast[15:]  # EMA 0.1 jumps by 2/17 * 1.4 to ≈ 0.26 s: under 0.5, over 0.25
    times = np.cumsum([0.0] + one_stall).tolist()
    assert meets_sla(10, 0.05, times, 100.0, 2.0)
    assert not meets_sla(10, 0.05, times, 100.0, 4.0)  # limit 0.25 s
    slow = np.cumsum([0.0] + [0.6] * 20).tolist()
    assert not meets_sla(10, 0.05, slow, 100.0, 2.0)


def test_benchmark_scores_with_the_servers_sla_definition():
    from fastgen.server import sla

    assert meets_sla is sla.meets_sla  # one definition for metrics and benchmark


def test_sla_with_multi_token_chunks():
    # Three tokens in one chunk at t = 1.0: gaps 0, 0 then a normal gap.
    times = [1.0, 1.0, 1.0, 1.2, 1.4]
    assert inter_token_times(times) == pytest.approx([0, 0, 0.2, 0.2])
    assert meets_sla(10, 0.05, times, 100.0, 4.0)


def test_summarize_throughput_effective_and_failures():
    good = [record(i, 0.1, [0.1] * 9) for i in range(3)]  # starts 0, 1, 2; each lasts 1.0 s
    slow = record(1.5, 0.1, [0.4] * 9)  # meets R = 2 (0.4 < 0.5), misses R = 4
    failed = RequestRecord(start=0.5, token_times=[], prompt_tokens=100, error="UNAVAILABLE")
    s = summarize(good + [slow, failed], SLA(100.0, (2.0, 4.0)))
    duration = (1.5 + 0.1 + 3.6) - 0.0
    assert s.requests == 5 and s.failed == 1
    assert s.duration_s == pytest.approx(duration)
    assert s.throughput == pytest.approx(4 / duration)
    assert s.effective["2"] == pytest.approx(4 / duration * 4 / 5)  # failures count as missing the SLA
    assert s.effective["4"] == pytest.approx(4 / duration * 3 / 5)
    assert s.sla_missed["4"] == pytest.approx(0.4)
    assert s.ttft["p50"] == pytest.approx(0.1)
    assert s.inter_token["p99"] == pytest.approx(np.percentile([0.1] * 27 + [0.4] * 9, 99))
    assert s.latency["p50"] == pytest.approx(1.0)


# ---- workloads ----
def test_lengths_are_normal_with_30_percent_sd():
    import random

    rng = random.Random(0)
    xs = [sample_length(rng, 600) for _ in range(4000)]
    assert np.mean(xs) == pytest.approx(600, rel=0.03)
    assert np.std(xs) == pytest.approx(180, rel=0.08)
    assert min(xs) >= 1 and max(xs) <= 1200


def test_prompts_are_reproducible_real_text_of_the_drawn_length(tiny_model_dir):
    w = parse_workload("64x8")
    a = make_requests(w, 5, str(tiny_model_dir), seed=3, tag="t")
    b = make_requests(w, 5, str(tiny_model_dir), seed=3, tag="t")
    c = make_requests(w, 5, str(tiny_model_dir), seed=3, tag="other")
    assert a == b
    assert [len(r.prompt) for r in a] == [len(r.prompt) for r in c]  # the tag changes text, not lengths
    assert a[0].prompt[:4] != c[0].prompt[:4]  # a new tag: fresh prefixes for servers that cache them
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tiny_model_dir).decode(a[0].prompt)
    assert text.startswith("[t #0]") and len(text.split()) > 10


def test_parse_workload_and_system():
    assert parse_workload("C1").prompt_mean == 600 and parse_workload("C2").gen_mean == 128
    assert parse_workload("32x4").gen_mean == 4
    with pytest.raises(ValueError):
        parse_workload("C9")
    s = parse_system("splitfuse-r2")
    assert (s.scheduler, s.replicas, s.kind) == ("splitfuse", 2, "fastgen")
    assert parse_system("hf").kind == "hf"
    with pytest.raises(ValueError):
        parse_system("fifo")


# ---- drivers on a fake backend ----
class FakeBackend:
    """Each request takes `delay` seconds and yields one token at its end; remembers concurrency."""

    def __init__(self, delay: float = 0.01):
        self.delay = delay
        self.in_flight = self.peak = 0
        self.log: list[tuple[str, int]] = []

    async def run(self, req: BenchRequest, client: int = 0) -> RequestRecord:
        loop = asyncio.get_running_loop()
        rec = RequestRecord(start=loop.time(), token_times=[], prompt_tokens=len(req.prompt), client=client)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.log.append(("start", req.index))
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        rec.token_times.append(loop.time())
        rec.end = loop.time()
        return rec


def requests(n: int, first: int = 0) -> list[BenchRequest]:
    return [BenchRequest(i, [1, 2, 3], 1) for i in range(first, first + n)]


def test_closed_loop_warms_up_then_keeps_n_clients_busy():
    backend = FakeBackend()
    records = asyncio.run(closed_loop(backend, requests(10), requests(3, 100), clients=3))
    assert len(records) == 10 and backend.peak == 3
    started = [i for kind, i in backend.log]
    assert sorted(started[:3]) == [100, 101, 102]  # warm-ups first, all of them before any measured request
    assert started[3:] == list(range(10))
    assert {r.client for r in records} == {0, 1, 2}


def test_requests_laid_back_to_back_keep_their_figures_and_span_their_own_time():
    """A paired run's records of one system, spread over the run by the other systems' requests, laid end to end:
    the duration is the sum of their latencies and every first-token and inter-token time is unchanged."""
    spread = [record(0.0, 0.5, [0.1, 0.1]), record(10.0, 0.4, [0.2]), record(30.0, 0.6, [0.1, 0.3, 0.1])]
    failed = RequestRecord(start=50.0, token_times=[50.7], prompt_tokens=100, error="lost")
    laid = back_to_back(spread + [failed])
    assert [r.start for r in laid] == pytest.approx([0.0, 0.7, 1.3, 2.4])
    assert [r.ttft for r in laid[:3]] == pytest.approx([r.ttft for r in spread])
    assert [r.inter_token for r in laid[:3]] == [pytest.approx(r.inter_token) for r in spread]
    assert laid[3].end is None and laid[3].token_times == pytest.approx([3.1])
    s = summarize(laid[:3])
    assert s.duration_s == pytest.approx(0.7 + 0.6 + 1.1) and s.throughput == pytest.approx(3 / 2.4)
    assert summarize(spread).throughput == pytest.approx(3 / 31.1)  # what the spread records would have said


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_paired_orders_put_every_system_in_every_place_and_after_every_other_equally_often(n):
    from collections import Counter

    from fastgen.benchmarks.serving import balanced_order

    period = n if n % 2 == 0 else 2 * n
    orders = [balanced_order(n, row) for row in range(7, 7 + period)]  # any `period` consecutive requests
    assert all(sorted(order) == list(range(n)) for order in orders)
    places = Counter((system, place) for order in orders for place, system in enumerate(order))
    assert set(places.values()) == {period // n} and len(places) == n * n
    follows = Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert n == 1 or (len(follows) == n * (n - 1) and len(set(follows.values())) == 1)


def test_a_paired_repeat_sends_each_prompt_to_every_system_and_records_a_run_each(tmp_path, tiny_model_dir):
    """Every request goes to each system in turn, the same prompt, in an order that varies from request to request;
    each system gets a summary line for the repeat whose duration is its own requests' time."""
    import argparse

    from fastgen.benchmarks import serving
    from fastgen.benchmarks.serving import paired_repeat

    sent: list[tuple[str, int, tuple]] = []

    class Logged(FakeBackend):
        def __init__(self, name: str, delay: float):
            super().__init__(delay)
            self.name = name

        async def run(self, req: BenchRequest, client: int = 0) -> RequestRecord:
            sent.append((self.name, req.index, tuple(req.prompt)))
            return await super().run(req, client)

    delays = {"slo": 0.03, "splitfuse": 0.01, "prefill_first": 0.02}
    backends = [(parse_system(name), Logged(name, delay), {}) for name, delay in delays.items()]
    args = argparse.Namespace(quiet_cores=0, quiet_timeout=0, seed=0, requests=4, requests_scale=1.0, max_prompt=64)
    args.model, args.prompt_rate, args.token_rates = str(tiny_model_dir), 100.0, [2.0]
    args.out, args.raw, args.command_line = tmp_path / "out", tmp_path / "raw", "test"
    asyncio.run(paired_repeat(backends, "24x4", args, repeat=1))
    assert [(name, i) for name, i, _ in sent[:3]] == [(name, 10**6) for name in delays]  # one warm-up each
    measured = sent[3:]
    assert [i for _, i, _ in measured] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    names = [name for name, _, _ in measured]
    assert [names[k : k + 3] for k in range(0, 12, 3)] == [
        ["splitfuse", "prefill_first", "slo"],
        ["prefill_first", "slo", "splitfuse"],
        ["prefill_first", "splitfuse", "slo"],
        ["slo", "prefill_first", "splitfuse"],
    ]
    assert all(len({prompt for _, j, prompt in measured if j == i}) == 1 for i in range(4))  # the same prompt
    runs = {r["system"]: r for r in report.read_summary(tmp_path / "out")["runs"]}
    assert sorted(runs) == sorted(delays)
    for label, delay in delays.items():
        run = runs[label]
        assert (run["workload"], run["clients"], run["repeat"]) == ("24x4", 1, 1)
        assert run["meta"]["paired_with"] == list(delays) and run["meta"]["tag"] == "r1-24x4-paired-0"
        # its own requests laid end to end: their latencies add up to its duration (not the paired repeat's)
        records = json.loads((tmp_path / "raw" / "24x4" / label / "c1-1.json").read_text())["records"]
        own = sum(r["end"] - r["start"] for r in records)
        assert run["summary"]["requests"] == 4 and run["summary"]["duration_s"] == pytest.approx(own)
        assert own >= 4 * delay
    with pytest.raises(SystemExit, match="needs --clients 1"):
        serving.main(["run", "--paired", "--clients", "1,4", "--out", str(tmp_path / "x")])


def test_fresh_repeats_start_every_deployment_anew_for_each_repeat(tmp_path, monkeypatch):
    """--fresh: each repeat runs on deployments started for it (and stopped after it); without it one set of
    deployments serves every repeat."""
    import contextlib

    from fastgen.benchmarks import serving

    events: list[tuple] = []

    @contextlib.contextmanager
    def deployment(system, args):
        events.append(("up", system.label))
        yield (lambda: None), {}
        events.append(("down", system.label))

    async def interleaved(up, args, repeats):
        events.append(("run", [s.label for s, _, _ in up], list(repeats)))

    monkeypatch.setattr(serving, "system_under_test", deployment)
    monkeypatch.setattr(serving, "interleaved", interleaved)
    argv = ["run", "--systems", "slo,prefill_first", "--workloads", "C1", "--clients", "1", "--repeats", "2"]
    serving.run_repeats(serving.parse_args([*argv, "--fresh", "--out", str(tmp_path / "a")]))
    one_set = [("up", "slo"), ("up", "prefill_first"), ("down", "prefill_first"), ("down", "slo")]
    assert events == [
        *one_set[:2], ("run", ["slo", "prefill_first"], [0]), *one_set[2:],
        *one_set[:2], ("run", ["slo", "prefill_first"], [1]), *one_set[2:],
    ]  # fmt: skip
    events.clear()
    serving.run_repeats(serving.parse_args([*argv, "--out", str(tmp_path / "b")]))
    assert events == [*one_set[:2], ("run", ["slo", "prefill_first"], [0, 1]), *one_set[2:]]


def test_a_resumed_run_measures_only_what_is_missing(tmp_path, monkeypatch):
    """Repeats resumed after an interruption skip the client counts every system has already measured (one such
    count used to end the whole run) and measure the rest."""
    from fastgen.benchmarks import serving

    done = {("slo", 8, 0), ("prefill_first", 8, 0), ("slo", 4, 1)}
    ran = []

    async def one_run(system, backend, settings, workload, clients, args, repeat=None):
        ran.append((system.label, clients, repeat))

    class Backend:
        async def open(self):
            pass

        async def close(self):
            pass

    monkeypatch.setattr(serving, "has_run", lambda out, workload, label, n, k: (label, n, k) in done)
    monkeypatch.setattr(serving, "one_run", one_run)
    argv = ["run", "--systems", "slo,prefill_first", "--workloads", "C1", "--clients", "8,4", "--repeats", "2"]
    args = serving.parse_args([*argv, "--out", str(tmp_path)])
    asyncio.run(serving.interleaved([(s, Backend, {}) for s in args.systems], args, range(2)))
    everything = {(s, n, k) for s in ("slo", "prefill_first") for n in (8, 4) for k in (0, 1)}
    assert sorted(ran) == sorted(everything - done)


def test_open_loop_sends_on_schedule_regardless_of_completions():
    backend = FakeBackend(delay=0.2)
    records = asyncio.run(open_loop(backend, requests(8), rate=100.0, seed=1))
    assert len(records) == 8
    assert backend.peak >= 6  # at 100/s, arrivals do not wait for the 0.2 s requests to finish


# ---- the OpenAI streaming backend against a fake server ----
class FakeOpenAI(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["ignore_eos"] and isinstance(body["prompt"], list)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        events = [{"choices": [{"text": f" t{i}", "finish_reason": None}]} for i in range(n - 1)]
        events.append({"choices": [{"text": "", "finish_reason": "length"}]})  # last token's text held back
        events.append({"choices": [], "usage": {"completion_tokens": n}})
        for e in events:
            self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_openai_backend_times_every_streamed_token():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        backend = OpenAIBackend(f"http://127.0.0.1:{server.server_address[1]}", "m")
        rec = backend.run_blocking(BenchRequest(0, [5, 6, 7], 6))
    finally:
        server.shutdown()
    assert rec.ok, rec.error
    assert len(rec.token_times) == 6 and rec.prompt_tokens == 3
    assert rec.token_times == sorted(rec.token_times) and rec.end >= rec.token_times[-1]


# ---- report and balancer-overhead arithmetic ----
def fake_run(throughput: float, eff2: float, itl95: float) -> dict:
    pct = {"p50": 0.1, "p95": itl95, "p99": itl95}
    summary = {
        "requests": 10,
        "failed": 0,
        "duration_s": 10.0,
        "throughput": throughput,
        "token_throughput": 1.0,
        "effective": {"1": throughput, "2": eff2, "4": 0.0},
        "sla_missed": {"1": 0.0, "2": 0.5, "4": 1.0},
        "ttft": pct,
        "inter_token": pct,
        "latency": {"p50": 1.0, "p95": 2.0, "p99": 2.0},
    }
    return {"meta": {"date": "2026-12-01T00:00:00+00:00", "commit": "abc1234", "machine": MACHINE}, "summary": summary}


MACHINE = {"cpu": "Some CPU", "cores": 2, "amx": False, "avx512_bf16": True}


def test_report_finds_prefill_first_peak_and_checks_the_floor(tmp_path):
    runs = {
        ("splitfuse", 2): (0.5, 0.40, 0.2),
        ("splitfuse", 4): (0.6, 0.45, 0.25),
        ("prefill_first", 2): (0.5, 0.30, 0.5),
        ("prefill_first", 4): (0.55, 0.2, 0.6),
    }
    for (system, n), values in runs.items():
        report.add_run(tmp_path, "C1", system, n, None, fake_run(*values))
    text = report.report(tmp_path, "C1", plots=True)
    assert "Source: 4 runs" in text and "commit(s) abc1234; machine Some CPU x 2 (AVX512-BF16)" in text
    assert "prefill_first peaks (throughput) at 4 clients" in text
    assert "2.25×" in text and "← peak MET" in text  # 0.45 / 0.2 and 0.25 / 0.6 at the peak
    assert (tmp_path / "C1_latency_throughput.png").stat().st_size > 0
    assert (tmp_path / "C1_effective_throughput.png").stat().st_size > 0


def test_report_of_repeats_gives_medians_and_paired_ratios(tmp_path):
    for k, (sf_eff, pf_eff) in enumerate([(0.6, 0.3), (0.5, 0.4), (0.7, 0.35)]):
        for system, eff, itl in (("splitfuse", sf_eff, 0.2), ("prefill_first", pf_eff, 0.5)):
            report.add_run(tmp_path, "C1", system, 8, k, fake_run(0.7, eff, itl))
    report.add_run(tmp_path, "C1", "splitfuse", 8, 0, fake_run(0.7, 0.6, 0.2))  # the same point again: replaced
    assert len(report.read_summary(tmp_path)["runs"]) == 6
    assert report.has_run(tmp_path, "C1", "splitfuse", 8, 2) and not report.has_run(tmp_path, "C1", "splitfuse", 8)
    text = report.report(tmp_path, "C1", plots=False)
    assert "| splitfuse | 8 | 3 | 0.700 (0.700–0.700) | 0.600 (0.500–0.700) |" in text
    assert "effective R=2 2.00 (1.25–2.00)×" in text  # per-repeat ratios 2.0, 1.25, 2.0
    assert "P95 inter-token 0.40 (0.40–0.40)×" in text


def test_summary_file_is_one_line_per_run_without_records(tmp_path):
    result = RunResult(**fake_run(0.5, 0.4, 0.2), records=[{"start": 0.0, "token_times": [0.1]}])
    report.add_run(tmp_path, "C2", "hf", 2, None, result.summary_json())
    report.add_run(tmp_path, "C1", "splitfuse", 1, None, result.summary_json())
    text = (tmp_path / "summary.json").read_text()
    assert "records" not in text and "token_times" not in text
    lines = text.splitlines()
    assert len(lines) == 4 and lines[1].startswith('{"workload": "C1"') and lines[2].startswith('{"workload": "C2"')
    assert json.loads(text)["runs"][0]["summary"]["throughput"] == 0.5
    result.save_raw(tmp_path / "raw.json")
    assert json.loads((tmp_path / "raw.json").read_text())["records"] == result.records


def test_raw_records_go_to_the_ignored_folder():
    raw = default_raw(provenance.RESULTS_DIR / "serving-x")
    assert raw == provenance.RAW_DIR / "serving" / "serving-x"
    repo = provenance.BENCH_DIR.parent
    if not (repo / ".git").exists():
        require_tool(False, "not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(raw / "C1" / "c1.json")], cwd=repo)
    assert ignored.returncode == 0  # benchmarks/out/ is in .gitignore
    tracked = subprocess.run(
        ["git", "check-ignore", "-q", str(provenance.RESULTS_DIR / "x" / "summary.json")], cwd=repo
    )
    assert tracked.returncode == 1


def test_run_info_names_command_commit_date_and_machine():
    info = provenance.run_info("serving", ["run", "--clients", "4"])
    assert info["command"] == "python -m fastgen.benchmarks.serving run --clients 4"
    assert info["commit"] and info["date"].endswith("+00:00")
    assert {"cpu", "cores", "amx", "avx512_bf16"} <= set(info["machine"]) and info["machine"]["cores"] >= 1
    assert set(info["machine"]) <= {"cpu", "cores", "amx", "avx512_bf16", "family", "model"}  # family/model: x86
    assert provenance.machine_name(MACHINE) == "Some CPU x 2 (AVX512-BF16)"


def test_report_reads_offline_and_balancer_summaries(tmp_path):
    meta = {"command": "python -m fastgen.benchmarks.offline --threads 2", "commit": "abc1234", "machine": MACHINE}
    offline = {
        "W1": {
            "fastgen_s": [10.0, 12.0, 11.0],
            "transformers_s": [40.0, 44.0, 42.0],
            "speedup": 42 / 11,
            "vllm_s": [13.0, 11.5, 12.0],
            "speedup_vs_vllm": 12 / 11,
            "speedup_vs_vllm_first": 1.3,
        },
        "prefill_2048": {"model_flops": 30e9, "matmul_flops": 60e9},
        "prefill_512": {"model_flops": 40e9, "matmul_flops": 60e9},
        "meta": meta | {"threads": 2},
    }
    (tmp_path / "offline.json").write_text(json.dumps(offline))
    text = report.report_path(tmp_path / "offline.json")
    assert "`python -m fastgen.benchmarks.offline --threads 2`; commit abc1234; machine Some CPU x 2" in text
    # The first (cold) repeat beside every median; the prefill figures by length; the machine under the table.
    assert "| W1 | 2 | 11.0 (10.0–12.0) s | 10.0 s | 42.0 (40.0–44.0) s | 3.82× |" in text
    assert "| 12.0 (11.5–13.0) s | 13.0 s | 1.09× | 1.30× |" in text
    assert text.index("512-token prefill: 40 GFLOP/s") < text.index("2048-token prefill: 30 GFLOP/s")
    assert "Machine: Some CPU x 2 (AVX512-BF16)." in text


def test_balancer_overhead_verdict():
    R = balancer_overhead.Round
    rounds = [R("direct", i, 10.0 + i, 50.0, 80.0, 0) for i in range(3)]
    rounds += [R("balancer", i, 9.8 + i, 51.5, 83.0, 0) for i in range(3)]
    m = balancer_overhead.medians(rounds)
    v = balancer_overhead.verdict(m, balancer_overhead.paired(rounds))
    assert m["direct"]["throughput"] == 11.0 and m["balancer"]["throughput_min"] == 9.8
    assert v["throughput_drop"] == pytest.approx(0.2 / 11) and v["throughput_floor_met"]
    assert v["p50_added_ms"] == pytest.approx(1.5) and v["p50_floor_met"]
    assert v["paired_p50_added_ms"] == pytest.approx(1.5)
    assert v["paired_throughput_ratio"] == pytest.approx(10.8 / 11.0)


# ---- smoke run of the comparison command ----
@pytest.mark.slow
def test_serving_comparison_smoke(tiny_model_dir, tmp_path):
    """The one command, at a tiny size: a splitfuse deployment and the transformers baseline, one client, two
    requests each. The summary file gets one line per run (no per-request records), the raw records go to --raw;
    a resumed run does nothing and the report has the table and the plots."""
    out, raw = tmp_path / "results", tmp_path / "raw"
    env = dict(os.environ, FASTGEN_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        "-m",
        "fastgen.benchmarks.serving",
        "run",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--workloads",
        "24x4",
        "--systems",
        "splitfuse,hf",
        "--clients",
        "1",
        "--requests",
        "2",
        "--threads",
        "1",
        "--max-batch-tokens",
        "64",
        "--max-seqs",
        "8",
        "--quiet-cores",
        "0",
        "--no-progress",
        "--out",
        str(out),
        "--raw",
        str(raw),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {r["system"]: r for r in report.read_summary(out)["runs"]}
    assert sorted(runs) == ["hf", "splitfuse"] and sorted(p.name for p in out.iterdir()) == [
        "24x4_effective_throughput.png",
        "24x4_latency_throughput.png",
        "summary.json",
    ]
    for system, run in runs.items():
        assert (run["workload"], run["clients"], run["repeat"]) == ("24x4", 1, None)
        assert set(run) == {"workload", "system", "clients", "repeat", "meta", "summary"}
        assert run["summary"]["requests"] == 2 and run["summary"]["failed"] == 0
        assert {"throughput", "effective", "sla_missed", "ttft", "inter_token", "latency"} <= set(run["summary"])
        meta = run["meta"]
        assert meta["command"].startswith("python -m fastgen.benchmarks.serving run --model")
        assert meta["commit"] and meta["date"] and {"cpu", "cores", "amx"} <= set(meta["machine"])
        assert meta["raw"] == str(raw / "24x4" / system / "c1.json")
        records = json.loads((raw / "24x4" / system / "c1.json").read_text())["records"]
        assert len(records) == 2 and all(len(r["token_times"]) >= 1 for r in records)
    assert "| splitfuse | 1 | 2/2 |" in done.stdout and (out / "24x4_latency_throughput.png").exists()
    assert not list((tmp_path / "home").glob("bench-*"))  # stopped deployments leave no state behind
    again = subprocess.run(cmd + ["--no-report"], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "all runs already in" in again.stderr
