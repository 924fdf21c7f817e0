"""The k of a call's engine steps, chosen from what its own steps deliver (vllm: StepArms), and
the cost model's k for every round of an hf batch (CostModelK)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .model import Policy, acceptance_for, decode_speedup

if TYPE_CHECKING:
    from ..engine.api import RoundTiming


class StepArms:
    """The k of every engine step of one vLLM call, chosen from what the call's own steps delivered.

    `arms[0]` is the policy's k; when the policy has no costs at this concurrency yet, the other arms
    (plain decoding, k = 0) are measured too: each for `measure_steps` clean steps, in order, then the
    call keeps the arm with the most tokens per second for the rest of its steps. An arm is judged
    by its fastest clean step, tokens and seconds of that one step: another process taking the
    core only ever adds time, and beside one busy process a preempted step made the mean pick
    plain where k=4 was faster. Mixing the fastest time
    with the mean tokens was tried and is wrong for drafts whose step cost follows the data: an
    n-gram step that proposes little is both fast and short of tokens. No separate
    calibration call is needed and nothing is thrown away: every step, exploring or not, emits
    tokens of the rows being generated.

    A step is clean when it decodes only (no prompt is being prefilled) and the step before ran at
    the same k: a vLLM step verifies the drafts the previous step proposed and proposes as many as
    its own k, so the first step after a switch is neither arm. Engines call next_k() before each
    step and observe_step() after it (duck-typed like engine.generate.DraftLength).

    guard: for a call decided from known costs (one arm, k > 0), the predicted decode speedup of
    going on at k given an acceptance (prefill is spent by then). Once the call's clean steps at k
    have made `guard_passes` row passes, the acceptance they delivered is checked before every
    step, and when it predicts less than break-even the rest of the call runs plain (`stopped`
    says why). A decision rests on acceptance seen before the call (earlier shards, or an earlier
    run's memory); without this, data that drafts badly ran the whole call at k (the demo pair on
    prompts of random tokens, deciding from the legal job's remembered acceptance, took twice
    plain's time: docs/benchmarks.md). threshold: what the guard's prediction must reach, 1.0 for
    a call decided "on"; a call that checks a remembered "off" (runner/worker.py) gives the
    decision's own whole-call prediction and 1 + margin, which drops to 1.0 once passed."""

    def __init__(self, arms: tuple[int, ...], measure_steps: int = 2,
                 guard: Callable[[float], float] | None = None, guard_passes: int = 64, strict: bool = False,
                 threshold: float = 1.0):
        self.arms = tuple(dict.fromkeys(arms))
        self.measure_steps = measure_steps
        self.k = self.arms[0]
        self.settled = len(self.arms) == 1
        self.steps = {k: [0, 0, float("inf")] for k in self.arms}  # k -> [clean steps, fastest step's tokens, its seconds]
        self.prefill_s = 0.0  # the target's part of the prefill steps
        self.draft_prefill_s = 0.0  # the draft's part, where the engine timed it apart
        self.fill_decode: dict[int, int] = {}  # k -> tokens that rows already decoding emitted in those steps
        self.rows = 0  # rows decoding at the largest clean step
        self.fastest_rows: dict[int, int] = {}  # k -> rows decoding at that arm's fastest clean step
        self.strict = strict  # arms timed at different rows are not kept as costs (costs_kept)
        self._decoded = False  # a clean step has run: later prefill steps admit rows while others decode
        self.passes: dict[int, list[int]] = {}  # k > 0 -> [tokens, row passes, steps] over every clean step at k
        self.guard = guard if self.settled and self.k > 0 else None
        self.guard_passes = guard_passes
        self.threshold = threshold  # the guard's break-even: 1.0 once on; 1 + margin to turn on (a check)
        self.stopped: dict[str, float] | None = None  # when the guard turned the call plain: what it saw
        self._last: int | None = None

    def next_k(self) -> int:
        if not self.settled:
            todo = [k for k in self.arms if self.steps[k][0] < self.measure_steps]
            if todo:
                self.k = todo[0]
            else:
                rates = self.rates()
                self.k, self.settled = max(rates, key=lambda k: rates[k]), True
        elif self.guard is not None and self.stopped is None:
            self._check_guard()
        return self.k

    def finish(self) -> None:
        """The call has ended. One that ended while measuring its last arm keeps the faster arm
        measured, not the one it was measuring: a short call whose rows finished during its plain
        steps recorded "kept plain" after k=4 had run 4x faster, and its shard's kind was
        remembered as not paying."""
        if not self.settled and self.explored():
            rates = self.rates()
            self.k, self.settled = max(rates, key=lambda k: rates[k]), True

    def _check_guard(self) -> None:
        _, passes, steps = self.passes.get(self.k, (0, 0, 0))
        if self.guard is None or passes < self.guard_passes or steps < 2:
            return
        alpha = self.acceptance()[self.k]
        predicted = self.guard(alpha)
        if predicted < self.threshold:
            self.stopped = {"k": self.k, "acceptance": round(alpha, 3), "predicted_speedup": round(predicted, 3),
                            "steps": steps, "row_passes": passes}
            self.k = 0
        else:
            self.threshold = min(self.threshold, 1.0)  # on now: stays on down to break-even

    def observe_step(self, k: int, seconds: float, tokens: int, rows: int, prefill: bool, draft_s: float = 0.0,
                     decode_tokens: int = 0) -> None:
        """seconds: the step's cost as this arm will pay it; draft_s: the draft's time, where the
        engine measured it apart and left it out of seconds (a prefill step's, or a plain step's
        whose draft runs only while measuring); decode_tokens: of a prefill step's tokens, those
        that rows already decoding emitted (the rest are first tokens of rows whose prompt ended)."""
        if prefill:
            # What prompts cost is read from the call's fill, before its first clean step. In a
            # call of more rows than the engine runs at once, later steps decode the running rows
            # while admitting the next ones; counting those made most of a 1,536-row demo call
            # "prefill", and every later call "prefill-dominated". Within the fill,
            # rows admitted first decode while later prompts are chunked in: prefill_costs()
            # takes their tokens out.
            if not self._decoded:
                self.prefill_s += seconds
                self.draft_prefill_s += draft_s
                self.fill_decode[k] = self.fill_decode.get(k, 0) + decode_tokens
            self._last = k
            return
        self._decoded = True
        if k == self._last and k > 0:
            p = self.passes.setdefault(k, [0, 0, 0])
            p[0], p[1], p[2] = p[0] + tokens, p[1] + rows, p[2] + 1
        if k == self._last and k in self.steps and self.steps[k][0] < self.measure_steps:
            # Only an arm's first clean steps count: they are what the arms are compared on, at
            # the call's full concurrency (later steps run fewer rows as rows finish).
            n = self.steps[k]
            n[0] += 1
            if seconds < n[2]:
                n[1], n[2] = tokens, seconds
                self.fastest_rows[k] = rows
            self.rows = max(self.rows, rows)
        self._last = k

    def rates(self) -> dict[int, float]:
        """Tokens per second by arm, of its fastest clean step."""
        return {k: tok / fastest for k, (n, tok, fastest) in self.steps.items() if n and fastest > 0}

    def matched(self) -> bool:
        """Whether every arm's fastest clean step ran at least 3/4 of the rows of the largest one, so
        that their times are costs at one concurrency. Rows finish as a call goes on, and several
        tokens a step at k > 0: in a 256-row demo call the plain steps ran at 99-112 rows after k=4
        at 192-252, a plain step looked half its cost, and the costs learned from them said
        "prefill-dominated" for every later call. The arms still decide the call itself."""
        return all(4 * rows >= 3 * self.rows for rows in self.fastest_rows.values())

    def costs_kept(self) -> bool:
        """Whether the arms' step times may become the policy's costs. Only strict rules refuse
        unmatched arms: the first rows of a call of more rows than the engine runs at once (their
        skew made every later call of the 6,144-row demo "prefill-dominated"). A call within what
        the engine runs at once keeps them as before: on the mixed job the skewed costs keep it off,
        which bare vLLM agrees with, and refusing them there cost ~10% (docs/policy.md)."""
        return self.matched() or not self.strict

    def prefill_costs(self) -> tuple[float, float]:
        """Seconds the call's prompts cost, the target's and the draft's: the fill's steps less what
        the tokens that rows already decoding emitted in them would have cost in the call's clean
        steps at the same k. The cost model charges every new token to decoding steps, so with
        those tokens left in they were charged twice; taken out, the model's account of a call
        adds up to the call. (Decoding beside a prefill costs less than in a step of its own, so
        this is an estimate of the prompts' cost, not a measurement.) Tokens of an arm with no
        clean step stay in; so does
        all of it if the estimate would leave nothing."""
        rates = self.rates()
        decode = sum(tokens / rates[k] for k, tokens in self.fill_decode.items() if tokens and rates.get(k))
        total = self.prefill_s + self.draft_prefill_s
        if not 0 < decode < total:
            return self.prefill_s, self.draft_prefill_s
        keep = (total - decode) / total
        return self.prefill_s * keep, self.draft_prefill_s * keep

    def step_seconds(self) -> dict[int, float]:
        """Seconds of a clean step by arm, the fastest (the cost the policy keeps, as in rates())."""
        return {k: fastest for k, (n, _, fastest) in self.steps.items() if n}

    def acceptance(self) -> dict[int, float]:
        """By k > 0: the per-token acceptance that the call's clean steps at k delivered, as the cost
        model counts it (acceptance_for of their mean tokens per row)."""
        return {k: acceptance_for(tokens / passes, k) for k, (tokens, passes, _) in self.passes.items() if passes}

    def explored(self) -> bool:
        return len(self.arms) > 1 and all(self.steps[k][0] for k in self.arms)

    def summary(self) -> str:
        rates, costs_kept = self.rates(), self.costs_kept()
        parts = [f"{'plain' if k == 0 else f'k={k}'} {rates[k]:.0f} tokens/s"
                 + ("" if costs_kept else f" at {self.fastest_rows[k]} rows") for k in self.arms if k in rates]
        kept = "plain" if self.k == 0 else f"k={self.k}"
        at = f" at {self.rows} rows" if costs_kept else "; rows finished meanwhile, so not kept as costs"
        return f"measured in the call ({self.measure_steps} steps each{at}): {' vs '.join(parts)}; kept {kept}"


class CostModelK:
    """Draft length rule for the engine (duck-typed engine.generate.DraftLength): after each
    round, re-pick the k that maximizes decode speedup at the live acceptance estimate."""

    def __init__(self, policy: Policy, k: int):
        self.policy, self.k = policy, k

    def next_k(self) -> int:
        return self.k

    def observe(self, timing: RoundTiming) -> None:
        self.policy.observe_round(timing.k, timing.draft_s, timing.target_s, timing.accepted, timing.rejections)
        alpha = self.policy.prior.estimate
        costs = self.policy.costs
        if alpha is None or costs is None:
            return
        self.k = max(range(1, self.policy.k_max + 1), key=lambda k: decode_speedup(alpha, k, costs.c, costs.v(k)))
