"""Batched generation: plain (autoregressive) and speculative, in one loop.

A round feeds each row's pending token (the last emitted one, not yet in the target's cache)
followed by up to k draft tokens, verifies the draft in that single target pass, and emits n + 1
tokens per row (n accepted draft tokens, then the target's own). Plain decoding is the same round
with k = 0, so both paths share prefill, stop rules, stats and batch bookkeeping, and greedy
speculative output equals greedy plain output token for token (up to floating-point
non-associativity of batched kernels; exact in fp32 on CPU, see docs/engine.md).

    rows = generate(target_model, prompt_ids, GenerationConfig(max_new_tokens=64),
                    proposer=NgramDraft(), draft_length=FixedK(4))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from . import cache as kv
from .api import BatchResult, DraftLength, RoundTiming, RowOutput, RowStats
from .sampling import SAMPLE, RowRandom, SamplingParams, gather_uniforms, logits_to_probs, sample_from
from .verify import accepted_prefix, greedy_verify, rejection_verify


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0


class Proposer(Protocol):
    def prefill(self, prompts: list[list[int]], first_tokens: list[int], device) -> None: ...
    def propose(self, k: int, lengths: torch.Tensor, params: SamplingParams, uniforms): ...
    def accept(self, n_accepted: list[int], emitted: list[list[int]], proposed: bool) -> None: ...
    def select(self, keep_idx: torch.Tensor) -> None: ...


StopCheck = Callable[[list[int]], "str | None"]  # completion ids -> the stop string it now contains


@dataclass
class _Run:
    """What every round of one generate() call reads: the models, the settings and the rows' outputs."""

    model: torch.nn.Module
    config: GenerationConfig
    proposer: Proposer | None
    draft_length: DraftLength | None
    randoms: list[RowRandom] | None
    stop_check: StopCheck | None
    synchronize: Callable[[], None]
    window: int | None
    device: torch.device
    outputs: list[RowOutput]
    row_max: list[int]
    eos: set[int]
    features: bool  # learned drafts (Medusa, EAGLE) draft from the target's features
    layers: list[int] | None  # EAGLE-3 reads the inputs of a few decoder layers (feature_layers)


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    config: GenerationConfig,
    proposer: Proposer | None = None,
    draft_length: DraftLength | None = None,
    randoms: list[RowRandom] | None = None,
    stop_check: StopCheck | None = None,
    synchronize: Callable[[], None] = lambda: None,
    max_new_per_row: list[int] | None = None,
    window: int | None = None,
) -> BatchResult:
    """Generate for every prompt; speculative when a proposer is given, plain otherwise.

    max_new_per_row caps rows individually (e.g. so a long prompt stays inside the context);
    config.max_new_tokens applies to rows without their own cap. window: the model's sliding
    attention window; speculation then needs every row to fit in it (see _window_slack).
    """
    if not config.sampling.greedy and randoms is None:
        raise ValueError("sampling needs one RowRandom per row (see api.row_seed)")
    run = _Run(model, config, proposer, draft_length, randoms, stop_check, synchronize, window,
               next(model.parameters()).device, [RowOutput([], RowStats(prompt_tokens=len(p))) for p in prompts],
               list(max_new_per_row) if max_new_per_row is not None else [config.max_new_tokens] * len(prompts),
               set(config.eos_token_ids), proposer is not None and getattr(proposer, "needs_features", False),
               getattr(proposer, "feature_layers", None))
    start = time.perf_counter()
    # 1. Prefill every prompt (left-padded), decide each row's first token, prefill the draft.
    state, pending, done, prefill_s, draft_prefill_s = _first_tokens(run, prompts, start)
    active = list(range(len(prompts)))  # batch slot -> output row
    rounds: list[RoundTiming] = []
    while True:
        # 2. Rows that finished leave the batch (target state, proposer, pending tokens).
        for i, r in enumerate(active):
            if done[i]:
                run.outputs[r].stats.latency_s = time.perf_counter() - start
        if all(done):
            break
        active, state, pending = _drop_finished(active, done, state, pending, proposer)
        state, pending, done, timing = _round(run, active, state, pending)
        rounds.append(timing)
    for o in run.outputs:
        o.stats.completion_tokens = len(o.token_ids)
    return BatchResult(run.outputs, rounds, prefill_s, draft_prefill_s)


