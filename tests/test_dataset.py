"""Ray Data under the runner: every call comes back exactly once, whatever its actor did."""

from __future__ import annotations

import json

import pytest

from batchspec.runner.callmap import CrashLedger
from batchspec.runner.dataset import run_calls


@pytest.fixture()
def ledger(tmp_path):
    from batchspec.runner.store import OutputStore

    return CrashLedger(OutputStore(str(tmp_path / "out")), "job")


def failed(batch, why):
    return [{"shard": s, "status": "failed", "error": why} for s in batch]


@pytest.mark.parametrize("per_block", [1, 3])
def test_every_batch_comes_back_once_and_a_raising_call_fails_only_its_batch(ray_session, ledger, tmp_path, per_block):
    class Worker:  # defined here so that Ray ships it by value to its workers
        def __init__(self, tag):
            self.tag = tag

        def run(self, batch):
            if "bad" in batch:
                raise ValueError("row 3 is not a prompt\nand a second line")
            return [{"shard": s, "status": "done", "by": self.tag} for s in batch]

    batches = [["a", "b"], ["bad", "c"], ["d"], ["e", "f"]]
    results = list(run_calls(Worker, batches, size=2, actor_options={"num_cpus": 0}, init_kwargs={"tag": "w"},
                            ledger=ledger, failed=failed, per_block=per_block))

    got = {m["shard"]: m for ms in results for m in ms}
    assert len(results) == 4 and sorted(got) == ["a", "b", "bad", "c", "d", "e", "f"]
    assert [got[s]["status"] for s in ("bad", "c")] == ["failed", "failed"]
    assert got["bad"]["error"] == "ValueError: row 3 is not a prompt"
    assert all(got[s]["status"] == "done" for s in "abdef")  # the actor that raised kept working
    assert not (tmp_path / "out" / "_batchspec" / "crashes").exists()  # nothing crashed, nothing written


def test_an_actor_that_cannot_start_fails_every_batch_in_one_line_and_does_not_hang(ray_session, ledger):
    class Broken:
        def __init__(self):
            raise RuntimeError("no such device: cuda:7")

        def run(self, batch):
            return []

    batches = [["a"], ["b"], ["c"]]
    results = list(run_calls(Broken, batches, size=2, actor_options={"num_cpus": 0}, init_kwargs={}, ledger=ledger,
                             failed=failed))

    got = {m["shard"]: m for ms in results for m in ms}
    assert sorted(got) == ["a", "b", "c"]
    for m in got.values():
        assert m["status"] == "failed" and "\n" not in m["error"]
        assert m["error"].startswith("shard actor died: ") and "no such device: cuda:7" in m["error"], m["error"]


@pytest.mark.parametrize("per_block", [1, 2])
def test_a_call_that_kills_its_actor_every_time_fails_only_the_shard_that_does(ray_session, ledger, tmp_path,
                                                                               per_block):
    """Ray restarts the actor and retries the call's block (ATTEMPTS in all); a block that still
    kills it ATTEMPTS times runs shard by shard, so the other shards are done, and the one that
    crashes fails in one line, after ATTEMPTS more deaths alone. The restarted actors count the
    deaths in the ledger, per block (with two calls a block, the call after the crashing one is
    retried with it, and the count is the same); a run without crashes writes none."""
    class Crashing:
        def run(self, batch):
            if "boom" in batch:
                import os

                os._exit(1)  # what an OOM kill or a native crash looks like to Ray
            return [{"shard": s, "status": "done"} for s in batch]

    results = list(run_calls(Crashing, [["boom", "g"], ["h"]], size=1, actor_options={"num_cpus": 0},
                             init_kwargs={}, ledger=ledger, failed=failed, per_block=per_block))

    got = {m["shard"]: m for ms in results for m in ms}
    assert sorted(got) == ["boom", "g", "h"] and len(results) == 2
    assert got["g"]["status"] == got["h"]["status"] == "done"
    assert got["boom"]["status"] == "failed" and got["boom"]["error"].startswith("the shard killed its actor 3 times")
    [entry] = [json.loads(p.read_text()) for p in (tmp_path / "out" / "_batchspec" / "crashes" / "job").iterdir()]
    assert entry == {"deaths": 6, "running": None, "alone": {"boom": 3}}


