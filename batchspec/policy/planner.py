"""What an actor decides with, between and inside its calls: the policy and its acceptance prior,
the costs it measured per concurrency, what an earlier run on this node measured; and the rules
for a call: each shard's next decision, one decision for a call's shards together (vllm), a
remembered "off" checked, the draft-length rule a call runs under, what a call teaches.

Pure: no engine, no Ray, no I/O. The runner (runner/worker.py) runs calls and records; this
module decides. Tests drive it with scripted step rules (tests/test_planner.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, TypeVar

from ..engine.api import AdaptiveK, DraftLength, FixedK
from .decision import Alone, CallShare, Decision, Figures
from .decision import DecisionKind as Kind
from .model import Acceptance, Costs, LengthProfile, Policy, decode_speedup
from .steps import CostModelK, StepArms

# What this run found about acceptance, for memory.Recheck.after: a measurement outranks a
# skipped check, and speculation that paid outranks both.
_OUTCOME_RANK = {None: 0, "skipped": 1, "off": 2, "on": 3}


class ShardProgress(Protocol):
    """What the planner reads and records of a shard in progress (runner.read.ShardWork)."""

    profile: LengthProfile | None
    decisions: list[Decision]
    done: int  # rows generated so far

    def pending_prompt_lengths(self) -> list[int]: ...


S = TypeVar("S", bound=ShardProgress)


def _profile(shard: ShardProgress) -> LengthProfile:
    """The shard's length profile (its expected new tokens kept current by the runner)."""
    if shard.profile is None:
        raise ValueError("a shard is profiled when it is opened, before any decision")
    return shard.profile


