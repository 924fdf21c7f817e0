"""Policy decide/observe over scripted costs and acceptance (pure Python, no models)."""

from __future__ import annotations

import pytest

from batchspec.policy import (
    Acceptance,
    Costs,
    LengthProfile,
    Policy,
    StepArms,
    acceptance_for,
    decode_speedup,
    expected_tokens,
)


def costs(batch=1, step=0.030, draft=0.008, verify=None, prefill=0.0004, draft_prefill=0.0001):
    """Memory-bound target at batch 1: verifying k+1 tokens costs barely more than one step."""
    verify = verify or {k: step * (1 + 0.05 * k) for k in (1, 2, 4, 8)}
    return Costs(batch, step, draft, verify, prefill, draft_prefill)


def policy_with(alpha=None, c=None, **kw) -> Policy:
    p = Policy("auto", k_default=4, k_max=8, **kw)
    p.calibrate(c or costs())
    if alpha is not None:
        p.prior.accepted, p.prior.trials = alpha * 1000, 1000
    return p


def short_prompts(n=256):
    return LengthProfile([40] * 16, n)


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert decode_speedup(0.8, 4, 0.25, 1.2) == pytest.approx(expected_tokens(0.8, 4) / 2.2)


def test_prefill_dominated_shard_is_off_without_probing():
    # CPU-like measured prefill: one prompt token costs 1/15 of a decode step (target), 1/60 (draft).
    d = policy_with(c=costs(prefill=0.002, draft_prefill=0.0005)).decide(LengthProfile([1800] * 8, 16), None)
    assert not d.speculate and d.reason.startswith("off: prefill-dominated")
    assert "prompt p50 1800 tokens vs 16 new tokens" in d.reason and "even at acceptance 1.0" in d.reason


def test_no_prior_probes_first():
    d = policy_with().decide(short_prompts(), None)
    assert d.speculate and d.k == 4 and "probe" in d.reason


def test_low_acceptance_is_off():
    d = policy_with(alpha=0.05).decide(short_prompts(), None)
    assert not d.speculate and d.reason.startswith("off: per-token acceptance 0.05")


def test_high_acceptance_at_batch_one_is_on_with_k_above_one():
    d = policy_with(alpha=0.9).decide(short_prompts(), None)
    assert d.speculate and d.k > 1 and d.predicted_speedup > 1.5
    assert d.reason.startswith("on: per-token acceptance 0.90")


def test_large_batch_is_off_when_measured_costs_say_so():
    # At batch 64 the target is compute-bound: verifying k+1 tokens costs ~k+1 steps.
    big = costs(batch=64, step=0.2, draft=0.06, verify={k: 0.2 * (k + 1) for k in (1, 2, 4, 8)})
    d = policy_with(alpha=0.9, c=big).decide(short_prompts(), None)
    assert not d.speculate
    assert "draft too costly" in d.reason or "predicted" in d.reason


def test_no_flapping_around_the_threshold():
    p = policy_with(alpha=0.5)
    profile = short_prompts()
    # Find an acceptance whose prediction sits inside the hysteresis band (1.0 .. 1.05).
    alpha = next(a / 1000 for a in range(1000) if 1.0 <= p.best_k(profile, a / 1000)[1] < 1.05)
    p.prior.accepted, p.prior.trials = alpha * 1000, 1000
    assert p.decide(profile, currently_on=True).speculate  # stays on above break-even
    assert not p.decide(profile, currently_on=False).speculate  # stays off below 1 + margin
    states = []
    on = False
    for i in range(20):  # jitter around the band never toggles the decision more than once
        a = alpha + (0.002 if i % 2 else -0.002)
        p.prior.accepted, p.prior.trials = a * 1000, 1000
        on = p.decide(profile, on, batches_off=0).speculate
        states.append(on)
    assert sum(1 for x, y in zip(states, states[1:]) if x != y) <= 1


def test_prior_carries_across_shards():
    p = policy_with()
    assert "probe" in p.decide(short_prompts(), None).reason
    for _ in range(20):  # the first shard observes a good draft
        p.observe_round(4, draft_s=0.03, target_s=0.036, accepted=3, rejections=1)
    d = p.decide(short_prompts(), None)  # the next shard starts from that acceptance
    assert d.speculate and "probe" not in d.reason and d.alpha == pytest.approx(0.75, abs=0.01)


