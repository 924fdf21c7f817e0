"""The shard actor: one backend loaded per actor, a batch of shard descriptors per call.

A thin Ray actor around runner/worker.py's ShardRunner, which tests and scripts call without Ray
(runner/dataset.py maps calls onto it through Ray Data)."""

from __future__ import annotations

import logging
import os
import time

from ..spec import JobSpec
from .logs import log_event, worker_id
from .plan import Shard
from .worker import ShardRunner

log = logging.getLogger("batchspec.worker")


class ShardWorker:
    """A shard actor (runner/dataset.py): one engine per actor; each call runs a batch of shards."""

    def __init__(self, spec_json: str, job_id: str, threads: int = 0, backend: str | None = None):
        from .logs import configure_worker_logging

        started = time.perf_counter()
        configure_worker_logging()
        # vLLM logs at INFO through its own handler; follow batchspec's level (--quiet = WARNING).
        os.environ.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("BATCHSPEC_LOG_LEVEL", "INFO"))
        # ... and to stdout, which --worker-logs forwards to the driver's stdout: 45 raw lines per
        # demo run there beside --log-format json's records on stderr. On stderr they are records too.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        from ..engine.api import ModelLoadError

        self.runner: ShardRunner | None = None
        self.load_error = "model could not be loaded"  # its reason, set below when it happens
        try:
            self.runner = ShardRunner(JobSpec.model_validate_json(spec_json), job_id, backend=backend)
            # The engine that runs, not the one asked for: auto falls back to hf when vLLM cannot
            # serve the model. vLLM binds its own CPU threads.
            if threads and self.runner.engine.name == "hf":
                import torch

                torch.set_num_threads(threads)
        except ModelLoadError as e:
            # Raising here would make Ray restart the actor forever and end in a page of
            # ActorDiedError; every shard this actor gets fails with the reason instead.
            self.load_error = f"model could not be loaded: {e}"
            log_event(log, self.load_error, logging.ERROR, job=job_id)
        # Start-up, told to the driver with this actor's first call (job.py, run record "startup"):
        # the engine load, vLLM's import included; ready_at: when it could generate, in Unix time.
        self.start: dict | None = {"worker": worker_id(),
                                   "load_s": round(time.perf_counter() - started, 3), "ready_at": time.time()}

    def run(self, batch: list[dict]) -> list[dict]:
        """Shard descriptors (Shard.to_json) in; one manifest per shard out, in order. The first
        call of each actor (a restarted one included: it loaded again) carries the actor's start-up
        in its first manifest's ACTOR_START key, which the driver takes out."""
        shards = [Shard.from_json(s) for s in batch]
        if self.runner is None:
            out = [failed_manifest(s.shard, self.load_error) for s in shards]
        else:
            out = self.runner.run_many(shards)
        if self.start is not None and out:
            out[0] = {**out[0], ACTOR_START: self.start}
            self.start = None
        return out


ACTOR_START = "actor_start"  # not a manifest field: what ShardWorker.run adds for the driver


def failed_manifest(shard: str, error: str) -> dict:
    """What the driver hears of a shard no actor could run (the shard's own manifest, if any, is read after)."""
    return {"shard": shard, "status": "failed", "error": error}
