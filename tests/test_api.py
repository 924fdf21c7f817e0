"""The Python API a pipeline calls (batchspec/api.py, docs/api.md): one spec for every night
through params, a typed Run with the night's figures, reruns that redo only what failed, errors
as one exception family with the CLI's messages, and an import that stays cheap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import local_writer, write_prompt_shards

import batchspec
from batchspec import BatchspecError, JobRefused, Outcome, SpecError


def nightly_spec(models_dir, tmp_path) -> dict:
    return {"name": "nightly", "input": {"path": str(tmp_path / "in" / "dt={ds}"), "id_column": "doc_id"},
            "output": {"path": str(tmp_path / "out" / "dt={ds}") + "/"},
            "model": {"target": str(models_dir / "llama-target"), "draft": {"kind": "ngram"}, "backend": "hf"},
            "generation": {"max_new_tokens": 6}, "speculation": {"mode": "on"},
            "resources": {"actors": 1, "batch_size": 4}}


def metrics(path) -> dict[str, float]:
    """The samples of a textfile, read by Prometheus' own parser (it rejects a malformed file)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(path.read_text()) for s in family.samples
            if s.labels == {"job": "nightly"}}


def test_import_batchspec_loads_no_ray_torch_or_pydantic():
    code = "import sys, batchspec; print(sorted(m for m in ('ray', 'torch', 'pydantic', 'polars') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_two_nights_through_params_a_failed_shard_and_its_rerun(models_dir, ray_session, tmp_path):
    """Two dated partitions from one spec; the second night's truncated shard fails the run (a Run,
    not an exception), its rerun commits it alone, and every figure is JSON for a scheduler."""
    job = tmp_path / "nightly.yaml"
    job.write_text(yaml.safe_dump(nightly_spec(models_dir, tmp_path)))
    for ds in ("2026-12-04", "2026-12-05"):
        write_prompt_shards(local_writer(tmp_path / "in" / f"dt={ds}"), 2, 3)
    night = tmp_path / "in" / "dt=2026-12-05"
    good = (night / "prompts-0001.parquet").read_bytes()
    (night / "prompts-0001.parquet").write_bytes(good[:100])

    prom = tmp_path / "batchspec_nightly.prom"
    first = batchspec.submit(job, params={"ds": "2026-12-04"}, metrics_file=str(prom))
    assert first.outcome is Outcome.COMPLETED and first.ok and first.shards_done == 2
    assert first.output == str(tmp_path / "out" / "dt=2026-12-04") and first.params == {"ds": "2026-12-04"}
    assert first.draft == "ngram" and first.rows == 6 and first.tokens_out > 0
    assert first.totals["rows"] == 6 and first.totals["completion_tokens"] == first.tokens_out
    assert first.totals["actor_seconds"] > 0 and first.totals["prompt_tokens"] > 0
    assert json.loads(json.dumps(first.to_dict()))["outcome"] == "completed"

    after_first = metrics(prom)
    assert after_first["batchspec_last_run_success"] == 1 and after_first["batchspec_last_run_rows"] == 6
    assert after_first["batchspec_last_run_completion_tokens"] == first.tokens_out
    second = batchspec.submit(job, params={"ds": "2026-12-05"}, metrics_file=str(prom))
    after_second = metrics(prom)  # a failed run: success 0, the last success time kept from the first night
    assert after_second["batchspec_last_run_success"] == 0 and after_second["batchspec_last_run_failed_shards"] == 1
    assert after_second["batchspec_last_success_timestamp_seconds"] == after_first["batchspec_last_success_timestamp_seconds"]
    assert second.outcome is Outcome.FAILED_SHARDS and not second.ok and list(second.failed) == ["prompts-0001"]
    assert "unreadable Parquet" in second.failed["prompts-0001"]
    (night / "prompts-0001.parquet").write_bytes(good)
    fixed = batchspec.rerun(str(job), params={"ds": "2026-12-05"})
    assert fixed.ok and (fixed.shards_done, fixed.shards_skipped) == (1, 1) and fixed.totals["rows"] == 6
    marker = json.loads((tmp_path / "out" / "dt=2026-12-05" / "_batchspec" / "_SUCCESS").read_text())  # a sensor's summary
    assert (marker["job_id"], marker["rows"], marker["shards"], marker["error_rows"]) == (fixed.job_id, 6, 2, 0)
    st = batchspec.status(job, params={"ds": "2026-12-05"})
    assert st["complete"]
    rerun_shard = next(r for r in st["shard_list"] if r["shard"] == "prompts-0001")  # its cause is kept (issue 60)
    assert rerun_shard["error"] is None and rerun_shard["attempts"] == 2
    assert [e["job_id"] for e in rerun_shard["earlier_errors"]] == [second.job_id]
    assert "unreadable Parquet" in rerun_shard["earlier_errors"][0]["error"]
    rep = batchspec.report(str(tmp_path / "out" / "dt=2026-12-05"))
    assert rep["rows"] == 6 and [x["shard"] for x in rep["rerun_shards"]] == ["prompts-0001"]
    from batchspec.reports.output import build_report, to_text

    assert "failed before, committed on a rerun: prompts-0001 (attempt 2; before: " in to_text(
        build_report(str(tmp_path / "out" / "dt=2026-12-05")))
    again = batchspec.rerun(job, params={"ds": "2026-12-05"}, report=False)  # nothing left: a no-op
    assert again.ok and again.shards_done == 0 and again.totals == {}
    assert "done: 0 shard(s) run, 2 already done" in again.summary_line()

    nights = batchspec.status(tmp_path / "out")  # a folder of outputs: each night's status
    assert nights["complete"] and [s["output"][-13:] for s in nights["outputs"]] == ["dt=2026-12-04", "dt=2026-12-05"]

    # Night over night (issue 60): the folder of outputs, one entry per run, failures kept.
    trend = batchspec.report(tmp_path / "out")
    assert trend["kind"] == "trend"
    assert [n["partition"] for n in trend["nights"]] == [{"dt": "2026-12-04"}, {"dt": "2026-12-05"}]
    one, two = trend["nights"]
    assert [r["status"] for r in one["runs"]] == ["succeeded"] and one["rows"] == 6 and one["complete"]
    assert [r["status"] for r in two["runs"]] == ["failed", "succeeded", "succeeded"]
    assert [r["failed_shards"] for r in two["runs"]] == [["prompts-0001"], [], []]
    assert [r["shards_committed"] for r in two["runs"]] == [1, 1, 0] and two["rerun_shards"] == ["prompts-0001"]
    assert two["rows"] == sum(r["rows"] for r in two["runs"]) == 6 and two["draft"] == "ngram"
    assert two["completion_tokens"] == second.tokens_out + fixed.tokens_out and two["actor_seconds"] > 0
    from batchspec.reports.trend import to_html, to_text

    text = to_text(trend).splitlines()
    assert text[0] == "2 night(s), 4 run(s)" and text[2].startswith("dt=2026-12-04") and "failed" in text[3]
    assert text[-1].split()[:2] == ["night", "complete"]
    page = to_html(trend)
    assert page.count("<svg") == 1 and "rows per night" in page and "<script" not in page


