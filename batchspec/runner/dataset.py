"""Shard calls through Ray Data: a dataset of calls, map_batches onto a pool of shard actors.

    for manifests in run_calls(ShardWorker, calls, size=2, actor_options={"num_cpus": 2},
                               init_kwargs={...}, ledger=CrashLedger(store, job_id),
                               failed=lambda call, why: [...]):
        ...  # the manifests of one call, in finishing order; failed(call, why) for a call no actor ran

One row per call (a call is one or more shard descriptors, job.plan_calls), one block per row, so
Ray Data hands each call whole to one actor. What Ray Data gives is what the runner uses:
scheduling onto the actor pool across nodes, streaming with backpressure (the driver holds the
manifests of the calls in flight, not the job's), restarting a killed actor and retrying its call
on another node when its node is gone, and its execution stats. A shard is read, decided,
generated and committed inside one call, so the manifests the driver reads back are the truth;
what comes back through Ray Data is only what the driver logs and shows.

Failure rules (every call comes back exactly once, as manifests or as failed(call, reason)):
1. A call that raises fails only its own shards; the actor keeps working.
2. An actor whose constructor raised fails every call it gets, in one line, and does not hang.
3. An actor killed mid-call is restarted by Ray and the call retried on it, on another node if its
   node is gone, for as long as it takes. Ray's own retry count cannot tell a lost node from an
   input that crashes the engine: a SIGKILLed node is not known dead for some seconds, and every
   restart placed on it in that time counts as a death (three in 8 s here), so the node's shards
   failed. The restarted actor counts instead, in a ledger under the output (CrashLedger): only a
   call it actually ran again counts. After ATTEMPTS deaths a call of several shards runs shard
   by shard, and a shard that kills its actor ATTEMPTS times alone fails, alone.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import error_line

if TYPE_CHECKING:
    from .store import OutputStore

ATTEMPTS = 3  # a call (then a shard alone) that kills its actor this many times is given up
KILLED = (f"the shard killed its actor {ATTEMPTS} times (out of memory, or a native crash on its input); "
          "the shard actor's log has why")


class CrashLedger:
    """What a call's restarted actors know of its crashes: one small JSON file per call that killed
    an actor, in the output's `_batchspec/crashes/<job_id>/`, written (through the store, whole or
    not at all) only by an actor that was restarted, so a run without crashes writes nothing.
    {"deaths": n, "running": shard run alone when the actor died, or null, "alone": {shard: deaths
    while run alone}}."""

    def __init__(self, store: OutputStore, job_id: str):
        self.store, self.job_id = store, job_id

    def _path(self, call: list) -> str:
        key = hashlib.sha256(json.dumps(call, sort_keys=True).encode()).hexdigest()[:24]
        return self.store.meta_path("crashes", self.job_id, f"{key}.json")

    def read(self, call: list) -> dict:
        return self.store.read_json(self._path(call)) or {"deaths": 0, "running": None, "alone": {}}

    def write(self, call: list, entry: dict) -> None:
        self.store.write_json(self._path(call), entry)


class CallMap:
    """The map_batches callable: one shard worker per Ray Data actor, one call per batch."""

    def __init__(self, worker_cls: type, init_kwargs: dict, ledger: CrashLedger):
        import ray

        # Restarted after a death: its first call is the call that was running then, retried.
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.ledger = ledger
        self.worker: Any = None
        self.dead = ""
        try:
            self.worker = worker_cls(**init_kwargs)
        except Exception as e:  # raised, Ray Data would restart the actor and fail the whole job
            self.dead = f"shard actor died: {error_line(e)}"

    def __call__(self, batch: dict) -> dict:
        out: dict[str, list] = {"index": [], "manifests": [], "error": []}
        for index, text in zip(batch["index"], batch["call"]):
            call, error = json.loads(text), self.dead
            manifests: list[dict] = []
            if self.worker is not None:
                try:
                    manifests, error = (self._retried(call) if self.restarted else self.worker.run(call)), ""
                except Exception as e:  # the call's shards fail; the actor keeps working
                    error = error_line(e)
            self.restarted = False
            out["index"].append(int(index))
            out["manifests"].append(json.dumps(manifests))
            out["error"].append(error)
        return out

    def _retried(self, call: list) -> list[dict]:
        """A call that killed the actor before: whole while it has killed it fewer than ATTEMPTS
        times, then shard by shard; a shard that kills it ATTEMPTS times alone fails."""
        entry = self.ledger.read(call)
        entry["deaths"] += 1
        if entry["running"] is not None:
            entry["alone"][entry["running"]] = entry["alone"].get(entry["running"], 0) + 1
            entry["running"] = None
        if entry["deaths"] < ATTEMPTS:
            self.ledger.write(call, entry)
            return self.worker.run(call)
        out = []
        for shard in call:
            sid = shard["shard"] if isinstance(shard, dict) else shard
            if len(call) == 1 or entry["alone"].get(sid, 0) >= ATTEMPTS:
                out.append({"shard": sid, "status": "failed", "error": KILLED})
                continue
            self.ledger.write(call, {**entry, "running": sid})
            out += self.worker.run([shard])
        self.ledger.write(call, entry)
        return out


def run_calls(worker_cls: type, calls: list[list[Any]], size: int, actor_options: dict, init_kwargs: dict,
              ledger: CrashLedger, failed: Callable[[list[Any], str], list[dict]]) -> Iterator[list[dict]]:
    """Run every call on `size` actors of worker_cls (called as worker.run(call)); yield each
    call's manifests as it finishes, or failed(call, reason)."""
    if not calls:
        return
    import ray.data

    from .logs import quiet_foreign_loggers

    quiet_foreign_loggers()  # `import ray.data` gave its logger a console handler of its own
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # batchspec draws its own (runner/progress.py)
    ctx.print_on_execution_start = False
    ctx.max_errored_blocks = -1  # a call Ray Data gives up on fails its shards, not the job
    options = dict(actor_options)
    runtime_env = options.pop("runtime_env", None)
    items = ray.data.from_items([{"index": i, "call": json.dumps(c)} for i, c in enumerate(calls)],
                                override_num_blocks=len(calls))
    # The engine runs in the actor's main thread, the thread that loaded it (enable_true_multi_threading
    # with one call at a time): from a second thread OpenMP builds a second thread team, and vLLM's CPU
    # calls ran measurably slower (docs/history/benchmarks-log.md). One call in flight per actor: the
    # first call of a restarted actor is then the one that was running when it died (CallMap).
    pool = ray.data.ActorPoolStrategy(size=min(size, len(calls)), enable_true_multi_threading=True,
                                      max_concurrent_calls_per_actor=1, max_tasks_in_flight_per_actor=1)
    with warnings.catch_warnings():
        # max_task_retries has no named parameter in Ray 2.60 and goes through ray_remote_args, which
        # Ray says it removes in 2.64; test_dataset's crashing call fails loudly if it stops working.
        warnings.filterwarnings("ignore", message=".*ray_remote_args. is deprecated")
        ds = items.map_batches(CallMap, batch_size=1, compute=pool, fn_constructor_kwargs={
            "worker_cls": worker_cls, "init_kwargs": init_kwargs, "ledger": ledger}, max_restarts=-1,
            max_task_retries=-1, runtime_env=runtime_env, **options)
    left = set(range(len(calls)))
    for row in ds.iter_rows():
        call = calls[row["index"]]
        left.discard(row["index"])
        yield failed(call, row["error"]) if row["error"] else json.loads(row["manifests"])
    for index in sorted(left):  # Ray Data dropped it (max_errored_blocks): what its log says
        yield failed(calls[index], "Ray Data gave up on the call (its log on the driver has why)")
