"""Verification on scripted logits and probabilities: greedy rule and rejection sampling."""

import torch

from batchspec.engine.sampling import ACCEPT, SamplingParams, logits_to_probs, sample_from
from batchspec.engine.verify import greedy_verify, rejection_verify


def scripted_logits(argmax_rows: list[list[int]], V: int = 6) -> torch.Tensor:
    """Logits [B, T, V] whose argmax at (b, t) is argmax_rows[b][t]."""
    logits = torch.zeros(len(argmax_rows), len(argmax_rows[0]), V)
    for b, row in enumerate(argmax_rows):
        for t, tok in enumerate(row):
            logits[b, t, tok] = 5.0
    return logits


def test_greedy_all_accepted_takes_bonus_token():
    logits = scripted_logits([[1, 2, 3, 4]])
    n, nxt = greedy_verify(logits, torch.tensor([[1, 2, 3]]), torch.tensor([3]))
    assert n.tolist() == [3] and nxt.tolist() == [4]


def test_greedy_first_rejected_takes_target_token():
    logits = scripted_logits([[1, 2, 3, 4]])
    n, nxt = greedy_verify(logits, torch.tensor([[5, 2, 3]]), torch.tensor([3]))
    assert n.tolist() == [0] and nxt.tolist() == [1]


def test_greedy_empty_draft_is_a_plain_step():
    logits = scripted_logits([[1, 2, 3, 4]])
    n, nxt = greedy_verify(logits, torch.tensor([[1, 2, 3]]), torch.tensor([0]))
    assert n.tolist() == [0] and nxt.tolist() == [1]


def test_greedy_ragged_batch():
    logits = scripted_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [1, 2, 3], [1, 2, 3]])
    lengths = torch.tensor([3, 3, 1, 2])  # row 2 proposes one token, row 3 two
    n, nxt = greedy_verify(logits, drafts, lengths)
    assert n.tolist() == [3, 1, 1, 2]
    assert nxt.tolist() == [4, 2, 2, 3]


def _uniforms(B, k, u_accept=None, u_sample=0.5):
    u = torch.full((B, k + 1, 3), float(u_sample))
    if u_accept is not None:
        u[:, :k, ACCEPT] = torch.tensor(u_accept, dtype=torch.float)
    return u


def test_rejection_all_accepted_samples_bonus_from_target():
    V = 4
    target = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]])  # [1, 3, V]
    draft = torch.full((1, 2, V), 0.25)
    n, nxt = rejection_verify(target, draft, torch.tensor([[1, 2]]), torch.tensor([2]), _uniforms(1, 2, [[0.0, 0.0]]))
    assert n.tolist() == [2] and nxt.tolist() == [3]


def test_rejection_first_rejected_samples_residual():
    # target puts 0.5 on tokens 0 and 1; draft put all mass on token 1 -> residual is all on token 0.
    target = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    draft = torch.tensor([[[0.0, 1.0, 0.0]]])
    u = _uniforms(1, 1, [[0.9]])  # 0.9 >= p/q = 0.5 -> reject
    n, nxt = rejection_verify(target, draft, torch.tensor([[1]]), torch.tensor([1]), u)
    assert n.tolist() == [0] and nxt.tolist() == [0]


def test_rejection_empty_draft_samples_target():
    target = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    n, nxt = rejection_verify(target, torch.full((1, 1, 3), 1 / 3), torch.tensor([[0]]), torch.tensor([0]), _uniforms(1, 1, [[0.0]]))
    assert n.tolist() == [0] and nxt.tolist() == [2]


def test_rejection_point_mass_draft_accepts_with_target_probability():
    target = torch.tensor([[[0.3, 0.7], [1.0, 0.0]], [[0.3, 0.7], [1.0, 0.0]]])
    drafts = torch.tensor([[1], [1]])
    u = _uniforms(2, 1, [[0.69], [0.71]])  # accept iff u < 0.7
    n, nxt = rejection_verify(target, None, drafts, torch.tensor([1, 1]), u)
    assert n.tolist() == [1, 0]
    assert nxt.tolist() == [0, 0]  # row 1: residual of a point mass on 1 is all on token 0


def _draft_sample(draft_probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return sample_from(draft_probs, torch.rand(draft_probs.shape[:-1], generator=gen))


def test_rejection_sampling_preserves_target_distribution():
    """Emitted tokens follow the target distribution whatever the draft (Leviathan et al., Thm. 1).

    200k rows, V = 5, k = 2, target and draft far apart. Position 0's emitted token and position
    1's (when position 0 was an accepted draft token) must both match the target within 5
    standard errors; sampling from the target instead of the residual on rejection is off by ~0.1.
    """
    gen = torch.Generator().manual_seed(0)
    N, V, k = 200_000, 5, 2
    target_probs_0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    target_probs_1 = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.4])
    draft_probs_0 = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    draft_probs_1 = torch.tensor([0.05, 0.6, 0.05, 0.2, 0.1])
    target = torch.stack([target_probs_0, target_probs_1, target_probs_0]).expand(N, k + 1, V)
    draft = torch.stack([draft_probs_0, draft_probs_1]).expand(N, k, V)
    tokens = _draft_sample(draft, gen)  # [N, k]
    uniforms = torch.rand(N, k + 1, 3, generator=gen)
    n, nxt = rejection_verify(target, draft, tokens, torch.full((N,), k), uniforms)

    first = torch.where(n >= 1, tokens[:, 0], nxt)
    freq0 = torch.bincount(first, minlength=V).float() / N
    tol0 = 5 * (target_probs_0 * (1 - target_probs_0) / N).sqrt()
    assert ((freq0 - target_probs_0).abs() <= tol0).all(), (freq0, target_probs_0)

    reached = n >= 1
    second = torch.where(n >= 2, tokens[:, 1], nxt)[reached]
    freq1 = torch.bincount(second, minlength=V).float() / reached.sum()
    tol1 = 5 * (target_probs_1 * (1 - target_probs_1) / reached.sum()).sqrt()
    assert ((freq1 - target_probs_1).abs() <= tol1).all(), (freq1, target_probs_1)


def test_top_k_and_top_p_processing():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert logits_to_probs(logits, SamplingParams(1.0, top_k=2)).tolist() == [0.625, 0.375, 0.0, 0.0]
    top_p = logits_to_probs(logits, SamplingParams(1.0, top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert top_p[2:].sum() == 0 and torch.allclose(top_p[:2], torch.tensor([0.625, 0.375]))
    cold = logits_to_probs(logits, SamplingParams(0.1))
    assert cold[0] > 0.99


def test_sample_from_inverse_cdf():
    probs = torch.tensor([[0.2, 0.3, 0.5]])
    assert sample_from(probs, torch.tensor([0.1])).tolist() == [0]
    assert sample_from(probs, torch.tensor([0.45])).tolist() == [1]
    assert sample_from(probs, torch.tensor([0.999999])).tolist() == [2]
