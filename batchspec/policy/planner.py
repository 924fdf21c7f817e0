"""What an actor decides with, between and inside its calls: the policy and its acceptance prior,
the steps it measured (measured.py: step lines, costs per concurrency), what an earlier run on
this node measured; and the rules for a call: each shard's next decision (hf), the look that
measures each shard's own acceptance and each shard's own decision from it (vllm), the
draft-length rule a call runs under, what a call teaches.

Pure: no engine, no Ray, no I/O. The runner (runner/worker.py) runs calls and records; this
module decides. Tests drive it with scripted step rules (tests/test_planner.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol

from ..engine.api import AdaptiveK, DraftLength, FixedK
from .decision import Decision, Figures
from .decision import DecisionKind as Kind
from .interleaved import InterleavedSteps, t95
from .measured import StepCosts
from .model import Acceptance, Costs, LengthProfile, Policy, acceptance_for
from .steps import CostModelK

LOOK_LEAST = 8  # rows of a shard its look takes at least (all of a smaller shard)
LOOK_FIRST = 4  # rows of a shard its look takes first; the rest of its look only where these do not settle it
PLAIN_LINE_STEPS = 8  # clean plain steps a plain engine's line needs before looks stop timing it


class ShardProgress(Protocol):
    """What the planner reads and records of a shard in progress (runner.work.ShardWork)."""

    profile: LengthProfile | None
    decisions: list[Decision]
    done: int  # rows generated so far

    def pending_prompt_lengths(self) -> list[int]: ...



def _profile(shard: ShardProgress) -> LengthProfile:
    """The shard's length profile (its expected new tokens kept current by the runner)."""
    if shard.profile is None:
        raise ValueError("a shard is profiled when it is opened, before any decision")
    return shard.profile


def _tokens_per_step(rows: Sequence[tuple[int, int]]) -> float | None:
    """Tokens per verify step over rows' (accepted tokens, verify steps): each step emits its
    accepted drafts and the target's own token. None where no row ran a step."""
    steps = sum(n for _, n in rows)
    return (sum(a for a, _ in rows) + steps) / steps if steps else None


def own_acceptance(rows: Sequence[tuple[int, int]], k: int) -> tuple[float | None, float | None]:
    """(per-token acceptance, tokens per verify step) of a shard from its rows' (accepted tokens,
    verify steps): what its own rows delivered, as the cost model counts it (acceptance_for)."""
    per_step = _tokens_per_step(rows)
    if per_step is None:
        return None, None
    return acceptance_for(per_step, k), round(per_step, 3)


def tokens_per_step_interval(rows: Sequence[tuple[int, int]], k: int) -> tuple[float, float] | None:
    """The 95% interval of a shard's tokens per verify step from its rows' (accepted tokens, verify
    steps), each row one observation (a ratio estimator over rows: a row's steps are not
    independent trials); None with fewer than 2 rows that ran a step."""
    rows = [(a, n) for a, n in rows if n > 0]
    per_step = _tokens_per_step(rows)
    if len(rows) < 2 or per_step is None:
        return None
    mean_steps = sum(n for _, n in rows) / len(rows)
    spread = sum((a + n - per_step * n) ** 2 for a, n in rows) / (len(rows) - 1)
    half = t95(len(rows) - 1) * math.sqrt(spread / len(rows)) / mean_steps
    return max(1.0, per_step - half), min(k + 1.0, per_step + half)


