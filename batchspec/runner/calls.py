"""The generate stage of a shard on an actor: its rows through the engine, under the decisions
of the actor's policy (policy/planner.py). What the backend declares picks the flow: one that
takes whole shards (vLLM, `whole_shard_calls`) runs a call's shards together, a look first and
then one engine call per decision, so shards that agree share vLLM's continuous batch; the hf
engine runs one shard alone, in micro-batches, re-deciding after each.

Calls keeps what generating needs between shards (the engine, the actor's policy, the costs it
measured per concurrency); ShardRunner (runner/worker.py) owns it and does the other stages.
"""

from __future__ import annotations

import logging
import time

from ..engine.api import Backend, DraftLength, SamplingParams, row_seed
from ..policy import ActorPolicy, CostModelK, Costs, Decision, InterleavedSteps
from ..spec import JobSpec
from .faults import FaultPlan
from .logs import log_event
from .read import RowInput, ShardWork

log = logging.getLogger("batchspec.worker")


class Calls:
    """An actor's engine calls: the backend, the policy that decides them, the job's settings."""

    def __init__(self, spec: JobSpec, job_id: str, engine: Backend, planner: ActorPolicy, calibrate: bool,
                 faults: FaultPlan | None):
        self.spec, self.job_id, self.engine, self.planner = spec, job_id, engine, planner
        self.policy = planner.policy
        self.calibrate = calibrate  # measure costs before a shard's calls (hf with mode auto)
        self.faults = faults

    @property
    def learns_costs(self) -> bool:
        """The policy's costs come from the steps of real calls (the policy measures in the call)."""
        return self.planner.learns_costs

    def concurrency(self, rows: int) -> int:
        """Rows the backend runs at once for this shard: the micro-batch (hf), or the shard up to
        vLLM's max_num_seqs, rounded down to a power of two so shards of similar size share costs."""
        if not self.engine.whole_shard_calls:
            return self.spec.resources.batch_size
        cap = self.engine.max_batch
        n = max(1, rows if cap is None else min(rows, cap))
        return 1 << (n.bit_length() - 1)

    def calibrate_for(self, rows: int, sample: list[list[int]] | None = None) -> float:
        """Give the policy costs measured at this shard's concurrency, on a sample of its prompts;
        returns the seconds spent measuring (0 when already known), which the manifest reports and
        the cost report counts."""
        known = self.planner.costs_by_batch
        if self.learns_costs:  # what earlier calls at this concurrency measured, if any
            self.policy.costs = known.get(self.concurrency(rows)) if rows else None
            return 0.0
        if not self.calibrate or rows == 0:
            return 0.0
        b, t0 = self.concurrency(rows), time.perf_counter()
        measured = b not in known
        if measured:
            known[b] = Costs(**self.engine.measure_costs(b, sample))
        self.policy.calibrate(known[b])
        return time.perf_counter() - t0 if measured else 0.0

    def draft_length(self, k: int, rows: int = 0) -> DraftLength | InterleavedSteps:
        """The rule that picks k inside a speculative call over `rows` rows (ActorPolicy.draft_length)."""
        return self.planner.draft_length(k, self.concurrency(rows), self.engine.per_round_k,
                                         self.spec.speculation.adaptive)

    def expected_new(self, work: ShardWork) -> float:
        """What the job has seen rows produce, capped per row by the room its prompt leaves in the context."""
        seen = self.policy.expected_new_tokens(self.spec.generation.max_new_tokens)
        lengths = [len(r.token_ids) for r in work.valid]
        return sum(min(seen, self.engine.max_context - n) for n in lengths) / len(lengths) if lengths else seen

    def _decide(self, work: ShardWork, batches_off: int = 0) -> Decision:
        """The policy's next decision for this shard, recorded (and logged when it changes)."""
        assert work.profile is not None  # profiled when opened
        work.profile.expected_new_tokens = self.expected_new(work)
        d, changed = self.planner.decide(work, batches_off)
        if changed:
            log_event(log, f"policy: {d.reason}", job=self.job_id, shard=work.shard.shard, at_row=work.done)
        return d

    def alone(self, work: ShardWork) -> None:
        """One shard alone on the hf backend: micro-batches of batch_size, re-deciding after each."""
        if self.faults:
            self.faults.reached(work.shard.shard, 0)
        work.calibrate_s = self.calibrate_for(len(work.valid), [r.token_ids for r in work.valid])
        bs, off_batches, t0 = self.spec.resources.batch_size, 0, time.perf_counter()
        while work.done < len(work.valid):
            decision = self._decide(work, off_batches)
            rule = self.draft_length(decision.k) if decision.speculate else None
            self._run_block([(work, r) for r in work.valid[work.done:work.done + bs]], decision, rule)
            off_batches = 0 if decision.speculate else off_batches + 1
            if self.faults:
                self.faults.reached(work.shard.shard, work.done)
        work.gen_s = time.perf_counter() - t0

    def together(self, works: list[ShardWork]) -> None:
        """Shards on the vllm backend, each under its own decision. auto: first a look (a sample of
        each shard's rows at k, at the call's concurrency, ActorPolicy.look), then each shard's own
        decision from its own rows' acceptance and the step costs at this concurrency; then one
        call per decision over the rest of their rows, so shards that agree share vLLM's
        continuous batch. A call's time is split among its shards by their completion tokens."""
        for w in works:
            if self.faults:
                self.faults.reached(w.shard.shard, 0)
        works = [w for w in works if w.valid]
        spent = {id(w): 0.0 for w in works}
        looked: dict[int, tuple[float | None, float | None, int, float | None]] = {}
        if works and self.learns_costs:
            looked = self._look(works, spent)
        groups: dict[tuple[bool, int], list[ShardWork]] = {}
        rows_left = sum(len(w.valid) - w.done for w in works)
        for w in works:
            if w.done == len(w.valid):
                continue
            if self.learns_costs:
                assert w.profile is not None  # profiled when opened
                w.profile.expected_new_tokens = self.expected_new(w)
                alpha, per_step, rows, new_tokens = looked.get(id(w), (None, None, 0, None))
                d = self.planner.decide_own(w, alpha, rows, per_step, self.concurrency(rows_left), new_tokens)
                log_event(log, f"policy: {d.reason}", job=self.job_id, shard=w.shard.shard, at_row=w.done)
            else:
                d = self._decide(w)
            groups.setdefault((d.speculate, d.k), []).append(w)
        for (speculate, k), members in groups.items():
            batch = [(w, r) for w in members for r in w.valid[w.done:]]
            rule = self.draft_length(k, len(batch)) if speculate else None
            self._timed(batch, members[0].decisions[-1], rule, spent)
        for w in works:
            w.gen_s = spent[id(w)]
            if self.faults:
                self.faults.reached(w.shard.shard, w.done)

    def _look(self, works: list[ShardWork], spent: dict[int, float]
              ) -> dict[int, tuple[float | None, float | None, int, float | None]]:
        """Run each shard's look rows (evenly spread over its rows) in one call at the call's
        concurrency, interleaved across shards, so that no shard's acceptance is another's; returns
        each shard's (own acceptance, tokens per verify step, rows, mean completion tokens) from them."""
        c = self.concurrency(sum(len(w.valid) for w in works))
        sizes = self.planner.look_sizes([len(w.valid) for w in works], c)
        for w, n in zip(works, sizes):
            step = len(w.valid) / n
            picked = {int(i * step) for i in range(n)}
            w.valid[:] = [r for i, r in enumerate(w.valid) if i in picked] + [r for i, r in enumerate(w.valid) if i not in picked]
        batch = [(w, w.valid[i]) for i in range(max(sizes)) for w, n in zip(works, sizes) if i < n]
        decision, rule = self.planner.look(len(batch), len(works))
        for w in works:
            w.decisions.append(decision)
            log_event(log, f"policy: {decision.reason}", job=self.job_id, shard=w.shard.shard, at_row=0)
        self._timed(batch, decision, rule, spent)
        k = decision.k
        out = {}
        for w, n in zip(works, sizes):
            stats = [w.results[r.row_index][0].stats for r in w.valid[:n] if r.row_index in w.results]
            alpha, per_step = self.planner.own_acceptance([(s.accepted_tokens, s.spec_rounds) for s in stats], k)
            new_tokens = sum(s.completion_tokens for s in stats) / len(stats) if stats else None
            out[id(w)] = (alpha, per_step, len(stats), new_tokens)
        return out

    def _timed(self, batch: list[tuple[ShardWork, RowInput]], decision: Decision, rule, spent: dict[int, float]) -> None:
        """One call (_run_block), its measured time split among the shards it ran rows of by what
        their rows' own work cost (_row_shares), so a shard's time is its rows', not a share of the
        call by tokens."""
        t0 = time.perf_counter()
        self._run_block(batch, decision, rule)
        seconds = time.perf_counter() - t0
        for key, share in _row_shares(self.planner, batch, min(len(batch), self.concurrency(len(batch)))).items():
            spent[key] += seconds * share

    def _call(self, rows: list[RowInput], max_new: int, speculate: bool, draft_length):
        """engine.generate over rows with the job's sampling, stops and per-row seeds, each row capped
        by the room its prompt leaves in the context; what the call measured goes to the policy
        (unless a CostModelK rule already fed it every round)."""
        gen, engine = self.spec.generation, self.engine
        outs, res = engine.generate(
            [r.token_ids for r in rows], max_new, SamplingParams(gen.temperature, gen.top_k, gen.top_p), tuple(gen.stop),
            seeds=[row_seed(gen.seed, r.id) for r in rows], speculate=speculate, draft_length=draft_length,
            max_new_per_row=[min(max_new, engine.max_context - len(r.token_ids)) for r in rows],
        )
        if not isinstance(draft_length, CostModelK):
            for t in res.rounds:
                self.policy.observe_round(t.k, t.draft_s, t.target_s, t.accepted, t.rejections)
        return outs

    def _run_block(self, batch: list[tuple[ShardWork, RowInput]], decision: Decision, rule) -> Decision:
        """The engine call itself under a draft-length rule, over rows of one or more shards; records
        each row's result in its shard and feeds what the call measured to the policy. Returns what
        the rows ran under: `decision`, or what the call's own steps turned it into (stopped)."""
        outs = self._call([r for _, r in batch], self.spec.generation.max_new_tokens, decision.speculate, rule)
        self.policy.observe_rows([o.stats.completion_tokens for o in outs if o.error is None])
        if isinstance(rule, InterleavedSteps):
            learnt = self.planner.learn(rule, decision, self.concurrency(len(batch)),
                                        [len(r.token_ids) for _, r in batch])
            if learnt is not decision:  # what the call's own steps decided: in each of its shards' manifests
                decision = _record(self.job_id, batch, learnt)
        concurrency = min(len(batch), self.concurrency(len(batch)))
        # vllm: each row ran under its own shard's decision (the last recorded: its own, the look's,
        # or what the call's steps turned it into); hf: under the micro-batch's.
        own = self.engine.whole_shard_calls
        for (work, r), o in zip(batch, outs):
            if o.error is not None:
                r.error = o.error
            else:
                work.results[r.row_index] = (o, work.decisions[-1] if own and work.decisions else decision, concurrency)
            work.done += 1
        return decision


