"""The HTTP-overhead benchmark (benchmarks/http_overhead.py) and what it stands on: the load generator's OpenAI
backend against a server that streams as FastGen's balancer does (a `"usage": null` on every chunk, a usage-only
chunk with no choices, `data: [DONE]`, HTTP/1.1 chunked with keep-alive), fixed-length prompts, the paired
arithmetic, the third-party client's command line; and, marked slow, the whole command at toy size against a
deployment of the tiny model that it starts itself."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fastgen.benchmarks import http_overhead, third_party
from fastgen.benchmarks.backends import OpenAIBackend, served_models
from fastgen.benchmarks.http_overhead import Run, markdown, medians, paired
from fastgen.benchmarks.loadgen import fixed_requests
from fastgen.benchmarks.workload import BenchRequest, Workload


# ---- a server that streams like FastGen's balancer ----
class FastGenLike(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, chunked bodies
    seen: list[dict]  # set per server: one entry per request
    connections: list[int]
    drop_after_response = False  # close the connection without saying so (a server's idle timeout)
    usage_on_last_choice = (
        False  # llama.cpp's shape: the usage rides on a last choice with no text, no usage-only event
    )

    def setup(self):
        super().setup()
        self.connections.append(1)

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.seen.append({"path": self.path, "auth": self.headers.get("Authorization")})
        body = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": req})
        n = req["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": req["model"]}

        def event(choices, usage=None):
            data = base | {"choices": choices, "usage": usage}
            self.chunk(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")

        def choice(text, finish=None):
            return [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]

        event(choice(" a"))
        event(choice(" bc"))  # two tokens in one event (the first one's text was held back): usage fixes the count
        for i in range(n - 4):
            event(choice(f" t{i}"))
        usage = {"prompt_tokens": len(req["prompt"]), "completion_tokens": n, "total_tokens": len(req["prompt"]) + n}
        if self.usage_on_last_choice:
            event(choice(" end"))
            event(choice("", "length"), usage)
        else:
            event(choice(" end", "length"))
            event([], usage)
        self.chunk(b"data: [DONE]\n\n")
        self.chunk(b"")  # the chunked body's end
        if self.drop_after_response:
            self.close_connection = True

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


@pytest.fixture
def server():
    handler = type("Handler", (FastGenLike,), {"seen": [], "connections": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    httpd.handler = handler
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def url(server, suffix: str = "") -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{suffix}"


@pytest.mark.parametrize("suffix", ["", "/v1", "/v1/"])
def test_openai_backend_reads_a_fastgen_stream(server, suffix):
    backend = OpenAIBackend(url(server, suffix), "tiny", api_key="sk-test")
    rec = backend.run_blocking(BenchRequest(0, [5, 6, 7, 8], 8))
    assert rec.ok, rec.error
    assert len(rec.token_times) == 8  # 7 events, one of them with two tokens: the usage block adds the missing one
    assert rec.token_times == sorted(rec.token_times) and rec.end >= rec.token_times[-1] > rec.start
    seen = server.handler.seen[-1]
    assert seen["path"] == "/v1/completions" and seen["auth"] == "Bearer sk-test"
    body = seen["body"]
    assert body["prompt"] == [5, 6, 7, 8] and body["model"] == "tiny" and body["stream"] is True
    assert body["max_tokens"] == body["min_tokens"] == 8 and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}


def test_openai_backend_counts_tokens_a_llama_cpp_stream_merged(server):
    """llama.cpp sends the usage with its last choice (no usage-only event) and, holding back bytes of unfinished
    UTF-8 characters, at times dozens of tokens in one event: the usage still fills the count."""
    server.handler.usage_on_last_choice = True
    rec = OpenAIBackend(url(server), "tiny").run_blocking(BenchRequest(0, [5, 6, 7, 8], 8))
    assert rec.ok, rec.error
    assert len(rec.token_times) == 8 and rec.token_times == sorted(rec.token_times)


@pytest.mark.parametrize("keepalive, connections", [(True, 1), (False, 3)])
def test_openai_backend_keeps_one_connection_per_thread_when_asked(server, keepalive, connections):
    backend = OpenAIBackend(url(server), "tiny", keepalive=keepalive)
    recs = [backend.run_blocking(BenchRequest(i, [1, 2, 3], 5)) for i in range(3)]
    assert all(r.ok and len(r.token_times) == 5 for r in recs), [r.error for r in recs]
    assert len(server.handler.connections) == connections


def test_openai_backend_replaces_a_kept_connection_the_server_closed(server):
    server.handler.drop_after_response = True
    backend = OpenAIBackend(url(server), "tiny", keepalive=True)
    recs = [backend.run_blocking(BenchRequest(i, [1, 2, 3], 5)) for i in range(3)]
    assert all(r.ok and len(r.token_times) == 5 for r in recs), [r.error for r in recs]
    assert len(server.handler.connections) == 3


def test_served_models_lists_the_names(server):
    assert served_models(url(server, "/v1"), api_key="k") == ["tiny"]
    assert server.handler.seen[-1] == {"path": "/v1/models", "auth": "Bearer k"}


# ---- requests of fixed lengths ----
def test_fixed_requests_are_exact_fresh_per_tag_and_reproducible(tiny_model_dir):
    w = Workload("40x6", 40, 6)
    a = fixed_requests(w, 5, str(tiny_model_dir), seed=1, tag="grpc-r0-c1")
    assert [len(r.prompt) for r in a] == [40] * 5 and {r.max_new_tokens for r in a} == {6}
    assert a == fixed_requests(w, 5, str(tiny_model_dir), seed=1, tag="grpc-r0-c1")
    b = fixed_requests(w, 5, str(tiny_model_dir), seed=1, tag="http-r0-c1")
    assert all(x.prompt[0:3] != y.prompt[0:3] for x, y in zip(a, b))  # the header differs from the first tokens on
    assert fixed_requests(w, 5, str(tiny_model_dir), seed=2, tag="grpc-r0-c1") != a  # a seed picks the text


# ---- the arithmetic ----
def fake(path, clients, repeat, ttft, e2e, tput):
    return Run(path, clients, repeat, 10, 0, ttft, e2e, 5.0, tput, tput * 6)


def test_medians_and_paired_differences():
    runs = []
    for r, drift in enumerate((0.0, 10.0, 20.0)):  # the machine slows down: pairing removes it
        runs += [
            fake("grpc", 1, r, 100 + drift, 1000 + drift, 1.0),
            fake("http", 1, r, 102 + drift, 1003 + drift, 0.99),
        ]
        runs += [fake("grpc", 4, r, 300 + drift, 2000, 2.0), fake("http", 4, r, 301 + drift, 2001, 1.98)]
    m = medians(runs)
    assert m["grpc"]["1"]["ttft_p50_ms"] == 110 and m["grpc"]["1"]["ttft_p50_ms_min"] == 100
    assert m["http"]["4"]["throughput"] == pytest.approx(1.98) and m["http"]["4"]["repeats"] == 3
    p = paired(runs)
    assert p["1"]["ttft_p50_added_ms"] == pytest.approx(2) and p["1"]["e2e_p50_added_ms"] == pytest.approx(3)
    assert p["1"]["throughput_ratio"] == pytest.approx(0.99) and p["1"]["pairs"] == 3
    assert p["all"]["pairs"] == 6 and p["all"]["ttft_p50_added_ms"] == pytest.approx(1.5)
    text = markdown(m, p)
    assert "| 1 | grpc | 110.0 (100.0–120.0) |" in text and "| 4 | +1.0 | +1.0 | +0.00 | ×0.990 | 3 |" in text
    assert "| all | +1.5 |" in text


def test_a_run_without_a_pair_is_left_out_of_the_differences():
    p = paired([fake("grpc", 1, 0, 1, 1, 1.0), fake("http", 1, 0, 2, 2, 1.0), fake("grpc", 2, 0, 1, 1, 1.0)])
    assert set(p) == {"1", "all"} and p["all"]["pairs"] == 1


def test_grpc_and_http_go_together(capsys):
    with pytest.raises(SystemExit):
        http_overhead.parse_args(["--grpc", "127.0.0.1:1", "--tokenizer", "x"])
    assert "--grpc and --http go together" in capsys.readouterr().err


# ---- the third-party client (AIPerf in its own environment) ----
def test_third_party_command_line(tmp_path):
    args = third_party.parse_args(
        ["--url", "http://127.0.0.1:8000", "--tokenizer", "/m", "--clients", "1,2,4", "--artifacts", str(tmp_path)]
    )
    cmd = third_party.aiperf_command(args, tmp_path)
    text = " ".join(cmd)
    assert (
        cmd[1] == "profile" and "--model smollm2-135m --url http://127.0.0.1:8000 --endpoint-type completions" in text
    )
    assert "--streaming --tokenizer /m" in text and "--isl 300 --isl-stddev 0 --osl 64 --osl-stddev 0" in text
    assert "--extra-inputs ignore_eos:true --extra-inputs min_tokens:64" in text
    assert "--concurrency 1,2,4 --request-count 8,12,20 --sweep-type zip" in text


def test_third_party_reads_aiperf_exports(tmp_path):
    def export(folder: str, clients: int, ttft: float) -> None:
        data = {
            "run_info": {"variation_values": {"phases.profiling.concurrency": clients}},
            "time_to_first_token": {"p50": ttft, "p99": ttft * 2},
            "request_latency": {"p50": 900.0, "p99": 950.0},
            "inter_token_latency": {"p50": 12.5},
            "request_throughput": {"avg": 0.5 * clients},
            "output_token_throughput": {"avg": 32.0 * clients},
            "request_count": {"avg": 8},
            "request_error_rate": {"avg": 0.0},
        }
        (tmp_path / folder / "phases" / "profiling").mkdir(parents=True)
        (tmp_path / folder / "profile_export_aiperf.json").write_text(json.dumps(data))
        (tmp_path / folder / "phases" / "profiling" / "profile_export_aiperf.json").write_text("{}")  # ignored

    export("concurrency_1__requests_8", 1, 80.0)
    export("concurrency_2__requests_12", 2, 95.0)
    rows = third_party.read_exports(tmp_path)
    assert set(rows) == {"1", "2"} and rows["2"]["ttft_p50_ms"] == 95.0 and rows["2"]["throughput"] == 1.0
    assert math.isclose(rows["1"]["itl_p50_ms"], 12.5)
    assert "| 2 | 8 | 95.0 | 190.0 | 900.0 | 12.50 | 1.000 | 64.0 | 0% |" in third_party.markdown(rows)


# ---- the whole command at toy size (needs the HTTP API: fastgen-deploy start --http-port) ----
@pytest.mark.slow
def test_http_overhead_command_at_toy_size(tiny_model_dir, tmp_path):
    summary, raw = tmp_path / "http_overhead.json", tmp_path / "raw.json"
    cmd = [sys.executable, "-m", "fastgen.benchmarks.http_overhead", "--model", str(tiny_model_dir)]
    cmd += ["--dtype", "float32", "--kv-cache-memory", "8MiB", "--threads", "1", "--start-timeout", "120"]
    cmd += ["--workload", "16x4", "--clients", "1,2", "--requests", "3", "--repeats", "2", "--quiet-cores", "0"]
    cmd += ["--json", str(summary), "--raw", str(raw)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| 1 | grpc |" in done.stdout and "| 2 | http |" in done.stdout and "| all |" in done.stdout
    data = json.loads(summary.read_text())
    assert data["meta"]["command"].startswith("python -m fastgen.benchmarks.http_overhead --model")
    assert data["meta"]["commit"] and data["meta"]["machine"]["cores"] >= 1 and data["meta"]["served_model"]
    assert set(data["medians"]) == {"grpc", "http"} and set(data["medians"]["http"]) == {"1", "2"}
    assert data["paired"]["all"]["pairs"] == 4 and data["paired"]["1"]["throughput_ratio"] > 0
    assert len(data["runs"]) == 8 and all(r["failed"] == 0 and r["requests"] == 3 for r in data["runs"])
    runs = json.loads(raw.read_text())["runs"]
    assert all(len(rec["token_times"]) == 4 and rec["prompt_tokens"] == 16 for r in runs for rec in r["records"])
    assert "deployment state and logs kept" not in done.stderr  # it stopped cleanly and left nothing behind
