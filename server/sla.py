"""The paper's latency SLA for one request, as a pure function (no prometheus, no torch): the replica's metrics
recorder scores every finished request with it, and the benchmark load generator scores what its clients saw.

The rule (DeepSpeed-FastGen, §4; BENCHMARKS.md), for a prompt rate P (prompt tokens/s) and a generation rate R
(tokens/s), a request meets the SLA when both hold:

  (a) first token: ttft_s <= prompt_tokens / P;
  (b) pace: let d_1 .. d_{n-1} be the intervals between the arrival times of its n generated tokens, and
      e_1 = d_1, e_k = e_{k-1} + alpha * (d_k - e_{k-1}) with alpha = 2 / (span + 1) (an exponential moving
      average of span 16, seeded with the first interval rather than with 0); then every e_k <= 1 / R.

Edge cases: 0 generated tokens (ttft_s None) never meets it: nothing was delivered. 1 token has no interval, so
only (a) applies. Both bounds are inclusive; the update e += alpha * (d - e) keeps e exactly equal to d when every
interval is d, so a stream exactly at the threshold meets it without any tolerance. Tokens that arrive together
(one chunk) have interval 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SPAN = 16
# BENCHMARKS.md's CPU profile; the paper's GPU settings are P = 512, R in {2, 4, 6}.
DEFAULT_PROMPT_RATE = 100.0
DEFAULT_TOKEN_RATES = (1.0, 2.0, 4.0)


@dataclass(frozen=True)
class SlaConfig:
    """P and the R values a replica scores every finished request against (one result per R)."""

    prompt_rate: float = DEFAULT_PROMPT_RATE
    token_rates: tuple[float, ...] = DEFAULT_TOKEN_RATES

    def __post_init__(self):
        if self.prompt_rate <= 0 or not self.token_rates or min(self.token_rates) <= 0:
            raise ValueError(f"SLA rates must be positive, got P={self.prompt_rate}, R={self.token_rates}")


def ema_alpha(span: int = SPAN) -> float:
    return 2.0 / (span + 1)


def max_inter_token_ema(token_times: Sequence[float], span: int = SPAN) -> float | None:
    """The largest moving average of the intervals between consecutive token times; None under 2 tokens."""
    if len(token_times) < 2:
        return None
    alpha = ema_alpha(span)
    ema = worst = token_times[1] - token_times[0]
    for prev, cur in zip(token_times[1:], token_times[2:]):
        ema += alpha * ((cur - prev) - ema)
        worst = max(worst, ema)
    return worst


def meets_sla(
    prompt_tokens: int,
    ttft_s: float | None,
    token_times: Sequence[float],
    prompt_rate: float,
    token_rate: float,
    span: int = SPAN,
) -> bool:
    """Whether one request met the SLA (see the module's docstring for the exact rule).

    prompt_tokens: tokens of the prompt; ttft_s: seconds from the request's arrival to its first token (None when
    no token came); token_times: when each generated token arrived, in seconds on any one clock, first token first;
    prompt_rate: P, prompt tokens per second; token_rate: R, generated tokens per second."""
    if prompt_rate <= 0 or token_rate <= 0:
        raise ValueError(f"SLA rates must be positive, got prompt_rate={prompt_rate}, token_rate={token_rate}")
    if ttft_s is None or not token_times:
        return False
    if ttft_s > prompt_tokens / prompt_rate:
        return False
    worst = max_inter_token_ema(token_times, span)
    return worst is None or worst <= 1.0 / token_rate


def rate_label(rate: float) -> str:
    """How a rate is written in a Prometheus label: '2', '0.5' (never '2.0'), so dashboards can match it."""
    return f"{rate:g}"
