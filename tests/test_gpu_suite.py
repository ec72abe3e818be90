"""The GPU suite's dry run (every stage at toy size on the CPU) writes its JSON and Markdown with every stage, and a
stage that fails is recorded while the others still run, so the one prepared GPU command cannot rot."""

import json

import pytest

from fastgen.benchmarks import gpu_suite


@pytest.mark.slow  # builds models and runs both engines and transformers (about 15 s)
def test_dry_run_writes_every_stage(tmp_path):
    assert gpu_suite.main(["--out", str(tmp_path), "--dry-run"]) == 0
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == list(gpu_suite.STAGES) and report["failed"] == [] and report["dry_run"]
    assert all(s["status"] == "ok" or s["status"].startswith("skipped: ") for s in stages.values())
    assert stages["environment"]["results"]["copy_gbps"] > 0
    for name in ("engine_tests", "kernel_tests"):
        assert stages[name]["results"]["counts"]["tests collected"] > 0
    memory = stages["memory"]["results"]
    assert memory["kv_blocks"] > 0 and memory["fullest_step_ms"] > 0 and memory["decode_step_ms"] > 0
    assert {r["block"] for r in stages["kernels"]["results"]["attention"]} == {16, 32}
    offline = stages["offline"]["results"]
    assert offline["fastgen_tokens_per_s"] > 0 and offline["transformers_tokens_per_s"] > 0
    assert offline["decode_step_ms"] > 0 and offline["weights_read_bound_ms"] > 0
    moe = stages["offline_moe"]["results"]
    assert moe["fastgen_tokens_per_s"] > 0 and moe["weights_read_bound_ms"] > 0 and moe["model"].endswith("toy-moe")
    quantized = stages["offline_quantized"]["results"]["runs"]
    assert quantized["awq"]["model"].endswith("int4") and quantized["awq"]["layer_form"] == "QuantLinear"  # blocks
    assert quantized["fp8"]["layer_form"] == "Fp8Linear"
    assert all(r["fastgen_tokens_per_s"] > 0 and r["weights_read_bound_ms"] > 0 for r in quantized.values())
    systems = stages["sla"]["results"]["systems"]
    assert set(systems) == {"splitfuse", "prefill_first", "slo"}
    assert all(set(s["effective_rps"]) == {"2", "4", "6"} and s["failed"] == 0 for s in systems.values())
    model = stages["sla"]["results"]["slo_step_model"]
    assert model["steps"] > 0 and model["mdape"] >= 0
    assert len((tmp_path / model["trace"]).read_text().splitlines()) == model["steps"] + 1
    md = (tmp_path / "gpu_suite.md").read_text()
    assert all(f"## {name}: " in md for name in gpu_suite.STAGES)
    assert (tmp_path / "engine_tests.log").is_file() and (tmp_path / "kernel_tests.log").is_file()


def test_a_failing_stage_is_recorded_and_the_suite_goes_on(tmp_path, monkeypatch):
    def boom(ctx):
        raise RuntimeError("out of memory")

    monkeypatch.setitem(gpu_suite.STAGES, "boom", boom)
    monkeypatch.setitem(gpu_suite.STAGES, "after", lambda ctx: {"ran": True})
    monkeypatch.setattr(gpu_suite, "ESTIMATE_S", {"boom": 1, "after": 1})
    monkeypatch.setattr(gpu_suite, "toy_model", lambda folder, quantization_config=None: folder)  # no stage builds one
    assert gpu_suite.main(["--out", str(tmp_path), "--dry-run", "--stages", "boom,after"]) == 1
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    boom_record, after = report["stages"]
    assert boom_record["status"] == "failed" and "out of memory" in boom_record["error"]
    assert after["status"] == "ok" and after["results"] == {"ran": True} and report["failed"] == ["boom"]
    assert "out of memory" in (tmp_path / "gpu_suite.md").read_text()


