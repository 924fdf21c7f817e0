"""policy/planner.py without an engine: an actor's decisions between and inside its calls, driven
by profiles, scripted step rules and costs given by hand."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from batchspec.engine.api import AdaptiveK, FixedK
from batchspec.policy import ActorPolicy, CostModelK, Costs, Decision, DecisionKind, LengthProfile, Policy, StepArms


def costs(batch=8, step=0.010, draft=0.002, prefill=0.0001, draft_prefill=0.00002) -> Costs:
    return Costs(batch, step, draft, {k: step * (1 + 0.1 * k) for k in (1, 2, 4, 8)}, prefill, draft_prefill)


@dataclass
class Shard:
    """A shard in progress, as the planner sees one (policy.planner.ShardProgress)."""

    prompts: list[int]
    expected_new: float = 64.0
    decisions: list[Decision] = field(default_factory=list)
    done: int = 0

    def __post_init__(self):
        self.profile = LengthProfile(list(self.prompts), self.expected_new)

    def pending_prompt_lengths(self) -> list[int]:
        return self.prompts[self.done:]


def planner(alpha: float | None = None, costs_known: bool = True, measure_in_call: bool = False) -> ActorPolicy:
    plan = ActorPolicy(Policy("auto", k_default=4, k_max=8, measure_in_call=measure_in_call))
    if costs_known:
        plan.policy.calibrate(costs())
    if alpha is not None:
        plan.policy.prior.accepted, plan.policy.prior.trials = alpha * 1000, 1000
    return plan


def test_a_shard_records_its_first_decision_then_only_changes_and_what_follows_a_probe():
    plan, shard = planner(), Shard([20] * 8)
    probe, changed = plan.decide(shard)
    assert probe.kind is DecisionKind.PROBE and probe.probes and not changed  # the first is recorded, not "changed"
    plan.policy.prior.accepted, plan.policy.prior.trials = 900, 1000
    on, changed = plan.decide(shard)
    assert on.kind is DecisionKind.ON and changed  # after a probe, the next decision is always recorded
    again, changed = plan.decide(shard)
    assert not changed and shard.decisions == [probe, on]
    assert again.speculate and again.k == on.k


def test_an_off_is_written_as_data_and_rendered_not_parsed():
    plan, shard = planner(alpha=0.05), Shard([20] * 8)
    d, _ = plan.decide(shard)
    assert d.kind is DecisionKind.OFF and not d.speculate
    assert d.reason == "off: " + d.body() and d.to_json()["kind"] == "off"


def test_shards_that_decide_differently_share_one_call_under_a_joint_decision():
    plan = planner(alpha=0.7)
    short, long = Shard([10] * 8, expected_new=64), Shard([2000] * 8, expected_new=4)
    decided = [(short, plan.decide(short)[0]), (long, plan.decide(long)[0])]
    assert decided[0][1].speculate != decided[1][1].speculate  # the short one speculates alone, the long one not
    together = plan.joint(decided)
    (s, ds), (t, dt) = together
    assert (ds.speculate, ds.k) == (dt.speculate, dt.k) and ds.call is not None and ds.call.rows == 16
    assert ds.call.alone.speculate and not dt.call.alone.speculate  # each keeps what it would have got alone
    assert short.decisions[-1] is ds and long.decisions[-1] is dt  # recorded in place of the shard's own
    assert "for the 16 rows of this call's 2 shards together (this shard alone: on at k=" in ds.reason


def test_a_remembered_off_is_checked_when_due_and_skipped_otherwise():
    plan = planner(alpha=0.05, measure_in_call=True)
    plan.costs_by_batch[8] = costs()
    plan.remembered = "job night-1 at 2026-12-04T01:00:00"
    shard = Shard([20] * 8)
    off, _ = plan.decide(shard)
    assert off.rests_on_remembered_acceptance and off.remembered == plan.remembered
    assert plan.check_remembered([(shard, off)], 8) == [(shard, off)] and plan.outcome == "skipped"  # not due
    plan.recheck = True
    ((_, check),) = plan.check_remembered([(shard, off)], 8)
    assert check.kind is DecisionKind.CHECKING and check.speculate and check.k == off.figures.k
    assert check.reason == (f"on (checking): the remembered {off.body()}; this call speculates until its own steps "
                            f"show whether that still holds (from what {plan.remembered} measured on this node)")
    assert check.to_json()["numbers"]["checking"] and shard.decisions[-1] is check
    plan.recheck = True
    assert plan.check_remembered([(shard, off)], 64) == [(shard, off)]  # no costs at 64: not judged, not checked


def _measure(rule: StepArms, steps) -> None:
    for k, seconds, tokens, rows, prefill in steps:
        assert rule.next_k() == k
        rule.observe_step(k, seconds, tokens, rows, prefill)


def test_a_measuring_call_keeps_the_faster_arm_and_its_costs():
    plan = planner(costs_known=False, measure_in_call=True)
    decision, _ = plan.decide(Shard([20] * 8))
    assert decision.kind is DecisionKind.MEASURING
    rule = plan.draft_length(4, concurrency=8, per_round_k=False, adaptive=True)
    assert isinstance(rule, StepArms) and rule.arms == (4, 0)
    _measure(rule, [(4, 0.05, 8, 8, True), (4, 0.02, 24, 8, False), (4, 0.02, 24, 8, False),
                    (0, 0.015, 8, 8, False), (0, 0.01, 8, 8, False), (0, 0.01, 8, 8, False)])
    kept = plan.learn(rule, decision, 8, [20] * 8)
    assert kept.kind is DecisionKind.KEPT and kept.speculate and kept.k == 4
    assert kept.predicted_speedup == pytest.approx((24 / 0.02) / (8 / 0.01), rel=1e-3)
    assert 8 in plan.costs_by_batch and plan.policy.costs is plan.costs_by_batch[8] and plan.outcome == "on"
    guarded = plan.draft_length(4, concurrency=8, per_round_k=False, adaptive=True)
    assert isinstance(guarded, StepArms) and guarded.arms == (4,) and guarded.guard is not None  # now decided


def test_a_decided_call_whose_acceptance_stops_paying_turns_plain():
    plan = planner(alpha=0.9, measure_in_call=True)
    plan.costs_by_batch[8] = costs(draft=0.006)
    decision, _ = plan.decide(Shard([20] * 8))
    rule = plan.draft_length(decision.k, 8, per_round_k=False, adaptive=True)
    rule.guard_passes = 16
    # Each clean step at k emits one token per row: nothing accepted.
    _measure(rule, [(decision.k, 0.02, 8, 8, False)] * 3)
    assert rule.next_k() == 0 and rule.stopped
    stopped = plan.learn(rule, decision, 8, [20] * 8)
    assert stopped.kind is DecisionKind.STOPPED and not stopped.speculate and plan.outcome == "off"
    assert stopped.reason.startswith(f"off for the rest of the call: its steps at k={decision.k} delivered")


def test_hf_calls_get_a_per_round_rule():
    plan = planner()
    assert isinstance(plan.draft_length(4, 8, per_round_k=True, adaptive=True), CostModelK)
    assert isinstance(plan.draft_length(4, 8, per_round_k=True, adaptive=False), FixedK)
    assert isinstance(planner(costs_known=False).draft_length(4, 8, per_round_k=True, adaptive=True), AdaptiveK)
    assert isinstance(plan.draft_length(4, 8, per_round_k=False, adaptive=True), FixedK)  # k per call


def test_figures_are_typed_and_the_manifest_keeps_its_numbers():
    plan, shard = planner(alpha=0.9), Shard([20, 30, 40, 50] * 2)
    d, _ = plan.decide(shard)
    assert d.figures.k == d.k and d.figures.batch_size == 8 and d.figures.rows == 8
    numbers = d.to_json()["numbers"]
    assert set(numbers) == {"c", "v_k", "batch_size", "rows", "prompt_p50", "prompt_p90", "expected_new_tokens", "k"}
    assert numbers["prompt_p50"] == 35.0 and "tokens_per_s" not in numbers  # absent figures are not written


def test_a_check_is_judged_on_its_own_rows_with_the_margin_an_off_must_earn():
    plan = planner(alpha=0.05, measure_in_call=True)
    plan.costs_by_batch[8] = costs()
    shard = Shard([20] * 8)
    off, _ = plan.decide(shard)
    rule = plan.check_remembered  # noqa: F841  (the check itself: test above)
    check = Decision(DecisionKind.CHECKING, True, 4, "the remembered ...")
    rule = plan.checking_rule(check, [(shard, 20)] * 8, 8)
    assert rule.arms == (4,) and rule.threshold == pytest.approx(1.0 + plan.policy.margin)
    profile = LengthProfile([20] * 8, shard.profile.expected_new_tokens)
    assert rule.guard(0.9) == pytest.approx(plan.policy.predict(profile, 0.9, 4, plan.costs_by_batch[8]))
