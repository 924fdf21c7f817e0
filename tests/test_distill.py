"""batchspec distill (batchspec/training/, docs/distill.md): committed rows paired with their
prompts as the runner rendered them, a draft trained on the target's completions and checked on
held-out rows with the engine before it is used, and refused where it must not serve.
(On vLLM: tests/test_vllm_backend.py, test_drafts_distilled_from_a_vllm_output_...)"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchspec.spec import spec_from_dict


def _job(models_dir, tmp_path, name: str, draft: str, mode: str = "on", out: str = "out") -> dict:
    return {"name": name, "input": {"path": str(tmp_path / "in"), "id_column": "doc_id", "template": "Q: {prompt}\nA:"},
            "output": {"path": str(tmp_path / out)},
            "model": {"target": str(models_dir / "llama-target"), "draft": {"kind": "model", "path": draft},
                      "backend": "hf"},
            "generation": {"max_new_tokens": 12}, "speculation": {"mode": mode, "num_speculative_tokens": 3},
            "resources": {"actors": 1, "batch_size": 8}}


def _input(tmp_path, rows: int = 40) -> None:
    """Two groups by hive key, a null prompt among them (an error row)."""
    from batchspec.testing import synthetic_text

    for g, seed in (("a", 1), ("b", 2)):
        folder = tmp_path / "in" / f"domain={g}"
        folder.mkdir(parents=True)
        texts: list[str | None] = [t[:60] for t in synthetic_text(rows, seed=seed)]
        if g == "a":
            texts[3] = None
        pq.write_table(pa.table({"prompt": texts, "doc_id": [f"{g}{i}" for i in range(rows)]}),
                       folder / "part-0.parquet")


@pytest.fixture(scope="module")
def night(models_dir, ray_session, tmp_path_factory):
    """One night's output on the tiny pair (hf engine), its draft an unrelated random model."""
    from batchspec.runner.job import submit

    tmp = tmp_path_factory.mktemp("night")
    _input(tmp)
    spec = spec_from_dict(_job(models_dir, tmp, "night", str(models_dir / "llama-other")))
    assert submit(spec).ok
    return tmp, spec


def test_rows_are_the_runs_own_prompts_and_completions_and_what_is_left_out_is_counted(night, models_dir):
    from transformers import AutoTokenizer

    from batchspec.runner.read import prompt_hash
    from batchspec.runner.store import OutputStore
    from batchspec.training.rows import committed_rows

    tmp, spec = night
    tok = AutoTokenizer.from_pretrained(models_dir / "llama-target")
    got_spec, rows, left = committed_rows(spec.output.path, tok)
    assert got_spec.output_hash() == spec.output_hash()
    assert left == {"error": 1} and len(rows) == 79
    assert {r.group for r in rows} == {"domain=a", "domain=b"}
    store = OutputStore(spec.output.path)
    part = {r["id"]: r for s in store.manifests() for r in store.read_part(s).to_pylist()}
    for r in rows:
        assert r.prompt.startswith("Q: ") and prompt_hash(r.prompt) == part[r.id]["prompt_sha256"]
        assert r.completion == part[r.id]["completion"]
    # An input row edited after the run renders to another prompt: left out, not learned under the old completion.
    path = tmp / "in" / "domain=b" / "part-0.parquet"
    table = pq.read_table(path).to_pylist()
    original = pq.read_table(path)
    try:
        table[0]["prompt"] = "edited after the run"
        pq.write_table(pa.Table.from_pylist(table), path)
        _, rows, left = committed_rows(spec.output.path, tok, group_by="shard")
        assert left == {"error": 1, "changed": 1} and len(rows) == 78
        assert {r.group for r in rows} == {"domain_a_part-0", "domain_b_part-0"}
    finally:
        pq.write_table(original, path)