def test_reprobe_after_being_off_for_a_while():
    p = policy_with(alpha=0.05, reprobe_every=4)
    assert not p.decide(short_prompts(), False, batches_off=3).speculate
    d = p.decide(short_prompts(), False, batches_off=4)
    assert d.speculate and "re-probe" in d.reason


def test_acceptance_estimate_counts_trials_not_proposals():
    a = Acceptance(decay=1.0)
    for _ in range(10):  # k=4: 2 accepted then a rejection each round -> a = 2/3, not 2/4
        a.observe(accepted=2, rejections=1)
    assert a.estimate == pytest.approx(2 / 3)


def test_modes_on_and_off_are_forced():
    assert Policy("on", k_default=3).decide(short_prompts(), None).k == 3
    assert not Policy("off").decide(short_prompts(), None).speculate


def test_cost_refresh_keeps_ratios_from_plain_rounds():
    c = costs()
    before = (c.c, c.v(4))
    for _ in range(30):
        c.update(0, 0.0, 0.060)  # real plain steps twice as slow as calibrated
    assert c.target_step_s == pytest.approx(0.060, rel=0.01)
    assert (c.c, c.v(4)) == pytest.approx(before)


def _run_steps(rule: StepArms, steps: int, rate: dict, rows: int = 96, prefill_steps: int = 1) -> list[int]:
    """Drive a rule as the vllm backend does: next_k() before each step, observe_step() after it.
    rate[k] = (seconds, tokens) of a clean step at k; a step after a switch verifies the previous
    k's drafts, so it is given the previous k's tokens and a cost between the two."""
    ks, last = [], None
    for i in range(steps):
        k = rule.next_k()
        if i < prefill_steps:
            seconds, tokens, prefill = 0.2, rows, True
        elif last is not None and k != last:
            seconds, tokens, prefill = (rate[k][0] + rate[last][0]) / 2, rate[last][1], False
        else:
            (seconds, tokens), prefill = rate[k], False
        rule.observe_step(k, seconds, tokens, rows, prefill)
        ks.append(k)
        last = k
    return ks


def test_step_arms_measure_each_arm_in_the_call_then_keep_the_faster():
    fast_spec = {4: (0.033, 430), 0: (0.012, 96)}  # 13000 vs 8000 tokens/s: keep k=4
    rule = StepArms((4, 0), measure_steps=2)
    ks = _run_steps(rule, 12, fast_spec)
    # prefill, 2 clean k=4 steps, a switch step (not counted), 2 clean plain steps, back to k=4
    assert ks == [4, 4, 4, 0, 0, 0, 4, 4, 4, 4, 4, 4]
    assert rule.settled and rule.k == 4 and rule.explored()
    assert rule.rates() == pytest.approx({4: 430 / 0.033, 0: 96 / 0.012})
    assert rule.step_seconds() == pytest.approx({4: 0.033, 0: 0.012})
    assert rule.prefill_s == pytest.approx(0.2) and rule.rows == 96
    assert rule.summary() == ("measured in the call (2 steps each at 96 rows): k=4 13030 tokens/s vs plain "
                              "8000 tokens/s; kept k=4")

    # A call that ends during its plain arm's steps (its rows finished) keeps the faster arm too.
    rule = StepArms((4, 0), measure_steps=2)
    assert _run_steps(rule, 6, fast_spec) == [4, 4, 4, 0, 0, 0] and (rule.k, rule.settled) == (0, False)
    rule.finish()
    assert (rule.k, rule.settled) == (4, True) and rule.summary().endswith("kept k=4")

    slow_spec = {4: (0.040, 300), 0: (0.012, 96)}  # 7500 vs 8000 tokens/s: plain for the rest
    rule = StepArms((4, 0), measure_steps=2)
    assert _run_steps(rule, 10, slow_spec) == [4, 4, 4, 0, 0, 0, 0, 0, 0, 0]
    assert rule.k == 0 and rule.summary().endswith("kept plain")


def test_step_arms_judge_an_arm_by_its_fastest_step_so_a_preempted_step_does_not_decide():
    # Beside a busy process a step can lose its core for a time slice; that only ever adds time.
    rule = StepArms((4, 0), measure_steps=2)
    for k, seconds, tokens in [(4, 0.010, 30), (4, 0.010, 30), (4, 0.060, 34),  # the 2nd clean k=4 step preempted
                               (0, 0.020, 30), (0, 0.008, 8), (0, 0.008, 8)]:
        assert rule.next_k() == k
        rule.observe_step(k, seconds, tokens, 8, prefill=False)
    # Means would give k=4 64 tokens / 0.07 s = 914/s against plain 1000/s and keep plain.
    assert rule.rates() == pytest.approx({4: 30 / 0.010, 0: 8 / 0.008})
    assert rule.next_k() == 4 and rule.settled
    assert rule.step_seconds() == pytest.approx({4: 0.010, 0: 0.008})


