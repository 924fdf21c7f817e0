"""Speculation rates, derived from raw counters in one place. Rows, manifests and parts store only
counters (draft_tokens, accepted_tokens, spec_rounds, rejections); every reader that shows a rate
(worker rows, report, progress, bench, policy) calls these, so one name always means one formula.

    acceptance_rate         accepted / drafted        share of proposed draft tokens the target kept
    mean_acceptance_length  1 + accepted / rounds     tokens emitted per target pass, counting the bonus token
    per_token_acceptance    accepted / (accepted + rejections)
                            the policy's alpha: each verified position is a trial and a round stops at
                            its first rejection, so positions after it are never tried. It is the
                            maximum-likelihood estimate under the i.i.d. model of policy.py and sits
                            above acceptance_rate (e.g. 0.95 vs 0.76 when k is larger than the runs the
                            draft gets right); reports label the two apart.
"""

from __future__ import annotations


def acceptance_rate(accepted: float, drafted: float) -> float | None:
    return accepted / drafted if drafted else None


def mean_acceptance_length(accepted: float, rounds: float) -> float | None:
    return 1.0 + accepted / rounds if rounds else None


def per_token_acceptance(accepted: float, rejections: float) -> float | None:
    return accepted / (accepted + rejections) if accepted + rejections else None
