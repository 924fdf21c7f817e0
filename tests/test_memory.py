"""Policy memory (runner/memory.py): a second run of a job starts from what the first measured."""

from __future__ import annotations

import json
from datetime import UTC

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchspec.runner.memory import PRIOR_TRIALS, PolicyMemory
from batchspec.runner.plan import plan_shards
from batchspec.spec import spec_from_dict


@pytest.fixture()
def memory_dir(tmp_path, monkeypatch):
    where = tmp_path / "memory"
    monkeypatch.setenv("BATCHSPEC_POLICY_MEMORY", str(where))
    return where


def _spec(models_dir, tmp_path, out: str, **speculation):
    inp = tmp_path / "in"
    if not inp.exists():
        inp.mkdir()
        pq.write_table(pa.table({"prompt": [f"lease {i} rent is due" for i in range(8)],
                                 "doc_id": [f"c{i}" for i in range(8)]}), inp / "s-0000.parquet")
    return spec_from_dict({"name": "nightly", "input": {"path": str(inp), "id_column": "doc_id"},
                           "output": {"path": str(tmp_path / out)},
                           "model": {"target": str(models_dir / "llama-target"),
                                     "draft": {"kind": "layer_skip", "layers": 1}, "backend": "hf"},
                           "generation": {"max_new_tokens": 6},
                           "speculation": {"mode": "auto", **speculation}, "resources": {"batch_size": 4}})


def test_a_second_run_starts_from_the_first_runs_costs_and_acceptance(models_dir, tmp_path, memory_dir):
    """hf: the first run calibrates (and probes, when its costs let speculation pay at all); the
    second, a new actor on the same node, does neither, says where its numbers come from, and
    writes the same rows. Which way the decision goes depends on the costs this machine measures
    (on a busy one the draft is "too costly"), so the test holds either way."""
    from batchspec.runner.worker import ShardRunner

    first = ShardRunner(_spec(models_dir, tmp_path, "a"), "job-1")
    (m1,) = first.run_many(plan_shards(str(tmp_path / "in")))
    assert m1["timings"]["calibrate_s"] > 0
    files = sorted(p.name.split("-")[0] for p in memory_dir.iterdir())
    assert files == ["costs", "job"]
    saved = json.loads(next(memory_dir.glob("job-*.json")).read_text())
    assert saved["job_id"] == "job-1" and len(saved["new_tokens"]) == 8
    assert saved["acceptance"]["trials"] == pytest.approx(first.policy.prior.trials)
    assert "lease" not in json.dumps(saved) + next(memory_dir.glob("costs-*.json")).read_text()  # counts only

    stamp = json.loads(next(memory_dir.glob("costs-*.json")).read_text())["measured_at"]
    second = ShardRunner(_spec(models_dir, tmp_path, "b"), "job-2")
    assert second.planner.steps.costs_by_batch.keys() == first.planner.steps.costs_by_batch.keys()
    assert second.policy.prior.trials == pytest.approx(min(PRIOR_TRIALS, first.policy.prior.trials))
    if first.policy.prior.estimate is not None:  # it speculated: the same estimate, fewer trials
        assert second.policy.prior.estimate == pytest.approx(first.policy.prior.estimate)
    assert second.policy.new_tokens_seen == saved["new_tokens"]
    (m2,) = second.run_many(plan_shards(str(tmp_path / "in")))
    assert m2["timings"]["calibrate_s"] == 0
    d = m2["decisions"][0]
    assert "probe" not in d["reason"] and d["reason"].endswith(f"(from what job job-1 at {stamp} measured on this node)")
    assert d["numbers"]["remembered"].startswith("job job-1 at ")
    rows = [sorted(_rows(tmp_path / out), key=lambda r: r["row_index"]) for out in ("a", "b")]
    assert [r["completion"] for r in rows[0]] == [r["completion"] for r in rows[1]]
    assert json.loads(next(memory_dir.glob("job-*.json")).read_text())["job_id"] == "job-2"


def _rows(path):
    from batchspec.runner.store import OutputStore

    return OutputStore(str(path)).read_part("s-0000").to_pylist()