def test_step_arms_take_the_fastest_steps_tokens_with_its_time():
    # An n-gram step that proposes little is fast and short of tokens: its time must not be paired
    # with the tokens of a step that proposed a lot (that made k=4 look 2x faster than it is).
    rule = StepArms((4, 0), measure_steps=2)
    for _k, seconds, tokens in [(4, 0.03, 8), (4, 0.012, 8), (4, 0.030, 40),  # proposes nothing, then 4 per row
                               (0, 0.011, 8), (0, 0.011, 8), (0, 0.011, 8)]:
        rule.observe_step(rule.next_k(), seconds, tokens, 8, prefill=False)
    assert rule.rates() == pytest.approx({4: 8 / 0.012, 0: 8 / 0.011})  # not (8 + 40) / 2 / 0.012 = 2000/s
    assert rule.next_k() == 0 and rule.settled


def test_step_arms_with_one_arm_never_switch_and_measure_only_the_first_steps():
    rule = StepArms((2,), measure_steps=2)
    assert rule.settled and not rule.explored()
    assert _run_steps(rule, 6, {2: (0.02, 200)}) == [2] * 6
    assert rule.step_seconds() == {2: pytest.approx(0.02)}
    assert rule.steps[2][0] == 2  # later steps (fewer rows as rows finish) do not move the measure


def test_a_drafts_prefill_measured_in_the_call_can_turn_later_calls_plain():
    """A plain call skips the draft, prompts included (vllm backend), so the draft's part of the
    prefill is a cost of speculating only. The EAGLE-3 demo's shape: k=4 steps 1.29x faster per
    token than plain ones, but the draft's pass over 100-token prompts costs more than that saves."""
    rule = StepArms((4, 0), measure_steps=2)
    rule.observe_step(4, 0.50, 96, 96, prefill=True, draft_s=0.25)  # the target's 0.50 s, the draft's 0.25 s
    assert (rule.prefill_s, rule.draft_prefill_s) == pytest.approx((0.50, 0.25))
    positions = 100  # mean prompt length of the call: costs per position for the whole batch
    alpha, profile = 0.9, LengthProfile([100] * 96, 32)
    for draft_prefill, on in ((0.25 / positions, False), (0.0, True)):
        c = Costs.from_steps(96, {0: 0.0126, 4: 0.040}, 0.50 / positions, draft_prefill)
        assert c.draft_prefill_token_s == draft_prefill
        assert decode_speedup(alpha, 4, c.c, c.v(4)) == pytest.approx(1.29, abs=0.01)
        p = Policy("auto", k_default=4, k_max=4)
        p.calibrate(c)
        p.prior.accepted, p.prior.trials = alpha * 1000, 1000
        d = p.decide(profile, None)
        assert d.speculate is on, d.reason
    c.learn_steps({}, 0.0, 0.004)  # a later speculative call's draft prefill; a plain call's 0 moves nothing
    assert c.draft_prefill_token_s == pytest.approx(0.002)


def test_tokens_decoded_while_later_prompts_fill_are_not_counted_as_prefill():
    """Chunked prefill: the 96-row demo call fills in three steps, and from the second on the rows
    admitted first decode beside the next prompts. Their tokens are charged to decoding by the cost
    model, so their share of those steps, at the clean steps' rate, comes out of the prompts' cost;
    left in, the prompts looked ~2x as costly and every predicted speedup was pulled towards 1."""
    rule = StepArms((4, 0), measure_steps=2)
    rule.observe_step(4, 0.20, 32, 32, prefill=True, draft_s=0.10)  # 32 prompts, their first tokens
    rule.observe_step(4, 0.30, 32 + 100, 64, prefill=True, draft_s=0.10, decode_tokens=100)
    rule.observe_step(4, 0.30, 32 + 200, 96, prefill=True, draft_s=0.10, decode_tokens=200)
    assert rule.prefill_costs() == (pytest.approx(0.80), pytest.approx(0.30))  # no clean step yet: all of it
    for _ in range(2):
        rule.observe_step(4, 0.10, 300, 96, prefill=False)  # clean k=4 steps: 3,000 tokens/s
    rule.observe_step(4, 0.99, 999, 96, prefill=True, decode_tokens=900)  # after the fill: not prompts' cost
    target, draft = rule.prefill_costs()
    # 1.10 s of fill less 300 tokens at 3,000 tokens/s (0.10 s), split as the fill's parts were
    assert (target, draft) == (pytest.approx(0.80 * 1.0 / 1.1), pytest.approx(0.30 * 1.0 / 1.1))
    assert (rule.prefill_s, rule.draft_prefill_s) == (pytest.approx(0.80), pytest.approx(0.30))
    skewed = StepArms((4,))
    skewed.observe_step(4, 0.01, 500, 96, prefill=True, decode_tokens=500)
    skewed.observe_step(4, 0.10, 300, 96, prefill=False)
    assert skewed.prefill_costs() == (pytest.approx(0.01), 0.0)  # an estimate past the whole fill: left as measured

