"""Logits processing and per-row randomness.

Randomness is tied to *output positions*, not to calls: each row owns a seeded torch.Generator
and draws exactly three uniforms per output position, in position order:

    u[t] = (u_draft, u_accept, u_sample)   for the t-th generated token of the row

u_draft samples the draft's proposal at t, u_accept tests it, u_sample draws the target's (or the
residual) token at t. Every position is decided exactly once, from its own three uniforms and the
tokens before it, so a seeded row gives the same text whatever else is in its batch. The row's
tokens still depend on the draft length used at each position (a drafted-and-accepted token is a
different function of the uniforms than a directly sampled one), so fix `k` for bitwise
reproducibility of sampled rows; greedy rows never depend on it.
"""

from __future__ import annotations

import torch

from .api import SamplingParams

DRAFT, ACCEPT, SAMPLE = 0, 1, 2


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), then softmax. logits [..., V] -> probs [..., V].

    Computed in fp32 whatever the model's dtype, so bf16 logits do not quantize probabilities.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p (keeps at least one).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V], u [...] in [0, 1) -> token ids [...]."""
    cdf = probs.cumsum(-1)
    # Scale u by the total mass so rounding in cumsum can never push u past the last bin.
    idx = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


class RowRandom:
    """One seeded generator per row, drawing three uniforms per output position, lazily, in order.

    Uniforms drawn for positions that were proposed but then rejected stay buffered and are used
    when the position is decided in a later round.
    """

    def __init__(self, seed: int):
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.buffer = torch.empty(0, 3)  # [positions drawn so far, 3]

    def uniforms(self, start: int, count: int) -> torch.Tensor:
        """Uniforms for output positions start .. start+count-1 -> [count, 3]."""
        need = start + count - self.buffer.shape[0]
        if need > 0:
            self.buffer = torch.cat([self.buffer, torch.rand(need, 3, generator=self.generator)])
        return self.buffer[start:start + count]


def gather_uniforms(rows: list[RowRandom], starts: list[int], count: int, device) -> torch.Tensor:
    """Per-row uniforms for `count` positions from each row's own start -> [B, count, 3]."""
    return torch.stack([r.uniforms(s, count) for r, s in zip(rows, starts)]).to(device)