def test_pytest_summary():
    output = "\n".join(
        [
            "FAILED tests/test_a.py::test_x - AssertionError",
            "ERROR tests/test_b.py::test_y - ValueError",
            "SKIPPED [1] tests/test_c.py:3: needs a CUDA device",
            "==== 1 failed, 7 passed, 1 skipped, 500 deselected, 1 error in 12.3s ====",
        ]
    )
    s = gpu_suite.summarise_pytest(output)
    assert s["counts"] == {"failed": 1, "passed": 7, "skipped": 1, "deselected": 500, "error": 1}
    assert s["failed"] == output.splitlines()[:2] and len(s["skipped"]) == 1
    assert s["summary"] == "1 failed, 7 passed, 1 skipped, 500 deselected, 1 error in 12.3s"


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_weights_read_counts_the_form_each_kernel_reads(tmp_path, family):
    """On the CPU the linear layers hold their weights packed, not as parameters: the bound must still count them
    (it once counted only the norms, and the MoE bound rounded to 0). Expected: transformers' own parameter bytes,
    less the embedding table unless the LM head is tied to it, less the experts no token is routed to."""
    from dataclasses import replace

    folder = (gpu_suite.toy_model if family == "dense" else gpu_suite.toy_moe_model)(tmp_path / family)
    plan = gpu_suite.dry_plan(folder, folder)
    pipe = gpu_suite.build_pipeline(replace(plan, model=str(folder)), plan.offline_budget)
    hf = gpu_suite.transformers_model(folder, plan.dtype, "cpu")
    expected = sum(t.nbytes for t in hf.parameters())
    if not hf.config.tie_word_embeddings:
        expected -= hf.get_input_embeddings().weight.nbytes
    experts = [t for name, t in hf.named_parameters() if ".experts." in name]
    if family == "moe":
        assert experts
        active = hf.config.num_experts_per_tok / hf.config.num_experts
        expected -= round(sum(t.nbytes for t in experts) * (1 - active))
    assert gpu_suite.weights_read_bytes(pipe.engine.runner.model) == expected


def test_budget_plans_the_stages_in_order_with_start_up_counted():
    assert set(gpu_suite.ESTIMATE_S) == set(gpu_suite.STAGES)
    planned, skipped = gpu_suite.plan_stages(list(gpu_suite.STAGES), 540)
    assert planned == list(gpu_suite.STAGES)[: len(planned)] and planned[:4] == [
        "environment",
        "kernel_accuracy",
        "engine_tests",
        "memory",
    ]
    used = gpu_suite.STARTUP_S + sum(gpu_suite.ESTIMATE_S[s] for s in planned)
    assert used <= 540 and set(skipped) == set(gpu_suite.STAGES) - set(planned)
    assert all(r.startswith("over budget: estimated ") for r in skipped.values())
    # A stage that does not fit does not stop a later, shorter one; no budget runs everything.
    estimates = gpu_suite.ESTIMATE_S
    budget = gpu_suite.STARTUP_S + estimates["environment"] + estimates["kernels"]
    assert gpu_suite.plan_stages(["environment", "offline", "kernels"], budget) == (
        ["environment", "kernels"],
        {
            "offline": f"over budget: estimated {estimates['offline']} s, {estimates['kernels']} s of --budget-s "
            f"{budget} left"
        },
    )
    assert gpu_suite.plan_stages(["sla"], None) == (["sla"], {})
    lines = gpu_suite.plan_lines(list(gpu_suite.STAGES), 540)
    assert (
        lines[0]
        == f"plan for --budget-s 540: {used} s estimated on one H200, start-up {gpu_suite.STARTUP_S} s included"
    )
    assert [line.split()[1] for line in lines[1:]] == planned + list(skipped)


def test_a_stage_over_its_estimate_makes_the_next_skip_at_run_time(tmp_path, monkeypatch):
    """The plan fits both stages; the first runs 1.5 s over its 1 s estimate's share, so the second no longer fits
    and is reported skipped (the report written), not run into the device's time limit."""
    import time

    ran = []
    monkeypatch.setitem(gpu_suite.STAGES, "slow", lambda ctx: time.sleep(1.5) or {"left": ctx.seconds_left()})
    monkeypatch.setitem(gpu_suite.STAGES, "after", lambda ctx: ran.append(1) or {})
    monkeypatch.setattr(gpu_suite, "ESTIMATE_S", {"slow": 1, "after": 1})
    monkeypatch.setattr(gpu_suite, "STARTUP_S", 0)
    monkeypatch.setattr(gpu_suite, "toy_model", lambda folder, quantization_config=None: folder)
    args = ["--out", str(tmp_path), "--dry-run", "--stages", "slow,after", "--budget-s", "2.2"]
    assert gpu_suite.main(args) == 0 and not ran
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    slow, after = report["stages"]
    assert slow["status"] == "ok" and 0 < slow["results"]["left"] < 1 and slow["estimate_s"] == 1
    assert after["status"].startswith("skipped: over budget at run time: estimated 1 s")
    assert list(report["skipped"]) == ["after"] and [p["name"] for p in report["planned"]] == ["slow", "after"]


def test_a_budget_under_start_up_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_suite.main(["--out", str(tmp_path), "--dry-run", "--budget-s", "10"])
    assert "leaves nothing after the" in capsys.readouterr().err