class ActorPolicy:
    """The decisions of one actor, as data, with the state they rest on passed in and kept here."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.steps = StepCosts(policy.k_default)  # vllm: what its calls' steps measured (measured.py)
        self.remembered: str | None = None  # "job ... at ...", while decisions rest on remembered numbers
        # vllm with model.vllm_plain_engine: plain calls, and the plain arm's timing, on the plain engine.
        self.separate_plain = False

    @property
    def learns_costs(self) -> bool:
        """The policy's costs come from the steps of real calls (the policy measures in the call)."""
        return self.policy.measure_in_call

    def start_from(self, costs: dict[int, Costs], prior: Acceptance | None, new_tokens: list[int],
                   remembered: str | None, points: dict[int, list[tuple[float, float]]] | None = None,
                   prefill_row_token_s: tuple[float, float] | None = None) -> None:
        """Start from what an earlier run measured on this node (runner/memory.py.Remembered); its
        clean steps per arm and prompt costs (vllm) are joined by this run's."""
        self.policy.prior = prior or self.policy.prior
        self.policy.new_tokens_seen.extend(new_tokens)
        self.remembered = remembered
        self.steps.start_from(costs, points, prefill_row_token_s)

    # -- a shard's decisions ------------------------------------------------------------------
    def decide(self, shard: ShardProgress, batches_off: int = 0) -> tuple[Decision, bool]:
        """The policy's next decision for the shard (its profile up to date), and whether it is
        recorded as a new one (it differs from the last, or the last was a probe)."""
        profile = _profile(shard)
        last = shard.decisions[-1] if shard.decisions else None
        # A probe is not "on" for the hysteresis: after it, speculation must earn 1 + margin to stay on.
        state = None if last is None or last.probes else last.speculate
        d = self.mark_remembered(self.policy.decide(profile, state, batches_off, at_row=shard.done))
        new = last is None or d.speculate != last.speculate or d.k != last.k or last.probes
        if new:
            shard.decisions.append(d)
        return d, new and last is not None

    def mark_remembered(self, d: Decision) -> Decision:
        """A decision taken on remembered numbers says so (its reason renders where they came from)."""
        if self.remembered and self.policy.costs is not None:
            d.remembered = self.remembered
        return d

    # -- a call of several shards in one continuous batch (vllm) -------------------------------
    def look_sizes(self, pending: Sequence[int], concurrency: int) -> list[int]:
        """Rows of each shard the look takes: an equal share of the call's concurrency, at least
        LOOK_LEAST (all of a smaller shard), so that the look runs at the concurrency the shards
        will run at and each shard's acceptance is its own rows'."""
        share = max(LOOK_LEAST, -(-concurrency // max(len(pending), 1)))
        return [min(n, share) for n in pending]

    def plain_look_sizes(self, spec_sizes: Sequence[int], pending: Sequence[int], concurrency: int) -> list[int]:
        """With a plain engine apart: rows of each shard the look's plain half takes (the look at k
        then takes the shard's look size less what this leaves it short). It is there to time a
        plain step at the call's concurrency, which no shard's own rows change, so one wave of rows
        (the concurrency, at least LOOK_LEAST) dealt over the shards in turn: each shard at most
        its look size and its rows beyond it, or half of a shard the look at k would take whole. It
        took as many rows again as the look at k: at 8 rows at once, 32 of the demo's 96 rows ran
        plain before any shard decided; now 8."""
        caps = [min(n, rows - n) if rows > n else rows // 2 for n, rows in zip(spec_sizes, pending)]
        sizes = [0] * len(caps)
        want = min(max(concurrency, LOOK_LEAST), sum(caps))
        while sum(sizes) < want:
            for i, cap in enumerate(caps):
                if sizes[i] < cap and sum(sizes) < want:
                    sizes[i] += 1
        return sizes

    def look(self, rows: int, shards: int, more: bool = False) -> tuple[Decision, InterleavedSteps]:
        """The decision a look's rows run under, and its step rule: at k, never stopped (the look is
        there to measure); on one engine with plain blocks between its steps (InterleavedSteps)
        timing both arms at every row count it drains through, on two only the steps at k. more:
        the look's second stage, over the shards its first rows did not settle (runner/look.py)."""
        k = self.policy.k_default
        timing = (" and time a speculative step" if self.separate_plain
                  else ", with plain blocks between their steps timing what a step costs")
        which = (f"{rows} more rows of the {shards} shards whose first look rows left their decision open" if more
                 else f"{rows} rows of this call's {shards} shards")
        d = Decision(Kind.LOOK, True, k, f"{which} run at k={k} to measure each shard's own acceptance{timing}",
                     figures=Figures(rows=rows, k=k))
        if self.separate_plain:
            return d, InterleavedSteps(k, interleave=False)
        return d, InterleavedSteps(k, dense=True, guard=False)

    def needs_plain_look(self, concurrency: int) -> bool:
        """With a plain engine apart: whether a call's look runs rows plain too, until the plain
        steps this run timed, or an earlier run on this node (remembered), reach its concurrency."""
        if not self.separate_plain:
            return False
        return not any(steps >= PLAIN_LINE_STEPS and most_rows >= 0.9 * concurrency
                       for steps, most_rows in (self.steps.run_plain, self.steps.kept_plain))

    def settles(self, shard: ShardProgress, rows: Sequence[tuple[int, int]], concurrency: int,
                new_tokens: float | None = None) -> bool:
        """Whether a shard's first look rows, their (accepted tokens, verify steps), settle its
        decision, so its look takes no more of its rows: speculation loses (< 1.00x) at the high
        end of their tokens per step's 95% interval and the fast end of the step ratio's, or pays
        (>= 1 + margin) at the low ends of both. Not without step lines that reach half this
        concurrency: a first run's first look rows time steps at k at a few rows a shard, and on
        the nightly job a line from 24 rows put the step ratio at 256 at 4.6 (95% interval
        4.1-5.2); with a second stage of 165 rows in it, 2.3 (docs/benchmarks.md)."""
        costs = self.steps.costs_at(concurrency)
        k = self.policy.k_default
        interval = tokens_per_step_interval(rows, k)
        slow, fast = self.steps.cautious(costs, concurrency), self.steps.cautious(costs, concurrency, slow=False)
        if interval is None or costs is None or slow is None or fast is None:
            return False
        if any(line is None or line.high_rows < 0.5 * concurrency for line in self.steps.lines()):
            return False
        profile = LengthProfile(shard.pending_prompt_lengths(), new_tokens or _profile(shard).expected_new_tokens)
        if not profile.prompt_tokens:
            return True
        ks = tuple(sorted(costs.verify_s))
        best = max(self.policy.predict(profile, acceptance_for(interval[1], k), j, fast) for j in ks)
        worst = max(self.policy.predict(profile, acceptance_for(interval[0], k), j, slow) for j in ks)
        return best < 1.0 or worst >= 1.0 + self.policy.margin

    def plain_look(self, rows: int, shards: int) -> tuple[Decision, InterleavedSteps]:
        """With a plain engine apart: the decision and step rule of the look's plain half (a wave of
        rows, plain_look_sizes, on the engine without speculation, timing a plain step at the same
        concurrency)."""
        d = Decision(Kind.LOOK_PLAIN, False, 0, f"{rows} rows of this call's {shards} shards run plain on the "
                     "engine without speculation to time a plain step", figures=Figures(rows=rows, k=0))
        return d, InterleavedSteps(0, interleave=False)

    def plain_rule(self) -> InterleavedSteps | None:
        """The step rule of a plain call: with a plain engine apart, one that times its steps (the
        plain arm's line stays current, as the speculative calls keep theirs); None otherwise."""
        return InterleavedSteps(0, interleave=False) if self.separate_plain and self.learns_costs else None

    def decide_own(self, shard: ShardProgress, alpha: float | None, rows: int, tokens_per_step: float | None,
                   concurrency: int, new_tokens: float | None = None) -> Decision:
        """A shard's decision for the rest of its rows from its own look rows (their acceptance and,
        when given, their mean completion length) and the step costs at this concurrency, recorded
        in the shard: on one engine only if speculation pays at the slow end of the step ratio's 95%
        interval, on two _decide_central; numbers.predicted_own is the central prediction. Without
        costs (no clean steps of both arms, nothing remembered) the call measures: MEASURING."""
        costs = self.steps.costs_at(concurrency)
        self.policy.costs = costs
        if costs is None and self.policy.mode == "auto":
            d = Decision(Kind.MEASURING, True, self.policy.k_default, "no step costs at this concurrency yet; the "
                         "call interleaves plain blocks with its speculative steps and turns plain if they show it slower",
                         alpha=alpha, at_row=shard.done)
        else:
            ks = tuple(sorted(costs.verify_s)) if costs is not None else None
            expected = new_tokens if new_tokens else _profile(shard).expected_new_tokens
            profile = LengthProfile(shard.pending_prompt_lengths(), expected)
            cautious = self.steps.cautious(costs, concurrency)
            if self.separate_plain:
                d = self._decide_central(profile, shard.done, alpha, ks, costs, cautious)
            else:
                self.policy.costs = cautious or costs
                d = self.policy.decide(profile, None, at_row=shard.done, alpha=alpha, ks=ks)
            self.policy.costs = costs
            if costs is not None and alpha is not None and profile.prompt_tokens:
                own = max(self.policy.predict(profile, alpha, k, costs) for k in ks or (self.policy.k_default,))
                d.figures = dataclasses.replace(d.figures, predicted_own=round(own, 3))
                if cautious is not None and d.predicted_speedup is not None and not self.separate_plain:
                    d.detail += f" at the slow end of the step ratio's 95% interval (central estimate {own:.2f}x)"
        d.figures = dataclasses.replace(d.figures, look_rows=rows or None, tokens_per_step=tokens_per_step,
                                        **self.steps.cost_figures(concurrency))
        d.alpha = alpha if d.alpha is None else d.alpha  # measured on its rows, whatever the kind
        d = self.mark_remembered(d)
        shard.decisions.append(d)
        return d

    def _decide_central(self, profile: LengthProfile, at_row: int, alpha: float | None, ks: tuple[int, ...] | None,
                        costs: Costs | None, cautious: Costs | None) -> Decision:
        """A shard's decision where each arm was timed on its own engine (separate_plain): on the
        central estimate, vetoed where the slow end of the step ratio's 95% interval predicts a
        loss. One engine's plain arm runs slow, so there the slow end must pass (decide_own); on two
        engines that caution turned off shards bare runs showed faster speculating (docs/policy.md)."""
        self.policy.costs = costs
        d = self.policy.decide(profile, None, at_row=at_row, alpha=alpha, ks=ks)
        if d.kind is not Kind.ON or cautious is None or d.alpha is None:
            return d
        self.policy.costs = cautious
        _, low = self.policy.best_k(profile, d.alpha, ks)
        self.policy.costs = costs
        if low >= 1.0:
            d.detail += f" ({low:.2f}x at the slow end of the step ratio's 95% interval)"
            return d
        return Decision(Kind.OFF, False, 0, f"per-token acceptance {d.alpha:.2f}, k={d.k}, predicted {d.predicted_speedup:.2f}x "
                        f"but {low:.2f}x (< 1.00x) at the slow end of the step ratio's 95% interval",
                        d.predicted_speedup, d.alpha, at_row, d.figures)

    def call_rule(self, k: int, concurrency: int) -> InterleavedSteps:
        """The rule of a call at k: a plain block every InterleavedSteps.every steps (the control
        that keeps the step lines current), and plain for the rest of the call once its own steps
        show speculation slower with 95% confidence. Dense blocks while no costs are known."""
        if self.separate_plain:  # the plain arm is timed on the plain engine's own calls
            return InterleavedSteps(k, interleave=False)
        return InterleavedSteps(k, dense=self.steps.costs_at(concurrency) is None)

    # -- the rule a call runs under -----------------------------------------------------------
    def draft_length(self, k: int, concurrency: int, per_round_k: bool, adaptive: bool) -> DraftLength | InterleavedSteps:
        """How k is chosen inside a speculative call. vllm (costs learnt in calls): InterleavedSteps
        (call_rule). hf: per round, from the cost model (CostModelK) or the acceptance heuristic
        (AdaptiveK), or fixed."""
        if self.learns_costs:
            return self.call_rule(k, concurrency)
        if not per_round_k:  # k is set per call, by the policy between blocks
            return FixedK(k)
        if adaptive and self.policy.costs is not None:
            return CostModelK(self.policy, k)
        if adaptive:
            return AdaptiveK(k=k)
        return FixedK(k)

    # -- what a call teaches ------------------------------------------------------------------
    def learn(self, rule: InterleavedSteps, decision: Decision, concurrency: int, prompt_lengths: list[int]) -> Decision:
        """After a vllm call under an InterleavedSteps rule: keep its clean steps and what its
        prompts cost (StepCosts.keep), and the costs they give at this concurrency for the next
        decisions; returns the decision the call's rows ran under: `decision`, or STOPPED when its
        steps turned it plain (recorded by the runner)."""
        self.steps.keep(rule, concurrency, prompt_lengths)
        self.policy.costs = self.steps.costs_at(concurrency)
        if rule.stopped is None:
            return decision
        mean, low, high = rule.stopped
        # The call stopped because the interval's high end is below 1.0: rounded to the nearest, a
        # high end of 0.9996 read "0.28-1.00x"; rounded down it stays below 1.0 as written.
        high2, high3 = math.floor(high * 100) / 100, math.floor(high * 1000) / 1000
        return Decision(Kind.STOPPED, False, 0, f"its steps at k={rule.k_spec} ran {mean:.2f}x plain's tokens/s at "
                        f"{rule._rows} rows (95% interval {low:.2f}-{high2:.2f}x, over {len(rule.points[0])} plain "
                        f"and {len(rule.points[rule.k_spec])} speculative steps)", round(mean, 3), decision.alpha,
                        decision.at_row, Figures(rows=len(prompt_lengths), k=rule.k_spec,
                                                 clean_steps=min(len(p) for p in rule.points.values()),
                                                 speedup_interval=(round(low, 3), high3)))