def test_distill_trains_checks_on_held_out_rows_and_the_draft_stays_exact(night, models_dir, ray_session, tmp_path):
    """The draft learns the target's completions: held-out acceptance up on the hf engine, every
    held-out row regenerated as the output holds it; a job on the new draft equals plain decoding."""
    from batchspec import api
    from batchspec.engine.sources import checkpoint_fingerprint
    from batchspec.runner.job import submit

    tmp, spec = night
    result = api.distill(spec.output.path, tmp_path / "draft", held_out=0.25, epochs=4, lr=1e-3)
    record = json.loads((tmp_path / "draft" / "distill.json").read_text())
    assert record == json.loads(json.dumps(result.record))
    assert record["target_fingerprint"] == checkpoint_fingerprint(str(models_dir / "llama-target"))
    assert record["outputs"] == [spec.output.path] and record["backend"] == "hf" and record["k"] == 3
    assert record["rows"]["left_out"] == {"error": 1}
    assert record["rows"]["trained"] + record["rows"]["held_out"] == 79
    assert set(record["before"]["groups"]) == {"domain=a", "domain=b"}
    assert record["before"]["differs_from_output"] == record["after"]["differs_from_output"] == 0
    before, after = record["before"]["all"], record["after"]["all"]
    assert after["mean_acceptance_length"] > before["mean_acceptance_length"] * 1.02, (before, after)
    assert result.passed and record["passed"] and not record["reasons"]
    assert record["training"]["epochs"][0]["epoch"] == 0 and record["training"]["kept_epoch"] >= 1

    runs = {}
    for mode, draft in (("on", str(tmp_path / "draft")), ("off", str(models_dir / "llama-other"))):
        job = spec_from_dict(_job(models_dir, tmp, f"next-{mode}", draft, mode, out=f"next-{mode}"))
        assert submit(job).ok
        from batchspec.runner.store import OutputStore

        store = OutputStore(job.output.path)
        runs[mode] = {r["id"]: (r["completion"], r["draft_tokens"]) for s in store.manifests()
                      for r in store.read_part(s).to_pylist()}
    assert {i: c for i, (c, _) in runs["on"].items()} == {i: c for i, (c, _) in runs["off"].items()}
    assert sum(d for _, d in runs["on"].values()) > 0

    # The run names its draft and what it learned from; the two nights compare group by group.
    from batchspec.reports.output import build_report, compare, compare_text, to_text

    after = build_report(str(tmp / "next-on"))
    assert after["draft"]["fingerprint"] == checkpoint_fingerprint(str(tmp_path / "draft"))
    assert after["draft"]["distilled"]["outputs"] == [spec.output.path]
    assert f"draft: model {tmp_path / 'draft'} (distilled from {spec.output.path}), sha256:" in to_text(after)
    cmp = compare(build_report(spec.output.path), after)
    assert set(cmp["groups"]) == {"domain=a", "domain=b"}
    assert cmp["groups"]["domain=b"]["a"]["rows"] == 40 and cmp["groups"]["domain=b"]["b"]["rows"] == 40
    assert "acceptance by group" in compare_text(cmp) and f"draft in A: model {models_dir / 'llama-other'}" in compare_text(cmp)


def test_a_draft_that_is_not_better_exits_1_and_is_refused_as_is_one_made_for_another_target(night, models_dir,
                                                                                              tmp_path):
    tmp, spec = night
    out = tmp_path / "same"
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", "distill", spec.output.path, "--out", str(out),
                           "--epochs", "0", "--held-out", "0.25"], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "NOT better: held-out mean acceptance length" in proc.stdout and "less than +2%" in proc.stdout
    assert json.loads((out / "distill.json").read_text())["passed"] is False

    from batchspec.runner.validate import validate_job

    v = validate_job(spec_from_dict(_job(models_dir, tmp, "n", str(out), out="v1")))
    assert any("failed its held-out check" in p for p in v.problems), v.problems

    record = json.loads((out / "distill.json").read_text())
    (out / "distill.json").write_text(json.dumps({**record, "passed": True, "reasons": []}))
    other = _job(models_dir, tmp, "n", str(out), out="v2")
    other["model"]["target"] = str(models_dir / "llama-other")
    v = validate_job(spec_from_dict(other))
    assert any("was distilled for target" in p and "another checkpoint" in p for p in v.problems), v.problems
    assert validate_job(spec_from_dict(_job(models_dir, tmp, "n", str(out), out="v3"))).ok


def test_distill_says_what_it_cannot_do_in_one_line(night, tmp_path):
    from batchspec import DistillError, api

    _, spec = night
    with pytest.raises(DistillError, match="cannot be distilled yet"):
        api.distill(spec.output.path, tmp_path / "x", kind="medusa")
    with pytest.raises(DistillError, match="too few"):
        api.distill(spec.output.path, tmp_path / "x", held_out=0.0)
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", "distill", str(tmp_path / "nothing"), "--out",
                           str(tmp_path / "y")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no batchspec job at"), proc.stderr


