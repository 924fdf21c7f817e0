"""What a speculative step costs against a plain one inside a vLLM call, measured on the call's
own steps: short blocks of plain steps interleaved with speculative ones (InterleavedSteps), and
each arm's step time fitted against the rows the step ran (StepLine).

Why a fit and not two arms one after the other: a step's time depends on how many rows it runs,
and rows finish as a call goes on. On the demo pair a 256-row call of contracts drains from 249
rows to 17 in ten decode steps; two arms timed one after the other compared k = 4 at 187 rows
with plain at 92 (issue 39: a 1.10x loss read as 1.53x), and matching the two halves of a pair
by rows found no pair at all. Interleaved blocks put both arms at every stage of the drain, and a
straight line per arm (seconds = a + b x rows) gives each arm's step at the concurrency a shard
will run at, with an interval from the line's residuals.

A step is clean when it decodes only (no prompt is being prefilled) and the step before ran at
the same k: a vLLM step verifies the drafts the previous step proposed and proposes as many as its
own k, so the first step after a switch is neither arm. A block is `block` steps long and has
block - 1 clean steps.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Two-sided 95% quantiles of Student's t by degrees of freedom (1..30); 1.96 beyond.
_T95 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11,
        2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04]


def t95(df: int) -> float:
    return _T95[df - 1] if 1 <= df <= len(_T95) else 1.96


@dataclass(frozen=True)
class StepLine:
    """Least squares seconds = a + b x rows over an arm's clean steps, with what its interval needs.
    Steps that all ran about the same rows (within 10%) give a flat line: their mean, good near them."""

    a: float
    b: float
    points: int
    mean_rows: float
    sxx: float  # sum of squared deviations of rows from their mean
    residual_var: float  # residual variance (n - 2 degrees of freedom; n - 1 for a flat line)
    low_rows: float
    high_rows: float

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> StepLine | None:
        """points: (rows, seconds); None for fewer than two."""
        if len(points) < 2:
            return None
        rows = [r for r, _ in points]
        secs = [s for _, s in points]
        mr, ms = statistics.fmean(rows), statistics.fmean(secs)
        sxx = sum((r - mr) ** 2 for r in rows)
        if max(rows) <= 1.1 * min(rows) or sxx == 0 or len(points) < 3:
            var = statistics.variance(secs)
            return cls(ms, 0.0, len(points), mr, 0.0, var, min(rows), max(rows))
        b = sum((r - mr) * (s - ms) for r, s in points) / sxx
        b = max(b, 0.0)  # a step never gets cheaper with more rows; noise can tilt a short line
        a = ms - b * mr
        var = sum((s - a - b * r) ** 2 for r, s in points) / (len(points) - 2)
        return cls(a, b, len(points), mr, sxx, var, min(rows), max(rows))

    @property
    def df(self) -> int:
        return self.points - (1 if self.b == 0.0 and self.sxx == 0.0 else 2)

    def at(self, rows: float) -> float:
        return max(self.a + self.b * rows, 1e-9)

    def se(self, rows: float) -> float:
        """Standard error of the fitted mean step at `rows`."""
        spread = (rows - self.mean_rows) ** 2 / self.sxx if self.sxx > 0 else 0.0
        return math.sqrt(self.residual_var * (1.0 / self.points + spread))


def ratio_interval(spec: StepLine, plain: StepLine, rows: float) -> tuple[float, float, float]:
    """A speculative step's time over a plain step's at `rows`: (estimate, low, high), the 95%
    interval from both lines' standard errors (delta method on the log of the ratio)."""
    ts, tp = spec.at(rows), plain.at(rows)
    rel = math.sqrt((spec.se(rows) / ts) ** 2 + (plain.se(rows) / tp) ** 2)
    # Capped: a line extrapolated far below its steps can make the relative error enormous, and an
    # interval 20,000x wide says "unknown" as well as an infinite one.
    half = min(t95(max(1, min(spec.df, plain.df))) * rel, 10.0)
    r = ts / tp
    return r, r * math.exp(-half), r * math.exp(half)


