"""The served comparison with vLLM (benchmarks/against_vllm.py) and the time split (benchmarks/time_split.py): their
arithmetic and the charging of py-spy's samples; and, marked slow, each command at toy size against a deployment of
the tiny model that it starts itself (vLLM is not installed in CI, so the comparison runs FastGen's side alone; the
split samples the real replica and balancer with py-spy)."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys

import pytest

from fastgen.benchmarks import against_vllm, time_split
from fastgen.benchmarks.against_vllm import Run, System, medians, parse_system, ratios


def run(system: str, clients: int, repeat: int, throughput: float, itl_p95_ms: float) -> Run:
    return Run(system, clients, repeat, 10, 0, throughput, throughput / 2, 100.0, 200.0, 10.0, itl_p95_ms, 90.0, 50.0)


def test_systems_are_named_for_their_server_and_carry_their_arguments():
    assert parse_system("fastgen") == System("fastgen", ())
    s = parse_system("vllm-b512=--max-num-batched-tokens 512 --enable-prefix-caching")
    assert s.kind == "vllm" and s.extra == ("--max-num-batched-tokens", "512", "--enable-prefix-caching")
    assert parse_system("fastgen-t8=--sla-token-rate 8").kind == "fastgen"
    with pytest.raises(argparse.ArgumentTypeError, match="starts with fastgen or vllm"):
        parse_system("sglang")


def test_ratios_pair_runs_within_a_repeat():
    # vLLM's repeat 1 is slow: a ratio of medians would say 1.5x at 4 clients, the paired median says 2x
    runs = [
        run("fastgen", 4, 0, 2.0, 30.0),
        run("vllm", 4, 0, 1.0, 60.0),
        run("fastgen", 4, 1, 1.0, 30.0),
        run("vllm", 4, 1, 0.5, 60.0),
        run("fastgen", 4, 2, 3.0, 30.0),
        run("vllm", 4, 2, 1.5, 60.0),
        run("fastgen", 1, 0, 1.0, 10.0),  # no vLLM run at 1 client: no ratio there
    ]
    r = ratios(runs)
    assert list(r) == ["fastgen/vllm"] and list(r["fastgen/vllm"]) == ["4"]
    assert r["fastgen/vllm"]["4"]["throughput"] == pytest.approx(2.0)
    assert r["fastgen/vllm"]["4"]["itl_p95_ms"] == pytest.approx(0.5)
    m = medians(runs)
    assert m["fastgen"]["4"]["throughput"] == 2.0 and m["fastgen"]["4"]["repeats"] == 3
    assert m["vllm"]["4"]["throughput"] == 1.0 and "1" not in m["vllm"]
    text = against_vllm.markdown(m, r)
    assert "| 4 | fastgen | 2.000 |" in text and "| fastgen/vllm | 4 | 2.00× |" in text


def test_prompts_are_fresh_per_tag_and_within_the_lengths(tiny_model_dir):
    args = argparse.Namespace(tokenizer=str(tiny_model_dir), prompt_len=(40, 60), gen=7, seed=0)
    a, b = against_vllm.prompts(args, 6, "r0-c4"), against_vllm.prompts(args, 6, "r1-c4")
    assert all(40 <= len(p.prompt) <= 60 and p.max_new_tokens == 7 for p in a + b)
    assert len({len(p.prompt) for p in a}) > 1  # lengths vary
    assert all(x.prompt[:4] != y.prompt[:4] for x, y in zip(a, b, strict=True))  # no shared prefix across runs
    assert [p.prompt for p in a] == [p.prompt for p in against_vllm.prompts(args, 6, "r0-c4")]  # seeded


MAIN = "<module> (replica/__main__.py:9)"
STEP = "run (replica/engine_loop.py:200);step (replica/engine.py:90)"
RAW = "\n".join(
    f"{MAIN};{stack} {n}"  # py-spy's raw format: a collapsed stack, root first, and its samples
    for stack, n in (
        (f"{STEP};forward (replica/models/llama.py:50);linear (torch/nn/functional.py:1)", 30),
        (f"{STEP};sample (replica/sampler.py:40);argmax (torch/x.py:2)", 5),
        (f"{STEP};schedule (replica/slo_scheduler.py:214)", 4),
        ("run (replica/engine_loop.py:210);publish (replica/engine_loop.py:300)", 2),
        ("run_forever (asyncio/base_events.py:600);_run_once (asyncio/base_events.py:1900)", 3),
        ("Generate (replica/service.py:120);write (grpc/aio/_call.py:5)", 6),
        ("run_forever (asyncio/base_events.py:600);EpollSelector.select (selectors.py:468)", 10),
    )
)


def test_samples_are_charged_to_the_known_part_nearest_the_leaf():
    parts = time_split.split_samples(RAW, time_split.PARTS["replica"])
    # the forward's torch frames are the model's; the sampler's torch call is sampling; the loop's own frames are
    # the engine loop; asyncio's event loop under __main__ is no part (the entry point is matched by no path)
    assert parts == {
        "forward": 30,
        "sampling": 5,
        "scheduling": 4,
        "engine loop": 2,
        "other": 3,
        "gRPC service": 6,
        "waiting (epoll)": 10,  # py-spy's idle heuristic misses a thread in epoll_wait: not work
    }
    assert time_split.part_of("f (balancer/openai_api.py:3);g (grpc/aio/x.py:1)", time_split.PARTS["balancer"]) == (
        "gRPC relay"
    )
    sp = time_split.Split(16, 2.0, 40, 1.0, 8, 3.0, 50.0, {"replica": dict(parts)})
    assert sp.work("replica") == 50 and sp.cores("replica", rate=25) == pytest.approx(50 / 25 / 2.0)
    text = time_split.markdown([sp], rate=25)
    assert "| replica | forward | 0.60 | 60% | 30.00 | 150.0 |" in text  # 30 samples = 1.2 s over 2 s, 40 steps, 8 done
    assert "waiting" not in text


# ---- the commands at toy size ----
@pytest.mark.slow
def test_the_comparison_runs_fastgens_side_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "cmp.json"
    argv = [sys.executable, "-m", "fastgen.benchmarks.against_vllm", "--model", str(tiny_model_dir)]
    argv += ["--system", "fastgen", "--system", "fastgen-b64=--max-batch-tokens 64", "--clients", "1,2"]
    argv += ["--repeats", "2", "--requests-per-client", "1", "--requests-extra", "1", "--prompt-len", "20-40"]
    argv += ["--gen", "4", "--quiet-cores", "0", "--json", str(out), "--raw", str(tmp_path / "raw")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert {(r["system"], r["clients"]) for r in summary["runs"]} == {
        (s, c) for s in ("fastgen", "fastgen-b64") for c in (1, 2)
    }
    assert all(r["failed"] == 0 and r["throughput"] > 0 for r in summary["runs"])
    assert summary["meta"]["systems"] == {"fastgen": [], "fastgen-b64": ["--max-batch-tokens", "64"]}
    assert len(list((tmp_path / "raw").glob("*.json"))) == 8
    assert summary["ratios"] == {}  # no vLLM system


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy comes with the bench extra")
def test_the_time_split_samples_the_replica_and_the_balancer(tiny_model_dir, tmp_path):
    out = tmp_path / "split.json"
    argv = [sys.executable, "-m", "fastgen.benchmarks.time_split", "--model", str(tiny_model_dir), "--clients", "2"]
    argv += ["--prompt-len", "20-40", "--gen", "16", "--settle", "4", "--raw", str(tmp_path / "raw")]
    argv += ["--seconds", "3", "--rate", "50", "--quiet-cores", "0", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (split,) = json.loads(out.read_text())["splits"]
    assert split["steps"] > 0 and split["requests"] > 0 and not math.isnan(split["itl_p95_ms"])
    replica, balancer = split["samples"]["replica"], split["samples"]["balancer"]
    assert replica.get("forward", 0) > 0  # the engine thread runs forwards all the while
    assert sum(balancer.values()) > 0  # (its share of work at 50 samples a second for 3 s may round to nothing)
    assert "| replica | forward |" in done.stdout
