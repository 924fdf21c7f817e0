"""What an actor measured of its engine's steps in real calls (vllm): each arm's clean steps, the
step lines fitted on them, what a prompt token costs each arm, and the costs they give per
concurrency; and, priced with them, what a row's own work cost and what speculation saved.

Pure: no engine, no Ray, no I/O. ActorPolicy (planner.py) decides with it; the runner keeps it
between runs (runner/memory.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .interleaved import InterleavedSteps, PromptPrices, StepLine, ratio_interval, t95
from .model import Costs

KEEP_POINTS = 512  # clean steps kept per arm: what the step lines decisions cite are fitted on
# How far apart whole calls of the two arms take over their price, at most: what a call at k stands
# for a plain call with, where none ran. Measured: calls at k 1.08-1.09x, plain calls 1.06-1.08x
# (docs/history/benchmarks-log.md, "Prompt prices").
ARMS_APART = 0.03
STEPS_BASIS = ("each speculating row's verify steps and accepted tokens, priced with this run's step lines at the "
               "concurrency it ran at, less the draft's prefill; the interval is the step ratio's")


@dataclasses.dataclass(frozen=True)
class Saving:
    """What speculation saved on some rows against plain decoding of them (StepCosts.saving,
    StepCosts.saving_against_plain): seconds with a 95% interval, over `rows` rows, on step lines
    of at least `steps` clean steps per arm, and how it was measured. Written to a shard's manifest
    as "saving"."""

    seconds: float
    low: float
    high: float
    rows: int
    steps: int
    basis: str = STEPS_BASIS

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def streams(rows: int, concurrency: int) -> bool:
    """Whether a call over `rows` at `concurrency` streams (fills the engine at least twice) rather
    than running as one wave of fill and drain."""
    return rows >= 2 * concurrency


class StepCosts:
    """An actor's step measurements for the arm at k (and the plain arm), as data."""

    def __init__(self, k: int):
        self.k = k  # the speculative arm the lines are for (the policy's k_default)
        self.costs_by_batch: dict[int, Costs] = {}  # measured (or learned) per concurrency on this actor
        # vllm: this run's clean steps per arm, (rows, seconds), from every call's interleaved blocks,
        # and what a prompt token costs (target, draft): from the steps that ran prompts, else a fill.
        self.points: dict[int, list[tuple[float, float]]] = {}
        self.run_plain = (0, 0.0)  # this run's own clean plain steps: how many, the most rows (needs_plain_look)
        self.kept_plain = (0, 0.0)  # ... and an earlier run's on this node, remembered (start_from)
        self.prefill_row_token_s: tuple[float, float] | None = None
        self.prompts = PromptPrices()  # ... from the steps that ran prompts, where the engine counts their tokens
        self._fitted: tuple[StepLine | None, StepLine | None] | None = None
        # this run's calls by (plain, streams) (observe_call): seconds they took, their price and the
        # most concurrency it was at
        self.calls: dict[tuple[bool, bool], tuple[float, float, int]] = {}

    def start_from(self, costs: dict[int, Costs], points: dict[int, list[tuple[float, float]]] | None,
                   prefill_row_token_s: tuple[float, float] | None) -> None:
        """Start from what an earlier run measured on this node; this run's steps join them."""
        self.costs_by_batch.update(costs)
        self.points.update({k: list(kept)[-KEEP_POINTS:] for k, kept in (points or {}).items()})
        plain = self.points.get(0, [])
        self.kept_plain = (len(plain), max((r for r, _ in plain), default=0.0))
        self.prefill_row_token_s = prefill_row_token_s or self.prefill_row_token_s
        self._fitted = None

    def lines(self) -> tuple[StepLine | None, StepLine | None]:
        """(speculative, plain) step lines over this run's clean steps (vllm). Fitted once per set
        of steps: a call's rows are each priced with them (row_cost)."""
        if self._fitted is None:  # refitted after keep() or start_from() changed the steps
            self._fitted = StepLine.fit(self.points.get(self.k, [])), StepLine.fit(self.points.get(0, []))
        return self._fitted

    def costs_at(self, concurrency: int) -> Costs | None:
        """Step costs at this concurrency: from this run's step lines where both arms have them
        (with prompts' costs from its fills, scaled to the rows), else as remembered or measured at
        this concurrency or the nearest one within 2x."""
        spec, plain = self.lines()
        if spec is not None and plain is not None and self.prefill_row_token_s is not None:
            pre, pre_draft = (x * concurrency for x in self.prefill_row_token_s)
            return Costs.from_steps(concurrency, {0: plain.at(concurrency), self.k: spec.at(concurrency)}, pre, pre_draft)
        if concurrency in self.costs_by_batch:
            return self.costs_by_batch[concurrency]
        near = [b for b in self.costs_by_batch if concurrency / 2 <= b <= concurrency * 2]
        return self.costs_by_batch[min(near, key=lambda b: abs(b - concurrency))] if near else None

    def cautious(self, costs: Costs | None, concurrency: int, slow: bool = True) -> Costs | None:
        """The costs with a step at k at the upper end of the step ratio's 95% interval (slow=False:
        its lower end); None without step lines."""
        spec, plain = self.lines()
        if costs is None or spec is None or plain is None:
            return None
        _, low, high = ratio_interval(spec, plain, concurrency)
        ratio = high if slow else low
        return Costs.from_steps(costs.batch_size, {0: costs.target_step_s, self.k: costs.target_step_s * ratio},
                                costs.prefill_token_s, costs.draft_prefill_token_s)

    def cost_figures(self, concurrency: int) -> dict[str, Any]:
        """What a decision's step costs rest on: the clean steps behind the lines, and the step
        ratio at this concurrency with its 95% interval."""
        spec, plain = self.lines()
        if spec is None or plain is None:
            return {}
        r, low, high = ratio_interval(spec, plain, concurrency)
        return {"clean_steps": min(spec.points, plain.points), "step_ratio": round(r, 3),
                "step_ratio_interval": (round(low, 3), round(high, 3))}

    def keep(self, rule: InterleavedSteps, concurrency: int, prompt_lengths: list[int]) -> None:
        """After a vllm call under an InterleavedSteps rule: keep its clean steps and what its
        prompts cost, and the costs they give at this concurrency (for the next decisions and the
        next run's memory)."""
        for k, points in rule.points.items():
            if k == 0 and points:
                self.run_plain = (self.run_plain[0] + len(points), max(self.run_plain[1], *(r for r, _ in points)))
            kept = self.points.setdefault(k, [])
            kept.extend(points)
            del kept[:-KEEP_POINTS]
        self._fitted = None
        spec, plain = self.lines()
        self.prompts.add(rule.prompt_steps, {self.k: spec, 0: plain})
        priced = self.prompts.per_token(self.k, self.prefill_row_token_s)
        if priced is not None:
            self.prefill_row_token_s = priced
        elif rule.prefill_s > 0 and prompt_lengths:  # no prompt tokens counted (no arm priced yet): the fill's
            positions = sum(prompt_lengths) / len(prompt_lengths)
            rows = min(len(prompt_lengths), concurrency) or 1
            pre, pre_draft = (x / positions / rows for x in rule.prefill_costs())
            if rule.k_spec == 0 and self.prefill_row_token_s is not None:  # a plain arm: no draft to learn
                pre_draft = self.prefill_row_token_s[1]
            self.prefill_row_token_s = (pre, pre_draft)
        if (costs := self.costs_at(concurrency)) is not None and self.lines()[0] is not None:
            self.costs_by_batch[concurrency] = costs

    def saving(self, rows: Sequence[tuple[int, int, int, int]]) -> Saving | None:
        """What speculation saved (negative: cost) on a shard's rows against plain decoding of the
        same rows, in seconds with a 95% interval, from this run's measurements (vllm): each row's
        verify steps and accepted tokens, and the step lines at the concurrency it ran at.

        rows: (accepted tokens, verify steps, prompt tokens, concurrency) of the rows that ran at k.
        A row that made R verify steps and accepted A tokens emitted A + R tokens in them, which
        plain decoding makes in A + R steps; so it saved p x (A + R - R x r), with p a plain step's
        time per row and r a step at k over a plain step at its concurrency, less what the draft
        spent on its prompt. The interval is r's (the step lines' residuals); p's own error is small
        beside it and left out. None without step lines."""
        spec, plain = self.lines()
        if spec is None or plain is None:
            return None
        draft_row_token_s = self.prefill_row_token_s[1] if self.prefill_row_token_s else 0.0
        total = low = high = 0.0
        counted = 0
        for accepted, steps, prompt, concurrency in rows:
            if steps <= 0 or concurrency <= 0:
                continue
            p = plain.at(concurrency) / concurrency
            r, r_low, r_high = ratio_interval(spec, plain, concurrency)
            gain, draft = p * (accepted + steps), prompt * draft_row_token_s
            total += gain - p * steps * r - draft
            low += gain - p * steps * r_high - draft
            high += gain - p * steps * r_low - draft
            counted += 1
        return Saving(round(total, 4), round(low, 4), round(high, 4), counted, min(spec.points, plain.points))

    def plain_price(self, prompt: int, completion: int, concurrency: int) -> float | None:
        """What a row would cost decoded plain at this concurrency: its tokens at the plain line's
        step per row, its prompt at the target's price (None without a plain line)."""
        plain = self.lines()[1]
        if plain is None or concurrency <= 0:
            return None
        return completion * plain.at(concurrency) / concurrency + prompt * (self.prefill_row_token_s or (0.0, 0.0))[0]

    def observe_call(self, seconds: float, rows: int, concurrency: int, price: float | None, plain: bool) -> None:
        """A call took `seconds` over rows the step lines priced at `price` (a plain call: the plain
        price; a call at k: its rows' own work, row_cost): what whole calls take over their price
        (fill, drain, the lines' own bias) scales saving_against_plain. Kept by arm and shape: a call
        that streams (rows >= 2x concurrency) runs mostly full, one that never filled the engine
        twice is mostly fill and drain, and the two take differently over their price."""
        if price:
            key = (plain, streams(rows, concurrency))
            took, priced, most = self.calls.get(key, (0.0, 0.0, 0))
            self.calls[key] = (took + seconds, priced + price, max(most, concurrency))

    def saving_against_plain(self, rows: Sequence[tuple[int, int, int]], seconds: float,
                             stream: bool = True) -> Saving | None:
        """What a shard's decisions saved (negative: cost) against decoding its rows plain: rows,
        (prompt tokens, completion tokens, concurrency) of every row it generated, each priced plain
        (plain_price) and scaled by what this run's plain calls of the plain call's shape (`stream`,
        observe_call) took over their price; less `seconds`, the shard's generation time (its share
        of every call, its look's included). Where no plain call had that shape (every shard
        speculating), by what its calls at k of that shape took over theirs, the interval widened by
        ARMS_APART. The interval is the plain line's 95% interval at those concurrencies, widened,
        where those calls ran at less concurrency than the rows are priced at, to what pricing them
        at those calls' concurrency gives: the line extrapolated beyond the concurrency it was
        timed at, on the demo job (a plain look of 48 rows, a plain call of 96), priced plain
        decoding 5-15% low, and pricing at the look's concurrency 10-25% high. None before a call
        of that shape has been measured (then saving(), over the speculating rows only)."""
        arm = "plain" if (True, stream) in self.calls else "at k"
        took, priced, most = self.calls.get((arm == "plain", stream), (0.0, 0.0, 0))
        plain = self.lines()[1]
        if priced <= 0 or plain is None or not rows:
            return None
        scale = took / priced
        price = scale * sum(self.plain_price(p, n, c) or 0.0 for p, n, c in rows)
        timed = scale * sum(self.plain_price(p, n, min(c, most)) or 0.0 for p, n, c in rows)
        rel = max(min(t95(max(plain.df, 1)) * plain.se(c) / plain.at(c), 1.0) for _, _, c in rows)
        rel += 0.0 if arm == "plain" else ARMS_APART
        shape = "that streamed" if stream else "of one wave"
        basis = (f"its rows priced as plain decoding in one call over its actor call's rows (this run's plain step "
                 f"line and prompt price, x{scale:.3f}: what its calls {arm} {shape} took over their price), less the "
                 "time its rows took (its share of every call, the look included); the interval is the plain line's"
                 + (f", widened by {ARMS_APART:.0%} (a call at k stands for a plain one)" if arm != "plain" else "")
                 + (", and spans pricing at the concurrency those calls ran at" if timed != price else ""))
        return Saving(round(price - seconds, 4), round(min(price, timed) * (1 - rel) - seconds, 4),
                      round(max(price, timed) * (1 + rel) - seconds, 4), len(rows), plain.points, basis)

    def row_cost(self, prompt: int, completion: int, accepted: int, verify_steps: int, concurrency: int,
                 speculated: bool) -> float | None:
        """What one row's own work cost, in seconds, priced with this run's step lines at the
        concurrency it ran at: its verify steps at k, its other steps plain, and its prompt (the
        draft's part too when it speculated). An estimate of the row's share of its call (the
        runner scales the shares to the call's measured time); None without step lines."""
        spec = self.lines()[0]
        plain_part = self.plain_price(prompt, max(completion - accepted - verify_steps, 0), concurrency)
        if spec is None or plain_part is None:
            return None
        draft = prompt * (self.prefill_row_token_s or (0.0, 0.0))[1] if speculated else 0.0
        return verify_steps * spec.at(concurrency) / concurrency + plain_part + draft
