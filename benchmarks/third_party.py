"""A third-party client's view of an OpenAI-compatible server (FastGen's HTTP API, or vLLM): NVIDIA's AIPerf
(`aiperf` on PyPI), closed loop at a few concurrencies, synthetic prompts of real text (Shakespeare) cut to an exact
token count by the served model's own tokenizer (a local folder: nothing is fetched), exact generation lengths
(ignore_eos, min_tokens), greedy, streamed, token counts from the server's usage blocks.

    python -m fastgen.benchmarks.third_party --url http://127.0.0.1:8000 --model smollm2-135m \\
        --isl 300 --osl 64 --clients 1,2,4 --requests 8,12,16 --json benchmarks/results/aiperf_fastgen.json
    python -m fastgen.benchmarks.third_party --url ... --dry-run    # print the aiperf command, run nothing

AIPerf lives in its own environment, never in FastGen's (it pins its own transformers and friends):

    python -m venv ~/venv-bench && ~/venv-bench/bin/pip install aiperf==0.13.0

This wrapper only builds the command line, runs that environment's `aiperf profile` (one sweep: --concurrency and
--request-count zipped), and reads back its per-concurrency exports (ARTIFACTS/<variation>/profile_export_aiperf.json,
ARTIFACTS defaulting to benchmarks/out/aiperf/<the summary's name, or a timestamp>): TTFT, end-to-end and
inter-token p50/p99, requests/s and output tokens/s, into a summary with the command, commit, date and machine, and
a Markdown table. AIPerf's own figures are not ours: its TTFT starts when its worker sends, its throughput spans its
own phase timing, and its processes (a controller, workers, record processors) share the two cores with the server.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

from ..launch import processes
from .provenance import RAW_DIR, run_info

DEFAULT_AIPERF = Path.home() / "venv-bench" / "bin" / "aiperf"
# (our name, AIPerf's metric, the statistic, scale)
FIELDS = (
    ("ttft_p50_ms", "time_to_first_token", "p50", 1.0),
    ("ttft_p99_ms", "time_to_first_token", "p99", 1.0),
    ("e2e_p50_ms", "request_latency", "p50", 1.0),
    ("e2e_p99_ms", "request_latency", "p99", 1.0),
    ("itl_p50_ms", "inter_token_latency", "p50", 1.0),
    ("throughput", "request_throughput", "avg", 1.0),
    ("token_throughput", "output_token_throughput", "avg", 1.0),
    ("requests", "request_count", "avg", 1.0),
    ("error_rate", "request_error_rate", "avg", 0.01),  # AIPerf reports percent
)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def aiperf_command(args: argparse.Namespace, artifacts: Path) -> list[str]:
    if len(args.requests) != len(args.clients):
        raise ValueError("--requests needs one count per --clients value")
    cmd = [str(args.aiperf), "profile", "--model", args.model, "--url", args.url, "--endpoint-type", "completions"]
    cmd += ["--streaming", "--tokenizer", str(args.tokenizer), "--use-server-token-count"]
    cmd += ["--isl", str(args.isl), "--isl-stddev", "0", "--osl", str(args.osl), "--osl-stddev", "0"]
    for extra in ("ignore_eos:true", f"min_tokens:{args.osl}", "temperature:0"):
        cmd += ["--extra-inputs", extra]
    cmd += ["--concurrency", ",".join(map(str, args.clients)), "--request-count", ",".join(map(str, args.requests))]
    if len(args.clients) > 1:
        cmd += ["--sweep-type", "zip"]
    cmd += ["--warmup-request-count", str(args.warmup), "--random-seed", str(args.seed)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    cmd += ["--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(artifacts)]
    return cmd


def aiperf_env() -> dict[str, str]:
    """The environment for aiperf: no HF offline switches (with them AIPerf looks the tokenizer up as a hub repo
    in the cache and fails on a local folder; a local folder is read without any network either way)."""
    return {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}


def read_exports(artifacts: Path) -> dict[str, dict[str, float]]:
    """clients -> figures, from every variation's profile_export_aiperf.json (a single run writes it at the top)."""
    out = {}
    for path in sorted(artifacts.glob("**/profile_export_aiperf.json")):
        if "phases" in path.parts or "aggregate" in path.parts:
            continue
        data = json.loads(path.read_text())
        values = (data.get("run_info") or {}).get("variation_values") or {}
        clients = values.get("phases.profiling.concurrency") or concurrency_of(data)
        row = {}
        for name, metric, stat, scale in FIELDS:
            value = (data.get(metric) or {}).get(stat)
            row[name] = value * scale if value is not None else float("nan")
        row["export"] = str(path)
        out[str(clients)] = row
    return out


