"""The driver: plan, check what is already done, run the rest (runner/dispatch.py), commit the job.

    result = submit(load_spec("jobs/summarize_legal.yaml"))
    result.failed  # shard ids that failed; rerun() redoes only shards not done

Rerun rules (DESIGN.md): a shard is done when its manifest says so and names a part with its
input's row count. A run against an output written by a different spec, or whose done shards'
inputs changed since, is refused unless force=True: the committed parts would be stale.
"""

from __future__ import annotations

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
from .plan import Shard, plan_shards
from .record import run_entry, status
from .signals import ctrl_c_kept, sigterm_as_interrupt, sigterm_seen
from .store import COUNTED, OutputStore, now_iso

log = logging.getLogger("batchspec.job")


def check_paths(spec: JobSpec, probe: bool = False) -> None:
    """Refuse an output inside the input; with probe, also one that cannot be written (tried)."""
    inp, out = spec.input.path.rstrip("/*"), spec.output.path.rstrip("/")
    if out == inp or out.startswith(inp.rstrip("/") + "/"):
        raise JobRefused(f"output {spec.output.path} is inside the input {spec.input.path}; parts would be read as input")
    if probe:
        problem = OutputStore(spec.output.path, spec.output.storage_options).writable_problem()
        if problem:
            raise JobRefused(problem)


def prepare(spec: JobSpec, force: bool = False,
            shards: list[Shard] | None = None) -> tuple[OutputStore, list[Shard], list[Shard], dict]:
    """(store, all shards, shards to run, manifests); raises JobRefused on a stale or unwritable output.
    `shards` is a plan the caller already made (validate's), saving a second read of every footer."""
    check_paths(spec, probe=True)
    store = OutputStore(spec.output.path, spec.output.storage_options)
    if shards is None:
        shards = plan_shards(spec.input.path, spec.input.storage_options, spec.input.max_rows_per_shard)
    try:
        manifests = store.manifests(keep=COUNTED)
        job = store.read_job()
    except Exception as e:  # the probe wrote, but reading failed: permissions, a broken job.json
        raise JobRefused(f"cannot read the output {spec.output.path}: {error_line(e)}") from e
    # One listing of the parts (not a HEAD request per shard on S3), shared by the checks and the todo list.
    done_manifests = store.committed_manifests(manifests)
    committed = [s for s in shards if s.shard in done_manifests]
    if job and not force:
        # A changed spec is refused only where it would mix outputs: with no shard committed (e.g. every
        # shard failed to load the model), the fixed spec simply replaces the old one.
        if committed and job.get("spec_hash") != spec.output_hash():
            raise JobRefused(
                f"{spec.output.path} holds output of a different spec (spec hash {job.get('spec_hash', '?')[:12]} vs "
                f"{spec.output_hash()[:12]}); use a new output path, or --force to overwrite shard by shard")
        changed = [s.shard for s in committed if manifests[s.shard].get("input") != s.fingerprint]
        if changed:
            raise JobRefused(
                f"input changed for {len(changed)} committed shard(s) ({', '.join(changed[:5])}); their output would be "
                "stale. Use --force to regenerate them")
    done = {s.shard for s in committed if s.has_every_row(manifests[s.shard])}  # store.shard_done, one HEAD fewer
    spec_hash = spec.output_hash()
    todo = [s for s in shards if force and s.is_stale(manifests.get(s.shard), spec_hash) or s.shard not in done]
    return store, shards, todo, manifests

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

        problems = local_path_problems(spec)  # at once; the rest on a thread while Ray starts
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
    try:
        with sigterm_as_interrupt():
            return run(RunPlan(spec, store, shards, todo, job_id, backend, t0, ray_s, lease, on_shard))
    except JobInterrupted:
        raise
    except KeyboardInterrupt:
        terminated = sigterm_seen.is_set()
        st = _interrupted(spec, store, shards, job_id, backend, "SIGTERM" if terminated else "Ctrl-C", lease)
        raise JobInterrupted(job_id, st, terminated=terminated) from None
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
            # The runner's next import (0.6 s), while Ray's processes start: on the driver's main
            # thread it would add to the job's wall time.
            import ray.data  # noqa: F401
        except BaseException as e:  # handed to the caller of result()
            self._error = e

    def result(self) -> list[str]:
        self.join()
        if self._error is not None:
            raise self._error
        return self._problems or []

def _interrupted(spec: JobSpec, store: OutputStore, shards: list[Shard], job_id: str, backend: BackendChoice, by: str,
                 lease: Lease | None = None) -> dict:
    st = status(spec.output.path, spec.output.storage_options)
    if lease is not None and lease.lost:
        # Another run holds the output now and job.json is its record: an interrupt of this
        # displaced run marked the holder's own run "interrupted" before.
        log_event(log, "job interrupted after its lease was lost", logging.WARNING, job=job_id, by=by, why=lease.lost)
        return st
    job = store.read_job() or {}
    runs = job.get("runs") or []
    run_entry(runs, job_id).update({"status": "interrupted", "interrupted_by": by, "finished_at": now_iso(),
                                     "done": st["shards"]["done"], "pending": st["shards"]["pending"] + st["shards"]["failed"]})
    job.update({"status": "interrupted", "runs": runs, "updated_at": now_iso()})
    store.write_job(job)
    log_event(log, "job interrupted", logging.WARNING, job=job_id, by=by, done=st["shards"]["done"],
              pending=st["shards"]["pending"], failed=st["shards"]["failed"])
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