def _first_tokens(run: _Run, prompts: list[list[int]], start: float):
    """Prefill the target and decide each row's first token (emitted, with its ttft), then prefill
    the draft: (target state, pending tokens [B], done per row, prefill seconds, draft's)."""
    state, first, feats = _prefill(run.model, prompts, run.config, run.randoms, run.features, run.layers, run.device)
    run.synchronize()
    prefill_s = time.perf_counter() - start
    first_list = first.tolist()
    done = [_emit(run.outputs[r], [t], run.eos, run.row_max[r], run.stop_check) for r, t in enumerate(first_list)]
    now = time.perf_counter() - start
    for o in run.outputs:
        o.stats.ttft_s = now
    t_draft = time.perf_counter()
    if run.proposer is not None:
        extra = {"features": feats} if run.features else {}
        run.proposer.prefill(prompts, first_list, run.device, **extra)
        run.synchronize()
    return state, first, done, prefill_s, time.perf_counter() - t_draft


def _round(run: _Run, active: list[int], state, pending):
    """One round over the active rows: draft, one target pass that verifies, emit; returns
    (target state, pending tokens, done per active row, the round's timing)."""
    proposer, params = run.proposer, run.config.sampling
    emitted_so_far = [len(run.outputs[r].token_ids) for r in active]
    # 3. Draft: up to k tokens per row, never more than the row's remaining budget minus one
    #    (the round always adds the target's own token after the accepted draft tokens).
    k = run.draft_length.next_k() if (proposer is not None and run.draft_length is not None) else 0
    k, lengths = _draft_lengths(k, [run.row_max[r] - e - 1 for r, e in zip(active, emitted_so_far)], state,
                                run.window, run.device)
    uniforms = None
    if not params.greedy:
        assert run.randoms is not None  # checked by generate
        uniforms = gather_uniforms([run.randoms[r] for r in active], emitted_so_far, k + 1, run.device)  # [B, k+1, 3]
    t0 = time.perf_counter()
    proposed = k > 0
    siblings = draft_tokens = draft_probs = None
    if proposed:
        k, lengths, draft_tokens, draft_probs, siblings = _draft(proposer, k, lengths, params, uniforms,
                                                                 trees=params.greedy and run.window is None)
    step_ids = pending[:, None] if draft_tokens is None or k == 0 else torch.cat([pending[:, None], draft_tokens], dim=1)  # [B, k+1]
    run.synchronize()
    t1 = time.perf_counter()
    # 4. One target pass over pending + draft; verify. 5. Roll back rejected slots: keep pending
    #    and the accepted draft tokens (invariant in cache.py).
    if siblings is not None:  # a tree: the chain plus other candidates at each depth
        n, next_token, draft_tokens, state, feats = _verify_tree(run.model, state, pending, draft_tokens, siblings,
                                                                 lengths, run.layers)
    else:
        n, next_token, state, feats = _verify_chain(run.model, state, step_ids, draft_tokens, draft_probs, lengths,
                                                    params, uniforms, run.features, run.layers)
    run.synchronize()
    t2 = time.perf_counter()
    # 6. Emit n accepted draft tokens + the target's token per row, applying stop rules.
    emitted, done, (round_proposed, round_accepted, round_rejections) = _emit_round(
        [run.outputs[r] for r in active], [run.row_max[r] for r in active], n, next_token,
        draft_tokens if k > 0 else None, lengths, run.eos, run.stop_check)
    if proposer is not None:
        extra = {"features": feats} if run.features else {}  # feats [B, k+1, H]
        proposer.accept(n.tolist(), emitted, proposed=proposed, **extra)
    timing = RoundTiming(len(active), k, t1 - t0, t2 - t1, round_proposed, round_accepted, round_rejections)
    if run.draft_length is not None and proposed:
        run.draft_length.observe(timing)
    return state, next_token, done, timing


