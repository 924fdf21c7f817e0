"""Per-shard speculation policy: pure Python, no torch.

Cost model (Leviathan et al. 2023, section 3.3, with measured rather than assumed costs). With
per-token acceptance a and draft length k, one round emits on average

    E(a, k) = (1 - a^(k+1)) / (1 - a)            tokens (the accepted run plus one target token)

and costs k draft steps plus one verification of k+1 tokens. Relative to plain decoding, whose
round emits one token for one target step t,

    decode speedup(a, k) = E(a, k) / (k c + v(k))    with c = draft step / t, v(k) = verify(k) / t

For a shard we also pay prefill, the same with or without speculation (plus the draft's own),
so with P prompt tokens and N expected new tokens per row:

    shard speedup = (pre(P) + N t) / (pre(P) + pre_draft(P) + N / E(a, k) * (k d + verify(k)))

That is why long-prompt, short-output shards come out near 1.0x and stay off. All times are
measured on the actor at its batch size and refreshed from every round it runs.

Decisions: on at the k that maximizes predicted shard speedup when it beats 1 + margin; once on,
off only when it drops below break-even (1.0); off -> on again only past 1 + margin (hysteresis,
no flapping). Acceptance starts from what this actor saw on earlier shards (the prior); a shard
with no prior runs its first micro-batch as a probe.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .rates import per_token_acceptance


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens emitted per target pass: accepted draft tokens plus the target's own."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def acceptance_for(tokens_per_pass: float, k: int) -> float:
    """The per-token acceptance a at which E(a, k) equals a measured mean of tokens per target pass
    (E is increasing in a; bisection). For a draft that does not always propose k tokens (an
    n-gram lookup that finds no match proposes none) this is lower than the acceptance of the
    tokens it did propose: a position it left out counts as a rejection, which is what the cost
    model, built on k proposals per pass, needs in order to predict what the steps deliver."""
    lo, hi = 0.0, 1.0
    target = min(max(tokens_per_pass, 1.0), k + 1.0)
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < target else (lo, mid)
    return (lo + hi) / 2


def decode_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Predicted decode-phase speedup over plain decoding: E(a, k) / (k c + v(k))."""
    return expected_tokens(alpha, k) / (k * c + v)


