"""Verification of draft tokens against the target, for a batch of rows with ragged draft lengths.

Both functions return (n_accepted [B], next_token [B]): the row keeps its first n draft tokens
and then `next_token`, which is the target's correction at the first rejected position, or the
bonus token after the last draft token when every draft token was accepted. So a round always
emits n + 1 tokens per row, and a row with an empty draft (length 0) decodes one plain token.
"""

from __future__ import annotations

import torch

from .sampling import ACCEPT, SAMPLE, sample_from


def accepted_prefix(ok: torch.Tensor, draft_lengths: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in ok [B, k], capped at draft_lengths [B] -> [B]."""
    k = ok.shape[1]
    within = torch.arange(k, device=ok.device)[None, :] < draft_lengths[:, None]  # [B, k]
    return (ok & within).long().cumprod(dim=1).sum(dim=1)


def greedy_verify(
    target_logits: torch.Tensor,  # [B, k+1, V] target logits at pending, d_1 .. d_k
    draft_tokens: torch.Tensor,  # [B, k]
    draft_lengths: torch.Tensor,  # [B] tokens each row really proposed (<= k)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while the draft token equals the target's argmax; then take the target's argmax."""
    target_argmax = target_logits.argmax(dim=-1)  # [B, k+1]
    n = accepted_prefix(draft_tokens == target_argmax[:, :-1], draft_lengths)
    next_token = target_argmax.gather(1, n[:, None]).squeeze(1)
    return n, next_token


def rejection_verify(
    target_probs: torch.Tensor,  # [B, k+1, V] processed target distribution at each position
    draft_probs: torch.Tensor | None,  # [B, k, V] the draft's distribution, or None: point mass
    draft_tokens: torch.Tensor,  # [B, k]
    draft_lengths: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B, k+1, 3] per-position uniforms (see sampling.RowRandom)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: Leviathan et al. 2023, Algorithm 1; Chen et al. 2023.

    1. Accept draft token x at position j with probability min(1, target_probs(x) / draft_probs(x)).
    2. At the first rejection j, sample from the residual norm(max(0, target_probs - draft_probs)).
    3. If all of a row's draft tokens were accepted, sample the bonus token from target_probs.
    The emitted tokens are then distributed exactly as if sampled from the target one by one.
    A draft with no distribution (n-gram lookup) is a point mass: draft_probs(x) = 1.
    """
    B, k = draft_tokens.shape
    V = target_probs.shape[-1]
    # 1. acceptance test per position
    target_at_draft = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)  # [B, k]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
        draft_dist = torch.nn.functional.one_hot(draft_tokens, V).to(target_probs.dtype)  # [B, k, V]
    else:
        draft_at_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
        draft_dist = draft_probs
    ratio = target_at_draft / draft_at_draft.clamp_min(1e-20)
    ok = uniforms[:, :k, ACCEPT] < ratio  # u < min(1, ratio)
    n = accepted_prefix(ok, draft_lengths)  # [B]

    # 2./3. distribution at position n: residual if n is a rejected draft position, else bonus
    rows = torch.arange(B, device=target_probs.device)
    target_at_n = target_probs[rows, n]  # [B, V]
    rejected = n < draft_lengths  # [B]
    draft_at_n = draft_dist[rows, n.clamp(max=k - 1)] if k > 0 else torch.zeros_like(target_at_n)
    residual = (target_at_n - draft_at_n).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # A zero residual only happens when draft == target at that position, where rejection has
    # probability zero; fall back to the target so rounding can never produce a NaN.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_at_n)
    final_dist = torch.where(rejected[:, None], residual, target_at_n)
    u_sample = uniforms[rows, n, SAMPLE]
    return n, sample_from(final_dist, u_sample)