def _drop_finished(active: list[int], done: list[bool], state, pending, proposer):
    """The batch without its finished rows: (active rows, target state, pending tokens [B]); the
    proposer drops them too. Nothing is copied when no row finished."""
    keep = [i for i in range(len(active)) if not done[i]]
    if len(keep) == len(active):
        return active, state, pending
    keep_idx = torch.tensor(keep, device=pending.device)
    if proposer is not None:
        proposer.select(keep_idx)
    return [active[i] for i in keep], kv.select_rows(state, keep_idx), pending[keep_idx]


def _draft_lengths(k: int, budget: list[int], state, window: int | None, device) -> tuple[int, torch.Tensor]:
    """(the round's k, each row's own k [B]): k capped by each row's budget, and by the slack a
    sliding window leaves (see _window_slack)."""
    room = torch.tensor(budget, device=device)  # [B]
    if window is not None and k > 0:
        k = min(k, _window_slack(state.mask, room + 1, window))
    lengths = room.clamp(min=0, max=k)
    return (int(lengths.max()) if k > 0 else 0), lengths


def _draft(proposer, k: int, lengths, params, uniforms, trees: bool):
    """Up to k draft tokens per row (a row's own cap in lengths [B]): (k, lengths, draft_tokens
    [B, k], draft_probs [B, k, V] or None, siblings [B, k, w] or None). A lookup draft may find
    fewer tokens than asked, or none: k and lengths say what exists to verify. trees: a proposal's
    siblings are verified as a tree (greedy, no sliding window)."""
    proposal = proposer.propose(k, lengths, params, uniforms)
    lengths = proposal.lengths
    k = int(lengths.max())
    draft_tokens = proposal.tokens[:, :k]  # [B, k]
    draft_probs = proposal.draft_probs[:, :k] if proposal.draft_probs is not None else None
    siblings = proposal.siblings[:, :k] if proposal.siblings is not None and k > 0 and trees else None
    return k, lengths, draft_tokens, draft_probs, siblings


def _prefill(model, prompts: list[list[int]], config: GenerationConfig, randoms, features: bool, layers, device):
    """Prefill every prompt (left-padded) and pick each row's first token: (state, first [B], the
    target's features over the prompts or None)."""
    params = config.sampling
    ids, mask = kv.left_pad(prompts, config.pad_token_id, device)
    state = kv.empty_state(len(prompts), device)
    feats = None
    if features:
        logits, state, feats = kv.forward_with_features(model, state, ids, mask, layers)
        logits = logits[:, -1:]
    else:
        logits, state = kv.forward(model, state, ids, mask, last_only=True)  # [B, 1, V]
    if params.greedy:
        first = logits[:, -1].argmax(-1)
    else:
        u = gather_uniforms(randoms, [0] * len(prompts), 1, device)  # [B, 1, 3]
        first = sample_from(logits_to_probs(logits[:, -1], params), u[:, 0, SAMPLE])
    return state, first, feats


