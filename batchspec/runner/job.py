"""The driver: plan, check what is already done, run the rest (runner/dispatch.py), commit the job.

    result = submit(load_spec("jobs/summarize_legal.yaml"))
    result.failed  # shard ids that failed; rerun() redoes only shards not done

What is left to run, and when a run is refused, is runner/todo.py's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable

from ..engine.backend import BackendChoice
from ..errors import error_line
from ..spec import JobSpec
from .cluster import actor_env_vars, actor_threads, init_ray
from .dispatch import RunPlan, run
from .lease import Lease, LeaseHeld
from .logs import log_event
from .outcome import JobInterrupted, JobRefused, JobResult
from .plan import Shard
from .record import job_record, run_entry, status
from .signals import ctrl_c_kept, sigterm_as_interrupt, sigterm_seen
from .store import now_iso
from .todo import input_problem, prepare

log = logging.getLogger("batchspec.job")


def submit(spec: JobSpec, address: str | None = None, force: bool = False,
           on_shard: Callable[[dict], None] | None = None, on_plan: Callable[[list[Shard], list[Shard]], None] | None = None,
           lease_timeout_s: float | None = None, worker_logs: bool = False) -> JobResult:
    """Run every shard that is not done; commit manifests, job.json and, when all are done, _SUCCESS.

    force: proceed despite a changed spec or changed inputs, and take over another run's lease.
    On KeyboardInterrupt (Ctrl-C) the run is recorded as interrupted in job.json, the lease is
    released, and the interrupt propagates (raised as JobInterrupted, with what is done)."""
    t0 = time.perf_counter()
    store, shards, todo, manifests = prepare(spec, force)
    backend = pick_backend(spec)
    job_id = f"{spec.name}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    ray_s = None
    if todo:
        from .preflight import local_path_problems

        # At once: model paths, and input that no shard of a new run could use; the rest of the model
        # checks on a thread while Ray starts.
        problems = [*local_path_problems(spec), *filter(None, [input_problem(spec, shards, todo)])]
        if problems:
            raise JobRefused("; ".join(problems))
    try:  # before anything is written: a bad model or an unreachable cluster leave the output as it was
        if on_plan:
            on_plan(shards, todo)
        if todo:
            check = _ModelCheck(spec, backend.name)
            with ctrl_c_kept():
                t_ray = time.perf_counter()
                if init_ray(address, worker_logs=worker_logs, worker_env=actor_env_vars(backend.name, actor_threads(spec))):
                    ray_s = time.perf_counter() - t_ray
            problems = check.result()  # on the driver, not in every actor
            if problems:
                raise JobRefused("; ".join(problems))
            for note in check.notes:  # a sliding window that limits speculation; vLLM on CPU not exact
                log_event(log, note, logging.WARNING, job=job_id)
    except KeyboardInterrupt:  # nothing recorded yet (maybe not even job.json), so nothing to mark
        counts = {"total": len(shards), "done": len(shards) - len(todo), "pending": len(todo), "failed": 0}
        raise JobInterrupted(job_id, {"shards": counts}, recorded=False) from None
    lease = Lease(store, job_id, lease_timeout_s)
    try:
        taken = lease.acquire(force)
    except LeaseHeld as e:
        raise JobRefused(str(e)) from None
    if taken:
        log_event(log, taken, logging.WARNING, job=job_id)
    sigterm_seen.clear()  # an earlier run in this process may have been terminated
    plan = RunPlan(spec, store, shards, todo, job_id, backend, t0, ray_s, lease, on_shard)
    try:
        with sigterm_as_interrupt():
            return run(plan)
    except JobInterrupted:
        raise
    except KeyboardInterrupt:
        terminated = sigterm_seen.is_set()
        st = _ended(plan, "interrupted", {"interrupted_by": "SIGTERM" if terminated else "Ctrl-C"})
        raise JobInterrupted(job_id, st, terminated=terminated) from None
    except Exception as e:  # batchspec or Ray itself failed: recorded where the store answers, never left "running"
        with contextlib.suppress(Exception):  # a store that cannot be written must not hide the crash's cause
            _ended(plan, "crashed", {"error": error_line(e)})
        raise
    finally:
        lease.release()


class _ModelCheck(threading.Thread):
    """preflight.resolve_models, then `import ray.data`, on a thread of its own, started before Ray. On the hf backend it
    imports transformers and torch to read configs and tokenizers, seconds that would otherwise
    add to a local Ray's start (mostly waiting on the processes it spawns); side by side, the two
    overlap. A daemon: a Ctrl-C during Ray's start does not wait for it; signals go to the main
    thread only, so none lands inside its imports."""

    def __init__(self, spec: JobSpec, backend: str):
        super().__init__(name="batchspec-model-check", daemon=True)
        self.spec, self.backend = spec, backend
        self.notes: list[str] = []  # what validate would note about the models; the driver logs them
        self._problems: list[str] | None = None
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        from .preflight import resolve_models

        try:
            self._problems = resolve_models(self.spec, self.backend, self.notes)
            # The runner's next import, while Ray's processes start: on the driver's main
            # thread it would add to the job's wall time.
            import ray.data  # noqa: F401
        except BaseException as e:  # handed to the caller of result()
            self._error = e

    def result(self) -> list[str]:
        self.join()
        if self._error is not None:
            raise self._error
        return self._problems or []

def _ended(plan: RunPlan, how: str, why: dict) -> dict:
    """Record a run that ended without a result (interrupted; crashed: batchspec or Ray raised) in
    job.json with its wall time, start-up and what it left done; returns status() of the output."""
    spec, store, job_id, lease = plan.spec, plan.store, plan.job_id, plan.lease
    if store.read_job() is None:
        store.write_job(job_record(spec, job_id, plan.shards, None, status="running", backend=plan.backend))
    st = status(spec.output.path, spec.output.storage_options)
    if lease is not None and lease.lost:
        # Another run holds the output now and job.json is its record: an interrupt of this
        # displaced run marked the holder's own run "interrupted" before.
        log_event(log, f"job {how} after its lease was lost", logging.WARNING, job=job_id, **why, lost=lease.lost)
        return st
    job = store.read_job() or {}
    runs = job.get("runs") or []
    counts, starts = st["shards"], plan.result.actor_starts if plan.result else []
    run_entry(runs, job_id).update({"status": how, **why, "finished_at": now_iso(), "wall_s": time.perf_counter() - plan.started,
                                     "startup": {"ray_s": plan.ray_s, "actors": starts},
                                     "done": counts["done"], "pending": counts["pending"] + counts["failed"]})
    job.update({"status": how, "runs": runs, "updated_at": now_iso()})
    store.write_job(job)
    log_event(log, f"job {how}", logging.ERROR if how == "crashed" else logging.WARNING, job=job_id, **why,
              done=counts["done"], pending=counts["pending"], failed=counts["failed"])
    return st


def pick_backend(spec: JobSpec) -> BackendChoice:
    """The backend and why, decided once on the driver so every actor runs the same engine. Auto on
    CPU with vLLM installed reads the target's config.json (no transformers) to see whether it
    uses latent attention; a config it cannot read counts as not."""
    from ..engine import backend as engines

    latent = False
    if spec.model.backend == "auto" and spec.resources.gpus_per_actor == 0 and engines.vllm_installed():
        from .checkpoints import latent_attention, read_config

        latent = latent_attention(read_config(spec.model.target, spec.model.storage_options))
    try:
        return engines.backend_for(spec, latent)
    except ValueError as e:
        raise JobRefused(str(e)) from None
