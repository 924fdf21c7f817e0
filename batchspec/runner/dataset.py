"""Shard calls through Ray Data: a dataset of calls, map_batches onto a pool of shard actors.

    for manifests in run_calls(ShardWorker, calls, size=2, actor_options={"num_cpus": 2},
                               init_kwargs={...}, ledger=CrashLedger(store, job_id),
                               failed=lambda call, why: [...]):
        ...  # the manifests of one call, in finishing order; failed(call, why) for a call no actor ran

One row per call (a call is one or more shard descriptors, packing.plan_calls), a block of one or
more consecutive calls per Ray Data task (packing.calls_per_block: calls of a few rows go several to
a task, since a task costs Ray Data milliseconds to schedule), so each call goes whole to one
actor. What Ray Data gives is what the runner uses: scheduling onto the actor pool across nodes,
streaming with backpressure (the driver holds the manifests of the blocks in flight, not the
job's), restarting a killed actor and retrying its block on another node when its node is gone,
and its execution stats. A shard is read, decided,
generated and committed inside one call, so the manifests the driver reads back are the truth;
what comes back through Ray Data is only what the driver logs and shows.

Every call comes back exactly once, as manifests or as failed(call, reason); the failure rules
are runner/callmap.py's, the callable each actor runs.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .callmap import CallMap, CrashLedger


def run_calls(worker_cls: type, calls: list[list[Any]], size: int, actor_options: dict, init_kwargs: dict,
              ledger: CrashLedger, failed: Callable[[list[Any], str], list[dict]],
              max_size: int | None = None, stats: Callable[[str], None] | None = None,
              per_block: int = 1) -> Iterator[list[dict]]:
    """Run every call on `size` actors of worker_cls (called as worker.run(call)), or on a pool
    Ray Data grows from `size` to `max_size` actors while calls wait and the cluster has room for
    another (and shrinks when they idle), `per_block` consecutive calls to a Ray Data task
    (packing.calls_per_block); yield each call's manifests as its task finishes, or failed(call,
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
