"""Statistics of a serving benchmark run: per-request timings in, the paper's figures out (pure, no I/O).

Timings are seconds on one monotonic clock. A request's `token_times` hold the arrival time of every generated
token. The server streams one chunk per engine step; a chunk carrying k tokens means k tokens arrived at that
moment, so it contributes k equal times (k - 1 zero inter-token gaps). We do not spread a chunk's tokens over the
gap before it: that would invent arrival times the client never saw. With `ignore_eos` and one token per step per
sequence, k is almost always 1.

The SLA itself (first token within prompt_tokens / P seconds, every EMA of span 16 of the inter-token times at
most 1 / R seconds) is scored by fastgen.server.sla.meets_sla: the replicas' metrics and this benchmark use the
one definition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..server.sla import SPAN, meets_sla


@dataclass
class RequestRecord:
    start: float  # when the request was sent
    token_times: list[float]  # arrival time of every generated token
    prompt_tokens: int
    end: float | None = None  # when the last chunk arrived (None: failed)
    error: str | None = None
    client: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def inter_token(self) -> list[float]:
        return inter_token_times(self.token_times)

    def to_json(self) -> dict:
        return asdict(self)


def back_to_back(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """One client's requests moved in time so that each starts the moment the one before it ended. A paired
    comparison sends every request to each system in turn, so one system's requests are spread over the whole run;
    laid end to end they span the time that system spent serving them, and every per-request figure is unchanged."""
    out: list[RequestRecord] = []
    for r in records:
        shift = 0.0 if not out else last_time(out[-1]) - r.start
        out.append(
            RequestRecord(
                r.start + shift,
                [t + shift for t in r.token_times],
                r.prompt_tokens,
                None if r.end is None else r.end + shift,
                r.error,
                r.client,
            )
        )
    return out


def last_time(r: RequestRecord) -> float:
    """When a request stopped taking the server's time: its end, or for a failed one its last token or start."""
    return r.end if r.end is not None else (r.token_times[-1] if r.token_times else r.start)


def inter_token_times(token_times: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:])]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class SLA:
    prompt_rate: float = 100.0  # P: prompt tokens per second the first token may take
    token_rates: tuple[float, ...] = (1.0, 2.0, 4.0)  # R values: generated tokens per second
    span: int = SPAN


@dataclass
class Summary:
    requests: int
    failed: int
    duration_s: float
    throughput: float  # completed requests / (last end - first start)
    token_throughput: float  # generated tokens / duration
    ttft_missed: float = 0.0  # fraction whose first token came too late (misses the SLA at every R)
    effective: dict[str, float] = field(default_factory=dict)  # R -> throughput x fraction meeting the SLA
    sla_missed: dict[str, float] = field(default_factory=dict)  # R -> fraction missing it (failures count)
    ttft: dict[str, float] = field(default_factory=dict)  # p50 / p95 / p99 seconds
    inter_token: dict[str, float] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)


def pcts(values: Sequence[float], qs=(50, 95, 99)) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in qs}


def rate_key(r: float) -> str:
    return f"{r:g}"


def summarize(records: Sequence[RequestRecord], sla: SLA = SLA()) -> Summary:
    done = [r for r in records if r.ok]
    duration = (max(r.end for r in done) - min(r.start for r in done)) if done else math.nan
    throughput = len(done) / duration if done and duration > 0 else 0.0
    tokens = sum(len(r.token_times) for r in done)
    summary = Summary(
        requests=len(records),
        failed=len(records) - len(done),
        duration_s=duration,
        throughput=throughput,
        token_throughput=tokens / duration if done and duration > 0 else 0.0,
        ttft=pcts([r.ttft for r in done]),
        inter_token=pcts([g for r in done for g in r.inter_token]),
        latency=pcts([r.latency for r in done]),
    )
    late = sum(r.ttft > r.prompt_tokens / sla.prompt_rate for r in done)
    summary.ttft_missed = late / len(records) if records else 0.0
    for rate in sla.token_rates:
        met = sum(meets_sla(r.prompt_tokens, r.ttft, r.token_times, sla.prompt_rate, rate, sla.span) for r in done)
        fraction = met / len(records) if records else 0.0
        summary.effective[rate_key(rate)] = throughput * fraction
        summary.sla_missed[rate_key(rate)] = 1.0 - fraction
    return summary