class InterleavedSteps:
    """The k of every engine step of one vLLM call: at k, with a block of plain steps every
    `every` speculative steps (every `block` while `dense`: a look, or a call at a concurrency with
    no costs yet); with `guard`, plain for the rest of the call once its own steps show
    speculation slower than plain decoding at the rows running, with 95% confidence. Engines call
    next_k() before each step and observe_step() after it (engine.api.StepRule); `settled` tells
    the engine that k stays 0 to the call's end, so it may skip the draft.

    A block of plain steps costs what speculation would have saved in it: at `every` = 32 and a
    1.2x speedup, about 1% of the call.

    With `interleave` False the call runs at k throughout (k = 0 allowed) and only its clean steps
    are kept: one arm of a pair of engines (model.vllm_plain_engine), whose plain arm is timed on
    the engine without speculation, not inside the speculative one's calls."""

    def __init__(self, k: int, dense: bool = False, every: int = 32, block: int = 3, guard: bool = True,
                 guard_points: int = 4, interleave: bool = True):
        if k < (1 if interleave else 0) or block < 2 or every < 2:
            raise ValueError("InterleavedSteps needs k >= 1 (>= 0 for one arm), block >= 2 and every >= 2")
        self.k_spec, self.dense, self.every, self.block = k, dense, every, block
        self.interleave = interleave
        self.guard, self.guard_points = guard and interleave, guard_points
        self.k = k
        self.settled = False  # k stays where it is to the call's end
        self.stopped: tuple[float, float, float] | None = None  # the speedup interval that turned the call plain
        self.points: dict[int, list[tuple[float, float]]] = {k: [], 0: []}  # arm -> (rows, seconds) of clean steps
        self.spec_tokens = 0  # tokens of the clean steps at k
        self.spec_row_steps = 0  # and the rows they ran (a row's pass)
        self.prefill_s = 0.0  # the target's part of the steps that prefilled before the first clean step
        self.draft_prefill_s = 0.0
        self.fill_decode: dict[int, int] = {}  # k -> tokens that rows already decoding emitted in those steps
        # arm -> (rows decoding, prompt tokens, seconds) of every step that ran prompts (PromptPrices)
        self.prompt_steps: dict[int, list[tuple[int, int, float]]] = {}
        self._last: int | None = None
        self._decoded = False
        self._in_phase = 0  # steps at the current k since it was set
        self._rows = 0  # rows of the last step
        self._fill_rows = 0  # rows of the last step of the fill

    def next_k(self) -> int:
        if self.settled or not self.interleave:
            return self.k
        if self.k > 0 and self._in_phase >= (self.block if self.dense else self.every):
            self.k, self._in_phase = 0, 0
        elif self.k == 0 and self._in_phase >= self.block:
            self._check_guard()
            if not self.settled:
                self.k, self._in_phase = self.k_spec, 0
        return self.k

    def observe_step(self, k: int, seconds: float, tokens: int, rows: int, prefill: bool, draft_s: float = 0.0,
                     decode_tokens: int = 0, prompt_tokens: int = 0, decode_rows: int = 0) -> None:
        """seconds: the step's cost as its arm pays it (a plain step's draft forward, which a plain
        engine would not run, timed apart by the engine and left out); draft_s: that draft time;
        decode_tokens: of a prefill step's tokens, those that rows already decoding emitted;
        prompt_tokens: the prompt tokens the step ran, beside decode_rows rows decoding (a step
        that ran prompts is kept in prompt_steps, the draft's part counted for an arm at k)."""
        self._in_phase += 1
        self._rows = rows
        if prefill and prompt_tokens > 0:
            self.prompt_steps.setdefault(k, []).append((decode_rows, prompt_tokens, seconds + (draft_s if k else 0.0)))
        if prefill:
            if not self._decoded:
                self._fill_rows = rows
                self.prefill_s += seconds
                self.draft_prefill_s += draft_s
                self.fill_decode[k] = self.fill_decode.get(k, 0) + decode_tokens
            self._last = k
            if self.k > 0:
                self._in_phase = 0  # a block of plain steps is only worth running while rows decode
            return
        self._decoded = True
        if k == self._last and not self.settled and rows > 0:
            self.points[k].append((rows, seconds))
            if k > 0:
                self.spec_tokens += tokens
                self.spec_row_steps += rows
        self._last = k

    def _check_guard(self) -> None:
        if not self.guard or min(len(p) for p in self.points.values()) < self.guard_points:
            return
        interval = self.speedup(self._rows)
        if interval is not None and interval[2] < 1.0:
            self.stopped, self.settled, self.k = interval, True, 0

    # -- what the steps say -------------------------------------------------------------------------
    def lines(self) -> tuple[StepLine | None, StepLine | None]:
        """(speculative, plain) step lines fitted on this call's clean steps."""
        return StepLine.fit(self.points[self.k_spec]), StepLine.fit(self.points[0])

    def tokens_per_step(self) -> float | None:
        """Tokens a row emitted per clean step at k."""
        return self.spec_tokens / self.spec_row_steps if self.spec_row_steps else None

    def speedup(self, rows: float) -> tuple[float, float, float] | None:
        """Tokens per second at k over plain at `rows`: tokens per row-step over the step ratio,
        with the ratio's 95% interval; None before both arms have two clean steps."""
        spec, plain = self.lines()
        per_step = self.tokens_per_step()
        if spec is None or plain is None or per_step is None:
            return None
        r, low, high = ratio_interval(spec, plain, rows)
        return per_step / r, per_step / high, per_step / low

    def step_seconds(self, rows: float) -> dict[int, float]:
        """Each arm's step at `rows`, from the lines (for the cost model, which keeps a step's cost
        at a concurrency); {} before both arms have two clean steps."""
        spec, plain = self.lines()
        if spec is None or plain is None:
            return {}
        return {0: plain.at(rows), self.k_spec: spec.at(rows)}

    def prefill_costs(self) -> tuple[float, float]:
        """Seconds the call's prompts cost, the target's and the draft's: the steps before the first
        clean one, less what the tokens that rows already decoding emitted in them would have cost
        in clean steps at the same k (the cost model charges every new token to decoding, so left
        in they were charged twice). An estimate: decoding beside a prefill costs less than in a
        step of its own. All of it where an arm has no line or the estimate would leave nothing."""
        spec, plain = self.lines()
        per_step = self.tokens_per_step()
        rows = self._fill_rows or self._rows or 1  # the decoding in the fill ran beside its last rows
        seconds_per_token = {}
        if spec is not None and per_step:
            seconds_per_token[self.k_spec] = spec.at(rows) / (rows * per_step)
        if plain is not None:
            seconds_per_token[0] = plain.at(rows) / rows
        decode = sum(tokens * seconds_per_token[k] for k, tokens in self.fill_decode.items() if k in seconds_per_token)
        total = self.prefill_s + self.draft_prefill_s
        if not 0 < decode < total:
            return self.prefill_s, self.draft_prefill_s
        keep = (total - decode) / total
        return self.prefill_s * keep, self.draft_prefill_s * keep