def test_errors_are_one_family_with_the_clis_messages(models_dir, tmp_path):
    spec = nightly_spec(models_dir, tmp_path)
    with pytest.raises(SpecError, match=r"has the parameter \{ds\} but no value"):
        batchspec.submit(spec)
    with pytest.raises(SpecError, match="--param dt is not a parameter"):
        batchspec.load_job(spec, params={"ds": "x", "dt": "y"})
    with pytest.raises(JobRefused, match="nothing to rerun at .*dt=2026-01-01 .*submit the job first"):
        batchspec.rerun(spec, params={"ds": "2026-01-01"})
    assert issubclass(JobRefused, BatchspecError) and issubclass(SpecError, BatchspecError)
    # Python overrides take values as they are (no YAML reading), key paths as --set's.
    loaded = batchspec.load_job(spec, params={"ds": "d"}, overrides={"generation.max_new_tokens": 9,
                                                                      "input.template": "{prompt}: yes"})
    assert loaded.generation.max_new_tokens == 9 and loaded.input.template == "{prompt}: yes"
    with pytest.raises(SpecError, match="not to a JobSpec"):
        batchspec.load_job(loaded, params={"ds": "d"})


def test_raise_on_error_false_returns_refused_and_crashed_runs(models_dir, ray_session, tmp_path, monkeypatch):
    """For an orchestrator that records every run: a refused run (a changed spec) and a crash come
    back as a Run with that outcome and its error; the crash is in job.json as `crashed`."""
    spec = {**nightly_spec(models_dir, tmp_path), "input": {"path": str(tmp_path / "in"), "id_column": "doc_id"},
            "output": {"path": str(tmp_path / "out")}}
    write_prompt_shards(local_writer(tmp_path / "in"), 1, 2)
    assert batchspec.submit(spec, report=False).ok
    refused = batchspec.submit(spec, overrides={"generation.seed": 3}, raise_on_error=False)
    assert refused.outcome is Outcome.REFUSED and not refused.ok and "generation.seed: 0 there, 3 here" in refused.error
    import batchspec.runner.job as job

    def boom(plan):
        raise RuntimeError("the runner broke")

    monkeypatch.setattr(job, "run", boom)
    crashed = batchspec.submit(spec, force=True, raise_on_error=False)
    assert crashed.outcome is Outcome.CRASHED and crashed.error == "RuntimeError: the runner broke"
    assert json.loads(json.dumps(crashed.to_dict()))["outcome"] == "crashed"
    recorded = json.loads((tmp_path / "out" / "_batchspec" / "job.json").read_text())
    assert recorded["status"] == recorded["runs"][-1]["status"] == "crashed" and recorded["runs"][-1]["wall_s"] > 0
    with pytest.raises(RuntimeError, match="the runner broke"):
        batchspec.submit(spec, force=True)