def _verify_chain(model, state, step_ids, draft_tokens, draft_probs, lengths, params, uniforms, features: bool,
                  layers):
    """One target pass over each row's pending token and its draft chain, then verification and
    rollback: (n accepted [B], the target's next token [B], state, features of the pass or None).

    step_ids [B, k+1]; draft_tokens [B, k]; lengths [B] (a row's own k); uniforms [B, k+1, 3] or
    None (greedy). Cache invariant after the rollback: a row keeps its pending token and its n
    accepted draft tokens; the slots after them are garbage (cache.py)."""
    k = step_ids.shape[1] - 1
    feats = None
    if features:
        logits, state, feats = kv.forward_with_features(model, state, step_ids, torch.ones_like(step_ids), layers)
    else:
        logits, state = kv.forward(model, state, step_ids, torch.ones_like(step_ids))  # [B, k+1, V]
    if k == 0:
        n = torch.zeros(step_ids.shape[0], dtype=torch.long, device=step_ids.device)
        if params.greedy:
            return n, logits[:, -1].argmax(-1), state, feats
        return n, sample_from(logits_to_probs(logits[:, -1], params), uniforms[:, 0, SAMPLE]), state, feats
    if params.greedy:
        n, next_token = greedy_verify(logits, draft_tokens, lengths)
    else:
        target_probs = logits_to_probs(logits, params)  # [B, k+1, V]
        n, next_token = rejection_verify(target_probs, draft_probs, draft_tokens, lengths, uniforms[:, : k + 1])
    keep_cols = torch.arange(k + 1, device=step_ids.device)[None, :] <= n[:, None]  # [B, k+1]
    return n, next_token, kv.rollback(state, keep_cols), feats


def _emit_round(outputs: list[RowOutput], row_max: list[int], n, next_token, draft_tokens, lengths, eos: set[int],
                stop_check: StopCheck | None) -> tuple[list[list[int]], list[bool], tuple[int, int, int]]:
    """Emit each active row's n accepted draft tokens and the target's token, applying stop rules,
    and count the round: (tokens emitted per row, whether each row is done, (proposed, accepted,
    rejections)). draft_tokens [B, k] or None (a plain round); n, next_token, lengths [B]."""
    n_list, next_list = n.tolist(), next_token.tolist()
    draft_list = draft_tokens.tolist() if draft_tokens is not None else None
    len_list = lengths.tolist()
    emitted, done = [], []
    proposed = accepted_total = rejections = 0
    for i, out in enumerate(outputs):
        new = (draft_list[i][: n_list[i]] if draft_list is not None else []) + [next_list[i]]
        before = len(out.token_ids)
        done.append(_emit(out, new, eos, row_max[i], stop_check))
        emitted.append(new)
        if draft_list is not None and len_list[i] > 0:
            accepted = min(n_list[i], len(out.token_ids) - before)  # only tokens really emitted
            rejected = int(n_list[i] < len_list[i])
            out.stats.draft_tokens += len_list[i]
            out.stats.accepted_tokens += accepted
            out.stats.spec_rounds += 1
            out.stats.rejections += rejected
            proposed, accepted_total, rejections = proposed + len_list[i], accepted_total + accepted, rejections + rejected
    return emitted, done, (proposed, accepted_total, rejections)


