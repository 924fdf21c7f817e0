"""One shard's work on an actor, stage by stage: read and validate (runner/read.py), decide
(policy/), generate through the backend (engine/api.py), commit (runner/commit.py).

ShardRunner keeps what an actor keeps between shards: the backend, the policy with its acceptance
prior, the costs measured per concurrency, the node's memory. Tests and scripts call it without
Ray; runner/actor.py is the Ray actor around it.
"""

from __future__ import annotations

import functools
import gc
import logging
import time

import pyarrow as pa

from ..engine.api import Backend, DraftLength, SamplingParams, row_seed
from ..policy import (
    ActorPolicy,
    CostModelK,
    Costs,
    Decision,
    LengthProfile,
    Look,
    Policy,
    StepArms,
)
from ..policy import DecisionKind as Kind
from ..spec import JobSpec
from .commit import commit_shard, committed_already, fail_shard
from .faults import FaultPlan
from .logs import log_event, worker_id
from .memory import PolicyMemory
from .plan import Shard
from .read import RowInput, ShardReadError, ShardWork, read_shard, tokenized_rows
from .store import OUTPUT_SCHEMA, OutputStore, now_iso

log = logging.getLogger("batchspec.worker")


class ShardRunner:
    """Everything an actor keeps between shards: backend, policy (with its acceptance prior), store."""

    def __init__(self, spec: JobSpec, job_id: str, engine=None, calibrate: bool = True, backend: str | None = None):
        self.spec, self.job_id = spec, job_id
        m = spec.model
        self.backend_note = None  # why this actor runs another backend than the driver chose
        if engine is None:
            engine, self.backend_note = load_actor_backend(spec, job_id, backend)
        self.engine = engine  # a backend: engine.Engine (hf) or vllm_backend.VLLMBackend
        self.store = OutputStore(spec.output.path, spec.output.storage_options)
        # pyarrow imports pandas and pyarrow.compute on its first conversion. Done in the first
        # shard's commit, that import made it the slowest and costliest shard in the report; it is
        # start-up, so it happens here.
        pa.Table.from_pylist([], schema=OUTPUT_SCHEMA)
        sp = spec.speculation
        mode = "off" if m.draft.kind == "none" else sp.mode
        # vLLM with one engine: costs come from the steps of real calls (policy.StepArms), no calibration.
        measure_in_call = mode == "auto" and engine.learns_costs
        # The actor's decisions, and the state they rest on (policy/planner.py).
        self.planner = ActorPolicy(Policy(mode, k_default=sp.num_speculative_tokens,
                                          k_max=max(8, sp.num_speculative_tokens), measure_in_call=measure_in_call))
        self.policy = self.planner.policy
        self.calibrate = mode == "auto" and calibrate and not measure_in_call
        # What earlier runs measured on this node (runner/memory.py): the first call need not measure.
        self.memory = PolicyMemory.for_spec(spec, engine.name) if mode == "auto" else None
        if self.memory is not None:
            costs, prior, new_tokens, remembered = self.memory.load()
            self.planner.start_from(costs, prior, new_tokens, remembered, self.memory.recheck.due())
            if remembered:
                a = self.policy.prior.estimate
                log_event(log, f"policy: starting from what {remembered} measured on this node (costs at "
                          f"concurrency {', '.join(map(str, sorted(costs))) or 'none'}, acceptance "
                          f"{'unknown' if a is None else f'{a:.2f}'})", job=job_id)
        self.worker = worker_id()
        self.faults = FaultPlan.from_env()  # None unless a reliability test set BATCHSPEC_FAULT_FILE

    @property
    def learns_costs(self) -> bool:
        """The policy's costs come from the steps of real calls (the policy measures in the call)."""
        return self.planner.learns_costs

    def concurrency(self, rows: int) -> int:
        """Rows the backend runs at once for this shard: the micro-batch (hf), or the shard up to
        vLLM's max_num_seqs, rounded down to a power of two so shards of similar size share costs."""
        if not self.engine.whole_shard_calls:
            return self.spec.resources.batch_size
        n = max(1, min(rows, self.engine.max_batch))
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

    def draft_length(self, k: int, rows: int = 0, strict: bool = False) -> DraftLength | StepArms:
        """The rule that picks k inside a speculative call over `rows` rows (ActorPolicy.draft_length)."""
        return self.planner.draft_length(k, self.concurrency(rows), self.engine.per_round_k,
                                         self.spec.speculation.adaptive, strict)

    def run(self, shard: Shard) -> dict:
        """Process one shard and commit it; returns the shard manifest (also written to the store)."""
        return self.run_many([shard])[0]

    def run_many(self, shards: list[Shard]) -> list[dict]:
        """Process shards and commit each one; returns their manifests, in order.

        On the vllm backend, shards that get the same decision share one engine call, so vLLM's
        continuous batching sees all their rows at once (a shard is still profiled, decided,
        committed and retried alone). Any failure fails its shard alone (all shards of a shared call
        when the call itself fails): the manifest records the error, when the store can be reached
        at all, and the actor moves on."""
        out: dict[str, dict] = {}
        works = []
        for shard in shards:
            try:
                done, previous = committed_already(self.store, shard, self.spec.output_hash(), self.job_id)
                if done:
                    out[shard.shard] = previous
                    continue
                work = self._open(shard, previous)
            except Exception as e:
                out[shard.shard] = fail_shard(self.store, self.job_id, self.worker, shard, e)
                continue
            if isinstance(work, dict):  # unreadable input: already a failed manifest
                out[shard.shard] = work
            else:
                works.append(work)
        together = self.engine.whole_shard_calls and len(works) > 1
        for group in ([works] if together else [[w] for w in works]):
            try:
                self._generate_together(group) if together else self._generate(group[0])
            except Exception as e:  # OOM, a dead engine, a bug: the shards of this call fail, the job goes on
                for w in group:
                    out[w.shard.shard] = fail_shard(self.store, self.job_id, self.worker, w.shard, e)
        works = [w for w in works if w.shard.shard not in out]
        for w in works:
            try:
                out[w.shard.shard] = commit_shard(w, self.store, self.engine, self.job_id, self.worker,
                                                  self.backend_note, self.policy.costs)
            except Exception as e:
                out[w.shard.shard] = fail_shard(self.store, self.job_id, self.worker, w.shard, e)
        if self.memory is not None and works:
            p, plan = self.policy, self.planner
            self.memory.save(plan.costs_by_batch, p.prior, p.new_tokens_seen, self.job_id, plan.outcome)
            plan.remembered = None  # from here on the decisions rest on this run's own measurements too
        return [out[s.shard] for s in shards]

    def _open(self, shard: Shard, previous: dict | None = None) -> ShardWork | dict:
        """Read, validate and tokenize a shard (previous: its manifest, read here when not given);
        a failed manifest when its input cannot be read."""
        started, t0 = now_iso(), time.perf_counter()
        if previous is None:
            previous = self.store.read_json(self.store.manifest_path(shard.shard)) or {}
        attempt = int(previous.get("attempts", 0)) + 1
        base = {"shard": shard.shard, "job_id": self.job_id, "input": shard.fingerprint, "path": shard.path,
                "row_start": shard.row_start, "row_end": shard.row_end, "attempts": attempt, "worker": self.worker,
                "spec_hash": self.spec.output_hash(), "started_at": started}
        try:
            table = read_shard(shard, self.spec)
        except ShardReadError as e:
            log_event(log, f"shard failed: {e}", logging.WARNING, job=self.job_id, shard=shard.shard)
            manifest = {**base, "status": "failed", "error": str(e), "rows_in": None, "finished_at": now_iso()}
            self.store.write_manifest(shard.shard, manifest)
            return manifest
        rows, valid = tokenized_rows(table, shard, self.spec, self.engine)
        work = ShardWork(shard, base, attempt, table.num_rows, rows, valid, time.perf_counter() - t0)
        work.profile = LengthProfile([len(r.token_ids) for r in valid], self.expected_new(work))
        return work

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

    def _generate(self, work: ShardWork) -> None:
        """One shard alone. hf: micro-batches of batch_size, re-deciding after each. vllm: the rest of
        the shard in one call (continuous batching), after a short probe when no acceptance is known."""
        if self.faults:
            self.faults.reached(work.shard.shard, 0)
        work.calibrate_s = self.calibrate_for(len(work.valid), [r.token_ids for r in work.valid])
        bs, off_batches, t0 = self.spec.resources.batch_size, 0, time.perf_counter()
        while work.done < len(work.valid):
            decision = self._decide(work, off_batches)
            whole = self.engine.whole_shard_calls
            if whole:
                ((_, decision),) = self.planner.check_remembered([(work, decision)],
                                                                 self.concurrency(len(work.valid) - work.done))
            if whole and decision.probes:
                self._probe(work, decision)
                continue
            batch = work.valid[work.done:] if whole else work.valid[work.done:work.done + bs]
            self._generate_block([(work, r) for r in batch], decision)
            off_batches = 0 if decision.speculate else off_batches + 1
            if self.faults:
                self.faults.reached(work.shard.shard, work.done)
        work.gen_s = time.perf_counter() - t0

    def _generate_together(self, works: list[ShardWork]) -> None:
        """Several shards on the vllm backend: a probe first if this actor has seen no acceptance yet,
        then each shard's own decision, and one call per distinct (on/off, k) over all their rows.
        A shared call's time is split among its shards by their completion tokens."""
        for w in works:
            if self.faults:
                self.faults.reached(w.shard.shard, 0)
        works = [w for w in works if w.valid]
        if works:
            works[0].calibrate_s = self.calibrate_for(sum(len(w.valid) for w in works),
                                                      [r.token_ids for w in works for r in w.valid])
        spent: dict[int, float] = {}
        if works and self.policy.prior.estimate is None:
            first, t0 = works[0], time.perf_counter()
            decision = self._decide(first)
            if decision.probes:
                self._probe(first, decision)
                spent[id(first)] = time.perf_counter() - t0
        groups: dict[tuple, list] = {}
        decided = self.planner.joint([(w, self._decide(w)) for w in works if w.done < len(w.valid)])
        rows_left = sum(len(w.valid) - w.done for w, _ in decided)
        for w, d in self.planner.check_remembered(decided, self.concurrency(rows_left)):
            groups.setdefault((d.speculate, d.k), []).append((w, d))
        for members in groups.values():
            t0 = time.perf_counter()
            rows = [(w, r) for w, _ in members for r in w.valid[w.done:]]
            before = {id(w): w.completion_tokens() for w, _ in members}
            self._generate_block(rows, members[0][1])
            gained = {id(w): w.completion_tokens() - before[id(w)] for w, _ in members}
            total = sum(gained.values()) or 1
            for w, _ in members:
                spent[id(w)] = spent.get(id(w), 0.0) + (time.perf_counter() - t0) * gained[id(w)] / total
        for w in works:
            w.gen_s = spent.get(id(w), 0.0)
            if self.faults:
                self.faults.reached(w.shard.shard, w.done)

    def _probe(self, work: ShardWork, decision: Decision, tokens: int = 16) -> None:
        """vllm: measure acceptance with a short look (the first batch_size rows, `tokens` new tokens
        each, speculating at the probe's k), then discard it; the rows are generated in full with the
        decision it informs. A full-length probe would cost a whole low-concurrency call, a
        quarter of the demo job's generation. Greedy rows come out the same; seeded sampled rows
        too, since vLLM seeds each request."""
        rows = work.valid[:self.spec.resources.batch_size]
        self._call(rows, tokens, True, decision.k)
        decision.look = Look(tokens, len(rows))

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
        measured = draft_length.acceptance() if isinstance(draft_length, StepArms) else {}
        if measured:
            # vLLM: the acceptance the cost model needs is what the call's steps delivered
            # (policy.acceptance_for), not the drafts' hit rate: an n-gram draft that often proposes
            # nothing has a fair hit rate on what it proposes, and from that the model predicted a
            # speedup where its steps ran slower than plain ones.
            trials = sum(t.accepted + t.rejections for t in res.rounds)
            for alpha in measured.values():
                self.policy.prior.observe(alpha * trials, (1 - alpha) * trials)
        elif not isinstance(draft_length, CostModelK):
            for t in res.rounds:
                self.policy.observe_round(t.k, t.draft_s, t.target_s, t.accepted, t.rejections)
        return outs

    def _generate_block(self, batch: list[tuple[ShardWork, RowInput]], decision: Decision) -> Decision:
        """One engine call over rows (possibly of several shards) under one decision; records each
        row's result in its shard and feeds what the call measured to the policy. Returns the
        decision the rows ran under (what a measuring call kept)."""
        rule = self.draft_length(decision.k, len(batch)) if decision.speculate else None
        measuring = isinstance(rule, StepArms) and len(rule.arms) > 1
        checking = decision.kind is Kind.CHECKING and isinstance(rule, StepArms) and rule.guard is not None
        if (measuring or checking) and len(batch) > self.engine.max_batch:
            # Measuring needs clean steps at the call's full concurrency, and a call of more rows
            # than the engine runs at once has almost none: as rows finish, every step admits the
            # next ones. Its first max_num_seqs rows measure; the rest follow in one call under
            # what they kept, recorded in the manifests of their shards too. A check of a
            # remembered "off" is done on those rows too, so that the draft reads only their
            # prompts when the "off" still holds.
            first, batch = batch[:self.engine.max_batch], batch[self.engine.max_batch:]
            if checking:
                first_rule = self.planner.checking_rule(decision, _lengths(first), self.concurrency(len(first)))
            else:
                first_rule = self.draft_length(decision.k, len(first), strict=True)
            kept = self._run_block(first, decision, first_rule)
            if kept is not decision:
                measured = {id(w) for w, _ in first}
                _record(self.job_id, [(w, r) for w, r in batch if id(w) not in measured], kept)
            decision = kept
            rule = self.draft_length(decision.k, len(batch)) if decision.speculate else None
            if isinstance(rule, StepArms) and len(rule.arms) > 1:  # its costs were not kept: k as measured
                rule = StepArms((decision.k,))
        elif checking:
            rule = self.planner.checking_rule(decision, _lengths(batch), self.concurrency(len(batch)))
        return self._run_block(batch, decision, rule)

    def _run_block(self, batch: list[tuple[ShardWork, RowInput]], decision: Decision, rule) -> Decision:
        """The engine call itself under a draft-length rule; what the rows ran under is returned."""
        outs = self._call([r for _, r in batch], self.spec.generation.max_new_tokens, decision.speculate, rule)
        self.policy.observe_rows([o.stats.completion_tokens for o in outs if o.error is None])
        if isinstance(rule, StepArms):
            learnt = self.planner.learn(rule, decision, self.concurrency(len(batch)),
                                        [len(r.token_ids) for _, r in batch])
            if learnt is not decision:  # what the call's own steps decided: in each of its shards' manifests
                decision = _record(self.job_id, batch, learnt)
        concurrency = min(len(batch), self.concurrency(len(batch)))
        for (work, r), o in zip(batch, outs):
            if o.error is not None:
                r.error = o.error
            else:
                work.results[r.row_index] = (o, decision, concurrency)
            work.done += 1
        return decision



