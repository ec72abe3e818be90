"""The step-time model: how long one engine step takes, from what its batch carries (no torch).

    seconds = c0 + c1 * prompt tokens + c2 * decode sequences + c3 * decode context + c4 * prompt context

where the decode context is the key rows the decodes' attention reads (the sum of their lengths) and the prompt
context the key rows the prompt tokens' attention reads (each token reads its sequence up to itself). A pass costs
a fixed part (weights read, per-layer dispatch), a part per token (the linear layers) and a part per key row
(attention), and the model fits each on the device it runs on.

A mixture of experts reads only the experts its tokens are routed to, so its weights' cost is not fixed: a decode
step of one token reads k of E experts a layer, a step of hundreds reads them all. Its model has a sixth feature,
`expert_reads`, the expected share of the experts a step of that many tokens reads (expert_share), with c5 the
cost of reading all of them; c0 is then what every step reads (attention, norms, the router, a shared expert).

The fit is least squares over every step the engine ran, recent steps weighing more (exponential forgetting, as
recursive least squares does): normal equations kept as running sums, solved after each step on columns scaled to
unit length, with coefficients held non-negative (a feature whose coefficient comes out negative is dropped from
that solve), so a longer batch never predicts a shorter step. Before each update the step is predicted, and the
relative error of that prediction is what the model reports as its error: a prediction made without the step's own
timing.

Least squares weighs a step by the square of its miss, so one stalled step (a collection pause, a neighbour's burst,
a kernel compiled on first use) would bend every prediction for as long as the model remembers it. Once the model has
learned from ROBUST_AFTER steps, a step is learned as taking at most OUTLIER times its prediction and at least its
prediction over OUTLIER: a stall moves the model by a bounded step, and a device whose costs really changed is still
followed, a factor of OUTLIER at a time.

Forgetting over about two hundred steps also makes the fit slow to follow a device whose speed shifts for a while (a
neighbour's load, a clock change): it under-predicts every step by the shift until the older steps fade, and a
schedule planned on it overruns its time by as much. So a prediction is the fit times its recent miss: a moving
average (span DRIFT_SPAN, the SLA's own) of log(measured / fitted) over the latest steps, each step's term held
within a factor of DRIFT_LIMIT, so one stall moves it little and a shift is followed within a few dozen steps.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("fastgen.replica")

FEATURES = ("fixed", "prompt_tokens", "decode_seqs", "decode_context", "prompt_context")
EXPERT_READS = "expert_reads"  # the sixth feature of a mixture of experts' model
FORGETTING = 0.995  # weight of a step's timing after each later step: about the last 200 steps count
RIDGE = 1e-6  # relative to each scaled column: keeps the solve defined when a feature has not varied yet
MIN_STEPS = 8  # steps seen before the model predicts
# A feature that no step has carried for a long while (its weight of recent steps that carried it below this: about
# 2,800 steps) keeps the coefficient it had, rather than one fitted on next to nothing.
STALE = 1e-6
ERROR_WINDOW = 512  # recent prediction errors kept for the median
OUTLIER = 3.0  # a step is learned as within this factor of its prediction, either way
ROBUST_AFTER = 32  # steps learned as measured first: a start-up profile takes about this many
DRIFT_SPAN = 16  # steps in the moving average of the fit's recent miss
DRIFT_LIMIT = 1.5  # one step's miss counts as at most this factor either way


def chunk_context(start: int, n: int, window: int | None = None) -> int:
    """Key rows the attention of n prompt tokens at positions start .. start + n - 1 reads: each its sequence up to
    itself, or only its last `window` positions when every layer attends within a window (SchedulerConfig.kv_window)."""
    full = n if window is None else max(0, min(n, window - start))  # the tokens that still see the whole sequence
    return full * start + full * (full + 1) // 2 + (n - full) * (window or 0)


def decode_context(starts: Iterable[int], window: int | None = None) -> int:
    """Key rows the decodes at these positions read."""
    return sum(start + 1 if window is None else min(start + 1, window) for start in starts)


@dataclass(frozen=True)
class StepShape:
    """What a step's time depends on."""

    prompt_tokens: int = 0
    decode_seqs: int = 0
    decode_context: int = 0  # key rows the decodes read: the sum of their sequences' lengths
    prompt_context: int = 0  # key rows the prompt tokens read (chunk_context of every chunk)

    def vector(self) -> tuple[float, ...]:
        return (1.0, self.prompt_tokens, self.decode_seqs, self.decode_context, self.prompt_context)

    @staticmethod
    def of_decodes(decodes: Sequence, window: int | None = None) -> StepShape:
        """A step of these decodes (ScheduledSeqs) only."""
        return StepShape(0, len(decodes), decode_context((s.start for s in decodes), window), 0)

    def plus_chunk(self, start: int, n: int, window: int | None = None) -> StepShape:
        rows = chunk_context(start, n, window)
        return StepShape(self.prompt_tokens + n, self.decode_seqs, self.decode_context, self.prompt_context + rows)


