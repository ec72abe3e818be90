"""The overload benchmark at toy size: a burst far past what one replica serves is refused with RESOURCE_EXHAUSTED
and a retry hint, every process stays alive, and a request after the burst is served. Functional properties only:
the timings of a run this short on a shared machine mean nothing."""

import pytest

from fastgen.benchmarks import overload

TOY = ["--calibrate-s", "2", "--phase-s", "2", "--burst-s", "3", "--deadline-s", "2", "--max-queue-requests", "16"]


@pytest.mark.slow
def test_a_burst_is_refused_with_a_retry_hint_and_the_deployment_recovers(tiny_model_dir, tmp_path):
    args = overload.parse_args([*TOY, "--model", str(tiny_model_dir), "--logs", str(tmp_path)])
    summary = overload.run(args)
    assert overload.passed(summary), summary
    burst = summary["phases"]["burst"]
    refused = burst["codes"].get("RESOURCE_EXHAUSTED", 0)
    assert refused > 0 and burst["codes"].get("OK", 0) > 0, burst
    assert burst["refused_with_retry_hint"] == refused, burst
    assert summary["phases"]["after"]["codes"].get("OK", 0) > 0, summary["phases"]["after"]