def _record(job_id: str, batch: list, decision: Decision) -> Decision:
    """A decision taken inside a call, in the manifest of each shard the call ran rows of."""
    for work in {id(w): w for w, _ in batch}.values():
        work.decisions.append(decision)
        log_event(log, f"policy: {decision.reason}", job=job_id, shard=work.shard.shard, at_row=work.done)
    return decision


def _row_shares(planner: ActorPolicy, batch: list[tuple[ShardWork, RowInput]], concurrency: int) -> dict[int, float]:
    """Each shard's share of a call: what its rows' own work cost (ActorPolicy.row_cost: verify
    steps at k, plain steps and prompt, priced with the step lines at the call's concurrency), by
    completion tokens where there are no lines, equal shares when nothing was generated."""
    weights: dict[int, float] = {}
    for w, r in batch:
        result = w.results.get(r.row_index)
        if result is None:
            continue
        s = result[0].stats
        cost = planner.row_cost(s.prompt_tokens, s.completion_tokens, s.accepted_tokens, s.spec_rounds,
                                concurrency, result[1].speculate or s.spec_rounds > 0)
        weights[id(w)] = weights.get(id(w), 0.0) + (s.completion_tokens if cost is None else cost)
    total, shards = sum(weights.values()), {id(w) for w, _ in batch}
    return {key: weights.get(key, 0.0) / total if total else 1.0 / len(shards) for key in shards}


def measured_saving(planner: ActorPolicy, work: ShardWork) -> dict | None:
    """What speculation saved on the shard's rows, measured in this run (ActorPolicy.saving; vllm);
    None where there is nothing to measure it with."""
    rows = [(o.stats.accepted_tokens, o.stats.spec_rounds, o.stats.prompt_tokens, concurrency)
            for o, _, concurrency in work.results.values() if o.stats.spec_rounds]
    if not rows:
        return {"seconds": 0.0, "low": 0.0, "high": 0.0, "rows": 0, "steps": 0, "basis": "no row speculated"}
    saving = planner.saving(rows)
    return saving.to_json() if saving else None