def test_costs_from_steps_need_a_plain_and_a_speculative_step():
    assert Costs.from_steps(64, {4: 0.03}, 1e-4) is None
    assert Costs.from_steps(64, {0: 0.01}, 1e-4) is None
    c = Costs.from_steps(64, {0: 0.010, 4: 0.030}, 1e-4)
    assert (c.batch_size, c.c, c.v(4), c.verify(8)) == (64, 0.0, pytest.approx(3.0), pytest.approx(0.030 * 9 / 5))
    c.learn_steps({0: 0.020, 2: 0.015}, 3e-4)  # EWMA on k=0 and the prefill; k=2 taken as measured
    assert (c.target_step_s, c.verify_s[2], c.verify_s[4]) == pytest.approx((0.015, 0.015, 0.030))
    assert c.prefill_token_s == pytest.approx(2e-4)
    p = Policy("auto", k_default=4, measure_in_call=True)
    d = p.decide(short_prompts(), None)
    assert d.speculate and d.k == 4 and d.reason.startswith("on (measuring): no costs measured at this concurrency")
    p.calibrate(c)
    p.prior.accepted, p.prior.trials = 900, 1000  # with costs and acceptance: the usual decision
    assert p.decide(short_prompts(), None).reason.startswith("on: per-token acceptance 0.90")


def test_a_call_too_short_to_measure_both_arms_learns_nothing_about_plain():
    rule = StepArms((4, 0), measure_steps=2)
    assert _run_steps(rule, 4, {4: (0.033, 430), 0: (0.012, 96)}) == [4, 4, 4, 0]  # ends on the switch step
    assert not rule.explored() and set(rule.step_seconds()) == {4}
    assert Costs.from_steps(96, rule.step_seconds(), rule.prefill_s / 1000) is None  # the next call measures again


def test_acceptance_for_inverts_expected_tokens():
    for alpha, k in ((0.0, 4), (0.3, 1), (0.49, 4), (0.9, 4), (0.95, 8)):
        assert acceptance_for(expected_tokens(alpha, k), k) == pytest.approx(alpha, abs=1e-6)
    assert acceptance_for(0.5, 4) == pytest.approx(0.0, abs=1e-6)  # below one token a pass: nothing accepted
    assert acceptance_for(9.0, 4) == pytest.approx(1.0, abs=1e-6)


def test_the_acceptance_a_call_measures_agrees_with_its_arms():
    """The 104M n-gram job's shape: k=4 steps deliver 1.35 tokens per row (the lookup often finds
    nothing to propose) at 1.54x the cost of a plain step, so plain is faster. The acceptance the
    rule derives from its steps makes the cost model predict the same; the drafts' own hit rate
    (0.49) predicted k=4 faster and turned speculation on in the next run."""
    rule = StepArms((4, 0), measure_steps=2)
    rows, plain_s, spec_s = 64, 0.100, 0.154
    ks = _run_steps(rule, 12, {4: (spec_s, round(1.35 * rows)), 0: (plain_s, rows)}, rows=rows)
    assert rule.k == 0 and ks[-1] == 0
    (k, alpha), = rule.acceptance().items()
    assert k == 4 and expected_tokens(alpha, 4) == pytest.approx(round(1.35 * rows) / rows)
    costs = Costs.from_steps(rows, rule.step_seconds(), 1e-5)
    measured = rule.rates()[4] / rule.rates()[0]
    assert decode_speedup(alpha, 4, costs.c, costs.v(4)) == pytest.approx(measured)
    assert measured < 1 < decode_speedup(0.49, 4, costs.c, costs.v(4))