@dataclass
class Costs:
    """Seconds measured on this actor at batch_size rows."""

    batch_size: int
    target_step_s: float  # one plain decode step (1 token per row)
    draft_step_s: float  # one draft step
    verify_s: dict[int, float]  # target pass over k+1 tokens per row, by k
    prefill_token_s: float  # target prefill per prompt token
    draft_prefill_token_s: float = 0.0  # draft prefill per prompt token (0 for ngram)

    @property
    def c(self) -> float:
        return self.draft_step_s / self.target_step_s

    def v(self, k: int) -> float:
        return self.verify(k) / self.target_step_s

    def verify(self, k: int) -> float:
        if k in self.verify_s:
            return self.verify_s[k]
        known = sorted(self.verify_s)  # interpolate linearly in k between measured points
        lo = max([x for x in known if x < k], default=known[0])
        hi = min([x for x in known if x > k], default=known[-1])
        if lo == hi:
            return self.verify_s[lo] * (k + 1) / (lo + 1) if k > lo else self.verify_s[lo]
        w = (k - lo) / (hi - lo)
        return self.verify_s[lo] * (1 - w) + self.verify_s[hi] * w

    @classmethod
    def from_json(cls, data: dict) -> Costs:
        """Costs as a manifest or the policy memory wrote them (JSON made verify_s's keys strings)."""
        return cls(**{**data, "verify_s": {int(k): float(v) for k, v in data["verify_s"].items()}})

    @classmethod
    def from_steps(cls, batch_size: int, step_s: dict[int, float], prefill_token_s: float,
                   draft_prefill_token_s: float = 0.0) -> Costs | None:
        """Costs of an engine that times whole steps (vLLM): step_s[0] a plain step, step_s[k] a step
        that verifies k drafts and proposes k more, so draft_step_s is 0 and verify(k) is the round.
        The prefill costs are the target's and the draft's apart (a plain call skips the draft).
        None until both a plain and a speculative step were measured."""
        spec = {k: s for k, s in step_s.items() if k > 0}
        if 0 not in step_s or not spec:
            return None
        return cls(batch_size, step_s[0], 0.0, spec, prefill_token_s, draft_prefill_token_s)

    def learn_steps(self, step_s: dict[int, float], prefill_token_s: float, draft_prefill_token_s: float = 0.0,
                    weight: float = 0.5) -> None:
        """Refresh from the steps of a later call (EWMA per k; a k not seen before is taken as measured)."""
        for k, s in step_s.items():
            if k == 0:
                self.target_step_s += weight * (s - self.target_step_s)
            else:
                old = self.verify_s.get(k)
                self.verify_s[k] = s if old is None else old + weight * (s - old)
        if prefill_token_s > 0:
            self.prefill_token_s += weight * (prefill_token_s - self.prefill_token_s)
        if draft_prefill_token_s > 0:  # only calls that ran the draft over their prompts measure it
            self.draft_prefill_token_s += weight * (draft_prefill_token_s - self.draft_prefill_token_s)

    def update(self, k: int, draft_s: float, target_s: float, weight: float = 0.2) -> None:
        """Refresh from one measured round (EWMA), so costs follow real context lengths and loop
        overheads. A plain round (k=0) and a k-round both measure the target; the calibrated shape
        (verify(k) relative to a plain step) is kept and every target cost moves by the same
        factor, so learning one of them never skews the ratios c and v(k) the decision rests on."""
        old = self.target_step_s if k == 0 else self.verify(k)
        factor = 1.0 + weight * (target_s / old - 1.0)
        self.target_step_s *= factor
        self.verify_s = {kk: v * factor for kk, v in self.verify_s.items()}
        if k > 0:
            self.draft_step_s += weight * (draft_s / k - self.draft_step_s)
        else:  # no draft measured: longer contexts and loop overhead slow the draft alike
            self.draft_step_s *= factor


@dataclass
class LengthProfile:
    prompt_tokens: list[int]
    expected_new_tokens: float

    @property
    def p50(self) -> float:
        return float(statistics.median(self.prompt_tokens)) if self.prompt_tokens else 0.0

    @property
    def mean(self) -> float:
        return float(statistics.fmean(self.prompt_tokens)) if self.prompt_tokens else 0.0

    def summary(self) -> dict:
        q = sorted(self.prompt_tokens) or [0]
        return {"rows": len(self.prompt_tokens), "prompt_p50": self.p50, "prompt_p90": float(q[int(0.9 * (len(q) - 1))]),
                "expected_new_tokens": round(self.expected_new_tokens, 1)}


@dataclass
class Decision:
    speculate: bool
    k: int
    reason: str
    predicted_speedup: float | None = None
    alpha: float | None = None
    at_row: int = 0  # rows of the shard already generated when this decision was taken
    numbers: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Acceptance:
    """Per-token acceptance a, estimated as accepted / (accepted + rejections): each proposed
    position that verification reached is one Bernoulli trial, and a round stops at its first
    rejection (the maximum-likelihood estimate for the truncated-geometric model above). Plain
    accepted / proposed would be biased low, since positions after a rejection are never tried."""

    accepted: float = 0.0
    trials: float = 0.0
    decay: float = 0.9  # per observation; keeps the estimate current as a shard changes

    def observe(self, accepted: int, rejections: int) -> None:
        self.accepted = self.accepted * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + rejections

    @property
    def estimate(self) -> float | None:
        return per_token_acceptance(self.accepted, self.trials - self.accepted) if self.trials >= 8 else None


