"""A smoke run of the offline comparison (benchmarks/offline.py) at a tiny size, so the command cannot rot."""

import json
import shlex
import statistics
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_offline_benchmark_smoke(tmp_path):
    """Both workloads, FastGen and transformers in turn, each repeat's own ratio, the medians, the first repeat,
    the prefill figures at two lengths and the run's provenance in the summary JSON (the only file it writes)."""
    out = tmp_path / "results" / "offline.json"
    cmd = [
        sys.executable,
        "-m",
        "fastgen.benchmarks.offline",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--repeats",
        "2",
        "--scale",
        "0.02",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    for name in ("W1", "W2"):
        r = results[name]
        assert r["requests"] == 1 and len(r["fastgen_s"]) == 2 and len(r["transformers_s"]) == 2
        assert r["speedup_per_repeat"] == [t / o for o, t in zip(r["fastgen_s"], r["transformers_s"])]
        assert r["speedup"] > 0 and f"{name}: FastGen median" in done.stdout
        assert r["fastgen_median_s"] == statistics.median(r["fastgen_s"])
        assert r["transformers_median_s"] == statistics.median(r["transformers_s"])
    assert results["prefill_512"]["model_flops"] > 0 and results["prefill_2048"]["model_flops"] > 0
    assert results["meta"]["threads"] == 1 and "first" in done.stdout
    meta = results["meta"]  # where the figures came from: RESULTS.md quotes these with every table
    assert meta["command"] == "python -m fastgen.benchmarks.offline " + shlex.join(cmd[3:])
    assert meta["commit"] and meta["date"] and meta["torch"]
    assert {"cpu", "cores", "amx", "avx512_bf16"} <= set(meta["machine"])


def test_every_repeat_sends_fresh_prompts():
    """No prefix cache, ours or a peer's, may serve a repeat from an earlier one: no two repeats share a prompt's
    first block (16 tokens), nor do two prompts of one repeat; a repeat's prompts are the same for every system."""
    from fastgen.benchmarks.offline import make_prompts
    from fastgen.replica.weights import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    repeats = [make_prompts(tokenizer, 64, 128, 512, repeat=r) for r in range(3)]
    assert repeats[0] == make_prompts(tokenizer, 64, 128, 512, repeat=0)
    firsts = [{tuple(p[:16]) for p in prompts} for prompts in repeats]
    assert all(len(f) == 64 for f in firsts)
    assert not (firsts[0] & firsts[1]) and not (firsts[0] & firsts[2]) and not (firsts[1] & firsts[2])
