"""How an actor call's time is split among the shards it ran rows of (by what their rows' own
work cost, priced with the step lines), and what speculation saved on a shard, measured from the
same lines (vllm; policy/measured.py).
"""

from __future__ import annotations

import logging
import time

from ..policy import ActorPolicy, Decision, streams
from .calls import Calls
from .logs import log_event
from .work import RowInput, ShardWork

log = logging.getLogger("batchspec.worker")


def timed(calls: Calls, batch: list[tuple[ShardWork, RowInput]], decision: Decision, rule, spent: dict[int, float],
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