def concurrency_of(data: dict) -> int | None:
    for phase in (data.get("input_config") or {}).get("phases", []):
        if phase.get("kind") == "profiling" or phase.get("name") == "profiling":
            return phase.get("concurrency")
    return None


def markdown(rows: dict[str, dict[str, float]]) -> str:
    lines = [
        "| clients | requests | TTFT p50 (ms) | TTFT p99 (ms) | end-to-end p50 (ms) | inter-token p50 (ms) | req/s | "
        "output tok/s | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for clients in sorted(rows, key=int):
        r = rows[clients]
        lines.append(
            f"| {clients} | {r['requests']:.0f} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
            f"{r['e2e_p50_ms']:.1f} | {r['itl_p50_ms']:.2f} | {r['throughput']:.3f} | {r['token_throughput']:.1f} | "
            f"{r['error_rate']:.0%} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.third_party",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (default: %(default)s)")
    p.add_argument("--model", default="smollm2-135m", help="the model name requests carry (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="the served model's local folder (default: smollm2-135m's)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $FASTGEN_API_KEY, else none)")
    p.add_argument("--isl", type=int, default=300, help="prompt tokens, exact (default: %(default)s)")
    p.add_argument("--osl", type=int, default=64, help="generated tokens, exact (default: %(default)s)")
    p.add_argument("--clients", type=int_list, default=[1, 2, 4], help="concurrencies (default: 1,2,4)")
    p.add_argument("--requests", type=int_list, default=None, help="per concurrency (default: 4 x clients + 4)")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per concurrency (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aiperf", type=Path, default=DEFAULT_AIPERF, help="the aiperf executable (default: %(default)s)")
    p.add_argument("--artifacts", type=Path, default=None, help="AIPerf's output folder (default: benchmarks/out/...)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before aiperf is stopped")
    p.add_argument("--dry-run", action="store_true", help="print the aiperf command and exit")
    args = p.parse_args(argv)
    args.argv = argv
    args.requests = args.requests or [4 * c + 4 for c in args.clients]
    args.api_key = args.api_key or os.environ.get("FASTGEN_API_KEY")
    if args.tokenizer is None:
        from ..replica.weights import resolve_model

        args.tokenizer = str(resolve_model("smollm2-135m"))
    if args.artifacts is None:
        name = args.json.stem if args.json else f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
        args.artifacts = RAW_DIR / "aiperf" / name
    return args


def run_group(cmd: list[str], env: dict[str, str], timeout: float) -> int:
    """Runs cmd in its own process group, its output on our terminal; on timeout or interrupt the whole group
    (AIPerf's services) goes."""
    aiperf = processes.start("aiperf", cmd, env=env, new_session=True)
    try:
        return aiperf.popen.wait(timeout=timeout)
    except BaseException:
        aiperf.stop(grace=30)
        raise


def main(argv=None) -> int:
    args = parse_args(argv)
    cmd = aiperf_command(args, args.artifacts)
    shown = shlex.join(["***" if i and cmd[i - 1] == "--api-key" else c for i, c in enumerate(cmd)])
    print(shown, flush=True)
    if args.dry_run:
        return 0
    if not Path(args.aiperf).exists():
        print(f"{args.aiperf} not found: install AIPerf in its own environment (see --help)", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    rc = run_group(cmd, aiperf_env(), args.timeout)
    if rc != 0:
        print(f"aiperf exited {rc}; its logs are under {args.artifacts}", file=sys.stderr)
        return rc or 1
    rows = read_exports(args.artifacts)
    print(markdown(rows))
    if args.json:
        meta = run_info("third_party", args.argv) | {
            "client": "aiperf",
            "aiperf_command": shown,
            "url": args.url,
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "artifacts": str(args.artifacts),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "by_clients": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
