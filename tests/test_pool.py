"""The actor pool under the runner: every batch comes back exactly once, whatever its actor did."""

from __future__ import annotations

from batchspec.runner.pool import run_pool


def failed(batch, why):
    return [{"shard": s, "status": "failed", "error": why} for s in batch]


def test_every_batch_comes_back_once_and_a_raising_call_fails_only_its_batch(ray_session):
    class Worker:  # defined here so that Ray ships it by value to its workers
        def __init__(self, tag):
            self.tag = tag

        def run(self, batch):
            if "bad" in batch:
                raise ValueError("row 3 is not a prompt\nand a second line")
            return [{"shard": s, "status": "done", "by": self.tag} for s in batch]

    batches = [["a", "b"], ["bad", "c"], ["d"], ["e", "f"]]
    results = list(run_pool(Worker, batches, size=2, actor_options={"num_cpus": 0}, init_kwargs={"tag": "w"},
                            failed=failed))

    got = {m["shard"]: m for ms in results for m in ms}
    assert len(results) == 4 and sorted(got) == ["a", "b", "bad", "c", "d", "e", "f"]
    assert [got[s]["status"] for s in ("bad", "c")] == ["failed", "failed"]
    assert got["bad"]["error"] == "ValueError: row 3 is not a prompt"
    assert all(got[s]["status"] == "done" for s in "abdef")  # the actor that raised kept working


def test_an_actor_that_cannot_start_fails_every_batch_in_one_line_and_does_not_hang(ray_session):
    class Broken:
        def __init__(self):
            raise RuntimeError("no such device: cuda:7")

        def run(self, batch):
            return []

    batches = [["a"], ["b"], ["c"]]
    results = list(run_pool(Broken, batches, size=2, actor_options={"num_cpus": 0}, init_kwargs={}, failed=failed))

    got = {m["shard"]: m for ms in results for m in ms}
    assert sorted(got) == ["a", "b", "c"]
    for m in got.values():
        assert m["status"] == "failed" and "\n" not in m["error"]
        assert m["error"].startswith("shard actor died: ") and "no such device: cuda:7" in m["error"], m["error"]
