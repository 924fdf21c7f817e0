"""The generate stage of a shard on an actor: its rows through the engine, under the decisions
of the actor's policy (policy/planner.py). What the backend declares picks the flow: the hf
engine runs one shard alone, in micro-batches, re-deciding after each (Calls.alone, here); one
that takes whole shards (vLLM, `whole_shard_calls`) runs a call's shards together, a look first
and then one engine call per decision (runner/together.py).

Calls keeps what generating needs between shards (the engine, the actor's policy, the costs it
measured per concurrency) and makes the engine call itself (run_block); ShardRunner
(runner/worker.py) owns it and does the other stages.
"""

from __future__ import annotations

import logging
import time

from ..engine.api import Backend, DraftLength, SamplingParams, row_seed
from ..policy import ActorPolicy, CostModelK, Costs, Decision, InterleavedSteps
from ..spec import JobSpec
from .faults import FaultPlan
from .logs import log_event
from .work import RowInput, ShardWork

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
        known = self.planner.steps.costs_by_batch
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

    def decide(self, work: ShardWork, batches_off: int = 0) -> Decision:
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
            decision = self.decide(work, off_batches)
            rule = self.draft_length(decision.k) if decision.speculate else None
            self.run_block([(work, r) for r in work.valid[work.done:work.done + bs]], decision, rule)
            off_batches = 0 if decision.speculate else off_batches + 1
            if self.faults:
                self.faults.reached(work.shard.shard, work.done)
        work.gen_s = time.perf_counter() - t0

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

    def run_block(self, batch: list[tuple[ShardWork, RowInput]], decision: Decision, rule) -> Decision:
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