class Policy:
    """Decides, per shard and as it runs, whether to speculate and with which k."""

    def __init__(self, mode: str = "auto", k_default: int = 4, k_max: int = 8, margin: float = 0.05,
                 reprobe_every: int = 8, measure_in_call: bool = False):
        self.mode, self.k_default, self.k_max = mode, k_default, k_max
        # An engine that times its own steps (vLLM): with no costs yet, speculate and let the call
        # measure plain and speculative steps (StepArms) instead of calibrating beforehand.
        self.measure_in_call = measure_in_call
        self.margin, self.reprobe_every = margin, reprobe_every
        self.costs: Costs | None = None
        self.prior = Acceptance()  # carried across shards on this actor
        self.new_tokens_seen: list[int] = []

    # -- inputs ---------------------------------------------------------------------------------
    def calibrate(self, costs: Costs) -> None:
        self.costs = costs

    def expected_new_tokens(self, max_new_tokens: int) -> float:
        """max_new_tokens until completions were seen, then their recent mean (rows stop early)."""
        if len(self.new_tokens_seen) < 8:
            return float(max_new_tokens)
        return float(statistics.fmean(self.new_tokens_seen[-256:]))

    def observe_round(self, k: int, draft_s: float, target_s: float, accepted: int, rejections: int) -> None:
        if self.costs is not None and target_s > 0:  # 0: an untimed aggregate (the vllm backend's)
            self.costs.update(k, draft_s, target_s)
        if k > 0:
            self.prior.observe(accepted, rejections)

    def observe_rows(self, completion_tokens: list[int]) -> None:
        self.new_tokens_seen.extend(completion_tokens)

    # -- decisions ------------------------------------------------------------------------------
    def predict(self, profile: LengthProfile, alpha: float, k: int, costs: Costs | None = None) -> float:
        """Predicted shard speedup of speculation at (alpha, k) over plain decoding."""
        c = costs or self.costs
        P, N = profile.mean, profile.expected_new_tokens
        prefill = P * c.prefill_token_s
        plain = prefill + N * c.target_step_s
        spec = prefill + P * c.draft_prefill_token_s + N / expected_tokens(alpha, k) * (k * c.draft_step_s + c.verify(k))
        return plain / spec

    def best_k(self, profile: LengthProfile, alpha: float) -> tuple[int, float]:
        return max(((k, self.predict(profile, alpha, k)) for k in range(1, self.k_max + 1)), key=lambda t: t[1])

    def decide(self, profile: LengthProfile, currently_on: bool | None, batches_off: int = 0, at_row: int = 0) -> Decision:
        """currently_on: None at the start of a shard, else the state in force."""
        if not profile.prompt_tokens:
            return Decision(False, 0, "off: no valid rows to generate", at_row=at_row)
        if self.mode == "off":
            return Decision(False, 0, "off: speculation.mode is off", at_row=at_row)
        if self.mode == "on":
            return Decision(True, self.k_default, "on: speculation.mode is on", at_row=at_row)
        if self.costs is None and self.measure_in_call:
            return Decision(True, self.k_default, f"on (measuring): no costs measured at this concurrency yet; the call "
                            f"times its own plain and k={self.k_default} steps and keeps the faster", at_row=at_row)
        if self.costs is None:
            return Decision(True, self.k_default, "on: no cost calibration available, speculating by default", at_row=at_row)
        numbers = {"c": round(self.costs.c, 3), "v_k": round(self.costs.v(self.k_default), 3),
                   "batch_size": self.costs.batch_size, **profile.summary()}
        # Hysteresis: switching on needs 1 + margin; once on, it stays on down to break-even (1.0).
        threshold = 1.0 if currently_on else 1.0 + self.margin
        # 1. Could speculation pay even if the draft were always right? If not, it stays off.
        k_ub, best_case = self.best_k(profile, 1.0)
        if best_case < threshold:
            why = ("prefill-dominated" if profile.mean * self.costs.prefill_token_s
                   > profile.expected_new_tokens * self.costs.target_step_s else "draft too costly at this batch size")
            return Decision(False, 0, f"off: {why}, prompt p50 {profile.p50:.0f} tokens vs {profile.expected_new_tokens:.0f} "
                            f"new tokens, predicted {best_case:.2f}x even at acceptance 1.0", best_case, None, at_row, numbers)
        # 2. No acceptance estimate yet: probe with the default k.
        alpha = self.prior.estimate
        if alpha is None:
            return Decision(True, self.k_default, f"on (probe): no acceptance observed yet; at acceptance 1.0 it could "
                            f"reach {best_case:.2f}x", best_case, None, at_row, numbers)
        # 3. Acceptance known: the best k at that acceptance, against the threshold for our state.
        k, predicted = self.best_k(profile, alpha)
        numbers["k"] = k
        if predicted >= threshold:
            return Decision(True, k, f"on: per-token acceptance {alpha:.2f}, k={k}, predicted {predicted:.2f}x", predicted, alpha,
                            at_row, numbers)
        if currently_on is False and self.reprobe_every and batches_off >= self.reprobe_every:
            return Decision(True, k, f"on (re-probe): off for {batches_off} micro-batches, checking acceptance again "
                            f"(last estimate {alpha:.2f}, predicted {predicted:.2f}x)", predicted, alpha, at_row, numbers)
        return Decision(False, 0, f"off: per-token acceptance {alpha:.2f} gives predicted {predicted:.2f}x (< {threshold:.2f}x) "
                        f"at best k={k}", predicted, alpha, at_row, numbers)


