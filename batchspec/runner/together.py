"""An actor call's shards on the vllm backend (`whole_shard_calls`), each under its own decision
in one continuous batch: a look at a sample of each shard's rows, each shard's own decision from
them, then one engine call per decision, so shards that agree share vLLM's batch. A call's time is
split among its shards by what their own rows cost, and what speculation saved on a shard is
measured from the same step lines (policy/planner.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from ..policy import ActorPolicy, Decision, own_acceptance, streams
from .calls import Calls
from .logs import log_event
from .work import RowInput, ShardWork

log = logging.getLogger("batchspec.worker")


def together(calls: Calls, works: list[ShardWork]) -> None:
    """Shards on the vllm backend, each under its own decision. auto: first a look (a sample of
    each shard's rows at k, at the call's concurrency, ActorPolicy.look), then each shard's own
    decision from its own rows' acceptance and the step costs at this concurrency; then one
    call per decision over the rest of their rows, so shards that agree share vLLM's
    continuous batch. A call's time is split among its shards by what their rows cost (_timed)."""
    for w in works:
        if calls.faults:
            calls.faults.reached(w.shard.shard, 0)
    works = [w for w in works if w.valid]
    spent = {id(w): 0.0 for w in works}
    rows = sum(len(x.valid) for x in works)
    for w in works:  # plain decoding, the saving's reference, would run all of them in one call
        w.plain_call = (rows, calls.concurrency(rows))
    looked = _look(calls, works, spent) if works and calls.learns_costs else {}
    groups: dict[tuple[bool, int], list[ShardWork]] = {}
    rows_left = sum(len(w.valid) - w.done for w in works)
    for w in works:
        if w.done == len(w.valid):
            continue
        if calls.learns_costs:
            assert w.profile is not None  # profiled when opened
            w.profile.expected_new_tokens = calls.expected_new(w)
            alpha, per_step, rows, new_tokens = looked.get(id(w), (None, None, 0, None))
            d = calls.planner.decide_own(w, alpha, rows, per_step, calls.concurrency(rows_left), new_tokens)
            log_event(log, f"policy: {d.reason}", job=calls.job_id, shard=w.shard.shard, at_row=w.done)
        else:
            d = calls.decide(w)
        groups.setdefault((d.speculate, d.k), []).append(w)
    for (speculate, k), members in groups.items():
        batch = [(w, r) for w in members for r in w.valid[w.done:]]
        rule = calls.draft_length(k, len(batch)) if speculate else calls.planner.plain_rule()
        _timed(calls, batch, members[0].decisions[-1], rule, spent)
    for w in works:
        w.gen_s = spent[id(w)]
        if calls.faults:
            calls.faults.reached(w.shard.shard, w.done)


def _look(calls: Calls, works: list[ShardWork], spent: dict[int, float]
          ) -> dict[int, tuple[float | None, float | None, int, float | None]]:
    """Run each shard's look rows (evenly spread over its rows) in one call at the call's
    concurrency, interleaved across shards, so that no shard's acceptance is another's; returns
    each shard's (own acceptance, tokens per verify step, rows, mean completion tokens) from them.
    With a plain engine apart, a wave of rows then runs plain on it (plain_look_sizes), timing the
    plain arm at the call's concurrency, until this run's plain steps reach it (needs_plain_look)."""
    c = calls.concurrency(sum(len(w.valid) for w in works))
    sizes = calls.planner.look_sizes([len(w.valid) for w in works], c)
    plain_sizes = (calls.planner.plain_look_sizes(sizes, [len(w.valid) for w in works], c)
                   if calls.planner.needs_plain_look(c) else [0] * len(works))
    sizes = [min(n, len(w.valid) - m) for w, n, m in zip(works, sizes, plain_sizes)]
    for w, n, m in zip(works, sizes, plain_sizes):
        _spread_first(w, n, m)
    batch = [(w, w.valid[i]) for i in range(max(sizes)) for w, n in zip(works, sizes) if i < n]
    decision, rule = calls.planner.look(len(batch), len(works))
    _run_look(calls, works, batch, decision, rule, spent)
    if any(plain_sizes):  # rows of the shards, plain on the engine without speculation
        plain = [(w, w.valid[n + i]) for i in range(max(plain_sizes)) for w, n, m in zip(works, sizes, plain_sizes)
                 if i < m]
        _run_look(calls, works, plain, *calls.planner.plain_look(len(plain), len(works)), spent)
    k = decision.k
    out = {}
    for w, n, m in zip(works, sizes, plain_sizes):
        total = n + m
        stats = [w.results[r.row_index][0].stats for r in w.valid[:n] if r.row_index in w.results]
        alpha, per_step = own_acceptance([(s.accepted_tokens, s.spec_rounds) for s in stats], k)
        lengths = [w.results[r.row_index][0].stats.completion_tokens for r in w.valid[:total] if r.row_index in w.results]
        new_tokens = sum(lengths) / len(lengths) if lengths else None
        out[id(w)] = (alpha, per_step, len(stats), new_tokens)
    return out


