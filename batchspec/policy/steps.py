"""The cost model's k for every round of an hf batch (CostModelK). vLLM's step rule is
paired.InterleavedSteps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model import Policy, decode_speedup

if TYPE_CHECKING:
    from ..engine.api import RoundTiming


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