def _verify_tree(model, state, pending, spine, siblings, lengths, layers=None):
    """Greedy verification of a draft tree in one target pass (Medusa's tree attention; EAGLE's
    drafts use it too, with the layers their features come from).

    The tree is the chain `spine` [B, k] (each head's first choice) plus, at each depth d, w-1
    other candidates `siblings` [B, k, w-1] that continue the spine's first d-1 tokens. Columns:
    pending, spine 1..k, then the siblings depth by depth; node positions are their depths, and
    each node attends to the row's cache, pending, the spine above it and itself. The row accepts
    the spine while it matches the target's argmax; where the spine fails at depth d, a sibling
    equal to the target's token there is accepted too (and ends the path: siblings have no
    children). Rejected nodes become holes in the cache like rejected chain tokens, so the kept
    path may be non-contiguous in columns; positions are explicit, so nothing shifts.

    Returns (n, next_token, path tokens [B, k], state, path features [B, k+1, H]) in the chain's
    terms, so the rest of the round (emit, stats, proposer.accept) is unchanged.
    """
    B, k = spine.shape
    w1 = siblings.shape[2]
    device = spine.device
    depth = torch.cat([torch.arange(k + 1, device=device), torch.arange(1, k + 1, device=device).repeat_interleave(w1)])
    T = depth.shape[0]
    col = torch.arange(T, device=device)
    # Every node sees pending (column 0), itself, and the spine above it: spine node j sits in
    # column j, so those are the columns 1 .. depth-1.
    tree = (col[None, :] == 0) | (col[None, :] == col[:, None]) | ((col[None, :] >= 1) & (col[None, :] < depth[:, None]))
    ids = torch.cat([pending[:, None], spine, siblings.reshape(B, k * w1)], dim=1)
    positions = state.next_pos[:, None] + depth[None, :]
    logits, state, feats = kv.forward_tree(model, state, ids, positions, tree, layers)
    pred = logits.argmax(-1)  # [B, T]: the target's token after each node
    n_spine = accepted_prefix(spine == pred[:, :k], lengths)  # [B]
    # At depth n_spine + 1 (where the spine failed), does a sibling match the target's token?
    d_next = (n_spine + 1).clamp(max=k)
    sib_at = siblings.gather(1, (d_next - 1)[:, None, None].expand(B, 1, w1)).squeeze(1)  # [B, w-1]
    want = pred.gather(1, n_spine[:, None])  # [B, 1] the target's token after the accepted spine
    match = (sib_at == want) & (n_spine < lengths)[:, None]
    has = match.any(1)
    which = match.float().argmax(1)  # first matching sibling
    sib_col = 1 + k + (d_next - 1) * w1 + which  # [B]
    n = n_spine + has.long()
    last_col = torch.where(has, sib_col, n_spine)  # the column whose prediction comes next
    next_token = pred.gather(1, last_col[:, None]).squeeze(1)
    path = spine.clone()
    rows = torch.arange(B, device=device)
    path[rows[has], n_spine[has]] = sib_at[rows[has], which[has]]
    keep = torch.zeros(B, T, dtype=torch.bool, device=device)
    keep[:, : k + 1] = torch.arange(k + 1, device=device)[None, :] <= n_spine[:, None]  # pending + accepted spine
    keep[rows[has], sib_col[has]] = True  # and the accepted sibling
    state = kv.rollback(state, keep)
    path_cols = torch.arange(k + 1, device=device)[None, :].expand(B, k + 1).clone()
    path_cols[rows[has], n[has]] = sib_col[has]
    path_feats = feats.gather(1, path_cols[:, :, None].expand(B, k + 1, feats.shape[-1]))
    return n, next_token, path, state, path_feats


def _window_slack(mask: torch.Tensor, remaining: torch.Tensor, window: int) -> int:
    """The most draft tokens this round may verify while every row still attends to all its tokens.

    Sliding-window masks count cache columns, not tokens (transformers: key column c is visible
    from query column q when q - c < window), and speculation leaves holes in a row's columns. A
    row whose span (first real column to the cache's end) plus remaining tokens stays within the
    window never loses a token to the window, so attention is the full causal attention that
    unbatched decoding computes while it, too, stays inside the window (prompt + max_new <= window,
    which Engine.generate checks). Plain rounds keep each row's slack (window - span - remaining):
    the span grows by one as remaining falls by one. A round with k draft tokens lowers it by at
    most k (the cache grows by the longest accepted run + 1, the row advances by at least one), so
    capping k at the smallest slack keeps every slack at or above zero.
    """
    first_real = mask.argmax(1)  # every row has at least its prompt's first token
    span = mask.shape[1] - first_real
    return max(0, int((window - span - remaining).min()))


def _emit(out: RowOutput, tokens: list[int], eos: set[int], max_new: int, stop_check: StopCheck | None) -> bool:
    """Append tokens to a row in order, stopping at EOS, a stop string or max_new_tokens.

    Tokens after the stop are dropped even if the target accepted them in this round. Returns
    True when the row is finished.
    """
    for t in tokens:
        out.token_ids.append(t)
        if t in eos:
            out.stats.finish_reason = "stop"
            return True
        if stop_check is not None:
            hit = stop_check(out.token_ids)
            if hit is not None:
                out.stats.finish_reason, out.stop_string = "stop", hit
                return True
        if len(out.token_ids) >= max_new:
            out.stats.finish_reason = "length"
            return True
    return False