def _spread_first(work: ShardWork, at_k: int, plain: int) -> None:
    """Move at_k + plain of the shard's rows, evenly spread over it, to the front of its rows to
    generate: first the look's rows at k, then its plain ones, each arm's rows spread over the
    shard's prompt lengths alike (rows are sorted by prompt length)."""
    total = at_k + plain
    step = len(work.valid) / total
    picked = [int(i * step) for i in range(total)]
    to_plain = {picked[int(j * total / plain)] for j in range(plain)} if plain else set()
    dealt = [i for i in picked if i not in to_plain] + [i for i in picked if i in to_plain]
    rest = set(picked)
    work.valid[:] = [work.valid[i] for i in dealt] + [r for i, r in enumerate(work.valid) if i not in rest]


def _run_look(calls: Calls, works: list[ShardWork], batch: list[tuple[ShardWork, RowInput]], decision: Decision,
              rule, spent: dict[int, float]) -> None:
    """A look call, its decision recorded in every shard it looks at, from the row each is at."""
    for w in works:
        w.decisions.append(dataclasses.replace(decision, at_row=w.done))
        log_event(log, f"policy: {decision.reason}", job=calls.job_id, shard=w.shard.shard, at_row=w.done)
    _timed(calls, batch, decision, rule, spent, observed=not decision.speculate)


def _timed(calls: Calls, batch: list[tuple[ShardWork, RowInput]], decision: Decision, rule, spent: dict[int, float],
           observed: bool = True) -> None:
    """One call (_run_block), its measured time split among the shards it ran rows of by what
    their rows' own work cost (_row_shares), so a shard's time is its rows', not a share of the
    call by tokens. The log says what the call took against what the step lines priced it at:
    how far the cost model the decisions rest on is from whole calls (docs/policy.md). Its time over
    its price (not a look's at k) scales the plain price of the saving (measured_saving)."""
    t0 = time.perf_counter()
    calls.run_block(batch, decision, rule)
    seconds = time.perf_counter() - t0
    concurrency = min(len(batch), calls.concurrency(len(batch)))
    shares, priced = _row_shares(calls.planner, batch, concurrency)
    for key, share in shares.items():
        spent[key] += seconds * share
    if observed:  # a look at k (with plain blocks on one engine) scales nothing
        calls.planner.steps.observe_call(seconds, len(batch), concurrency, priced, plain=not decision.speculate)
    if priced:
        log_event(log, f"call: {len(batch)} rows at k={decision.k if decision.speculate else 0} took {seconds:.2f} s; "
                  f"the step lines priced them at {priced:.2f} s ({seconds / priced:.2f}x)", job=calls.job_id)


def _row_shares(planner: ActorPolicy, batch: list[tuple[ShardWork, RowInput]], concurrency: int
                ) -> tuple[dict[int, float], float | None]:
    """Each shard's share of a call: what its rows' own work cost (StepCosts.row_cost: verify
    steps at k, plain steps and prompt, priced with the step lines at the call's concurrency), by
    completion tokens where there are no lines, equal shares when nothing was generated; and the
    call's price, the sum of its rows' costs (None without lines)."""
    weights: dict[int, float] = {}
    priced = 0.0
    for w, r in batch:
        result = w.results.get(r.row_index)
        if result is None:
            continue
        s = result[0].stats
        cost = planner.steps.row_cost(s.prompt_tokens, s.completion_tokens, s.accepted_tokens, s.spec_rounds,
                                concurrency, result[1].speculate or s.spec_rounds > 0)
        weights[id(w)] = weights.get(id(w), 0.0) + (s.completion_tokens if cost is None else cost)
        priced += cost or 0.0
    total, shards = sum(weights.values()), {id(w) for w, _ in batch}
    return {key: weights.get(key, 0.0) / total if total else 1.0 / len(shards) for key in shards}, priced or None


def measured_saving(planner: ActorPolicy, work: ShardWork) -> dict | None:
    """What speculation saved on the shard's rows in this run (vllm): against all of them decoded plain
    in one call over the actor call's rows, once a plain call of that shape was timed
    (StepCosts.saving_against_plain, the look counted); else from its speculating rows' steps."""
    rows = [(o.stats.accepted_tokens, o.stats.spec_rounds, o.stats.prompt_tokens, concurrency)
            for o, _, concurrency in work.results.values() if o.stats.spec_rounds]
    if not rows:
        return {"seconds": 0.0, "low": 0.0, "high": 0.0, "rows": 0, "steps": 0, "basis": "no row speculated"}
    every = [(o.stats.prompt_tokens, o.stats.completion_tokens, work.plain_call[1] or c)
             for o, _, c in work.results.values()]
    stream = streams(*work.plain_call)
    saving = planner.steps.saving_against_plain(every, work.gen_s, stream) or planner.steps.saving(rows)
    return saving.to_json() if saving else None
