"""policy/planner.py without an engine: an actor's decisions between and inside its calls, driven
by profiles, scripted step rules and costs given by hand."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from batchspec.engine.api import AdaptiveK, FixedK
from batchspec.policy import (
    ActorPolicy,
    CostModelK,
    Costs,
    Decision,
    DecisionKind,
    InterleavedSteps,
    LengthProfile,
    Policy,
    PromptPrices,
    StepLine,
    expected_tokens,
    own_acceptance,
    ratio_interval,
    tokens_per_step_interval,
)


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


def _pairs(rule, spec=(0.030, 8 * 3.5), plain=(0.010, 8), rows=8, steps=60):
    """Drive an InterleavedSteps rule as the vllm backend does, with one prefill step first."""
    last = None
    for i in range(steps):
        k = rule.next_k()
        if i == 0:
            rule.observe_step(k, 0.05, rows, rows, True)
        else:
            seconds, tokens = spec if k else plain
            if last is not None and k != last:
                tokens = (spec if last else plain)[1]
            rule.observe_step(k, seconds, tokens, rows, False)
        last = k


def test_a_look_takes_an_equal_share_of_the_calls_concurrency_from_each_shard():
    plan = planner(measure_in_call=True)
    assert plan.look_sizes([300] * 8, 256) == [32] * 8
    assert plan.look_sizes([24] * 4, 64) == [16] * 4
    assert plan.look_sizes([5, 300], 16) == [5, 8]  # all of a small shard; at least LOOK_LEAST of a big one
    d, rule = plan.look(64, 4)
    assert d.kind is DecisionKind.LOOK and d.speculate and d.k == 4 and d.reason.startswith("on (look): 64 rows")
    assert isinstance(rule, InterleavedSteps) and not rule.guard and rule.dense


def test_a_looks_plain_half_is_one_wave_dealt_over_the_shards():
    """It times a plain step at the call's concurrency: one wave of rows, not as many again as the
    look at k (at 8 rows at once that ran a third of the demo's 96 rows plain before deciding)."""
    plan = planner(measure_in_call=True)
    assert plan.plain_look_sizes([8] * 4, [24] * 4, 8) == [2] * 4  # the demo on its stand-in
    assert plan.plain_look_sizes([32] * 8, [300] * 8, 256) == [32] * 8  # a full wave: as before
    assert plan.plain_look_sizes([24] * 4, [24] * 4, 256) == [12] * 4  # shards the look takes whole: halves
    assert plan.plain_look_sizes([5, 8], [5, 300], 16) == [2, 8]  # capped by each shard's share
    assert plan.plain_look_sizes([8, 8], [9, 9], 2) == [1, 1]  # at least LOOK_LEAST, at most the rows beyond the look


def test_each_shard_is_decided_from_its_own_rows_and_the_paired_step_costs():
    """A look's interleaved steps give the step costs at the concurrency (a k=4 step 3x a plain
    one); then a shard whose own rows made 3.5 tokens a verify step speculates and one whose rows
    made 1.6 does not, each citing its own figures and the steps behind the costs."""
    plan = planner(costs_known=False, measure_in_call=True)
    _, rule = plan.look(16, 2)
    _pairs(rule)
    assert plan.learn(rule, plan.look(16, 2)[0], 8, [20] * 16).kind is DecisionKind.LOOK
    assert plan.steps.costs_by_batch[8].v(4) == pytest.approx(3.0) and len(plan.steps.points[0]) >= 8
    good, bad = Shard([20] * 8, expected_new=64), Shard([20] * 8, expected_new=64)
    alpha_good, per_step_good = own_acceptance([(25, 10)] * 8, 4)  # 3.5 tokens a verify step
    alpha_bad, per_step_bad = own_acceptance([(6, 10)] * 8, 4)  # 1.6
    on = plan.decide_own(good, alpha_good, 8, per_step_good, 8)
    off = plan.decide_own(bad, alpha_bad, 8, per_step_bad, 8)
    assert on.kind is DecisionKind.ON and on.speculate and off.kind is DecisionKind.OFF and not off.speculate
    assert on.figures.tokens_per_step == 3.5 and on.figures.look_rows == 8 and on.figures.clean_steps >= 8
    assert on.figures.step_ratio == pytest.approx(3.0) and good.decisions == [on] and bad.decisions == [off]
    assert on.alpha == pytest.approx(alpha_good) and expected_tokens(alpha_good, 4) == pytest.approx(3.5)
    assert on.figures.predicted_own == pytest.approx(on.predicted_speedup, abs=1e-3)  # at its own acceptance
    assert off.figures.predicted_own == pytest.approx(off.predicted_speedup, abs=1e-3) and off.figures.predicted_own < 1.0
    assert own_acceptance([], 4) == (None, None)


def test_with_a_plain_engine_apart_each_arm_is_timed_on_its_own_engine():
    """model.vllm_plain_engine: the look's speculative rows time only steps at k (no plain blocks
    on the speculative engine), as many rows again time plain steps on the plain engine; the step
    costs come from the two, the draft's prompt cost from the speculative look alone, and later
    calls keep each arm's line current from their own engine's steps."""
    plan = planner(costs_known=False, measure_in_call=True)
    assert plan.plain_rule() is None  # one engine: plain calls are not timed apart
    plan.separate_plain = True
    look, rule = plan.look(16, 2)
    assert look.speculate and not rule.interleave and not rule.guard
    rule.observe_step(4, 0.05, 16, 8, True, draft_s=0.01)
    for rows in range(8, 0, -1):
        assert rule.next_k() == 4  # never a plain block on the speculative engine
        rule.observe_step(4, 0.030, rows * 3, rows, False)
    assert plan.learn(rule, look, 8, [20] * 8) is look
    plain_look, plain = plan.plain_look(16, 2)
    assert plain_look.kind is DecisionKind.LOOK_PLAIN and not plain_look.speculate and plain_look.k == 0
    assert plain_look.reason.startswith("off (look): 16 rows") and plain.k_spec == 0
    plain.observe_step(0, 0.04, 8, 8, True)
    for rows in range(8, 0, -1):
        assert plain.next_k() == 0
        plain.observe_step(0, 0.010, rows, rows, False)
    plan.learn(plain, plain_look, 8, [20] * 8)
    assert len(plan.steps.points[4]) == 8 and len(plan.steps.points[0]) == 8  # every decode step at the one k is clean
    assert plan.steps.costs_by_batch[8].v(4) == pytest.approx(3.0)
    target, draft = plan.steps.prefill_row_token_s
    assert target == pytest.approx(0.04 / 20 / 8) and draft == pytest.approx(0.01 / 20 / 8)
    call = plan.call_rule(4, 8)
    assert not call.interleave and call.k_spec == 4
    later = plan.plain_rule()
    assert later is not None and later.k_spec == 0 and later.next_k() == 0
    with pytest.raises(ValueError):
        InterleavedSteps(0)  # interleaving needs an arm at k >= 1


def test_prompts_are_priced_from_the_steps_that_ran_them_not_from_the_fill():
    """Where the engine counts the prompt tokens a step ran, a prompt token's price is what the
    steps that ran prompts took beyond their rows' decoding at the arm's step line, over those
    tokens: the target's from the plain arm, the draft's as the arm at k's excess over it. The
    fill, whose prompts cost more a token here than beside decoding rows, is one such step among
    many; without counted prompt tokens the price is the fill's, as before."""
    plan = planner(costs_known=False, measure_in_call=True)
    plan.separate_plain = True
    look, rule = plan.look(16, 2)
    rule.observe_step(4, 0.05 + 1000 * 2 * 50e-6, 16, 8, True, draft_s=0.01, prompt_tokens=1000)  # the fill
    for rows in range(8, 0, -1):
        rule.observe_step(4, 0.020 + 0.002 * rows, rows * 3, rows, False)
        rule.observe_step(4, 0.020 + 0.002 * rows + 100 * 50e-6, rows * 3, rows, True, prompt_tokens=100, decode_rows=rows)
    plan.learn(rule, look, 8, [20] * 8)
    assert plan.steps.prompts.per_token(4, None) is None  # only the arm at k priced: the fill's estimate for now
    assert plan.steps.prefill_row_token_s is not None
    plain_look, plain = plan.plain_look(16, 2)
    plain.observe_step(0, 0.04, 8, 8, True, prompt_tokens=500)  # a plain fill at 70 us a token beyond 5 ms
    for rows in range(8, 0, -1):
        plain.observe_step(0, 0.005 + 0.001 * rows, rows, rows, False)
        plain.observe_step(0, 0.005 + 0.001 * rows + 100 * 40e-6, rows, rows, True, prompt_tokens=100, decode_rows=rows)
    plan.learn(plain, plain_look, 8, [20] * 8)
    target, draft = plan.steps.prefill_row_token_s
    # plain: its fill's 40 ms less the line's 5 ms at no rows, and 4 ms in each of 8 steps beside
    # rows decoding, over 1,300 tokens; at k: the fill's 0.16 s (draft included) less 20 ms, and
    # 5 ms in each of 8 steps, over 1,800
    assert target == pytest.approx((0.035 + 8 * 0.004) / 1300)
    assert target + draft == pytest.approx((0.14 + 8 * 0.005) / 1800)
    fill_only = planner(costs_known=False, measure_in_call=True)
    look, rule = fill_only.look(16, 2)
    rule.observe_step(4, 0.15, 16, 8, True, draft_s=0.01)  # no prompt tokens counted: the fill's estimate
    for rows in range(8, 0, -1):
        rule.observe_step(4, 0.020 + 0.002 * rows, rows * 3, rows, False)
    fill_only.learn(rule, look, 8, [20] * 8)
    assert fill_only.steps.prefill_row_token_s == pytest.approx((0.15 / 20 / 8, 0.01 / 20 / 8))
    again = PromptPrices()
    assert again.per_token(4, None) is None and again.per_token(4, (1e-5, 2e-6)) is None  # nothing priced: the fill
    again.add({4: [(0, 100, 0.02)]}, {4: None})
    assert again.work == {}  # an arm without a step line is not priced
    again.add({4: [(0, 100, 0.02)]}, {4: StepLine.fit([(1, 0.01), (2, 0.01)])})
    assert again.per_token(4, (1e-5, 2e-6)) == pytest.approx((1e-5, 1e-4 - 1e-5))  # a remembered target, this run's k


def test_with_a_plain_engine_apart_a_look_runs_rows_plain_until_the_plain_line_reaches_the_calls_concurrency():
    """A plain look drains through every row count up to its concurrency: once this run's plain
    steps reach a call's concurrency, the call's look runs at k only (its shards' other rows run
    under their own decisions); a call at a higher concurrency, or a run with too few plain steps,
    looks plain again. With one engine the look never runs rows plain."""
    plan = planner(costs_known=False, measure_in_call=True)
    assert not plan.needs_plain_look(8)  # one engine: plain blocks inside the look's own call
    plan.separate_plain = True
    assert plan.needs_plain_look(8)  # nothing timed plain yet
    plain_look, plain = plan.plain_look(8, 1)
    plain.observe_step(0, 0.04, 8, 8, True)
    for rows in range(8, 4, -1):
        plain.observe_step(0, 0.010, rows, rows, False)
    plan.learn(plain, plain_look, 8, [20] * 8)
    assert plan.needs_plain_look(8)  # 4 clean steps: too few to stop timing the plain arm
    plain_look, plain = plan.plain_look(8, 1)
    plain.observe_step(0, 0.04, 4, 4, True)
    for rows in range(4, 0, -1):
        plain.observe_step(0, 0.010, rows, rows, False)
    plan.learn(plain, plain_look, 8, [20] * 8)
    assert not plan.needs_plain_look(8) and not plan.needs_plain_look(4)
    assert plan.needs_plain_look(16)  # beyond the row counts timed


def test_remembered_steps_join_the_runs_own_and_spare_a_remembered_run_the_plain_look():
    """What a first run's calls timed (its clean steps per arm and prompt costs) starts the next
    run's planner (runner/memory.py): its step lines rest on them, joined by its own steps, so the
    step ratio's interval is as narrow as the steps allow; where the remembered plain steps reach a
    call's concurrency its look runs no rows plain (issue 58), beyond it it still does."""
    first = _two_engine_plan([0.020, 0.040] * 4)
    look, rule = first.look(8, 1)
    for rows in range(8, 0, -1):  # a later call: more steps at k
        rule.observe_step(4, 0.030, rows * 3, rows, False)
    first.learn(rule, look, 8, [20] * 8)
    again = planner(costs_known=False, measure_in_call=True)
    again.separate_plain = True
    assert again.needs_plain_look(8) and again.steps.lines() == (None, None)
    again.start_from(first.steps.costs_by_batch, None, [], "job night-1 at t", first.steps.points, first.steps.prefill_row_token_s)
    assert not again.needs_plain_look(8)  # remembered plain steps at 8 rows: no plain look at 8
    assert again.needs_plain_look(16)  # ... but at 16, beyond what they timed
    assert again.steps.lines() == first.steps.lines() and again.steps.costs_at(8) == first.steps.costs_at(8)
    _, low, high = ratio_interval(*again.steps.lines(), 8)
    look, rule = again.look(8, 1)
    for rows in range(8, 0, -1):  # its own look's steps join the remembered ones
        rule.observe_step(4, 0.030, rows * 3, rows, False)
    again.learn(rule, look, 8, [20] * 8)
    assert len(again.steps.points[4]) == len(first.steps.points[4]) + len(rule.points[4]) > len(first.steps.points[4])
    _, low_after, high_after = ratio_interval(*again.steps.lines(), 8)
    assert high_after / low_after < high / low


def _two_engine_plan(spec_seconds) -> ActorPolicy:
    """A planner with a plain engine apart whose look timed steps at k (spec_seconds, one per row
    count from 8 down) and plain steps of 0.010 s."""
    plan = planner(costs_known=False, measure_in_call=True)
    plan.separate_plain = True
    look, rule = plan.look(8, 1)
    rule.observe_step(4, 0.05, 8, 8, True)
    for rows, seconds in zip(range(8, 0, -1), spec_seconds):
        rule.observe_step(4, seconds, rows * 3, rows, False)
    plan.learn(rule, look, 8, [20] * 8)
    plain_look, plain = plan.plain_look(8, 1)
    plain.observe_step(0, 0.04, 8, 8, True)
    for rows in range(8, 0, -1):
        plain.observe_step(0, 0.010, rows, rows, False)
    plan.learn(plain, plain_look, 8, [20] * 8)
    return plan


def test_with_a_plain_engine_apart_a_shard_is_decided_on_the_central_estimate_unless_its_slow_end_loses():
    """Both arms timed on their own engines: "on" where the central prediction passes the
    threshold and the step ratio's slow end still pays; "off", saying why, where the slow end of a
    noisy ratio predicts a loss though the central estimate is the same."""
    alpha, per_step = own_acceptance([(25, 10)] * 8, 4)  # 3.5 tokens a verify step
    tight = _two_engine_plan([0.030] * 8)
    on = tight.decide_own(Shard([20] * 8), alpha, 8, per_step, 8)
    assert on.kind is DecisionKind.ON and on.speculate and "at the slow end of the step ratio's 95% interval)" in on.reason
    noisy = _two_engine_plan([0.020, 0.040] * 4)
    off = noisy.decide_own(Shard([20] * 8), alpha, 8, per_step, 8)
    assert off.kind is DecisionKind.OFF and not off.speculate
    assert off.predicted_speedup == pytest.approx(on.predicted_speedup, rel=0.05) and off.predicted_speedup >= 1.05
    assert "(< 1.00x) at the slow end of the step ratio's 95% interval" in off.reason
    low, high = off.figures.step_ratio_interval
    assert low < high and tight.decide_own(Shard([20] * 8), alpha, 8, per_step, 8).figures.step_ratio_interval[1] < high


def test_without_step_costs_a_shard_is_measured_in_its_call():
    plan = planner(costs_known=False, measure_in_call=True)
    d = plan.decide_own(Shard([20] * 8), 0.8, 8, 3.0, 8)
    assert d.kind is DecisionKind.MEASURING and d.speculate
    rule = plan.draft_length(4, 8, per_round_k=False, adaptive=True)
    assert isinstance(rule, InterleavedSteps) and rule.dense and rule.guard  # dense blocks, stops if slower


def test_a_call_whose_steps_show_speculation_slower_is_recorded_as_stopped():
    plan = planner(measure_in_call=True)
    plan.steps.costs_by_batch[8] = costs()
    shard = Shard([20] * 8)
    d = plan.decide_own(shard, 0.9, 8, 4.0, 8)
    rule = plan.draft_length(d.k, 8, per_round_k=False, adaptive=True)
    assert isinstance(rule, InterleavedSteps) and not rule.dense  # costs known: sparse control blocks
    rule = InterleavedSteps(d.k, dense=True)
    _pairs(rule, spec=(0.030, 8 * 1.2))
    stopped = plan.learn(rule, d, 8, [20] * 8)
    assert stopped.kind is DecisionKind.STOPPED and not stopped.speculate
    assert stopped.reason.startswith(f"off for the rest of the call: its steps at k={d.k} ran 0.40x plain's tokens/s at 8 rows")
    assert stopped.figures.speedup_interval[1] < 1.0


def test_a_stopped_calls_interval_is_written_below_one_as_its_stop_requires():
    """A call stops when its measured speedup's 95% interval lies below 1.0; a high end of 0.9996
    rounded to the nearest read "0.28-1.00x" (and 1.0 in the figures), as if it had not."""
    plan = planner(measure_in_call=True)
    plan.steps.costs_by_batch[8] = costs()
    d = plan.decide_own(Shard([20] * 8), 0.9, 8, 4.0, 8)
    rule = InterleavedSteps(d.k, dense=True)
    _pairs(rule, spec=(0.030, 8 * 1.2))
    rule.stopped = (0.53, 0.28, 0.9996)
    stopped = plan.learn(rule, d, 8, [20] * 8)
    assert stopped.figures.speedup_interval == (0.28, 0.999)
    assert "(95% interval 0.28-0.99x," in stopped.reason


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
    assert numbers["prompt_p50"] == 35.0 and "clean_steps" not in numbers  # absent figures are not written


def test_a_rows_own_cost_is_priced_from_its_steps_and_prompt():
    """A row's share of its call: its verify steps at k and its other steps plain, at the call's
    concurrency, plus its prompt (the draft's part only when it speculated)."""
    plan = planner(costs_known=False, measure_in_call=True)
    assert plan.steps.row_cost(20, 30, 20, 5, 8, True) is None  # no step lines yet
    _, rule = plan.look(8, 1)
    _pairs(rule)  # a step at k 0.030 s, a plain one 0.010 s, at 8 rows
    plan.learn(rule, plan.look(8, 1)[0], 8, [20] * 8)
    pre, pre_draft = plan.steps.prefill_row_token_s
    spec = plan.steps.row_cost(20, 30, 20, 5, 8, True)  # 5 verify steps, 5 plain (30 - 20 - 5)
    assert spec == pytest.approx((5 * 0.030 + 5 * 0.010) / 8 + 20 * (pre + pre_draft))
    assert plan.steps.row_cost(20, 30, 0, 0, 8, False) == pytest.approx(30 * 0.010 / 8 + 20 * pre)


def test_what_speculation_saved_on_its_rows_is_priced_from_the_step_lines():
    """A row that made R verify steps and accepted A tokens saved p x (A + R - R x r) against plain
    decoding (p: a plain step per row, r: the step ratio), less its draft's prompt."""
    plan = planner(costs_known=False, measure_in_call=True)
    assert plan.steps.saving([(20, 5, 0, 8)]) is None  # no step lines yet
    _, rule = plan.look(8, 1)
    _pairs(rule)  # a step at k 0.030 s, a plain one 0.010 s, at 8 rows: r = 3
    plan.learn(rule, plan.look(8, 1)[0], 8, [20] * 8)
    saved = plan.steps.saving([(20, 5, 0, 8), (0, 10, 0, 8)])  # the second accepted nothing: a loss
    assert saved.seconds == pytest.approx(0.010 / 8 * (25 - 15) + 0.010 / 8 * (10 - 30))
    assert saved.low <= saved.seconds <= saved.high and saved.rows == 2 and "step ratio" in saved.basis


def test_a_shards_saving_against_plain_counts_all_its_time_once_a_plain_call_was_timed():
    """Once this run has timed a call of the shape one plain call over the actor call's rows would
    have (streaming: it fills the engine at least twice; or one wave), a shard's saving is its rows'
    plain price (scaled by what those calls took over their price, plain ones preferred, a call at
    k standing in with a wider interval) less the time its rows took: whatever its look cost
    counts, not only its speculating rows' steps."""
    plan = planner(costs_known=False, measure_in_call=True)
    _, rule = plan.look(8, 1)
    _pairs(rule)
    plan.learn(rule, plan.look(8, 1)[0], 8, [20] * 8)
    rows = [(20, 30, 8)] * 4
    assert plan.steps.saving_against_plain(rows, 0.3) is None  # no call timed yet
    plan.steps.observe_call(1.2, 16, 8, 1.0, plain=False)  # every shard speculating: a call at k stands in
    at_k = plan.steps.saving_against_plain(rows, 0.3)
    assert "x1.200" in at_k.basis and "at k" in at_k.basis and "widened by 3%" in at_k.basis
    assert at_k.low < at_k.seconds < at_k.high
    plan.steps.observe_call(5.0, 15, 8, 1.0, plain=True)  # 15 rows at 8: one wave, mostly fill and drain
    assert "at k" in plan.steps.saving_against_plain(rows, 0.3).basis  # ... not the shape of a streaming call
    one_wave = plan.steps.saving_against_plain(rows, 0.3, stream=False)  # but the shape of one wave
    assert "x5.000" in one_wave.basis and "one wave" in one_wave.basis and "spans" not in one_wave.basis
    # Rows priced at more concurrency than the one-wave call ran at: the interval spans their price there.
    wider = plan.steps.saving_against_plain([(20, 30, 16)] * 4, 0.3, stream=False)
    at_8 = 5.0 * 4 * (30 * 0.010 / 8 + 20 * plan.steps.prefill_row_token_s[0]) - 0.3
    assert wider.low <= wider.seconds < at_8 == pytest.approx(wider.high) and "spans" in wider.basis
    plan.steps.observe_call(1.1, 16, 8, 1.0, plain=True)
    pre = plan.steps.prefill_row_token_s[0]
    price = 1.1 * 4 * (30 * 0.010 / 8 + 20 * pre)
    saved = plan.steps.saving_against_plain(rows, 0.3)
    assert saved.seconds == pytest.approx(price - 0.3, abs=1e-4) and saved.rows == 4
    assert saved.low <= saved.seconds <= saved.high and "x1.100" in saved.basis and "look" in saved.basis
    assert "widened" not in saved.basis  # a plain call of the shape: no call at k stands in
    assert plan.steps.saving_against_plain(rows, 5.0).seconds < 0  # rows that took longer than plain: a cost


def test_a_shards_first_look_rows_settle_it_only_where_both_intervals_agree():
    """The look's first rows of a shard (runner/look.py) settle its decision when speculation loses
    even at the high end of their tokens per step's interval and the fast end of the step
    ratio's, or pays at both low ends; otherwise the shard's look takes more of its rows."""
    plan = _two_engine_plan([0.030] * 8)  # a step at k costs 3 plain steps
    assert plan.settles(Shard([20] * 8), [(1, 4), (2, 4), (1, 5), (0, 4)], 8)  # ~1.2 tokens a step: loses
    assert plan.settles(Shard([20] * 8), [(39, 10), (38, 10), (40, 10), (39, 10)], 8)  # ~4.9: pays
    assert not plan.settles(Shard([20] * 8), [(20, 10), (21, 10), (19, 10), (20, 10)], 8)  # ~3.0: break-even
    assert not plan.settles(Shard([20] * 8), [(1, 10), (40, 10), (2, 10), (39, 10)], 8)  # rows disagree
    assert not plan.settles(Shard([20] * 8), [(39, 10)], 8)  # one row gives no interval
    assert not _two_engine_plan([0.020, 0.040] * 4).settles(Shard([20] * 8), [(20, 10)] * 4, 8)
    assert not planner(costs_known=False, measure_in_call=True).settles(Shard([20] * 8), [(39, 10)] * 4, 8)
    assert plan.settles(Shard([20] * 8), [(39, 10)] * 4, 16)  # steps timed at 8 rows reach half of 16 ...
    assert not plan.settles(Shard([20] * 8), [(39, 10)] * 4, 17)  # ... not beyond: the rest look further
    low, high = tokens_per_step_interval([(1, 10), (40, 10), (2, 10), (39, 10)], 4)
    assert 1.0 <= low < 3.05 < high <= 5.0
