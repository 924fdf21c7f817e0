"""Ray for a job: start or join it, and what the shard actors need in their environment."""

from __future__ import annotations

import logging
import os

from ..errors import error_line
from ..spec import JobSpec
from .logs import quiet_foreign_loggers
from .outcome import JobRefused

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


    if ray.is_initialized():
        return False
    quiet_foreign_loggers()  # `import ray` installed its console handler; ray.init already logs
    address = address or os.environ.get("RAY_ADDRESS")
    passed = ("BATCHSPEC_LOG_FORMAT", "BATCHSPEC_LOG_LEVEL", "BATCHSPEC_CACHE", "BATCHSPEC_POLICY_MEMORY",
              "BATCHSPEC_FAULT_FILE", "HF_HUB_OFFLINE", "VLLM_LOGGING_LEVEL", "VLLM_CPU_KVCACHE_SPACE",
              "VLLM_CPU_OMP_THREADS_BIND", "OMP_WAIT_POLICY")
    if address:
        env = {"env_vars": {k: os.environ[k] for k in passed if k in os.environ}}
        problem = cluster_unreachable(address) or shadowed_package()
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
        worker_env = {**(worker_env or {}), **preload_package()}
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


def preload_package() -> dict[str, str]:
    """Ray puts the driver's working directory first on every worker's sys.path, so a folder named
    batchspec/ there (a checkout beside a pipeline, even an empty folder) was imported by the actors
    instead of the installed package: every shard failed with "cannot import name '__version__'
    from 'batchspec' (unknown location)". Workers that import batchspec when they start, before
    Ray adds that path (Ray's preload_python_modules), keep the installed one; submodules are then
    found through the package's own __path__, never through sys.path."""
    modules = [m for m in os.environ.get("RAY_preload_python_modules", "").split(",") if m]
    return {"RAY_preload_python_modules": ",".join([*modules, "batchspec"] if "batchspec" not in modules else modules)}


def shadowed_package() -> str | None:
    """For a Ray this process joins (whose workers it did not start, so preload_package cannot
    reach them): a line refusing the run when the working directory holds a batchspec entry that
    is not the package this process runs, which the workers on this machine would import."""
    import batchspec

    here = os.path.join(os.getcwd(), "batchspec")
    if not (os.path.isdir(here) or os.path.exists(here + ".py")):
        return None
    ours = os.path.dirname(os.path.realpath(batchspec.__file__ or ""))
    if os.path.realpath(here) == ours:
        return None  # a checkout of batchspec itself, run from its root: the same code
    return (f"the working directory holds {here}{'' if os.path.isdir(here) else '.py'}, which Ray's workers on "
            "this machine would import instead of the installed batchspec (Ray puts the driver's working "
            "directory first on their sys.path); run from another directory or rename it")


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
