"""One run of a job: the shards to do go to the shard actors through Ray Data (runner/dataset.py),
each manifest is logged and shown as it lands, and the job is counted from the manifests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.backend import BackendChoice
from ..errors import error_line
from ..spec import JobSpec
from .cluster import actor_env_vars, actor_runtime_env, actor_threads
from .lease import Lease, LeaseLost
from .logs import log_event
from .outcome import JobResult
from .packing import calls_per_block, plan_calls
from .plan import Shard
from .record import job_record
from .store import COUNTED, OutputStore, now_iso, part_names

log = logging.getLogger("batchspec.job")


def still_ours(lease: Lease | None, job_id: str, done: int) -> None:
    """Raise LeaseLost once another run has taken the output over: this run writes no more."""
    if lease is not None and lease.lost:
        # INFO: the CLI's `error:` line tells it in text; JSON logs get this record as well.
        log_event(log, "lease lost", logging.INFO, job=job_id, why=lease.lost, done=done)
        raise LeaseLost(f"{lease.lost} (--force, or this run's heartbeat went stale); this run stopped after "
                        f"{done} shard(s) so that two runs do not write one output. What it committed stays; "
                        f"the run that holds the lease does the rest (batchspec status shows it)")


@dataclass
class RunPlan:
    """What one run of a job works from, decided before any shard runs (submit)."""

    spec: JobSpec
    store: OutputStore
    shards: list[Shard]  # every shard of the job
    todo: list[Shard]  # those this run generates
    job_id: str
    backend: BackendChoice
    started: float  # time.perf_counter() when submit began
    ray_s: float | None = None  # seconds to start or join Ray; None when it was up already
    lease: Lease | None = None
    on_shard: Callable[[dict], None] | None = None  # told each shard's manifest as it lands
    result: JobResult | None = None  # the run's result as it fills: an interrupted or crashed run records its start-up


def run(plan: RunPlan) -> JobResult:
    """Run the shards to do, then record the job from the manifests (the truth, not what came back)."""
    spec, store, shards, job_id, backend = plan.spec, plan.store, plan.shards, plan.job_id, plan.backend
    todo = {s.shard for s in plan.todo}  # a set: `in` over a list is quadratic in the job's shards
    result = JobResult(job_id, spec.output.path, len(shards), skipped=[s.shard for s in shards if s.shard not in todo],
                       ray_s=plan.ray_s)
    plan.result = result
    store.clear_success()
    store.write_job(job_record(spec, job_id, shards, store.read_job(), status="running", backend=backend))
    log_event(log, "job started", job=job_id, shards=len(shards), todo=len(plan.todo), output=spec.output.path,
              backend=backend.name, backend_reason=backend.reason)
    reported = _dispatch(plan, result) if plan.todo else {}
    _tally(plan, result, reported)
    result.wall_s = time.perf_counter() - plan.started
    status = "succeeded" if result.ok else "failed"
    still_ours(plan.lease, job_id, len(reported))
    store.write_job(job_record(spec, job_id, shards, store.read_job(), status=status, result=result, backend=backend))
    if result.ok:
        store.mark_success({"name": spec.name, "output": spec.output.path, "job_id": job_id, "spec_hash": spec.output_hash(),
                            "shards": len(shards), "rows": result.rows, "error_rows": result.error_rows, "finished_at": now_iso()})
    startup = {f"startup_{k}": round(v, 2) for k, v in (result.startup or {}).items() if v is not None}
    log_event(log, f"job {status}", job=job_id, done=len(result.done), failed=len(result.failed),
              skipped=len(result.skipped), seconds=round(result.wall_s, 1), **startup)
    return result


def _dispatch(plan: RunPlan, result: JobResult) -> dict[str, str | None]:
    """Send the shards to do to the shard actors (runner/dataset.py); returns each shard's error as its actor reported it
    (None when it reported none). Actor starts go into result; each manifest is logged and shown."""
    from .actor import ACTOR_START, ShardWorker, failed_manifest
    from .callmap import CrashLedger
    from .dataset import run_calls

    spec, job_id, backend = plan.spec, plan.job_id, plan.backend
    began_at = time.time() - (time.perf_counter() - plan.started)  # the run's start in wall-clock time
    reported: dict[str, str | None] = {}
    notes: set[str] = set()  # actors' backend fallbacks, logged once each
    res = spec.resources
    threads = actor_threads(spec)
    calls = plan_calls(plan.todo, backend.name, res, spec.model.vllm_args)
    batches = [[s.to_json() for s in call] for call in calls]
    # A plain actor runs its calls in its main thread, the thread that loaded the engine: from a
    # second thread (as Ray Data's default map runs them) OpenMP builds a second thread team,
    # and vLLM's CPU calls ran measurably slower (docs/history/benchmarks-log.md).
    actor_options = {"num_cpus": res.cpus_per_actor, "num_gpus": res.gpus_per_actor or None,
                     **actor_runtime_env(actor_env_vars(backend.name, threads))}
    init_kwargs = {"spec_json": spec.model_dump_json(), "job_id": job_id, "threads": threads, "backend": backend.name}
    ledger = CrashLedger(plan.store, job_id)
    for manifests_of_call in run_calls(ShardWorker, batches, res.actors, actor_options, init_kwargs, ledger,
                                       failed=lambda batch, why: [failed_manifest(s["shard"], why) for s in batch],
                                       max_size=res.max_actors, stats=lambda text: _keep_stats(plan, text),
                                       per_block=calls_per_block(calls, res.most_actors)):
        for manifest in manifests_of_call:
            start = manifest.pop(ACTOR_START, None)
            if start:  # ready_s: on a cluster, within the clocks' skew
                result.actor_starts.append({"worker": start["worker"], "load_s": start["load_s"],
                                            "ready_s": round(max(0.0, start["ready_at"] - began_at), 3),
                                            "ready_at_unix": round(start["ready_at"], 3)})
            reported[manifest["shard"]] = manifest.get("error")
            if manifest.get("backend_note") and manifest["backend_note"] not in notes:
                # The actors' own logs are their files; the driver says it once per reason.
                notes.add(manifest["backend_note"])
                log_event(log, f"backend: {manifest['backend_note']}", logging.WARNING, job=job_id,
                          shard=manifest["shard"])
            _log_shard(job_id, manifest, shown=plan.on_shard is not None)
            if plan.on_shard:
                plan.on_shard(manifest)
        still_ours(plan.lease, job_id, len(reported))  # the call's shards are committed; hand out no more
    return reported


def _keep_stats(plan: RunPlan, text: str) -> None:
    """Ray Data's stats of the run (per operator: tasks, wall and CPU time, rows, nodes used),
    kept beside the manifests, where `ray.data` would print them."""
    path = plan.store.meta_path("stats", f"{plan.job_id}.json")
    try:
        plan.store.write_json(path, {"job_id": plan.job_id, "ray_data": text.splitlines()})
    except Exception as e:  # the shards are committed; stats are not worth failing the job for
        log_event(log, f"Ray Data stats not kept: {error_line(e)}", logging.WARNING, job=plan.job_id)
        return
    log_event(log, "Ray Data stats kept", logging.DEBUG, job=plan.job_id, path=path)


def _tally(plan: RunPlan, result: JobResult, reported: dict[str, str | None]) -> None:
    """Count what is done from the manifests, re-read: they are the truth, not what came back
    through Ray."""
    manifests = plan.store.manifests(keep=COUNTED)
    parts, skipped = part_names(plan.store, manifests), set(result.skipped)
    for s in plan.shards:
        m = manifests.get(s.shard)
        if plan.store.shard_done(s, m, parts=parts):
            assert m is not None  # shard_done says it exists
            result.rows += m["rows_out"]
            result.error_rows += m.get("error_rows", 0)
            if s.shard not in skipped:
                result.done.append(s.shard)
                tok = m.get("tokens", {})
                result.completion_tokens += tok.get("completion_tokens", 0)
                result.accepted_tokens += tok.get("accepted_tokens", 0)
                result.draft_tokens += tok.get("draft_tokens", 0)
        else:
            result.failed[s.shard] = ((m or {}).get("error") or reported.get(s.shard)
                                      or "no manifest written (the worker did not finish)")


def _log_shard(job_id: str, m: dict, shown: bool = False) -> None:
    """The driver's line for a finished shard (actors log to their own files): in order, before
    the job's last line, with the figures a pipeline wants. A failed shard is a warning, unless a
    display (on_shard) already tells it to the same person: then it is logged at INFO."""
    tok = m.get("tokens") or {}
    if m.get("status") == "done":
        log_event(log, "shard done", job=job_id, shard=m["shard"], rows=m.get("rows_out"),
                  error_rows=m.get("error_rows", 0), completion_tokens=tok.get("completion_tokens", 0),
                  accepted_tokens=tok.get("accepted_tokens", 0), draft_tokens=tok.get("draft_tokens", 0),
                  attempts=m.get("attempts"))
    else:
        log_event(log, f"shard failed: {m.get('error')}", logging.INFO if shown else logging.WARNING, job=job_id,
                  shard=m["shard"], attempts=m.get("attempts"))