def test_memory_is_kept_apart_by_what_changes_it(models_dir, tmp_path, memory_dir):
    """Costs are shared by jobs on the same models and hardware; acceptance only by the same job.
    The output path, the seed and remember itself are not part of what rows contain."""
    base = _spec(models_dir, tmp_path, "a")
    same = PolicyMemory.for_spec(base, "hf")
    other_out = PolicyMemory.for_spec(_spec(models_dir, tmp_path, "b"), "hf")
    assert (same.costs_path, same.job_path) == (other_out.costs_path, other_out.job_path)
    renamed = PolicyMemory.for_spec(base.model_copy(update={"name": "other"}), "hf")
    assert renamed.costs_path == same.costs_path and renamed.job_path != same.job_path
    assert PolicyMemory.for_spec(base, "vllm").costs_path != same.costs_path
    more_cpus = base.model_copy(update={"resources": base.resources.model_copy(update={"cpus_per_actor": 4})})
    assert PolicyMemory.for_spec(more_cpus, "hf").costs_path != same.costs_path
    assert PolicyMemory.for_spec(_spec(models_dir, tmp_path, "a", remember=False), "hf") is None
    assert _spec(models_dir, tmp_path, "a", remember=False).output_hash() == base.output_hash()


def test_an_unreadable_memory_is_ignored_with_one_warning(models_dir, tmp_path, memory_dir, caplog):
    from batchspec.runner.worker import ShardRunner

    spec = _spec(models_dir, tmp_path, "a")
    mem = PolicyMemory.for_spec(spec, "hf")
    memory_dir.mkdir()
    mem.costs_path.write_text("{not json")
    mem.job_path.write_text(json.dumps({"job_id": "x", "written_at": "t", "acceptance": {"trials": "many"}}))
    runner = ShardRunner(spec, "job-3")
    assert runner.planner.steps.costs_by_batch == {} and runner.policy.prior.estimate is None and runner.planner.remembered is None
    assert sum("policy memory" in r.message for r in caplog.records) == 2
    (m,) = runner.run_many(plan_shards(str(tmp_path / "in")))
    assert m["status"] == "done" and m["timings"]["calibrate_s"] > 0  # measured as a new job
    assert json.loads(mem.costs_path.read_text())["job_id"] == "job-3"  # and replaced the broken file


def test_memory_off_for_the_node_writes_nothing(models_dir, tmp_path, monkeypatch):
    from batchspec.runner.worker import ShardRunner

    monkeypatch.setenv("BATCHSPEC_POLICY_MEMORY", "off")
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    runner = ShardRunner(_spec(models_dir, tmp_path, "a"), "job-4")
    assert runner.memory is None
    runner.run_many(plan_shards(str(tmp_path / "in")))
    assert not (tmp_path / "cache" / "policy").exists()


def test_costs_age_from_the_run_that_measured_them(models_dir, tmp_path, memory_dir, caplog):
    """A run that measured nothing (decided off from memory) keeps the costs' stamp; costs older
    than MAX_AGE_DAYS are dropped, so a job that stays off measures again once a week."""
    import logging
    from datetime import datetime, timedelta

    from batchspec.policy import Acceptance, Costs
    from batchspec.runner.memory import MAX_AGE_DAYS

    mem = PolicyMemory.for_spec(_spec(models_dir, tmp_path, "a"), "hf")
    costs = {8: Costs(8, 0.01, 0.002, {4: 0.02}, 0.001)}
    mem.save(costs, Acceptance(), [5, 6], "night-1")
    stamp = json.loads(mem.costs_path.read_text())["measured_at"]

    later = PolicyMemory.for_spec(_spec(models_dir, tmp_path, "a"), "hf")
    loaded, _, new_tokens, source, _, _ = later.load()
    assert loaded == costs and new_tokens == [5, 6] and source == f"job night-1 at {stamp}"
    later.save(loaded, Acceptance(), new_tokens + [7], "night-2")  # costs untouched: stamp kept
    saved = json.loads(mem.costs_path.read_text())
    assert (saved["job_id"], saved["measured_at"]) == ("night-1", stamp)
    assert json.loads(mem.job_path.read_text())["job_id"] == "night-2"
    loaded[8].learn_steps({0: 0.012}, 0.0)
    later.save(loaded, Acceptance(), [], "night-3")  # measured: restamped
    assert json.loads(mem.costs_path.read_text())["job_id"] == "night-3"

    old = (datetime.now(UTC) - timedelta(days=MAX_AGE_DAYS + 1)).isoformat(timespec="seconds")
    mem.costs_path.write_text(json.dumps({**json.loads(mem.costs_path.read_text()), "measured_at": old}))
    with caplog.at_level(logging.INFO, logger="batchspec.worker"):
        costs_again, _, new_tokens, *_ = PolicyMemory.for_spec(_spec(models_dir, tmp_path, "a"), "hf").load()
    assert costs_again == {} and new_tokens == [5, 6, 7]
    assert any("measuring again" in r.message for r in caplog.records)