class StepArms:
    """The k of every engine step of one vLLM call, chosen from what the call's own steps delivered.

    `arms[0]` is the policy's k; when the policy has no costs at this concurrency yet, the other arms
    (plain decoding, k = 0) are measured too: each for `measure_steps` clean steps, in order, then the
    call keeps the arm with the most tokens per second for the rest of its steps. An arm is judged
    by its fastest clean step, tokens and seconds of that one step: another process taking the
    core only ever adds time, and beside one busy process a preempted step made the mean pick
    plain (demo job: 2.94 s against 2.37 s for the run that kept k=4). Mixing the fastest time
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
    run's memory); without this, data that drafts badly ran the whole call at k: the demo pair on
    prompts of random tokens, deciding from the legal job's remembered 0.91, generated in 1.35-1.51
    s where plain takes 0.73-0.78 s. threshold: what the guard's prediction must reach, 1.0 for
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
        self.stopped: dict | None = None  # when the guard turned the call plain: what it saw
        self._last: int | None = None

    def next_k(self) -> int:
        if not self.settled:
            todo = [k for k in self.arms if self.steps[k][0] < self.measure_steps]
            if todo:
                self.k = todo[0]
            else:
                rates = self.rates()
                self.k, self.settled = max(rates, key=rates.get), True
        elif self.guard is not None and self.stopped is None:
            self._check_guard()
        return self.k

    def finish(self) -> None:
        """The call has ended. One that ended while measuring its last arm keeps the faster arm
        measured, not the one it was measuring: a 5-row call whose rows finished during its plain
        steps recorded "kept plain" after k=4 had run 492 tokens/s to plain's 108, and its shard's
        kind was remembered as not paying."""
        if not self.settled and self.explored():
            rates = self.rates()
            self.k, self.settled = max(rates, key=rates.get), True

    def _check_guard(self) -> None:
        _, passes, steps = self.passes.get(self.k, (0, 0, 0))
        if passes < self.guard_passes or steps < 2:
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
            # while admitting the next ones; counting those made 5.2 s of a 7.1 s demo call of
            # 1,536 rows "prefill", and every later call "prefill-dominated". Within the fill,
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
        those tokens left in they were charged twice. The 96-row demo call fills in 3 steps
        (0.62-0.70 s of a 1.13-1.35 s call at k=4), and in the last two the first rows emit 665
        tokens, 0.09-0.11 s at the clean steps' rate; taken out, the model's account of the call
        adds up to the call. (A 1-token call over the same prompts, prefill alone, takes
        0.57-0.60 s: decoding beside a prefill costs less than in a step of its own, so neither
        figure is the prompts' cost exactly.) Tokens of an arm with no clean step stay in; so does
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

    def observe(self, timing) -> None:
        self.policy.observe_round(timing.k, timing.draft_s, timing.target_s, timing.accepted, timing.rejections)
        alpha = self.policy.prior.estimate
        costs = self.policy.costs
        if alpha is None or costs is None:
            return
        self.k = max(range(1, self.policy.k_max + 1), key=lambda k: decode_speedup(alpha, k, costs.c, costs.v(k)))
