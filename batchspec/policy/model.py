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

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from ..rates import per_token_acceptance
from .decision import Decision, Figures
from .decision import DecisionKind as Kind


def expected_tokens(alpha: float, k: float) -> float:
    """Mean tokens emitted per target pass: accepted draft tokens plus the target's own."""
    if alpha >= 1.0:
        return float(k + 1)
    return float((1.0 - alpha ** (k + 1)) / (1.0 - alpha))  # k may be a mean (bench); float ** float is Any to mypy


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
    def from_json(cls, data: dict[str, Any]) -> Costs:
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

    def summary(self) -> dict[str, float]:
        q = sorted(self.prompt_tokens) or [0]
        return {"rows": len(self.prompt_tokens), "prompt_p50": self.p50, "prompt_p90": float(q[int(0.9 * (len(q) - 1))]),
                "expected_new_tokens": round(self.expected_new_tokens, 1)}


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
        # measure plain and speculative steps (InterleavedSteps) instead of calibrating beforehand.
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
        if c is None:
            raise ValueError("predict needs costs: measured ones (calibrate) or given")
        P, N = profile.mean, profile.expected_new_tokens
        prefill = P * c.prefill_token_s
        plain = prefill + N * c.target_step_s
        spec = prefill + P * c.draft_prefill_token_s + N / expected_tokens(alpha, k) * (k * c.draft_step_s + c.verify(k))
        return plain / spec

    def best_k(self, profile: LengthProfile, alpha: float, ks: tuple[int, ...] | None = None) -> tuple[int, float]:
        """The k (of ks, default 1..k_max) with the highest predicted speedup, and that speedup."""
        return max(((k, self.predict(profile, alpha, k)) for k in ks or range(1, self.k_max + 1)), key=lambda t: t[1])

    def decide(self, profile: LengthProfile, currently_on: bool | None, batches_off: int = 0, at_row: int = 0,
               alpha: float | None = None, ks: tuple[int, ...] | None = None) -> Decision:
        """currently_on: None at the start of a shard, else the state in force. alpha: the shard's own
        acceptance where it was measured (vllm's look), else the actor's prior; ks: the k it may pick
        (vllm: those whose steps were timed), else 1..k_max."""
        if not profile.prompt_tokens:
            return Decision(Kind.NO_ROWS, False, 0, "no valid rows to generate", at_row=at_row)
        if self.mode == "off":
            return Decision(Kind.MODE_OFF, False, 0, "speculation.mode is off", at_row=at_row)
        if self.mode == "on":
            return Decision(Kind.MODE_ON, True, self.k_default, "speculation.mode is on", at_row=at_row)
        if self.costs is None and self.measure_in_call:
            return Decision(Kind.MEASURING, True, self.k_default, f"no costs measured at this concurrency yet; the call "
                            f"times its own plain and k={self.k_default} steps and keeps the faster", at_row=at_row)
        if self.costs is None:
            return Decision(Kind.UNCALIBRATED, True, self.k_default, "no cost calibration available, speculating by default",
                            at_row=at_row)
        lengths = profile.summary()
        numbers = Figures(c=round(self.costs.c, 3), v_k=round(self.costs.v(self.k_default), 3),
                          batch_size=self.costs.batch_size, rows=int(lengths["rows"]), prompt_p50=lengths["prompt_p50"],
                          prompt_p90=lengths["prompt_p90"], expected_new_tokens=lengths["expected_new_tokens"])
        # Hysteresis: switching on needs 1 + margin; once on, it stays on down to break-even (1.0).
        threshold = 1.0 if currently_on else 1.0 + self.margin
        # 1. Could speculation pay even if the draft were always right? If not, it stays off.
        k_ub, best_case = self.best_k(profile, 1.0, ks)
        if best_case < threshold:
            why = ("prefill-dominated" if profile.mean * self.costs.prefill_token_s
                   > profile.expected_new_tokens * self.costs.target_step_s else "draft too costly at this batch size")
            return Decision(Kind.CANNOT_PAY, False, 0, f"{why}, prompt p50 {profile.p50:.0f} tokens vs {profile.expected_new_tokens:.0f} "
                            f"new tokens, predicted {best_case:.2f}x even at acceptance 1.0", best_case, None, at_row, numbers)
        # 2. No acceptance estimate yet: probe with the default k.
        alpha = self.prior.estimate if alpha is None else alpha
        if alpha is None:
            return Decision(Kind.PROBE, True, self.k_default, f"no acceptance observed yet; at acceptance 1.0 it could "
                            f"reach {best_case:.2f}x", best_case, None, at_row, numbers)
        # 3. Acceptance known: the best k at that acceptance, against the threshold for our state.
        k, predicted = self.best_k(profile, alpha, ks)
        numbers = dataclasses.replace(numbers, k=k)
        if predicted >= threshold:
            return Decision(Kind.ON, True, k, f"per-token acceptance {alpha:.2f}, k={k}, predicted {predicted:.2f}x", predicted,
                            alpha,
                            at_row, numbers)
        if currently_on is False and self.reprobe_every and batches_off >= self.reprobe_every:
            return Decision(Kind.REPROBE, True, k, f"off for {batches_off} micro-batches, checking acceptance again "
                            f"(last estimate {alpha:.2f}, predicted {predicted:.2f}x)", predicted, alpha, at_row, numbers)
        return Decision(Kind.OFF, False, 0, f"per-token acceptance {alpha:.2f} gives predicted {predicted:.2f}x (< {threshold:.2f}x) "
                        f"at best k={k}", predicted, alpha, at_row, numbers)
