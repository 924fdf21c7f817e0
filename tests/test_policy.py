"""Policy decide/observe over scripted costs and acceptance (pure Python, no models)."""

from __future__ import annotations

import pytest

from batchspec.policy import (
    Acceptance,
    Costs,
    InterleavedSteps,
    LengthProfile,
    Policy,
    StepLine,
    acceptance_for,
    decode_speedup,
    expected_tokens,
    ratio_interval,
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


def _run_steps(rule: InterleavedSteps, steps: int, rate: dict, rows=96, prefill_steps: int = 1) -> list[int]:
    """Drive a rule as the vllm backend does: next_k() before each step, observe_step() after it.
    rate[k] = (seconds, tokens) of a clean step at k (or a function of the step's index giving
    them); a step after a switch verifies the previous k's drafts, so it is given the previous k's
    tokens and a cost between the two. rows: a number, or a function of the step's index."""
    ks, last = [], None
    for i in range(steps):
        k = rule.next_k()
        n = rows(i) if callable(rows) else rows
        at = {kk: (v(i) if callable(v) else v) for kk, v in rate.items()}
        if i < prefill_steps:
            seconds, tokens, prefill = 0.2, n, True
        elif last is not None and k != last:
            seconds, tokens, prefill = (at[k][0] + at[last][0]) / 2, at[last][1], False
        else:
            (seconds, tokens), prefill = at[k], False
        rule.observe_step(k, seconds, tokens, n, prefill)
        ks.append(k)
        last = k
    return ks


def test_interleaved_steps_run_plain_blocks_densely_while_measuring_and_sparsely_after():
    """Dense (3 at k, 3 plain) for a look or a call without costs, a block every 32 steps at k
    otherwise. Only clean steps count: decoding only, after a step at the same k."""
    dense = InterleavedSteps(4, dense=True)
    ks = _run_steps(dense, 13, {4: (0.033, 430), 0: (0.012, 96)})
    assert ks == [4, 4, 4, 4, 0, 0, 0, 4, 4, 4, 0, 0, 0]  # a prefill step, then blocks of 3
    assert len(dense.points[4]) == 5 and len(dense.points[0]) == 4  # the first step of each block is not clean
    sparse = InterleavedSteps(4)
    ks = _run_steps(sparse, 40, {4: (0.033, 430), 0: (0.012, 96)})
    assert ks[1:33] == [4] * 32 and ks[33:36] == [0, 0, 0] and ks[36] == 4
    assert sparse.tokens_per_step() == pytest.approx(430 / 96)
    mean, low, high = sparse.speedup(96)
    assert mean == pytest.approx((430 / 0.033) / (96 / 0.012)) and low == pytest.approx(mean)
    assert sparse.step_seconds(96) == pytest.approx({0: 0.012, 4: 0.033})


def test_step_lines_follow_the_rows_so_a_draining_call_compares_like_with_like():
    """Rows finish as a call goes on and a step costs less with fewer of them. Two arms timed one
    after the other compared k=4 at 187 rows with plain at 92 (issue 39: a 1.10x loss read as
    1.53x). A line per arm (seconds = a + b x rows) over interleaved blocks gives each arm at the
    same rows: here a k=4 step is 2 ms + 0.5 ms a row and a plain one 1 ms + 0.2 ms a row, and
    rows drain from 250 by 8 a step."""
    rows = lambda i: max(8, 250 - 8 * i)  # noqa: E731
    rate = {4: lambda i: (0.002 + 0.0005 * rows(i), 2.25 * rows(i)), 0: lambda i: (0.001 + 0.0002 * rows(i), rows(i))}
    rule = InterleavedSteps(4, dense=True, guard=False)
    _run_steps(rule, 28, rate, rows=rows)
    spec, plain = rule.lines()
    assert (spec.a, spec.b, plain.a, plain.b) == pytest.approx((0.002, 0.0005, 0.001, 0.0002), rel=1e-6)
    r, low, high = ratio_interval(spec, plain, 256)
    assert r == pytest.approx((0.002 + 0.128) / (0.001 + 0.0512)) and low == pytest.approx(r)
    mean, _, _ = rule.speedup(256)
    assert mean == pytest.approx(2.25 / r)
    flat = StepLine.fit([(64, 0.010), (62, 0.012), (64, 0.011)])
    assert flat.b == 0 and flat.at(64) == pytest.approx(0.011) and flat.df == 2
    assert StepLine.fit([(64, 0.010)]) is None


def test_a_call_whose_steps_show_speculation_slower_turns_plain_for_good():
    """With the guard, once each arm has guard_points clean steps and they say speculation is
    slower with 95% confidence at the rows running, the call runs plain to its end and says it
    has settled (so the engine may skip the draft); noise that leaves 1.0 inside the interval
    does not stop it, and a look never stops."""
    slow = InterleavedSteps(4, dense=True, guard_points=4)
    ks = _run_steps(slow, 60, {4: (0.040, 200), 0: (0.012, 96)})  # 0.62x
    assert slow.stopped is not None and slow.settled and slow.k == 0 and ks[-1] == 0
    assert slow.stopped[2] < 1.0 and set(ks[ks.index(0, 20):]) == {0}
    noisy = iter([0.7, 1.3] * 100)
    near = InterleavedSteps(4, dense=True, guard_points=4)
    _run_steps(near, 60, {4: lambda i: (0.033 * next(noisy), 430), 0: (0.033 * 96 / 430, 96)})
    assert near.stopped is None
    look = InterleavedSteps(4, dense=True, guard=False)
    _run_steps(look, 60, {4: (0.040, 200), 0: (0.012, 96)})
    assert look.stopped is None and len(look.points[0]) >= 8


def test_tokens_decoded_while_later_prompts_fill_are_not_counted_as_prefill():
    """The fill's steps are what prompts cost, less what the tokens that rows already decoding
    emitted in them would have cost in clean steps at the same k."""
    rule = InterleavedSteps(4, dense=True)
    for _ in range(3):
        rule.observe_step(4, 0.2, 60, 96, prefill=True, draft_s=0.05, decode_tokens=40)
    _run_steps(rule, 20, {4: (0.033, 430), 0: (0.012, 96)}, prefill_steps=0)
    decode = 120 * 0.033 / 430
    keep = (0.75 - decode) / 0.75
    assert rule.prefill_costs() == pytest.approx((0.6 * keep, 0.15 * keep))
    assert InterleavedSteps(4).prefill_costs() == (0.0, 0.0)


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


def test_acceptance_for_inverts_expected_tokens():
    for alpha, k in ((0.0, 4), (0.3, 1), (0.49, 4), (0.9, 4), (0.95, 8)):
        assert acceptance_for(expected_tokens(alpha, k), k) == pytest.approx(alpha, abs=1e-6)
    assert acceptance_for(0.5, 4) == pytest.approx(0.0, abs=1e-6)  # below one token a pass: nothing accepted
    assert acceptance_for(9.0, 4) == pytest.approx(1.0, abs=1e-6)




def test_a_step_ratio_interval_from_a_line_extrapolated_to_nothing_is_wide_not_an_error():
    spec = StepLine.fit([(200, 0.05), (100, 0.01), (150, 0.04)])  # extrapolated to 1 row: below zero
    plain = StepLine.fit([(200, 0.02), (100, 0.01), (150, 0.015)])
    r, low, high = ratio_interval(spec, plain, 1)
    assert low <= r <= high and high / low > 1e6