def test_an_eagle3_draft_from_the_outputs_alone_is_checked_against_the_jobs_draft_and_stays_exact(
        night, models_dir, ray_session, tmp_path):
    """kind eagle3, new (the job's draft is a model draft): features from a prefill pass of the
    target per batch, saved in the reference layout; the check compares it with the job's own
    draft on the held-out rows; a job on it equals plain decoding."""
    from batchspec import api
    from batchspec.runner.job import submit
    from batchspec.runner.store import OutputStore

    tmp, spec = night
    result = api.distill(spec.output.path, tmp_path / "eagle3", kind="eagle3", held_out=0.25, epochs=2,
                         min_gain=-1.0, max_group_loss=1.0)
    record = result.record
    assert record["kind"] == "eagle3" and record["started_from"] is None
    assert record["compared_with"] == {"kind": "model", "path": str(models_dir / "llama-other")}
    assert record["training"]["feature_layers"] and record["training"]["epochs"][-1]["epoch"] == 2
    assert record["before"]["differs_from_output"] == record["after"]["differs_from_output"] == 0
    assert record["after"]["all"]["mean_acceptance_length"] is not None
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == record["training"]["feature_layers"]

    completions = {}
    for mode, kind, draft in (("on", "eagle3", str(tmp_path / "eagle3")), ("off", "model", str(models_dir / "llama-other"))):
        job = _job(models_dir, tmp, f"e3-{mode}", draft, mode, out=f"e3-{mode}")
        job["model"]["draft"]["kind"] = kind
        assert submit(spec_from_dict(job)).ok
        store = OutputStore(str(tmp / f"e3-{mode}"))
        completions[mode] = {r["id"]: r["completion"] for s in store.manifests() for r in store.read_part(s).to_pylist()}
    assert completions["on"] == completions["off"]


def test_distill_trains_on_two_ray_train_workers(night, ray_session, tmp_path):
    """--workers 2: the model kind trains data-parallel through Ray Train (TorchTrainer, DDP over
    gloo on CPU), each step's batches dealt over the workers; the draft comes back through Ray
    Train's checkpoint and is checked as a one-process one is."""
    from batchspec import api

    _, spec = night
    record = api.distill(spec.output.path, tmp_path / "ddp", held_out=0.25, epochs=2, lr=1e-3, workers=2,
                         min_gain=-1.0, max_group_loss=1.0).record
    training = record["training"]
    assert training["workers"] == 2 and [e["epoch"] for e in training["epochs"]] == [0, 1, 2]
    assert all(e["loss"] > 0 for e in training["epochs"][1:])
    rows_per_epoch = record["rows"]["trained"] + record["rows"]["seen_twice"]
    assert training["steps"] == 2 * (-(-rows_per_epoch // 16) // 2)  # epochs x (batches of 16, dealt over 2)
    assert (tmp_path / "ddp" / "config.json").exists() and record["after"]["differs_from_output"] == 0
    assert record["after"]["all"]["mean_acceptance_length"] > record["before"]["all"]["mean_acceptance_length"]


def test_distill_reads_an_output_and_its_input_on_s3(models_dir, ray_session, s3, tmp_path):
    """job.json masks the credentials it was run with; distill reads the input again with the
    options it is given (and the environment's), not with '***'."""
    from conftest import s3_writer, write_prompt_shards

    from batchspec import api
    from batchspec.runner.job import submit

    opts, fs, bucket = s3
    write_prompt_shards(s3_writer(fs, f"{bucket}/in"), 2, 20)
    job = _job(models_dir, tmp_path, "s3", str(models_dir / "llama-other"))
    job["input"].update(path=f"{bucket}/in/", storage_options=opts)
    job["output"].update(path=f"{bucket}/out", storage_options=opts)
    assert submit(spec_from_dict(job)).ok
    result = api.distill(f"{bucket}/out", tmp_path / "from-s3", storage_options=opts, held_out=0.25, epochs=1,
                         min_gain=-1.0, max_group_loss=1.0)
    rows = result.record["rows"]
    assert rows["trained"] + rows["held_out"] == 40 and rows["left_out"] == {}
    assert result.record["after"]["differs_from_output"] == 0
    # moto takes any credentials, so what reaches S3 is checked here: the given ones, never '***'.
    from batchspec.runner.store import OutputStore
    from batchspec.spec import JobSpec
    from batchspec.training.rows import unmasked

    recorded = JobSpec.model_validate(OutputStore(f"{bucket}/out", opts).read_job()["spec"])
    assert recorded.input.storage_options["secret"] == "***"
    assert unmasked(recorded, opts).input.storage_options == opts
    assert unmasked(recorded, {}).input.storage_options == {"endpoint_url": opts["endpoint_url"]}