def expert_share(tokens: int, experts: int, per_token: int) -> float:
    """The expected share of a layer's experts that `tokens` tokens read, each routed to per_token of them (routing
    taken as uniform): an expert no token picks is never read, with probability (1 - per_token / experts) ** tokens."""
    return 1.0 - (1.0 - per_token / experts) ** tokens


def batch_shape(batch, window: int | None = None) -> StepShape:
    """The shape of a Batch (decodes first, then prompt chunks); window: SchedulerConfig.kv_window."""
    decodes = batch.seqs[: batch.num_decodes]
    chunks = batch.seqs[batch.num_decodes :]
    return StepShape(
        sum(len(s.token_ids) for s in chunks),
        len(decodes),
        decode_context((s.start for s in decodes), window),
        sum(chunk_context(s.start, len(s.token_ids), window) for s in chunks),
    )


class StepModel:
    """Predicts a step's seconds from its StepShape and learns from every step observed.

    `coefficients` seeds the model (one per feature, seconds per unit) and makes it ready at once; `learn=False`
    keeps them fixed (scripted tests, a model measured elsewhere). `experts`: (experts, experts per token) of a
    mixture of experts, whose model has the expert_reads feature too. `window`: SchedulerConfig.kv_window, which
    bounds the key rows a chunk reads (chunk_cost, chunk_fitting)."""

    def __init__(
        self,
        coefficients: Sequence[float] | None = None,
        learn: bool = True,
        experts: tuple[int, int] | None = None,
        window: int | None = None,
    ) -> None:
        self.experts = experts
        self.window = window
        self.features = FEATURES + ((EXPERT_READS,) if experts else ())
        k = len(self.features)
        if coefficients is not None and len(coefficients) != k:
            names = ", ".join(self.features)
            raise ValueError(f"a step model has {k} coefficients ({names}), got {len(coefficients)}")
        self.coefficients: list[float] | None = None if coefficients is None else [float(c) for c in coefficients]
        self.learn = learn
        self.steps = 0  # observed
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)  # |predicted - measured| / measured
        self._xtx = [[0.0] * k for _ in range(k)]
        self._xty = [0.0] * k
        self._carried = [0.0] * k  # per feature, the forgetting-weighted count of steps with it non-zero
        self._drift_log = 0.0  # the moving average of log(measured / fitted)

    @property
    def ready(self) -> bool:
        return self.coefficients is not None

    @property
    def drift(self) -> float:
        """The factor by which recent steps took longer than the fit says (1: on the fit)."""
        return math.exp(self._drift_log)

    def predict(self, shape: StepShape) -> float:
        """Seconds the step is expected to take; nan before the model is ready."""
        return self._fitted(shape) * self.drift

    def _fitted(self, shape: StepShape) -> float:
        if self.coefficients is None:
            return math.nan
        return max(0.0, sum(c * x for c, x in zip(self.coefficients, self.vector(shape))))

    def vector(self, shape: StepShape) -> tuple[float, ...]:
        if self.experts is None:
            return shape.vector()
        return (*shape.vector(), expert_share(shape.prompt_tokens + shape.decode_seqs, *self.experts))

    def _chunk_fitted(self, start: int, n: int) -> float:
        c = self.coefficients
        assert c is not None, "asked once the model is ready (chunk_cost, chunk_fitting)"
        cost = c[1] * n + c[4] * chunk_context(start, n, self.window)
        # The experts n tokens read on their own: at most what they add to a step that already reads some (the
        # share is concave in tokens), so a plan on it errs on the short side.
        return cost + (c[5] * expert_share(n, *self.experts) if self.experts else 0.0)

    def chunk_cost(self, start: int, n: int) -> float:
        """Seconds that a chunk of n prompt tokens starting at position `start` adds to a step (nan before the model
        is ready)."""
        if self.coefficients is None:
            return math.nan
        return self._chunk_fitted(start, n) * self.drift

    def chunk_fitting(self, start: int, seconds: float) -> int:
        """The most prompt tokens one chunk starting at position `start` may carry for its cost to stay within
        `seconds` (added to whatever else the step carries); a very large number when tokens cost nothing."""
        if self.coefficients is None or seconds <= 0:
            return 0
        seconds /= self.drift
        per_token, per_row = self.coefficients[1], self.coefficients[4]
        if self.window is not None and start + 1 >= self.window:  # every token reads `window` rows
            per = per_token + per_row * self.window
            n = seconds / per if per > 0 else math.inf
            hi = int(min(n, 1 << 30))
        else:
            # cost(n) = per_token * n + per_row * (n * start + n * (n + 1) / 2) <= seconds
            a, b = per_row / 2, per_token + per_row * (start + 0.5)
            if a > 0:
                n = (-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)
            elif b > 0:
                n = seconds / b
            else:
                return 1 << 30
            hi = int(min(n, 1 << 30))
            if self.window is not None and start + hi > self.window:
                # Past the window a token reads window rows, not more: the quadratic under-counts what fits. Each
                # token costs at least per_token + per_row (one row), which bounds the search.
                per = per_token + per_row
                hi = int(min(seconds / per if per > 0 else math.inf, 1 << 30))
        if not (self.experts and self.coefficients[5] > 0) and (self.window is None or start + 1 >= self.window):
            return hi
        lo = 0  # the experts' share, or a window reached part-way: the largest n whose cost fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._chunk_fitted(start, mid) <= seconds else (lo, mid - 1)
        return lo

    def observe(self, shape: StepShape, seconds: float) -> float:
        """Takes a step's measured seconds; returns what the model predicted for it (nan before it was ready)."""
        fitted = self._fitted(shape)
        predicted = fitted * self.drift
        if seconds > 0 and not math.isnan(predicted):
            self.errors.append(abs(predicted - seconds) / seconds)
        self.steps += 1
        if not self.learn:
            return predicted
        learned = seconds
        if self.steps > ROBUST_AFTER and fitted > 0:
            learned = min(max(seconds, fitted / OUTLIER), fitted * OUTLIER)
            if seconds > 0:
                miss = min(max(math.log(seconds / fitted), -math.log(DRIFT_LIMIT)), math.log(DRIFT_LIMIT))
                self._drift_log += 2 / (DRIFT_SPAN + 1) * (miss - self._drift_log)
        x = self.vector(shape)
        for i, xi in enumerate(x):
            self._carried[i] = FORGETTING * self._carried[i] + (xi != 0)
            row = self._xtx[i]
            for j, xj in enumerate(x):
                row[j] = FORGETTING * row[j] + xi * xj
            self._xty[i] = FORGETTING * self._xty[i] + xi * learned
        if self.steps >= MIN_STEPS:
            self.coefficients = self._solve()
        return predicted

    def median_error(self) -> float:
        """Median absolute relative error of the recent predictions (nan without any)."""
        return statistics.median(self.errors) if self.errors else math.nan

    def _solve(self) -> list[float]:
        """Least squares with every coefficient but the fixed part non-negative: solve, drop the most negative
        feature, solve again. A stale feature (STALE) keeps its coefficient."""
        k = len(self.features)
        previous = self.coefficients or [0.0] * k
        held = {i: previous[i] for i in range(1, k) if self._carried[i] < STALE}
        active = [i for i in range(k) if i not in held]
        while True:
            beta = _ridge_solve(self._xtx, self._xty, active)
            worst = min((i for i in active if i > 0), key=lambda i: beta[i], default=None)
            if worst is None or beta[worst] >= 0:
                return [held.get(i, b) for i, b in enumerate(beta)]
            active.remove(worst)