def test_a_pool_given_a_maximum_grows_while_every_actor_is_busy_and_a_fixed_pool_does_not(ray_session, ledger):
    """resources.max_actors: Ray Data adds actors (up to max_size) while calls wait and every
    actor is busy; without it the pool stays at size. Every call still comes back once."""
    class Slow:
        def run(self, batch):
            import os
            import time

            time.sleep(0.4)
            return [{"shard": s, "status": "done", "pid": os.getpid()} for s in batch]

    def pids(**pool):
        results = list(run_calls(Slow, [[f"s{i}"] for i in range(12)], actor_options={"num_cpus": 0}, init_kwargs={},
                                 ledger=ledger, failed=failed, **pool))
        got = [m for ms in results for m in ms]
        assert sorted(m["shard"] for m in got) == sorted(f"s{i}" for i in range(12))
        return {m["pid"] for m in got}

    assert len(pids(size=1)) == 1
    assert 2 <= len(pids(size=1, max_size=3)) <= 3


def test_vllm_calls_hold_enough_rows_for_vllms_batch_and_at_most_an_actors_share():
    """plan_calls: many small files fill vLLM's batch (256 rows by default) instead of 8 shards a
    call; large shards still go 8 a call; an actor never takes more than its equal share; hf and
    an explicit shards_per_call are a fixed count."""
    from batchspec.runner.packing import plan_calls
    from batchspec.runner.plan import Shard
    from batchspec.spec import ResourcesSpec

    def shards(n, rows):
        return [Shard(f"s{i}", f"/in/s{i}.parquet", 0, rows, {}) for i in range(n)]

    def sizes(calls):
        return [len(c) for c in calls]

    one = ResourcesSpec(actors=1)
    assert sizes(plan_calls(shards(200, 2), "vllm", one, {})) == [128, 72]
    assert sizes(plan_calls(shards(200, 2), "vllm", one, {"max_num_seqs": 64})) == [32] * 6 + [8]
    assert sizes(plan_calls(shards(4, 24), "vllm", one, {})) == [4]
    assert sizes(plan_calls(shards(32, 192), "vllm", one, {})) == [8, 8, 8, 8]
    assert sizes(plan_calls(shards(10, 2), "vllm", ResourcesSpec(actors=2), {})) == [5, 5]
    assert sizes(plan_calls(shards(12, 2), "vllm", ResourcesSpec(actors=1, max_actors=3), {})) == [4, 4, 4]
    calls = plan_calls(shards(5, 2), "hf", one, {})
    assert sizes(calls) == [1] * 5 and [s.shard for c in calls for s in c] == [f"s{i}" for i in range(5)]
    assert sizes(plan_calls(shards(7, 500), "vllm", ResourcesSpec(actors=1, shards_per_call=3), {})) == [3, 3, 1]


def test_calls_of_few_rows_go_several_to_a_ray_data_task_while_every_actor_keeps_tasks_to_take():
    """packing.calls_per_block: a task holds calls until it has BLOCK_ROWS rows, never so many that
    the job has fewer than BLOCKS_PER_ACTOR tasks per actor; calls of many rows go one a task."""
    from batchspec.runner.packing import calls_per_block
    from batchspec.runner.plan import Shard

    def calls(n, rows):
        return [[Shard(f"s{i}", f"/in/s{i}.parquet", 0, rows, {})] for i in range(n)]

    assert calls_per_block(calls(10000, 2), actors=1) == 128
    assert calls_per_block(calls(1200, 20), actors=1) == 13
    assert calls_per_block(calls(1200, 20), actors=100) == 3  # 400 tasks: 4 an actor
    assert calls_per_block(calls(50, 2000), actors=1) == 1
    assert calls_per_block(calls(3, 1), actors=1) == 1 and calls_per_block([], actors=1) == 1
