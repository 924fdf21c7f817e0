"""Shard calls through Ray Data: a dataset of calls, map_batches onto a pool of shard actors.

    for manifests in run_calls(ShardWorker, calls, size=2, actor_options={"num_cpus": 2},
                               init_kwargs={...}, failed=lambda call, why: [...]):
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
2. An actor whose constructor raised fails every call it gets, in one line, and does not hang the
   job (its calls still come back, with the reason).
3. An actor killed mid-call (SIGKILL, OOM, a lost node) is restarted by Ray and the call retried,
   ATTEMPTS in all. A call that still did not come back is the input's fault, not bad luck: a call
   of several shards is run again shard by shard, so only the shard that crashes fails.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import error_line

ATTEMPTS = 3  # a call that kills its actor this many times is given up (an OOM or native crash on its input)
log = logging.getLogger("batchspec.job")


class CallMap:
    """The map_batches callable: one shard worker per Ray Data actor, one call per batch."""

    def __init__(self, worker_cls: type, init_kwargs: dict):
        self.worker: Any = None
        self.dead = ""
        try:
            self.worker = worker_cls(**init_kwargs)
        except Exception as e:  # raised, Ray Data would restart the actor and fail the whole job
            self.dead = f"shard actor died: {error_line(e)}"

    def __call__(self, batch: dict) -> dict:
        out: dict[str, list] = {"index": [], "manifests": [], "error": []}
        for index, call in zip(batch["index"], batch["call"]):
            manifests, error = "[]", self.dead
            if self.worker is not None:
                try:
                    manifests, error = json.dumps(self.worker.run(json.loads(call))), ""
                except Exception as e:  # the call's shards fail; the actor keeps working
                    error = error_line(e)
            out["index"].append(int(index))
            out["manifests"].append(manifests)
            out["error"].append(error)
        return out


def run_calls(worker_cls: type, calls: list[list[Any]], size: int, actor_options: dict, init_kwargs: dict,
              failed: Callable[[list[Any], str], list[dict]]) -> Iterator[list[dict]]:
    """Run every call on `size` actors of worker_cls (called as worker.run(call)); yield each
    call's manifests as it finishes, or failed(call, reason)."""
    left = dict(enumerate(calls))
    for index, manifests in _map(worker_cls, left, size, actor_options, init_kwargs, failed):
        left.pop(index)
        yield manifests
    # What did not come back killed its actor ATTEMPTS times: each shard of it alone, once more.
    alone = {i: [shard] for i, shard in enumerate(s for call in left.values() if len(call) > 1 for s in call)}
    for call in (c for c in left.values() if len(c) == 1):
        yield failed(call, _KILLED)
    for index, manifests in _map(worker_cls, alone, size, actor_options, init_kwargs, failed):
        alone.pop(index)
        yield manifests
    for call in alone.values():
        yield failed(call, _KILLED)


_KILLED = (f"the shard killed its actor {ATTEMPTS} times (out of memory, or a native crash on its input); "
           "the shard actor's log has why")


def _map(worker_cls: type, calls: dict[int, list[Any]], size: int, actor_options: dict, init_kwargs: dict,
         failed: Callable[[list[Any], str], list[dict]]) -> Iterator[tuple[int, list[dict]]]:
    """(index, manifests) of each call that came back; a call whose actor died ATTEMPTS times is
    left out (Ray Data drops its block: max_errored_blocks)."""
    if not calls:
        return
    import ray.data

    from .logs import quiet_foreign_loggers

    quiet_foreign_loggers()  # `import ray.data` gave its logger a console handler of its own
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # batchspec draws its own (runner/progress.py)
    ctx.print_on_execution_start = False
    ctx.max_errored_blocks = -1  # a call that killed its actor every time is dropped, not the job's end
    options = dict(actor_options)
    runtime_env = options.pop("runtime_env", None)
    items = ray.data.from_items([{"index": i, "call": json.dumps(c)} for i, c in calls.items()],
                                override_num_blocks=len(calls))
    # The engine runs in the actor's main thread, the thread that loaded it (enable_true_multi_threading
    # with one call at a time): from a second thread OpenMP builds a second thread team, and vLLM's CPU
    # calls ran measurably slower (docs/history/benchmarks-log.md). One call in flight per actor: a
    # call queued behind one that crashes the actor would be retried with it, and given up with it.
    pool = ray.data.ActorPoolStrategy(size=min(size, len(calls)), enable_true_multi_threading=True,
                                      max_concurrent_calls_per_actor=1, max_tasks_in_flight_per_actor=1)
    with warnings.catch_warnings():
        # max_task_retries has no named parameter in Ray 2.60 and goes through ray_remote_args, which
        # Ray says it removes in 2.64; test_dataset's crashing call fails loudly if it stops working.
        warnings.filterwarnings("ignore", message=".*ray_remote_args. is deprecated")
        ds = items.map_batches(CallMap, batch_size=1, compute=pool, fn_constructor_kwargs={
            "worker_cls": worker_cls, "init_kwargs": init_kwargs}, max_task_retries=ATTEMPTS - 1,
            runtime_env=runtime_env, **options)
    for row in ds.iter_rows():
        call = calls[row["index"]]
        yield row["index"], failed(call, row["error"]) if row["error"] else json.loads(row["manifests"])