def test_a_decided_call_turns_plain_when_its_own_steps_say_speculation_no_longer_pays():
    """A call decided from known costs and an acceptance seen before it (earlier shards, or an
    earlier run's memory) checks what its own steps deliver: once they have made 64 row passes over
    at least 2 clean steps, an acceptance that predicts less than break-even turns the rest of the
    call plain, and only once. Costs of the demo's shape: a k=4 step costs 3x a plain one."""
    costs = Costs.from_steps(96, {0: 0.010, 4: 0.030}, 1e-5)

    def guard(alpha):
        return decode_speedup(alpha, 4, costs.c, costs.v(4))

    assert guard(0.91) > 1.05 > 1.0 > guard(0.28)  # decided on at 0.91; 0.28 loses
    bad = StepArms((4,), guard=guard)
    ks = _run_steps(bad, 10, {4: (0.030, round(1.37 * 96)), 0: (0.010, 96)})  # E(0.28, 4) = 1.37 tokens a pass
    assert ks == [4, 4, 4] + [0] * 7  # prefill, 2 clean steps at k=4, then plain to the end
    assert bad.settled and bad.stopped["k"] == 4 and bad.stopped["steps"] == 2
    assert bad.stopped["acceptance"] == pytest.approx(0.28, abs=0.01) and bad.stopped["predicted_speedup"] < 1
    assert bad.acceptance()[4] == pytest.approx(0.28, abs=0.01)  # what the policy learns from the call

    good = StepArms((4,), guard=guard)
    assert _run_steps(good, 10, {4: (0.030, round(4.1 * 96))}) == [4] * 10 and good.stopped is None

    few = StepArms((4,), guard=guard)  # 8 rows: 64 row passes take 8 clean steps
    assert _run_steps(few, 12, {4: (0.030, 11), 0: (0.010, 8)}, rows=8) == [4] * 9 + [0] * 3
    assert few.stopped["row_passes"] == 64

    # No guard where the call measures its arms, or runs plain: the arms decide there.
    assert StepArms((4, 0), guard=guard).guard is None and StepArms((0,), guard=guard).guard is None


def test_arms_timed_as_rows_finish_decide_the_call_and_a_strict_rule_keeps_no_costs_from_them():
    """A 256-row demo call: rows finish several tokens a step at k=4, so the plain steps measured
    after the k=4 ones ran at 112 and 99 rows. The arms still decide the call (k=4 emits more tokens
    a second), but a plain step at 99 rows is not the cost of one at 249: kept, it made every later
    call "prefill-dominated". Prefill is read from the call's fill only, not from steps that admit
    rows while others decode."""
    rule = StepArms((4, 0), measure_steps=2, strict=True)  # the first rows of a call of more rows than run at once
    steps = [(4, 0.124, 56, 56, True), (4, 0.099, 328, 104, True),  # the fill: prefill
             (4, 0.074, 1030, 252, False), (4, 0.059, 805, 192, False),  # clean k=4 steps
             (0, 0.035, 552, 152, False), (0, 0.0137, 112, 112, False), (0, 0.0123, 99, 99, False),
             (4, 0.100, 900, 240, True)]  # later: decodes while admitting the next rows
    for k, seconds, tokens, rows, prefill in steps:
        assert rule.next_k() == k
        rule.observe_step(k, seconds, tokens, rows, prefill)
    assert rule.k == 4 and rule.settled and not rule.matched()
    assert rule.prefill_s == pytest.approx(0.124 + 0.099)
    assert rule.summary() == ("measured in the call (2 steps each; rows finished meanwhile, so not kept as costs): "
                              "k=4 13644 tokens/s at 192 rows vs plain 8049 tokens/s at 99 rows; kept k=4")
    lenient = StepArms((4, 0), measure_steps=2)  # a call within what the engine runs at once keeps them
    for _k, seconds, tokens, rows, prefill in steps:
        lenient.observe_step(lenient.next_k(), seconds, tokens, rows, prefill)
    assert not lenient.matched() and lenient.costs_kept()
    assert lenient.summary().startswith("measured in the call (2 steps each at 252 rows)")
    level = StepArms((4, 0), measure_steps=2)  # the 96-row demo call: both arms at 96 rows
    _run_steps(level, 8, {4: (0.027, 431), 0: (0.009, 96)})
    assert level.matched() and level.summary().startswith("measured in the call (2 steps each at 96 rows)")
