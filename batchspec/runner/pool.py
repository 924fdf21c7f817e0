"""Shard batches onto a pool of Ray actors: one call per actor at a time, results as they finish.

    for manifests in run_pool(ShardWorker, batches, size=2, actor_options={"num_cpus": 2},
                              init_kwargs={...}, failed=lambda batch, why: [...]):
        ...  # the manifests of one batch, in finishing order; failed(batch, why) for a batch no actor ran

Why plain Ray actors and not Ray Data (v1's map_batches over a dataset of shard descriptors):
a shard is read, profiled, decided, generated and committed inside one call, so the only thing
the driver needs is "send this batch to a free actor, tell me when it is done"; Ray core already
restarts a killed actor and retries its call (max_restarts, max_task_retries), on another node if
its node is gone. What Ray Data added on top was fixed cost: `import ray.data` on the driver,
and three helper actors (stats, autoscaling coordinator, actor locations), each a Python process
importing Ray while the shard actor imports vLLM and loads the engine on the same cores
(docs/history/benchmarks-log.md). Issue 40 moves the runner back onto Ray Data, with that cost
measured against what it gives at scale.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import error_line

ATTEMPTS = 3  # a call that kills its actor this many times is given up (an OOM or native crash on its input)


def run_pool(worker_cls: type, batches: list[list[Any]], size: int, actor_options: dict, init_kwargs: dict,
             failed: Callable[[list[Any], str], list[dict]]) -> Iterator[list[dict]]:
    """Run every batch on `size` actors of worker_cls (called as actor.run(batch)); yield each
    batch's result as it finishes. Every batch comes back exactly once, as results or as
    failed(batch, reason).

    1. An actor that dies mid-call (SIGKILL, OOM, a lost node) is restarted by Ray and the call
       retried, up to ATTEMPTS in all. A call that kills its actor every time is the input's fault,
       not bad luck: a batch of several shards is split and each shard retried alone, so only the
       shard that crashes fails; a single shard fails with the reason. Before, Ray retried it
       forever and the job never ended.
    2. An actor whose constructor raised is not restarted by Ray; it leaves the pool, and once no
       actor is left every batch not yet run fails with its reason.
    3. An actor is let go as soon as no batch is left for it."""
    import ray

    options = {"max_restarts": -1, "max_task_retries": ATTEMPTS - 1, **actor_options}
    remote_cls: Any = ray.remote(worker_cls).options(**options)
    todo = deque(batches)
    idle = [remote_cls.remote(**init_kwargs) for _ in range(min(size, len(batches)))]
    running: dict[Any, tuple[Any, list[Any]]] = {}  # call ref -> (actor, batch)
    reason = "no actor could be started"
    while todo or running:
        while idle and todo:
            actor, batch = idle.pop(), todo.popleft()
            running[actor.run.remote(batch)] = (actor, batch)
        if not running:  # every actor is gone: what is left fails with the last actor's reason
            yield failed(list(todo.popleft()), reason)
            continue
        [ref], _ = ray.wait(list(running), num_returns=1)
        actor, batch = running.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            if isinstance(e, ray.exceptions.ActorDiedError) and e.actor_init_failed:  # dead for good: no more work
                reason = f"shard actor died: {death_reason(e)}"
                yield failed(batch, reason)
                continue
            if len(batch) > 1:  # which shard kills it? each alone, next (Ray is restarting the actor)
                todo.extendleft([item] for item in reversed(batch))
                idle.append(actor)
                continue
            result = failed(batch, f"the shard killed its actor {ATTEMPTS} times (out of memory, or a native crash "
                                   f"on its input): {death_reason(e)}")
        except ray.exceptions.RayTaskError as e:  # the call raised; the actor is still usable
            result = failed(batch, error_line(e.cause if e.cause is not None else e))
        if todo:
            idle.append(actor)
        else:
            # Nothing left to hand out: give its CPUs/GPUs back now. An actor Ray is restarting after
            # its node was lost may need exactly those to come back and finish its call (a cluster
            # with no spare capacity would otherwise wait forever: test_node_lost_mid_job).
            ray.kill(actor)
        yield result


def death_reason(e: Exception) -> str:
    """One line for a dead actor. Ray's message is a page: where the actor was, then the traceback
    of what killed it; the traceback's exception line ("RuntimeError: no such device: cuda:7") is
    what a user needs. Without a traceback (SIGKILL, a lost node), Ray's first line."""
    lines = str(getattr(e, "error_msg", None) or e).splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    if frames:  # after the last frame: its source line and ^^^ markers (indented), then the exception
        why = next((line.strip() for line in lines[frames[-1] + 1:] if line.strip() and not line[0].isspace()), "")
        if why:
            return why[:300]
    return error_line(e)