def _ridge_solve(xtx: list[list[float]], xty: list[float], active: list[int]) -> list[float]:
    """Solves the normal equations on the active features, columns scaled to unit length; 0 elsewhere."""
    scale = [math.sqrt(xtx[i][i]) or 1.0 for i in active]
    m = [
        [xtx[i][j] / (si * sj) + (RIDGE if a == b else 0.0) for b, (j, sj) in enumerate(zip(active, scale))]
        + [xty[i] / si]
        for a, (i, si) in enumerate(zip(active, scale))
    ]
    n = len(active)
    for col in range(n):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    z = [0.0] * n
    for r in range(n - 1, -1, -1):
        z[r] = (m[r][n] - sum(m[r][c] * z[c] for c in range(r + 1, n))) / m[r][r]
    beta = [0.0] * len(xty)
    for a, (i, si) in enumerate(zip(active, scale)):
        beta[i] = z[a] / si
    return beta


# ---- the record of predictions against measurements ------------------------------------------------------------
# A step trace stops here (a row is about 60 bytes: some 4 million steps, days of a busy replica).
TRACE_MAX_BYTES = 256 << 20
TRACE_COLUMNS = (
    "time",
    "prompt_tokens",
    "decode_seqs",
    "decode_context",
    "prompt_context",
    "predicted_s",
    "measured_s",
    "budget_s",
    "overloaded",
)


