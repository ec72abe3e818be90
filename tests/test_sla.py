"""The SLA scorer on hand-made timings: thresholds, the moving average, edge cases."""

import pytest

from fastgen.server.sla import SlaConfig, ema_alpha, max_inter_token_ema, meets_sla, rate_label

P, R = 100.0, 2.0  # first token within prompt_tokens / 100 s; moving average of intervals at most 0.5 s


def stream(intervals, start=0.0):
    """Token arrival times for the given intervals between consecutive tokens."""
    times = [start]
    for d in intervals:
        times.append(times[-1] + d)
    return times


def test_first_token_exactly_at_the_threshold_meets_and_just_after_misses():
    times = stream([0.1] * 10)
    assert meets_sla(50, 0.5, times, P, R)  # 50 prompt tokens / 100 tokens/s = 0.5 s
    assert not meets_sla(50, 0.5 + 1e-9, times, P, R)
    assert meets_sla(200, 1.99, times, P, R)  # longer prompts get longer


def test_pace_exactly_at_the_threshold_meets_and_just_over_misses():
    assert meets_sla(10, 0.01, stream([0.5] * 40), P, R)  # every average is exactly 1 / R
    assert not meets_sla(10, 0.01, stream([0.5 + 1e-9] * 40), P, R)


def test_a_short_slow_patch_inside_a_fast_stream_is_smoothed_a_longer_one_misses():
    # Fast tokens every 0.1 s, then k intervals of 1 s, then fast again. The average after the patch is
    # 1 - 0.9 * (1 - alpha)^k: 0.4545 for k = 4 (meets 0.5), 0.5187 for k = 5 (misses).
    for k, expected in ((1, True), (4, True), (5, False), (8, False)):
        times = stream([0.1] * 20 + [1.0] * k + [0.1] * 20)
        worst = max_inter_token_ema(times)
        assert worst == pytest.approx(1 - 0.9 * (1 - ema_alpha()) ** k)
        assert meets_sla(10, 0.05, times, P, R) is expected, k


def test_the_moving_average_is_seeded_with_the_first_interval():
    assert not meets_sla(10, 0.05, stream([0.6] + [0.1] * 50), P, R)  # the first gap alone already misses
    assert meets_sla(10, 0.05, stream([0.1] * 50 + [0.6]), P, R)  # a last slow gap is smoothed


def test_no_token_never_meets_one_token_is_judged_on_its_first_token_only():
    assert not meets_sla(10, None, [], P, R)
    assert meets_sla(10, 0.1, [5.0], P, R)
    assert not meets_sla(10, 0.2, [5.0], P, R)
    assert max_inter_token_ema([5.0]) is None


def test_tokens_arriving_together_have_interval_zero():
    times = [0.0, 0.9, 0.9, 0.9, 0.9]  # one slow step delivering four tokens
    assert max_inter_token_ema(times) == pytest.approx(0.9)
    assert not meets_sla(10, 0.05, times, P, R)
    assert meets_sla(10, 0.05, times, P, 1.0)


def test_alpha_and_labels():
    assert ema_alpha(16) == 2 / 17
    assert [rate_label(r) for r in (2.0, 0.5, 100.0, 4)] == ["2", "0.5", "100", "4"]


@pytest.mark.parametrize("p, r", [(0, 2), (100, 0), (-1, 2)])
def test_rates_must_be_positive(p, r):
    with pytest.raises(ValueError):
        meets_sla(10, 0.1, [0.0, 0.1], p, r)
    with pytest.raises(ValueError):
        SlaConfig(p, (r,))


def test_replica_flags():
    from fastgen.replica.__main__ import parse_args

    args = parse_args(["--port", "1"])
    assert (args.sla_prompt_rate, args.sla_token_rates) == (100.0, (1.0, 2.0, 4.0))
    args = parse_args(["--port", "1", "--sla-prompt-rate", "512", "--sla-token-rate", "2", "4", "6"])
    assert SlaConfig(args.sla_prompt_rate, tuple(args.sla_token_rates)) == SlaConfig(512.0, (2.0, 4.0, 6.0))
    with pytest.raises(SystemExit):
        parse_args(["--port", "1", "--sla-token-rate", "0"])
