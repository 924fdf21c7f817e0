"""An actor call's shards on the vllm backend (`whole_shard_calls`), each under its own decision
in one continuous batch: a look at a sample of each shard's rows (runner/look.py), each shard's
own decision from them (policy/planner.py), then one engine call per decision, so shards that
agree share vLLM's batch. A call's time is split among its shards by what their own rows cost
(runner/shares.py).
"""

from __future__ import annotations

import logging

from .calls import Calls
from .logs import log_event
from .look import look
from .shares import timed
from .work import ShardWork

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
    looked = look(calls, works, spent) if works and calls.learns_costs else {}
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
        timed(calls, batch, members[0].decisions[-1], rule, spent)
    for w in works:
        w.gen_s = spent[id(w)]
        if calls.faults:
            calls.faults.reached(w.shard.shard, w.done)
