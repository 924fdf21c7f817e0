"""One shard's work on an actor, stage by stage: read and validate (runner/read.py), decide
(policy/), generate through the backend (engine/api.py), commit (runner/commit.py).

ShardRunner keeps what an actor keeps between shards: the backend, the policy with its acceptance
prior, the costs measured per concurrency, the node's memory. Tests and scripts call it without
Ray; runner/actor.py is the Ray actor around it.
"""

from __future__ import annotations

import logging
import time

import pyarrow as pa

from ..policy import ActorPolicy, LengthProfile, Policy
from ..spec import JobSpec
from .calls import Calls
from .commit import commit_shard, committed_already, earlier_errors, fail_shard
from .faults import FaultPlan
from .lease_state import taken_over_by
from .load import load_actor_backend
from .logs import log_event, worker_id
from .memory import PolicyMemory
from .plan import Shard
from .read import ShardReadError, read_shard, tokenized_rows
from .schema import OUTPUT_SCHEMA
from .shares import measured_saving
from .store import OutputStore, now_iso
from .together import together
from .work import ShardWork

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
        # vLLM: costs come from the steps of real calls (policy.InterleavedSteps), no calibration.
        measure_in_call = mode == "auto" and engine.learns_costs
        # The actor's decisions, and the state they rest on (policy/planner.py).
        self.planner = ActorPolicy(Policy(mode, k_default=sp.num_speculative_tokens,
                                          k_max=max(8, sp.num_speculative_tokens), measure_in_call=measure_in_call))
        self.planner.separate_plain = measure_in_call and engine.separate_plain
        self.policy = self.planner.policy
        # What earlier runs measured on this node (runner/memory.py): the first call need not measure.
        self.memory = PolicyMemory.for_spec(spec, engine.name) if mode == "auto" else None
        if self.memory is not None:
            costs, prior, new_tokens, remembered, points, prefill = self.memory.load()
            self.planner.start_from(costs, prior, new_tokens, remembered, points, prefill)
            if remembered:
                a = self.policy.prior.estimate
                log_event(log, f"policy: starting from what {remembered} measured on this node (costs at "
                          f"concurrency {', '.join(map(str, sorted(costs))) or 'none'}, "
                          f"{sum(map(len, points.values()))} clean steps, acceptance "
                          f"{'unknown' if a is None else f'{a:.2f}'})", job=job_id)
        self.worker = worker_id()
        faults = FaultPlan.from_env()  # None unless a reliability test set BATCHSPEC_FAULT_FILE
        self.calls = Calls(spec, job_id, engine, self.planner, mode == "auto" and calibrate and not measure_in_call,
                           faults)

    @property
    def learns_costs(self) -> bool:
        """The policy's costs come from the steps of real calls (the policy measures in the call)."""
        return self.planner.learns_costs

    def run(self, shard: Shard) -> dict:
        """Process one shard and commit it; returns the shard manifest (also written to the store)."""
        return self.run_many([shard])[0]

    def run_many(self, shards: list[Shard]) -> list[dict]:
        """Process shards and commit each one; returns their manifests, in order.

        On the vllm backend, each shard runs under its own decision and shards with the same decision
        share one engine call, so vLLM's continuous batching sees all their rows at once (a shard is
        still profiled, decided, committed and retried alone). Any failure fails its shard alone (all shards of a shared call
        when the call itself fails): the manifest records the error, when the store can be reached
        at all, and the actor moves on."""
        holder = taken_over_by(self.store, self.job_id)
        if holder:  # the run that holds the output does these; nothing is written for them here
            return [{"shard": s.shard, "status": "failed", "error": f"not run: job {holder} took the output over"}
                    for s in shards]
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
        shared = self.engine.whole_shard_calls
        for group in ([works] if shared else [[w] for w in works]):
            try:
                together(self.calls, group) if shared else self.calls.alone(group[0])
            except Exception as e:  # OOM, a dead engine, a bug: the shards of this call fail, the job goes on
                for w in group:
                    out[w.shard.shard] = fail_shard(self.store, self.job_id, self.worker, w.shard, e, w.base)
        works = [w for w in works if w.shard.shard not in out]
        for w in works:
            try:
                out[w.shard.shard] = commit_shard(w, self.store, self.engine, self.job_id, self.worker,
                                                  self.backend_note, self.policy.costs,
                                                  measured_saving(self.planner, w) if self.learns_costs else None)
            except Exception as e:
                out[w.shard.shard] = fail_shard(self.store, self.job_id, self.worker, w.shard, e, w.base)
        if self.memory is not None and works:
            p, plan = self.policy, self.planner
            self.memory.save(plan.steps.costs_by_batch, p.prior, p.new_tokens_seen, self.job_id, plan.steps.points,
                             plan.steps.prefill_row_token_s)
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
                "spec_hash": self.spec.output_hash(), "started_at": started, "earlier_errors": earlier_errors(previous)}
        try:
            table = read_shard(shard, self.spec)
        except ShardReadError as e:
            log_event(log, f"shard failed: {e}", logging.WARNING, job=self.job_id, shard=shard.shard)
            manifest = {**base, "status": "failed", "error": str(e), "rows_in": None, "finished_at": now_iso()}
            self.store.write_manifest(shard.shard, manifest)
            return manifest
        rows, valid = tokenized_rows(table, shard, self.spec, self.engine)
        work = ShardWork(shard, base, attempt, table.num_rows, rows, valid, time.perf_counter() - t0)
        work.profile = LengthProfile([len(r.token_ids) for r in valid], self.calls.expected_new(work))
        return work
