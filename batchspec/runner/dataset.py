"""Shard calls through Ray Data: a dataset of calls, map_batches onto a pool of shard actors.

    for manifests in run_calls(ShardWorker, calls, size=2, actor_options={"num_cpus": 2},
                               init_kwargs={...}, ledger=CrashLedger(store, job_id),
                               failed=lambda call, why: [...]):
        ...  # the manifests of one call, in finishing order; failed(call, why) for a call no actor ran

One row per call (a call is one or more shard descriptors, plan.plan_calls), a block of one or
more consecutive calls per Ray Data task (plan.calls_per_block: calls of a few rows go several to
a task, since a task costs Ray Data milliseconds to schedule), so each call goes whole to one
actor. What Ray Data gives is what the runner uses: scheduling onto the actor pool across nodes,
streaming with backpressure (the driver holds the manifests of the blocks in flight, not the
job's), restarting a killed actor and retrying its block on another node when its node is gone,
and its execution stats. A shard is read, decided,
generated and committed inside one call, so the manifests the driver reads back are the truth;
what comes back through Ray Data is only what the driver logs and shows.

Failure rules (every call comes back exactly once, as manifests or as failed(call, reason)):
1. A call that raises fails only its own shards; the actor keeps working.
2. An actor whose constructor raised fails every call it gets, in one line, and does not hang.
3. An actor killed mid-call is restarted by Ray and its block retried on it, on another node if
   its node is gone, for as long as it takes (calls of the block committed before the death are
   not generated again). Ray's own retry count cannot tell a lost node from an input that crashes
   the engine: a SIGKILLed node is not known dead for some seconds, and every restart placed on it
   in that time counts as a death (three in 8 s here), so the node's shards failed. The restarted
   actor counts instead, in a ledger under the output (CrashLedger): only a block it actually ran
   again counts. After ATTEMPTS deaths a block of several shards runs shard by shard, and a shard
   that kills its actor ATTEMPTS times alone fails, alone.
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

ATTEMPTS = 3  # a block (then a shard alone) that kills its actor this many times is given up
KILLED = (f"the shard killed its actor {ATTEMPTS} times (out of memory, or a native crash on its input); "
          "the shard actor's log has why")


class CrashLedger:
    """What a block's restarted actors know of its crashes: one small JSON file per block of calls
    that killed an actor, in the output's `_batchspec/crashes/<job_id>/`, written (through the
    store, whole or not at all) only by an actor that was restarted, so a run without crashes
    writes nothing. {"deaths": n, "running": shard run alone when the actor died, or null,
    "alone": {shard: deaths while run alone}}."""

    def __init__(self, store: OutputStore, job_id: str):
        self.store, self.job_id = store, job_id

    def _path(self, calls: list) -> str:
        key = hashlib.sha256(json.dumps(calls, sort_keys=True).encode()).hexdigest()[:24]
        return self.store.meta_path("crashes", self.job_id, f"{key}.json")

    def read(self, calls: list) -> dict:
        return self.store.read_json(self._path(calls)) or {"deaths": 0, "running": None, "alone": {}}

    def write(self, calls: list, entry: dict) -> None:
        self.store.write_json(self._path(calls), entry)


class CallMap:
    """The map_batches callable: one shard worker per Ray Data actor; a batch is one block of
    consecutive calls (one Ray Data task), run one after another."""

    def __init__(self, worker_cls: type, init_kwargs: dict, ledger: CrashLedger):
        import ray

        # Restarted after a death: its first block is the block that was running then, retried.
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.ledger = ledger
        self.worker: Any = None
        self.dead = ""
        try:
            self.worker = worker_cls(**init_kwargs)
        except Exception as e:  # raised, Ray Data would restart the actor and fail the whole job
            self.dead = f"shard actor died: {error_line(e)}"

    def __call__(self, batch: dict) -> dict:
        calls = [json.loads(text) for text in batch["call"]]
        results: list[tuple[list[dict], str]]
        if self.worker is None:
            results = [([], self.dead)] * len(calls)
        elif self.restarted:
            results = self._retried(calls)
        else:
            results = [self._run(call) for call in calls]
        self.restarted = False
        return {"index": [int(i) for i in batch["index"]], "manifests": [json.dumps(m) for m, _ in results],
                "error": [error for _, error in results]}

    def _run(self, call: list) -> tuple[list[dict], str]:
        try:
            return self.worker.run(call), ""
        except Exception as e:  # the call's shards fail; the actor keeps working
            return [], error_line(e)

    def _retried(self, calls: list[list]) -> list[tuple[list[dict], str]]:
        """A block that killed the actor before: whole while it has killed it fewer than ATTEMPTS
        times (its calls committed by then are not generated again), then shard by shard; a shard
        that kills it ATTEMPTS times alone fails."""
        entry = self.ledger.read(calls)
        entry["deaths"] += 1
        if entry["running"] is not None:
            entry["alone"][entry["running"]] = entry["alone"].get(entry["running"], 0) + 1
            entry["running"] = None
        if entry["deaths"] < ATTEMPTS:
            self.ledger.write(calls, entry)
            return [self._run(call) for call in calls]
        alone = sum(len(call) for call in calls) == 1
        out = []
        for call in calls:
            manifests: list[dict] = []
            for shard in call:
                sid = shard["shard"] if isinstance(shard, dict) else shard
                if alone or entry["alone"].get(sid, 0) >= ATTEMPTS:
                    manifests.append({"shard": sid, "status": "failed", "error": KILLED})
                    continue
                self.ledger.write(calls, {**entry, "running": sid})
                got, error = self._run([shard])
                manifests += got or [{"shard": sid, "status": "failed", "error": error}]
            out.append((manifests, ""))
        self.ledger.write(calls, entry)
        return out


def run_calls(worker_cls: type, calls: list[list[Any]], size: int, actor_options: dict, init_kwargs: dict,
              ledger: CrashLedger, failed: Callable[[list[Any], str], list[dict]],
              max_size: int | None = None, stats: Callable[[str], None] | None = None,
              per_block: int = 1) -> Iterator[list[dict]]:
    """Run every call on `size` actors of worker_cls (called as worker.run(call)), or on a pool
    Ray Data grows from `size` to `max_size` actors while calls wait and the cluster has room for
    another (and shrinks when they idle), `per_block` consecutive calls to a Ray Data task
    (plan.calls_per_block); yield each call's manifests as its task finishes, or failed(call,
    reason). stats(text): Ray Data's execution stats once every call is back."""
    if not calls:
        return
    import ray.data

    from .logs import quiet_foreign_loggers

    quiet_foreign_loggers()  # `import ray.data` gave its logger a console handler of its own
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # batchspec draws its own (runner/progress.py)
    ctx.print_on_execution_start = False
    ctx.max_errored_blocks = -1  # a call Ray Data gives up on fails its shards, not the job
    # Ray Data grows a pool when its calls in flight exceed 1.75 per actor slot; with one call in
    # flight per actor (below) that never happens, so it grows when every actor is busy instead.
    ctx.autoscaling_config.actor_pool_util_upscaling_threshold = 1.0
    options = dict(actor_options)
    runtime_env = options.pop("runtime_env", None)
    blocks = -(-len(calls) // max(1, per_block))
    items = ray.data.from_items([{"index": i, "call": json.dumps(c)} for i, c in enumerate(calls)],
                                override_num_blocks=blocks)
    # The engine runs in the actor's main thread, the thread that loaded it (enable_true_multi_threading
    # with one call at a time): from a second thread OpenMP builds a second thread team, and vLLM's CPU
    # calls ran measurably slower (docs/history/benchmarks-log.md). One task in flight per actor: the
    # first block of a restarted actor is then the one that was running when it died (CallMap).
    low, high = min(size, blocks), min(max(max_size or size, size), blocks)
    pool = ray.data.ActorPoolStrategy(min_size=low, max_size=high, enable_true_multi_threading=True,
                                      max_concurrent_calls_per_actor=1, max_tasks_in_flight_per_actor=1)
    with warnings.catch_warnings():
        # max_task_retries has no named parameter in Ray 2.60 and goes through ray_remote_args, which
        # Ray says it removes in 2.64; test_dataset's crashing call fails loudly if it stops working.
        warnings.filterwarnings("ignore", message=".*ray_remote_args. is deprecated")
        ds = items.map_batches(CallMap, batch_size=None, compute=pool, fn_constructor_kwargs={
            "worker_cls": worker_cls, "init_kwargs": init_kwargs, "ledger": ledger}, max_restarts=-1,
            max_task_retries=-1, runtime_env=runtime_env, **options)
    left = set(range(len(calls)))
    for row in ds.iter_rows():
        call = calls[row["index"]]
        left.discard(row["index"])
        yield failed(call, row["error"]) if row["error"] else json.loads(row["manifests"])
    for index in sorted(left):  # Ray Data dropped it (max_errored_blocks): what its log says
        yield failed(calls[index], "Ray Data gave up on the call (its log on the driver has why)")
    if stats:
        stats(ds.stats())