class StepTrace:
    """Appends one CSV row per engine step (TRACE_COLUMNS) to a file: the step's shape, the model's prediction and
    the measured step time, for the model's error figure and plot (`python -m fastgen.replica --step-trace F`).
    A step planned without the model (the fixed-budget schedules) has its prompt tokens, decodes and measured time,
    and no context, prediction or budget: every schedule's steps can be compared.

    A trace is a diagnostic, never a reason to stop serving: it stops (once, with a warning) at max_bytes, or when
    writing fails (a full disk), and the replica goes on without it."""

    def __init__(self, path: str | Path, max_bytes: int = TRACE_MAX_BYTES) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        new = not path.exists() or path.stat().st_size == 0
        self._file = path.open("a", newline="", buffering=1)  # line by line: a reader sees every finished step
        self._writer = csv.writer(self._file)
        self.stopped: str | None = None  # why the trace stopped (None while it runs)
        if new:
            self._row(TRACE_COLUMNS)

    def write(self, time: float, stats) -> None:
        """One step's StepStats (with its plan, where the scheduler made one)."""
        if self.stopped is not None:
            return
        plan = stats.plan
        if plan is None:
            row = (stats.num_prefill_tokens, stats.num_decode_tokens, "", "", "nan", f"{stats.step_s:.6g}", "inf", 0)
        else:
            s = plan.shape
            row = (
                s.prompt_tokens,
                s.decode_seqs,
                s.decode_context,
                s.prompt_context,
                f"{plan.predicted_s:.6g}",
                f"{stats.step_s:.6g}",
                f"{plan.budget_s:.6g}",
                int(plan.overloaded),
            )
        self._row((f"{time:.6f}", *row))

    def _row(self, row) -> None:
        try:
            if self._file.tell() >= self.max_bytes:
                self._stop(f"it reached {self.max_bytes} bytes; move it away and restart to trace again")
                return
            self._writer.writerow(row)
        except OSError as exc:  # ENOSPC, EIO, a file system gone read-only
            self._stop(f"writing failed: {exc}")

    def _stop(self, why: str) -> None:
        self.stopped = why
        log.warning("step trace %s stopped: %s; the replica goes on without it", self.path, why)
        with contextlib.suppress(OSError):  # closing flushes, and the buffered line may fail the same way
            self._file.close()

    def flush(self) -> None:
        if self.stopped is None:
            self._file.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