def test_the_steps_behind_the_step_lines_are_kept_and_a_malformed_list_is_a_new_job(models_dir, tmp_path,
                                                                                  memory_dir, caplog):
    """vllm's clean steps per arm (rows, seconds) and prompt costs go in the costs file and come
    back as they were; saving them unchanged keeps the stamp; a step list that is not pairs makes
    the whole memory unreadable (one warning, measured as new), not a half-read one."""
    from batchspec.policy import Acceptance, Costs

    mem = PolicyMemory.for_spec(_spec(models_dir, tmp_path, "a"), "vllm")
    costs = {64: Costs(64, 0.05, 0.0, {4: 0.14}, 0.001, 0.0002)}
    points = {0: [(64.0, 0.05), (60.0, 0.048)], 4: [(64.0, 0.14), (32.0, 0.08)]}
    mem.save(costs, Acceptance(), [], "night-1", points, (1e-5, 2e-6))
    stamp = json.loads(mem.costs_path.read_text())["measured_at"]
    loaded = PolicyMemory.for_spec(_spec(models_dir, tmp_path, "a"), "vllm")
    got = loaded.load()
    assert (got.costs, got.points, got.prefill_row_token_s) == (costs, points, (1e-5, 2e-6))
    loaded.save(got.costs, Acceptance(), [], "night-2", got.points, got.prefill_row_token_s)
    assert json.loads(mem.costs_path.read_text())["measured_at"] == stamp
    loaded.save(got.costs, Acceptance(), [], "night-3", {**points, 0: points[0] + [(8.0, 0.01)]}, (1e-5, 2e-6))
    assert json.loads(mem.costs_path.read_text())["job_id"] == "night-3"  # new steps: restamped

    data = json.loads(mem.costs_path.read_text())
    mem.costs_path.write_text(json.dumps({**data, "steps": {"points": {"0": [[64.0]]}}}))
    again = PolicyMemory.for_spec(_spec(models_dir, tmp_path, "a"), "vllm").load()
    assert again.costs == {} and again.points == {} and again.source is None
    assert sum("malformed" in r.message for r in caplog.records) == 1


def test_the_memory_files_name_vllm_args_but_keep_no_values(models_dir, tmp_path, memory_dir):
    from batchspec.policy import Acceptance, Costs

    spec = _spec(models_dir, tmp_path, "a")
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"vllm_args": {"hf_token": "hf_s3cr3t"}})})
    mem = PolicyMemory.for_spec(spec, "vllm")
    assert mem.costs_path != PolicyMemory.for_spec(_spec(models_dir, tmp_path, "a"), "vllm").costs_path
    mem.save({8: Costs(8, 0.01, 0.0, {4: 0.02}, 0.001)}, Acceptance(9.0, 10.0), [5], "night-1")
    for path in (mem.costs_path, mem.job_path):
        text = path.read_text()
        assert "hf_s3cr3t" not in text and '"hf_token"' in text


def test_a_relative_model_path_is_remembered_by_where_it_points(models_dir, tmp_path, memory_dir, monkeypatch):
    import shutil

    for d in ("a", "b"):
        shutil.copytree(models_dir / "llama-target", tmp_path / d / "target")
    keys = []
    for d in ("a", "b"):
        monkeypatch.chdir(tmp_path / d)
        spec = _spec(models_dir, tmp_path, "out")
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"target": "target"})})
        keys.append(PolicyMemory.for_spec(spec, "hf").costs_path)
    assert keys[0] != keys[1]