def load_actor_backend(spec: JobSpec, job_id: str, backend: str | None = None) -> tuple[Backend, str | None]:
    """The actor's backend (the driver's choice, or the spec's), and why it is another one when
    auto had to fall back (None otherwise)."""
    from ..engine.api import ModelLoadError
    from ..engine.backend import HF_DRAFT_KINDS, backend_for, load_backend
    from .checkpoints import local_checkpoints

    m = spec.model
    backend = backend or backend_for(spec).name
    load = functools.partial(load_backend, spec_model=m, k_default=spec.speculation.num_speculative_tokens,
                             sampled=spec.generation.temperature > 0, local_paths=local_checkpoints(m))
    try:
        return load(backend), None
    except ModelLoadError as e:
        # auto promises the backend that can serve the job. Which models vLLM serves shows only
        # when an engine starts (an architecture it lacks, or on CPU attention heads of 16), so the
        # actor falls back to the hf engine, which serves any transformers model, and says so in
        # its log and every manifest it writes.
        if backend != "vllm" or m.backend != "auto" or m.draft.kind not in HF_DRAFT_KINDS:
            raise
        note = f"auto: {str(e).splitlines()[0][:400]}; batchspec's own engine serves it"
        log_event(log, f"backend: {note}", logging.WARNING, job=job_id)
        gc.collect()  # the failed engine's memory, before the hf engine loads
        return load("hf"), note


def _record(job_id: str, batch: list, decision: Decision) -> Decision:
    """A decision taken inside a call, in the manifest of each shard the call ran rows of."""
    for work in {id(w): w for w, _ in batch}.values():
        work.decisions.append(decision)
        log_event(log, f"policy: {decision.reason}", job=job_id, shard=work.shard.shard, at_row=work.done)
    return decision


def _lengths(batch: list[tuple[ShardWork, RowInput]]) -> list[tuple[ShardWork, int]]:
    """Each row of a call as (its shard, its prompt length), as the planner reads a call."""
    return [(w, len(r.token_ids)) for w, r in batch]