class PromptPrices:
    """What a prompt token costs each arm, from the steps that ran prompts (InterleavedSteps.
    prompt_steps): each such step's time less what its rows decoding cost at the arm's step line
    (its fixed part where none decoded), summed over the run and divided by the prompt tokens the
    steps ran. Most of a long call's steps admit a prompt beside the rows decoding; pricing
    prompts from them, not from the fill that starts a call (prompts alone, the draft's forward
    over them timed on its own), is what a prompt costs where it runs (docs/policy.md)."""

    def __init__(self) -> None:
        self.work: dict[int, tuple[float, int]] = {}  # arm -> (seconds of prompt work, prompt tokens)

    def add(self, steps: dict[int, list[tuple[int, int, float]]], lines: dict[int, StepLine | None]) -> None:
        """steps: a call's prompt_steps; lines: each arm's step line (an arm without one is left out)."""
        for arm, kept in steps.items():
            line = lines.get(arm)
            if line is None or not kept:
                continue
            seconds, tokens = self.work.get(arm, (0.0, 0))
            self.work[arm] = (seconds + sum(s - line.at(rows) for rows, _, s in kept), tokens + sum(p for _, p, _ in kept))

    def per_token(self, k: int, known: tuple[float, float] | None) -> tuple[float, float] | None:
        """(target's, draft's on top) seconds per prompt token: the plain arm's price, and the arm
        at k's above it. An arm not priced yet keeps its part of `known` (remembered, or what this
        run had); None while that leaves either part unknown."""
        price = {arm: s / t for arm, (s, t) in self.work.items() if t > 0 and s > 0}
        target = price.get(0, known[0] if known else None)
        if target is None:
            return None
        if k in price:
            return target, max(price[k] - target, 0.0)
        return (target, known[1]) if known and 0 in price else None