class ActorPolicy:
    """The decisions of one actor, as data, with the state they rest on passed in and kept here."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.costs_by_batch: dict[int, Costs] = {}  # measured (or learned) per concurrency on this actor
        self.remembered: str | None = None  # "job ... at ...", while decisions rest on remembered numbers
        self.recheck = False  # check a remembered "off" in the next call (memory.Recheck)
        self.outcome: str | None = None  # what this run found about acceptance (memory.Recheck.after)

    @property
    def learns_costs(self) -> bool:
        """The policy's costs come from the steps of real calls (the policy measures in the call)."""
        return self.policy.measure_in_call

    def start_from(self, costs: dict[int, Costs], prior: Acceptance | None, new_tokens: list[int],
                   remembered: str | None, recheck_due: bool) -> None:
        """Start from what an earlier run measured on this node (runner/memory.py): costs by
        concurrency, the acceptance prior, completion lengths, and which run that was."""
        self.costs_by_batch.update(costs)
        self.policy.prior = prior or self.policy.prior
        self.policy.new_tokens_seen.extend(new_tokens)
        self.remembered = remembered
        # On vllm a call decided "off" runs plain and observes no acceptance, so an "off" that rests
        # on a remembered acceptance is checked in this run's first call when due.
        self.recheck = prior is not None and self.learns_costs and recheck_due

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
        """A decision taken on remembered numbers says so (its reason renders where they came from),
        and, when it is off for an earlier run's acceptance, is one check_remembered may turn into a
        check."""
        if self.remembered and not d.speculate and d.alpha is not None and self.learns_costs:
            d.rests_on_remembered_acceptance = True
        if self.remembered and self.policy.costs is not None:
            d.remembered = self.remembered
        return d

    @staticmethod
    def _replace(shard: ShardProgress, old: Decision, new: Decision) -> None:
        """Record `new` in the shard's decisions where `decide` recorded `old` (the call runs under new)."""
        shard.decisions[:] = [new if x is old else x for x in shard.decisions]

    # -- a call of several shards (vllm) ------------------------------------------------------
    def joint(self, decided: Sequence[tuple[S, Decision]]) -> list[tuple[S, Decision]]:
        """vllm: shards whose own decisions differ still share one call, under the decision the
        policy takes for all their rows together. vLLM sets k per engine step for every row it
        runs, so a call split by decision ran its parts one after the other, each at a fraction
        of the call's concurrency. On a GPU a decode step costs about as much for 48 rows as for
        96, so that can double the call's time (docs/policy.md; issue 39 replaces this with each
        shard's own decision inside one continuous batch). The cost model is linear in prompt and
        new tokens, so the rows' mean profile predicts their sum."""
        if len({(d.speculate, d.k) for _, d in decided}) < 2 or self.policy.costs is None:
            return list(decided)
        left = [(w.pending_prompt_lengths(), _profile(w).expected_new_tokens) for w, _ in decided]
        n = sum(len(lengths) for lengths, _ in left)
        profile = LengthProfile([p for lengths, _ in left for p in lengths],
                                sum(expected * len(lengths) for lengths, expected in left) / n)
        joint = self.policy.decide(profile, None)
        out = []
        for w, d in decided:
            share = CallShare(n, len(decided), Alone(d.speculate, d.k, d.predicted_speedup))
            together = self.mark_remembered(
                dataclasses.replace(joint, at_row=d.at_row, call=share))
            self._replace(w, d, together)
            out.append((w, together))
        return out

    def check_remembered(self, decided: Sequence[tuple[S, Decision]], concurrency: int) -> list[tuple[S, Decision]]:
        """vllm: the decisions of a call's shards, with an "off" that rests on an earlier run's
        acceptance turned into a check when one is due (memory.Recheck): the call speculates
        until its own steps say whether that acceptance still holds (checking_rule). Only when
        every shard of the call is off for that reason, so the check never splits a call, and
        when costs are known at the call's concurrency, so it is judged, not measured."""
        offs = [d for _, d in decided if d.rests_on_remembered_acceptance]
        if not offs:
            return list(decided)
        if not (self.recheck and len(offs) == len(decided) and concurrency in self.costs_by_batch):
            self.found("skipped")
            return list(decided)
        out = []
        for w, d in decided:
            k = d.figures.k if d.figures.k is not None else self.policy.k_default
            check = Decision(Kind.CHECKING, True, k, f"the remembered {d.body()}; this call speculates "
                             "until its own steps show whether that still holds", d.predicted_speedup, d.alpha,
                             d.at_row, d.figures, remembered=self.remembered)
            self._replace(w, d, check)
            out.append((w, check))
        return out

    def found(self, outcome: str) -> None:
        """Note what this run found about acceptance (the higher rank stays)."""
        if _OUTCOME_RANK[outcome] > _OUTCOME_RANK[self.outcome]:
            self.outcome = outcome

    # -- the rule a call runs under -----------------------------------------------------------
    def draft_length(self, k: int, concurrency: int, per_round_k: bool, adaptive: bool,
                     strict: bool = False) -> DraftLength | StepArms:
        """How k is chosen inside a speculative call. vllm (costs learnt in calls): a StepArms that
        measures plain steps too while costs at this concurrency are unknown, else one that guards
        the decision with the acceptance its steps deliver. hf: per round, from the cost model
        (CostModelK) or the acceptance heuristic (AdaptiveK), or fixed."""
        if self.learns_costs:
            costs = self.costs_by_batch.get(concurrency)
            if costs is None:
                return StepArms((k, 0), strict=strict)
            # Decided from known costs: the call still checks the acceptance its own steps deliver.
            return StepArms((k,), guard=lambda alpha: decode_speedup(alpha, k, costs.c, costs.v(k)))
        if not per_round_k:  # k is set per call, by the policy between blocks
            return FixedK(k)
        if adaptive and self.policy.costs is not None:
            return CostModelK(self.policy, k)
        if adaptive:
            return AdaptiveK(k=k)
        return FixedK(k)

    def checking_rule(self, decision: Decision, rows: Sequence[tuple[ShardProgress, int]], concurrency: int) -> StepArms:
        """The rule of a call that checks a remembered "off": k from the start, and once its clean
        steps have made guard_passes row passes, plain for the rest unless the acceptance they
        delivered makes the decision's own prediction (prefill included, for the call's rows: each
        a shard and its prompt length) earn 1 + margin, as any "off" must to turn on. Where the
        remembered acceptance still holds, the check costs the draft's prefill and a few
        speculative steps."""
        expected = sum(_profile(shard).expected_new_tokens for shard, _ in rows) / len(rows)  # by the rows in this call
        profile = LengthProfile([length for _, length in rows], expected)
        costs = self.costs_by_batch[concurrency]
        k = decision.k
        return StepArms((k,), guard=lambda alpha: self.policy.predict(profile, alpha, k, costs),
                        threshold=1.0 + self.policy.margin)

    # -- what a call teaches ------------------------------------------------------------------
    def learn(self, rule: StepArms, decision: Decision, concurrency: int, prompt_lengths: list[int]) -> Decision:
        """After a vllm call whose steps a StepArms rule chose: keep the step costs it measured for
        the next decisions at this concurrency; returns the decision the call's rows ran under:
        `decision` itself, or a new one (kept arm, or stopped) for the runner to record in the
        manifest of each shard the call ran rows of."""
        rule.finish()
        # A call decided beforehand: did what its steps delivered pay? Judged by the costs the call
        # was decided and guarded with, before this call's steps refresh them below. Judged after,
        # one step's time measured here was set against a plain step remembered from another run:
        # in CI, under load, a check whose rows had all run at k and stayed on was counted as
        # confirming its "off" (test_an_off_from_an_earlier_runs_acceptance_is_checked_...).
        verdict = None
        if rule.guard is not None:
            alpha = rule.acceptance().get(rule.arms[0])
            if rule.stopped or alpha is not None:
                verdict = "off" if rule.stopped or rule.guard(alpha) < rule.threshold else "on"  # type: ignore[arg-type]
        self._learn_costs(rule, concurrency, prompt_lengths)
        if decision.kind is Kind.CHECKING:
            self.recheck = False  # once a run: later calls decide from what this one delivered
        if verdict is not None:
            self.found(verdict)
        elif rule.guard is None and rule.explored():
            self.found("on" if rule.k > 0 else "off")
        if rule.stopped:  # the call's own acceptance said speculation no longer pays
            seen = rule.stopped
            assumed = f" where the decision assumed {decision.alpha:.2f}" if decision.alpha is not None else ""
            return Decision(Kind.STOPPED, False, 0, f"its steps at k={seen['k']} delivered per-token acceptance "
                            f"{seen['acceptance']:.2f} over {seen['row_passes']} row passes{assumed}, predicted "
                            f"{seen['predicted_speedup']:.2f}x", seen["predicted_speedup"], seen["acceptance"],
                            decision.at_row, Figures(rows=len(prompt_lengths), k=int(seen["k"]), acceptance=seen["acceptance"],
                                    predicted_speedup=seen["predicted_speedup"], steps=int(seen["steps"]),
                                    row_passes=int(seen["row_passes"])))
        if not rule.explored():
            return decision
        rates = rule.rates()  # measured speedup: speculative steps' tokens per second over plain steps'
        return Decision(Kind.KEPT, rule.k > 0, rule.k, rule.summary(), round(rates[rule.arms[0]] / rates[0], 3),
                        self.policy.prior.estimate, decision.at_row,
                        Figures(tokens_per_s={str(k): round(v, 1) for k, v in rates.items()}, k=decision.k,
                                rows=rule.rows, costs_kept=rule.costs_kept()))

    def _learn_costs(self, rule: StepArms, concurrency: int, prompt_lengths: list[int]) -> None:
        """The step costs a call measured, kept for its concurrency (when its arms were comparable)."""
        b = concurrency
        # Prefill costs are per prompt position for the whole batch (as measure_costs gives them,
        # and as Policy.predict multiplies them by the mean prompt length), not per token.
        positions = sum(prompt_lengths) / max(len(prompt_lengths), 1) or 1
        steps = rule.step_seconds() if rule.costs_kept() else {}  # not kept: the next call measures again
        prefill, draft_prefill = (seconds / positions for seconds in rule.prefill_costs())
        if b in self.costs_by_batch:
            self.costs_by_batch[b].learn_steps(steps, prefill, draft_prefill)
        elif (costs := Costs.from_steps(b, steps, prefill, draft_prefill)) is not None:
            self.costs_by_batch[b] = costs
        self.policy.costs = self.costs_by_batch.get(b)
