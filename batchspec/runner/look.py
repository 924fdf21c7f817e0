"""The look of an actor call of several shards on the vllm backend (runner/together.py): rows of
each shard at k that measure its own acceptance, in two stages (a few rows of every shard first,
more only of the shards those do not settle), and with a plain engine apart a wave of rows plain
that times a plain step. Each shard is then decided from its own look rows (policy/planner.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from ..policy import Decision, DecisionKind, own_acceptance
from ..policy.planner import LOOK_FIRST
from .calls import Calls
from .logs import log_event
from .shares import timed
from .work import RowInput, ShardWork

log = logging.getLogger("batchspec.worker")

Looked = dict[int, tuple[float | None, float | None, int, float | None]]


def look(calls: Calls, works: list[ShardWork], spent: dict[int, float]) -> Looked:
    """Run the look; returns each shard's (own acceptance, tokens per verify step, look rows at k,
    mean completion tokens) from its look rows. First LOOK_FIRST rows of each shard at k (evenly
    spread over its rows, interleaved across shards, in one call at the call's concurrency), then,
    where needed (needs_plain_look), a wave of rows plain on the plain engine; then the rest of
    each shard's look share (look_sizes) at k, only for the shards whose first rows leave the
    decision open (ActorPolicy.settles): a shard that plainly loses, or plainly pays, is decided
    on a few rows instead of a whole share of the concurrency."""
    planner = calls.planner
    pending = [len(w.valid) - w.done for w in works]
    c = calls.concurrency(sum(pending))
    sizes = planner.look_sizes(pending, c)
    plain = planner.plain_look_sizes(sizes, pending, c) if planner.needs_plain_look(c) else [0] * len(works)
    sizes = [min(n, rows - m) for n, rows, m in zip(sizes, pending, plain)]
    first = [min(LOOK_FIRST, n) for n in sizes]
    for w, n, m in zip(works, first, plain):
        _spread_first(w, n, m)
    _run_look(calls, works, _dealt(works, first), *planner.look(sum(first), len(works)), spent)
    if any(plain):  # rows of the shards, plain on the engine without speculation
        _run_look(calls, works, _dealt(works, plain), *planner.plain_look(sum(plain), len(works)), spent)
    rest = calls.concurrency(sum(len(w.valid) - w.done for w in works))
    more = [n - f if n > f and not planner.settles(w, _look_rows(w), rest, _new_tokens(w)) else 0
            for w, n, f in zip(works, sizes, first)]
    if any(more):
        for w, n in zip(works, more):
            _spread_first(w, n, 0)
        unsettled = [w for w, n in zip(works, more) if n]
        _run_look(calls, unsettled, _dealt(works, more), *planner.look(sum(more), len(unsettled), more=True), spent)
    k = planner.policy.k_default
    out: Looked = {}
    for w in works:
        rows = _look_rows(w)
        alpha, per_step = own_acceptance(rows, k)
        out[id(w)] = (alpha, per_step, len(rows), _new_tokens(w))
    return out


def _look_rows(work: ShardWork) -> list[tuple[int, int]]:
    """(accepted tokens, verify steps) of the shard's rows that its look ran at k."""
    return [(o.stats.accepted_tokens, o.stats.spec_rounds) for o, d, _ in work.results.values()
            if d.kind is DecisionKind.LOOK]


def _new_tokens(work: ShardWork) -> float | None:
    """The mean completion tokens of the shard's rows generated so far (its look's, both arms)."""
    lengths = [o.stats.completion_tokens for o, _, _ in work.results.values()]
    return sum(lengths) / len(lengths) if lengths else None


def _dealt(works: list[ShardWork], sizes: Sequence[int]) -> list[tuple[ShardWork, RowInput]]:
    """The next `sizes` rows of each shard, interleaved across shards (no shard's rows all at the end)."""
    return [(w, w.valid[w.done + i]) for i in range(max(sizes, default=0)) for w, n in zip(works, sizes) if i < n]


def _spread_first(work: ShardWork, at_k: int, plain: int) -> None:
    """Move at_k + plain of the shard's rows not yet generated, evenly spread over them, to the
    front of what it generates next: first the rows at k, then the plain ones, each arm's rows
    spread over the shard's prompt lengths alike (rows are sorted by prompt length)."""
    total = at_k + plain
    rest = work.valid[work.done:]
    if not total or not rest:
        return
    step = len(rest) / total
    picked = [int(i * step) for i in range(total)]
    to_plain = {picked[int(j * total / plain)] for j in range(plain)} if plain else set()
    dealt = [i for i in picked if i not in to_plain] + [i for i in picked if i in to_plain]
    chosen = set(picked)
    work.valid[work.done:] = [rest[i] for i in dealt] + [r for i, r in enumerate(rest) if i not in chosen]


def _run_look(calls: Calls, works: list[ShardWork], batch: list[tuple[ShardWork, RowInput]], decision: Decision,
              rule, spent: dict[int, float]) -> None:
    """A look call, its decision recorded in every shard it looks at, from the row each is at."""
    for w in works:
        w.decisions.append(dataclasses.replace(decision, at_row=w.done))
        log_event(log, f"policy: {decision.reason}", job=calls.job_id, shard=w.shard.shard, at_row=w.done)
    timed(calls, batch, decision, rule, spent, observed=not decision.speculate)
