"""The job runner end to end: local Ray, a real S3 endpoint (moto server), parts and manifests."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import local_writer, part_ids, record_fault, result_of, s3_writer, write_prompt_shards

from batchspec.runner.job import submit
from batchspec.runner.outcome import JobRefused
from batchspec.runner.progress import startup_text
from batchspec.runner.record import status
from batchspec.runner.schema import OUTPUT_SCHEMA
from batchspec.runner.store import OutputStore
from batchspec.runner.todo import prepare
from batchspec.spec import spec_from_dict


def make_spec(models_dir, inp, out, input_opts=None, output_opts=None, **extra):
    data = {
        "name": "t",
        "input": {"path": inp, "id_column": "doc_id", "storage_options": input_opts or {}},
        "output": {"path": out, "storage_options": output_opts or {}},
        # The runner's mechanics are tested on the hf reference engine; test_vllm_backend runs vllm.
        "model": {"target": str(models_dir / "llama-target"), "draft": {"kind": "ngram"}, "backend": "hf"},
        "generation": {"max_new_tokens": 8},
        "speculation": {"mode": "on"},
        "resources": {"actors": 1, "batch_size": 4},
    }
    for key, value in extra.items():
        section, field = key.split("__")
        data.setdefault(section, {})[field] = value
    return spec_from_dict(data)


def read_parts(store: OutputStore) -> dict[str, pa.Table]:
    return {s: store.read_part(s) for s, m in store.manifests().items() if m["status"] == "done"}


def test_end_to_end_on_s3(models_dir, ray_session, s3):
    opts, fs, bucket = s3
    write = s3_writer(fs, f"{bucket}/in")
    write_prompt_shards(write, 2, 5)
    # A file big enough to be sliced: 3 row groups of 4 rows, at most 5 rows per shard.
    big = pa.table({"prompt": [f"clause {i} of the lease" for i in range(12)], "doc_id": [f"big-{i}" for i in range(12)]})
    write("big-0000.parquet", big, row_group_size=4)
    spec = make_spec(models_dir, f"{bucket}/in/", f"{bucket}/out", opts, opts, input__max_rows_per_shard=5)

    result = submit(spec)

    assert result.ok, result.failed
    store = OutputStore(spec.output.path, opts)
    manifests = store.manifests()
    assert sorted(manifests) == ["big-0000-r0", "big-0000-r1", "big-0000-r2", "prompts-0000", "prompts-0001"]
    parts = read_parts(store)
    ids = [i for t in parts.values() for i in t.column("id").to_pylist()]
    assert len(ids) == 22 and len(set(ids)) == 22  # rows out == rows in, ids unique
    assert set(ids) >= {f"big-{i}" for i in range(12)}
    for shard, table in parts.items():
        assert table.schema.equals(OUTPUT_SCHEMA, check_metadata=False), shard
        assert table.num_rows == manifests[shard]["rows_in"] == manifests[shard]["rows_out"]
        assert set(table.column("finish_reason").to_pylist()) <= {"stop", "length"}
    assert store.has_success()
    job = store.read_job()
    assert job["spec"]["input"]["storage_options"]["secret"] == "***"
    assert job["spec"]["input"]["storage_options"]["endpoint_url"] == opts["endpoint_url"]
    assert "testing" not in json.dumps(job)  # no credentials anywhere in job.json
    assert status(spec.output.path, opts)["shards"]["done"] == 5


def test_a_job_whose_models_are_on_s3_runs_on_the_actors_copies_and_names_them_by_their_uris(
        models_dir, ray_session, s3, tmp_path):
    """Target and draft under s3:// prefixes: the actor copies them into its cache (the engine
    reaches no S3, runner/checkpoints.py) and the rows name the checkpoints as the job does."""
    opts, fs, bucket = s3
    for name in ("llama-target", "llama-other"):  # each saved with its tokenizer
        fs.put(str(models_dir / name), f"{bucket}/models/{name}", recursive=True)
    write_prompt_shards(local_writer(tmp_path / "in"), 1, 4)
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"),
                     model__target=f"{bucket}/models/llama-target", model__storage_options=opts,
                     model__draft={"kind": "model", "path": f"{bucket}/models/llama-other"})

    result = submit(spec)

    assert result.ok, result.failed
    rows = [r for t in read_parts(OutputStore(spec.output.path)).values() for r in t.to_pylist()]
    assert len(rows) == 4 and {r["finish_reason"] for r in rows} <= {"stop", "length"}
    assert {r["target_model"] for r in rows} == {f"{bucket}/models/llama-target"}
    assert {r["draft_model"] for r in rows} == {f"{bucket}/models/llama-other"}  # speculation.mode: on
    assert sum(r["draft_tokens"] for r in rows) > 0


def _mtimes(folder) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (folder / "data").glob("part-*.parquet")}


def test_rerun_redoes_only_missing_shards(models_dir, ray_session, tmp_path, monkeypatch):
    write_prompt_shards(local_writer(tmp_path / "in"), 3, 4)
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))
    assert submit(spec).ok
    out = tmp_path / "out"
    before = _mtimes(out)
    (out / "_batchspec" / "shards" / "prompts-0001.json").unlink()
    st = status(str(out))  # _SUCCESS is still there, but a planned shard is not committed
    assert not st["complete"] and st["shards"] == {"done": 2, "failed": 0, "pending": 1, "total": 3}
    assert st["rows"] == 8 and st["success_marker"]

    again = submit(spec)

    assert again.done == ["prompts-0001"] and sorted(again.skipped) == ["prompts-0000", "prompts-0002"]
    after = _mtimes(out)
    assert after["part-prompts-0000.parquet"] == before["part-prompts-0000.parquet"]
    assert after["part-prompts-0002.parquet"] == before["part-prompts-0002.parquet"]
    assert after["part-prompts-0001.parquet"] != before["part-prompts-0001.parquet"]
    assert (out / "_batchspec" / "_SUCCESS").exists()
    # A run with nothing left to do touches no part at all; planning it lists data/ once instead of
    # looking at each part (a rerun of 10,000 shards on S3 was 10,000 HEAD requests before it started).
    from batchspec.runner import store as stores

    looked, listed, real_names = [], [], stores.part_names
    with monkeypatch.context() as m:
        m.setattr(OutputStore, "part_info", lambda self, shard, manifest=None: looked.append(shard))
        m.setattr(stores, "part_names", lambda store, manifests: listed.append(len(manifests)) or real_names(store, manifests))
        assert prepare(spec)[2] == []
    assert looked == [] and listed == [3]
    nothing = submit(spec)
    assert nothing.done == [] and _mtimes(out) == after
    assert nothing.startup is None  # no actor was started, so no start-up to pay or report


def test_a_run_records_its_start_up_apart(models_dir, ray_session, tmp_path):
    """What a run paid before its first engine could generate (Ray, the engine's load), kept in
    job.json's run record and told in the summary: on a short job it is most of the wall time."""
    write_prompt_shards(local_writer(tmp_path / "in"), 2, 3)
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))

    result = submit(spec)

    assert result.ok and len(result.actor_starts) == 1
    start = result.actor_starts[0]
    assert 0 < start["load_s"] <= start["ready_s"] < result.wall_s  # the load happens within the run
    assert result.ray_s is None  # this test process had Ray up already: nothing started, nothing to count
    assert result.startup == {"ready_s": start["ready_s"], "ray_s": None, "engine_load_s": start["load_s"]}
    run = OutputStore(str(tmp_path / "out")).read_job()["runs"][-1]
    assert run["startup"] == {"ray_s": None, "actors": [start]}
    assert all("actor_start" not in m for m in OutputStore(str(tmp_path / "out")).manifests().values())
    assert startup_text(result.startup) == (f", of which start-up {start['ready_s']:.1f}s "
                                            f"(engine load {start['load_s']:.1f}s)")
    stats = OutputStore(str(tmp_path / "out")).read_json(str(tmp_path / "out/_batchspec/stats" / f"{result.job_id}.json"))
    assert stats["job_id"] == result.job_id  # Ray Data's own account of the run, kept beside it
    assert any(line.startswith("Operator 1 MapBatches(CallMap): 2 tasks executed") for line in stats["ray_data"])


def test_rerun_with_changed_spec_is_refused_unless_forced(models_dir, ray_session, tmp_path):
    write_prompt_shards(local_writer(tmp_path / "in"), 1, 3)
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))
    assert submit(spec).ok
    changed = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"), generation__max_new_tokens=5)
    with pytest.raises(JobRefused, match=r"different spec \(generation.max_new_tokens: \d+ there, 5 here\)"):
        submit(changed)
    forced = submit(changed, force=True)
    assert forced.ok and forced.done == ["prompts-0000"]
    part = pq.read_table(tmp_path / "out" / "data" / "part-prompts-0000.parquet")
    assert max(part.column("completion_tokens").to_pylist()) <= 5


def test_a_changed_spec_is_taken_where_nothing_was_committed(models_dir, tmp_path):
    """Every shard of a run failed (here: the job record of a run that committed nothing, as when
    `model.device: cuda` found no GPU): the fixed spec runs without --force. With one committed
    shard the same change is refused, since the output would mix two specs."""
    from batchspec.runner.todo import prepare

    write_prompt_shards(local_writer(tmp_path / "in"), 2, 3)
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))
    store = OutputStore(str(tmp_path / "out"))
    store.write_job({"name": "t", "spec_hash": "0" * 64, "runs": [{"job_id": "old", "status": "failed"}]})
    store.write_manifest("prompts-0000", {"shard": "prompts-0000", "status": "failed", "error": "model could not be loaded"})
    _, _, todo, _ = prepare(spec)
    assert [s.shard for s in todo] == ["prompts-0000", "prompts-0001"]
    store.write_part("prompts-0001", pa.table({"id": ["x"]}))
    store.write_manifest("prompts-0001", {"shard": "prompts-0001", "status": "done", "part": store.part_name("prompts-0001"),
                                          "rows_out": 3})
    with pytest.raises(JobRefused, match="different spec"):
        prepare(spec)


def test_a_trailing_slash_is_the_same_spec_and_a_change_is_named(models_dir, tmp_path):
    """Issue 60: `out/dt=…/` after a run with `out/dt=…` was refused as "a different spec" with two
    hashes. Paths are normalised before hashing; an output recorded by a version that hashed the
    slash is still this spec (its recorded spec hashed as now); a real change names its key."""
    from batchspec.runner.plan import plan_shards
    from batchspec.runner.todo import prepare

    write_prompt_shards(local_writer(tmp_path / "in"), 1, 3)
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))
    slashed = make_spec(models_dir, str(tmp_path / "in") + "/", str(tmp_path / "out") + "//")
    assert slashed.output.path == spec.output.path and slashed.output_hash() == spec.output_hash()
    store = OutputStore(str(tmp_path / "out"))
    recorded = {**spec.masked(), "output": {**spec.masked()["output"], "path": str(tmp_path / "out") + "/"}}
    store.write_job({"name": "t", "spec_hash": "1" * 64, "spec": recorded, "runs": []})  # hashed with the slash
    store.write_part("prompts-0000", pa.table({"id": ["x"]}))
    fingerprint = plan_shards(str(tmp_path / "in"))[0].fingerprint
    store.write_manifest("prompts-0000", {"shard": "prompts-0000", "status": "done", "part": store.part_name("prompts-0000"),
                                          "rows_out": 3, "spec_hash": "1" * 64, "input": fingerprint})
    _, shards, todo, _ = prepare(slashed)
    assert todo == [] and len(shards) == 1
    assert prepare(slashed, force=True)[2] == []  # the shard's own older hash is this spec's too: not stale
    changed = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"), generation__seed=7)
    with pytest.raises(JobRefused, match=r"different spec \(generation.seed: 0 there, 7 here\)"):
        prepare(changed)


def test_changed_input_of_a_done_shard_is_refused(models_dir, ray_session, tmp_path):
    write = local_writer(tmp_path / "in")
    write_prompt_shards(write, 2, 3)
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))
    assert submit(spec).ok
    write_prompt_shards(write, 1, 4, seed=50)  # prompts-0000 rewritten with other rows
    with pytest.raises(JobRefused, match="input changed"):
        submit(spec)
    assert submit(spec, force=True).done == ["prompts-0000"]


def test_bad_rows_and_unreadable_shard(models_dir, ray_session, tmp_path):
    write = local_writer(tmp_path / "in")
    write_prompt_shards(write, 1, 3)
    long_prompt = "lease " * 2000  # far beyond the tiny model's 1024-token context
    write("bad-0000.parquet", pa.table({
        "prompt": ["fine prompt", None, "", "   ", "dup a", "dup b", long_prompt],
        "doc_id": ["a", "b", "c", "d", "e", "e", "f"],
    }))
    write("nontext-0000.parquet", pa.table({"prompt": [1, 2], "doc_id": ["n1", "n2"]}))
    # pyarrow does not validate UTF-8 on write: one bad prompt must cost one row, not the shard.
    raw = pa.array([b"the lease", b"bad \xff\xfe bytes", b"the tenant"], pa.binary()).view(pa.string())
    write("utf8-0000.parquet", pa.table({"prompt": raw, "doc_id": ["u1", "u2", "u3"]}))
    (tmp_path / "in" / "truncated-0000.parquet").write_bytes(
        (tmp_path / "in" / "prompts-0000.parquet").read_bytes()[:100])
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))

    result = submit(spec)

    assert not result.ok and list(result.failed) == ["truncated-0000"]
    assert "unreadable Parquet" in result.failed["truncated-0000"]
    store = OutputStore(str(tmp_path / "out"))
    bad = store.read_part("bad-0000").to_pylist()
    by_id = {r["id"]: r for r in bad}
    assert by_id["a"]["finish_reason"] in ("stop", "length")
    assert by_id["b"]["error"] == "null prompt"
    assert by_id["c"]["error"] == by_id["d"]["error"] == "empty prompt"
    assert by_id["e"]["finish_reason"] != "error"
    assert by_id["e#dup5"]["error"].startswith("duplicate id 'e'")
    assert "context" in by_id["f"]["error"] and by_id["f"]["prompt_tokens"] > 1024
    assert all(r["completion"] is None for r in bad if r["finish_reason"] == "error")
    nontext = store.read_part("nontext-0000").to_pylist()
    assert {r["error"] for r in nontext} == {"prompt is int, not text"}
    utf8 = {r["id"]: r for r in store.read_part("utf8-0000").to_pylist()}
    assert utf8["u2"]["error"] == "column(s) prompt not valid UTF-8"
    assert utf8["u1"]["error"] is None and utf8["u3"]["error"] is None and utf8["u3"]["completion_tokens"] > 0
    assert not store.has_success()
    st = status(str(tmp_path / "out"))
    assert (st["shards"]["done"], st["shards"]["failed"], st["complete"]) == (4, 1, False)
    # Fix the file, rerun: only the failed shard runs and the job completes.
    write_prompt_shards(lambda name, t: write("truncated-0000.parquet", t), 1, 2, prefix="fixed", seed=9)
    again = submit(spec)
    assert again.ok and again.done == ["truncated-0000"] and store.has_success()
    expected = ["prompts0-0", "prompts0-1", "prompts0-2", "a", "b", "c", "d", "e", "e#dup5", "f", "n1", "n2",
                "u1", "u2", "u3", "fixed0-0", "fixed0-1"]
    got = part_ids(str(tmp_path / "out"))
    record_fault("corrupt input shard, fixed, then rerun", 1, again.ok, expected, got, sorted(got) == sorted(expected))


def test_a_script_that_reads_a_part_exits_cleanly(tmp_path):
    """What a user's script does with the output: read parts, exit. pyarrow decoding through a
    Python object (an fsspec file, or a buffer of its bytes) can leave that object to be freed on
    one of its threads while the interpreter shuts down, and that aborts the process (exit 134,
    "terminate called without an active exception"). Read threaded through an fsspec file, this
    script aborted 4 times in 20; single-threaded through it (read_part before objects.parquet_file)
    0 in 170 here, but in one of five CI runs of this test; opened by pyarrow itself 0 in 80 threaded."""
    import subprocess
    import sys

    store = OutputStore(str(tmp_path / "out"))
    text = pa.array([f"completion {i} " * 40 for i in range(96)])
    store.write_part("s-0000", pa.table({f.name: text if f.type == pa.string() else pa.nulls(96, f.type)
                                         for f in OUTPUT_SCHEMA}))
    script = ("import torch\nfrom batchspec.runner.store import OutputStore\n"
              f"store = OutputStore({str(tmp_path / 'out')!r})\n"
              "print(sum(store.read_part('s-0000').num_rows for _ in range(64)))")
    for _ in range(10):  # one after the other: side by side, the timing changes and none aborts
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert (run.returncode, run.stdout.strip()) == (0, str(64 * 96)), run.stderr[-500:]


def test_output_inside_input_is_refused(models_dir, tmp_path):
    write_prompt_shards(local_writer(tmp_path / "in"), 1, 2)
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "in" / "out"))
    with pytest.raises(JobRefused, match="inside the input"):
        submit(spec)


def test_input_no_shard_could_use_is_refused_before_ray_starts(models_dir, tmp_path, monkeypatch):
    """A prompt column no file has, or files none of which can be read, would start Ray and load the
    models only to fail every shard: refused at once, nothing written. Where some files are usable,
    or some shards are done (a rerun), the others still fail alone as they run (test_bad_input_catalogue,
    test_a_failed_shard_is_told_once_with_its_reason_and_quiet_still_tells_it)."""
    import batchspec.runner.job as job
    from batchspec.runner.todo import input_problem

    monkeypatch.setattr(job, "init_ray", lambda *a, **k: pytest.fail("Ray started for input no shard can use"))
    write = local_writer(tmp_path / "in")
    write("a-0000.parquet", pa.table({"text": ["one"], "doc_id": ["1"]}))
    write("b-0000.parquet", pa.table({"text": ["two"], "doc_id": ["2"]}))
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))  # reads column "prompt"
    with pytest.raises(JobRefused, match=r"no input file has every column the job reads: .*a-0000.parquet lacks "
                                         r"'prompt' \(its columns: text, doc_id\) \(and 1 more file"):
        submit(spec)
    assert not (tmp_path / "out").exists()

    write("c-0000.parquet", pa.table({"prompt": ["three"], "doc_id": ["3"]}))  # one usable file: a run goes ahead
    _, shards, todo, _ = prepare(spec)
    assert input_problem(spec, shards, todo) is None
    assert input_problem(spec, shards, todo[:2]) is None  # a rerun of the shards that failed: they fail again alone

    for name in ("a-0000", "b-0000", "c-0000"):
        (tmp_path / "in" / f"{name}.parquet").write_bytes(b"PAR1 not a footer")
    with pytest.raises(JobRefused, match=r"no input file of the shards to run can be read: a-0000: unreadable "
                                         r"Parquet file.*\(and 2 more shard"):
        submit(spec)


def test_shard_ids_stay_inside_the_output(tmp_path):
    store = OutputStore(str(tmp_path / "out"))
    assert store.part_path("../../etc/passwd").startswith(str(tmp_path / "out") + "/data/part-")
    assert store.part_name("a/../../b").count("/") == 1  # data/<one name>


def test_cli_submit_exit_code_names_failed_shards(models_dir, ray_session, tmp_path):
    from typer.testing import CliRunner

    from batchspec.cli import app

    write_prompt_shards(local_writer(tmp_path / "in"), 1, 2)
    (tmp_path / "in" / "broken-0000.parquet").write_bytes(b"not parquet")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out")).model_dump(mode="json")))
    res = CliRunner().invoke(app, ["submit", str(job), "--quiet"])
    assert res.exit_code == 1, res.output
    assert "broken-0000" in res.output
    res = CliRunner().invoke(app, ["status", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["shards"]["failed"] == 1
    os.remove(tmp_path / "in" / "broken-0000.parquet")
    res = CliRunner().invoke(app, ["rerun", str(job), "--quiet"])
    # The broken shard's input is gone: the job now has one shard, done.
    assert res.exit_code == 0, res.output


def test_model_that_fails_to_load_writes_nothing(models_dir, tmp_path):
    from batchspec.testing import build_model, build_tokenizer

    write_prompt_shards(local_writer(tmp_path / "in"), 1, 2)
    bad_path = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"), model__target=str(tmp_path / "none"))
    with pytest.raises(JobRefused, match="target model"):
        submit(bad_path)
    other_vocab = build_model(tmp_path / "v", "llama", build_tokenizer(tmp_path / "t", vocab_size=300), seed=2)
    bad_draft = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"),
                          model__draft={"kind": "model", "path": str(other_vocab)})
    with pytest.raises(JobRefused, match="incompatible tokenizer"):
        submit(bad_draft)
    assert not (tmp_path / "out").exists()


def test_the_model_check_runs_beside_rays_start_and_a_missing_path_is_refused_before_it(models_dir, tmp_path,
                                                                                         monkeypatch):
    """On the hf backend the driver's model check imports transformers and torch (~6.5 s on two
    cores); it runs on a thread while Ray starts. A path that does not exist needs no import and
    is refused before Ray starts; a problem only the full check finds is refused once Ray is up,
    before the lease is taken: the output stays as it was either way."""
    import batchspec.runner.job as job
    from batchspec.testing import build_model, build_tokenizer

    write_prompt_shards(local_writer(tmp_path / "in"), 1, 2)
    events = []

    def fake_init_ray(*args, **kwargs):  # this session's Ray is up already: only record the call
        events.append("ray")
        return False

    monkeypatch.setattr(job, "init_ray", fake_init_ray)
    missing = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"), model__target=str(tmp_path / "none"))
    with pytest.raises(JobRefused, match="target model: model directory .* does not exist"):
        submit(missing)
    assert events == []  # refused before Ray
    other_vocab = build_model(tmp_path / "v", "llama", build_tokenizer(tmp_path / "t", vocab_size=300), seed=2)
    bad_draft = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"),
                          model__draft={"kind": "model", "path": str(other_vocab)})
    with pytest.raises(JobRefused, match="incompatible tokenizer"):
        submit(bad_draft)
    assert len(events) == 1 and not (tmp_path / "out").exists()


def test_vllm_driver_checks_local_models_without_transformers_and_finds_the_same_problems(models_dir, tmp_path):
    """The vllm backend's driver check reads local configs and tokenizer.json itself (importing
    transformers costs ~3.5 s of start-up); it must refuse what the transformers check refuses."""
    import subprocess
    import sys

    from batchspec.runner.preflight import local_model_problems, resolve_models
    from batchspec.testing import build_model, build_tokenizer

    other_vocab = build_model(tmp_path / "v", "llama", build_tokenizer(tmp_path / "t", vocab_size=300), seed=2)
    target, draft = str(models_dir / "llama-target"), str(models_dir / "llama-other")
    cases = {
        "fine": {"model__draft": {"kind": "model", "path": draft}},
        "missing target": {"model__target": str(tmp_path / "none")},
        "other vocabulary": {"model__draft": {"kind": "model", "path": str(other_vocab)}},
        "not a medusa checkpoint": {"model__draft": {"kind": "medusa", "path": target}},
    }
    found = {}
    for name, extra in cases.items():
        spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"), **extra)
        quick = local_model_problems(spec)
        assert quick is not None, name
        assert quick == resolve_models(spec, "hf"), name  # the transformers check, word for word
        found[name] = quick
    assert found["fine"] == []
    assert "does not exist" in found["missing target"][0]
    assert "incompatible tokenizer" in found["other vocabulary"][0]
    assert "not a Medusa checkpoint" in found["not a medusa checkpoint"][0]
    hub_id = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"), model__target="someorg/somemodel")
    assert local_model_problems(hub_id) is None  # resolving a hub id is transformers' job
    code = ("import sys; from batchspec.spec import spec_from_dict; from batchspec.runner.preflight import resolve_models; "
            f"spec = spec_from_dict({{'name': 't', 'input': {{'path': 'in'}}, 'output': {{'path': 'out'}}, "
            f"'model': {{'target': {target!r}, 'draft': {{'kind': 'model', 'path': {draft!r}}}}}}}); "
            "assert resolve_models(spec, 'vllm') == []; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_lease_read_while_its_holder_rewrites_it_sees_a_whole_record(tmp_path, s3, where):
    """A second submit reads the lease while the first run's heartbeat replaces it (CI caught an
    S3 read failing so: a buffered open pins the ETag of its HEAD). Every read must give a whole
    record or none, never an error or a half-written file."""
    import threading
    import time

    if where == "local":
        store = OutputStore(str(tmp_path / "out"))
    else:
        opts, fs, bucket = s3
        store = OutputStore(f"{bucket}/out", opts)
    path = store.meta_path("lease.json")
    record = {"job_id": "holder", "beat": 0, "pad": "x" * 4000}
    store.write_json(path, record)
    stop, writes = threading.Event(), [0]

    def holder():
        while not stop.is_set():  # heartbeats, and a release-and-retake, as fast as they go
            writes[0] += 1
            if writes[0] % 5:
                store.write_json(path, dict(record, beat=writes[0]))
            else:
                store.delete(path)
                assert store.create_exclusive(path, dict(record, beat=writes[0]))

    beating = threading.Thread(target=holder)
    beating.start()
    seen, deadline = [], time.monotonic() + 20
    try:
        while (writes[0] < 100 or len(seen) < 100) and time.monotonic() < deadline:
            seen.append(store.read_json(path))
    finally:
        stop.set()
        beating.join()
    assert writes[0] >= 100 and len(seen) >= 100  # the reads really overlapped many rewrites
    assert all(r is None or (r["job_id"] == "holder" and len(r["pad"]) == 4000) for r in seen)
    assert any(r is not None for r in seen)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_second_submit_is_refused_while_a_lease_is_held(models_dir, ray_session, tmp_path, s3, where):
    import time

    from batchspec.runner.lease import Lease

    if where == "local":
        write_prompt_shards(local_writer(tmp_path / "in"), 1, 2)
        spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))
    else:
        opts, fs, bucket = s3
        write_prompt_shards(s3_writer(fs, f"{bucket}/in"), 1, 2)
        spec = make_spec(models_dir, f"{bucket}/in", f"{bucket}/out", opts, opts)
    store = OutputStore(spec.output.path, spec.output.storage_options)
    other = Lease(store, "the-first-run", heartbeat_s=0.2)
    assert other.acquire() is None  # a live run holds the output
    assert not Lease(store, "x").store.create_exclusive(other.path, {})  # create-only really refuses
    with pytest.raises(JobRefused, match="in use by job the-first-run"):
        submit(spec)
    # A dead run's lease goes stale: a later submit takes it over after the timeout...
    other._stop.set()
    time.sleep(1.1)
    assert submit(spec, lease_timeout_s=1.0).ok
    assert store.read_json(other.path) is None  # released at the end
    # ...and --force takes over a live one.
    Lease(store, "live").acquire()
    assert submit(spec, force=True).done == []


@pytest.mark.parametrize("then", ["next shard", "ctrl-c"])
def test_a_run_whose_lease_another_run_takes_over_stops_before_its_next_shard(models_dir, ray_session, tmp_path,
                                                                              monkeypatch, fault_file, then):
    """`rerun --force` elsewhere while this run was alive after all: it must neither beat the new
    holder's lease away nor go on writing the output beside it, and what it committed stays. Nor
    may a Ctrl-C of the displaced run write job.json (it marked the holder's run "interrupted").
    Ray Data starts the next call while the driver reads the last one's result, so the actor asks
    who holds the lease before each call: the shards after the takeover are not run (each later
    shard is held 1.5 s before it generates, so the takeover lands while the second one runs)."""
    import time

    from batchspec.runner import lease as lease_mod
    from batchspec.runner.lease import Lease, LeaseLost
    from batchspec.runner.outcome import JobInterrupted

    monkeypatch.setattr(lease_mod, "HEARTBEAT_S", 0.1)
    write_prompt_shards(local_writer(tmp_path / "in"), 5, 2)
    fault_file.write_text(json.dumps({"sleep": {f"prompts-000{i}": 1.5 for i in range(1, 5)}}))
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))
    store = OutputStore(spec.output.path)
    forcing, holders_record = [], []

    def on_shard(manifest):
        if not forcing:  # after the first shard, another driver forces its way in and records its run
            forcing.append(Lease(store, "the-forcing-run", heartbeat_s=60))
            forcing[0].acquire(force=True)
            job = store.read_job()
            job["runs"].append({"job_id": "the-forcing-run", "status": "running"})
            store.write_job(job)
            holders_record.append(store.read_job())
            time.sleep(1.0)  # ten of this run's heartbeats
            if then == "ctrl-c":
                raise KeyboardInterrupt

    expected = (pytest.raises(LeaseLost, match=r"job the-forcing-run \(.*\) took over .* stopped after [12] shard\(s\)")
                if then == "next shard" else pytest.raises(JobInterrupted))
    with expected:
        submit(spec, on_shard=on_shard)
    assert store.read_json(store.meta_path("lease.json"))["job_id"] == "the-forcing-run"  # not beaten away, not released
    assert store.read_job() == holders_record[0]  # job.json is the new holder's to write now
    assert not store.has_success()
    for p in fault_file.parent.glob(fault_file.name + "*"):
        p.unlink()
    st = status(spec.output.path)
    done = st["shards"]["done"]
    assert done in (1, 2) and st["shards"]["pending"] == 5 - done, st["shards"]
    forcing[0].release()
    again = submit(spec)  # the holder's run, in effect: the rest, nothing redone
    assert again.ok and len(again.done) == 5 - done and len(again.skipped) == done
    # The runs that ended without recording an end are not left "running" beside a finished one.
    runs = store.read_job()["runs"]
    assert [r["status"] for r in runs] == ["stopped", "stopped", "succeeded"]
    assert runs[-1]["job_id"] == again.job_id and again.job_id in runs[0]["stopped_note"]


def test_a_shard_committed_since_the_driver_planned_it_is_not_generated_again(models_dir, tmp_path):
    """A call retried after its actor died past a shard's commit, or a forced run that planned
    while the run it displaced still committed, reached an actor with a shard that is done: it was
    generated again. Now the actor returns the committed manifest; another spec or input still
    regenerates."""
    from batchspec.runner.plan import plan_shards
    from batchspec.runner.worker import ShardRunner

    write_prompt_shards(local_writer(tmp_path / "in"), 1, 2)
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))
    (shard,) = plan_shards(spec.input.path)
    runner = ShardRunner(spec, "first-run")
    assert runner.run(shard)["job_id"] == "first-run"
    part = runner.store.part_path(shard.shard)
    written = os.stat(part).st_mtime_ns
    again = ShardRunner(spec, "second-run").run(shard)
    assert again["status"] == "done" and again["job_id"] == "first-run" and os.stat(part).st_mtime_ns == written
    other = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"), generation__max_new_tokens=6)
    assert ShardRunner(other, "third-run").run(shard)["job_id"] == "third-run"  # another spec: generated
    assert os.stat(part).st_mtime_ns != written


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_takeover_that_lands_between_a_read_and_a_write_of_the_lease_wins(s3, tmp_path, where):
    """Three races that were plain writes: a heartbeat that read its lease just before another run
    forced it, two drivers that found the same stale lease at once, and a run that ended just as
    another took its lease over. Each write is conditional on the version read (If-Match on S3,
    compare under the folder's flock locally), so the takeover that landed first is kept."""
    from batchspec.runner.lease import Lease, LeaseHeld

    opts, fs, bucket = s3
    url, opts = (f"{bucket}/out", opts) if where == "s3" else (str(tmp_path / "out"), None)

    def store_whose_next_read_lets(other_run):
        """An OutputStore whose next tagged read of the lease lets `other_run` act right after it."""
        store = OutputStore(url, opts)
        read, pending = store.read_json_tagged, [other_run]

        def read_then_other(path):
            got = read(path)
            if pending:
                pending.pop()()
            return got

        store.read_json_tagged = read_then_other
        return store

    plain = OutputStore(url, opts)
    holder = Lease(store_whose_next_read_lets(lambda: Lease(plain, "forcer", heartbeat_s=3600).acquire(force=True)),
                   "holder", heartbeat_s=3600)  # no thread beats: the test calls beat()
    assert holder.store.create_exclusive(holder.path, holder._record(0.0))
    assert holder.beat(0.0)  # read, then the forced takeover, then its own write: refused
    assert plain.read_json(holder.path)["job_id"] == "forcer"
    assert not holder.beat(0.0) and "job forcer" in holder.lost  # and the next beat sees who holds it

    stale = {**holder._record(0.0), "job_id": "dead-run", "heartbeat_at": 0.0}
    plain.write_json(holder.path, stale)
    first = Lease(plain, "first-driver", heartbeat_s=3600)
    second = Lease(store_whose_next_read_lets(first.acquire), "second-driver", heartbeat_s=3600)
    with pytest.raises(LeaseHeld, match="in use by job first-driver .* took it over from job dead-run a moment before"):
        second.acquire()
    assert plain.read_json(holder.path)["job_id"] == "first-driver"

    plain.delete(holder.path)
    ending = Lease(store_whose_next_read_lets(lambda: Lease(plain, "late-forcer", heartbeat_s=3600).acquire(force=True)),
                   "ending-run", heartbeat_s=3600)
    assert ending.store.create_exclusive(ending.path, ending._record(0.0))
    ending.release()  # read its own lease, then the takeover, then its delete: refused
    assert plain.read_json(holder.path)["job_id"] == "late-forcer"


def test_local_conditional_lease_writes_lose_no_update_between_processes(tmp_path):
    """Processes that each read the lease and replace it conditionally, as fast as they can: with
    the compare and the rename under one lock, every replace that reports success is kept (a
    counter in the record ends at the number of successes). Unlocked, two processes passed the
    same compare and one write was lost."""
    import subprocess
    import sys
    import time

    store = OutputStore(str(tmp_path / "out"))
    path = store.meta_path("lease.json")
    store.write_json(path, {"n": 0})
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "from batchspec.runner.store import OutputStore\n"
        "store = OutputStore(sys.argv[1]); path = store.meta_path('lease.json'); won = 0\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.001)\n"  # all start together, imports done
        "for _ in range(400):\n"
        "    held, tag = store.read_json_tagged(path)\n"
        "    won += store.replace_json_if(path, {'n': held['n'] + 1}, tag)\n"
        "print(won)\n")
    workers = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "out"), str(go)], stdout=subprocess.PIPE,
                                text=True) for _ in range(3)]
    time.sleep(3)  # past their imports
    go.touch()
    won = [int(w.communicate(timeout=120)[0]) for w in workers]
    assert all(w.returncode == 0 for w in workers)
    assert sum(won) < 3 * 400  # they really overlapped: some replaces were refused for a newer version
    assert store.read_json(path)["n"] == sum(won)  # and none that succeeded was lost


def test_lease_of_a_dead_local_process_is_taken_over_at_once(tmp_path):
    import subprocess
    import sys

    from batchspec.runner.lease import Lease, LeaseHeld
    from batchspec.runner.lease_state import process_started

    store = OutputStore(str(tmp_path / "out"))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    held = Lease(store, "killed-run")
    record = held._record(0.0)  # as the child would have written it
    record.update(pid=child.pid, owner=f"{record['host']}:{child.pid}", pid_started=process_started(child.pid))
    assert store.create_exclusive(held.path, record)
    with pytest.raises(LeaseHeld, match="in use by job killed-run"):  # alive: refused
        Lease(store, "second").acquire()
    child.kill()
    _wait_for_zombie(child.pid)  # killed, not yet reaped by its parent (this test): dead all the same
    note = Lease(store, "third").acquire()
    assert "took over the lease of job killed-run" in note and f"process {child.pid} on this host is gone" in note
    child.wait()


def _wait_for_zombie(pid: int) -> None:
    import time

    import psutil

    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the killed child never became a zombie"
        time.sleep(0.01)


def test_lease_on_another_host_goes_stale_after_missed_heartbeats(tmp_path):
    import time

    from batchspec.runner.lease import Lease, LeaseHeld

    store = OutputStore(str(tmp_path / "out"))
    store.create_exclusive(Lease(store, "x").path, {"job_id": "remote", "owner": "other-host:1", "host": "other-host",
                                                   "pid": 1, "heartbeat_at": time.time() - 5, "heartbeat_s": 1.0})
    with pytest.raises(LeaseHeld, match="stale after 60s"):
        Lease(store, "a").acquire()
    note = Lease(store, "b", timeout_s=4.0).acquire()  # 5 s without a heartbeat > 4 s (and > 3 beats of 1 s)
    assert "no heartbeat for 5s" in note


def test_an_output_written_before_data_dir_is_still_read(models_dir, tmp_path):
    """Parts at the top of the output (the layout before data/): committed, counted, reported."""
    from batchspec.reports.output import build_report

    store = OutputStore(str(tmp_path / "out"))
    rows = [{**{f.name: None for f in OUTPUT_SCHEMA}, "id": "a", "shard": "s", "row_index": 0, "completion": "x",
             "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2, "spec_enabled": False,
             "draft_tokens": 0, "accepted_tokens": 0, "spec_rounds": 0, "ttft_s": 0.1, "latency_s": 0.2,
             "batch_size": 1, "attempt": 1, "worker": "w", "target_model": "t"}]
    store.write_part("s", pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA))
    os.replace(tmp_path / "out" / "data" / "part-s.parquet", tmp_path / "out" / "part-s.parquet")
    store.write_manifest("s", {"shard": "s", "status": "done", "part": "part-s.parquet", "rows_out": 1})
    store.write_job({"name": "old", "shards": ["s"], "runs": []})
    assert store.committed("s", store.manifests()["s"])
    assert status(str(tmp_path / "out"))["complete"]
    assert build_report(str(tmp_path / "out"))["rows"] == 1


def _shard_actor_niceness(seen: list[int], stop) -> None:
    """Poll /proc for the shard actor (Ray Data's map actor, ray::MapWorker(MapBatches(CallMap)),
    whose name the kernel cuts to 15 characters) and record its niceness."""
    while not stop.is_set():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().startswith("ray::MapWorker("):
                        seen.append(os.getpriority(os.PRIO_PROCESS, int(pid)))
            except OSError:
                pass
        stop.wait(0.02)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads actors' niceness from /proc")
def test_shard_actors_run_at_the_drivers_niceness_not_rays_15(models_dir, ray_session, tmp_path):
    # Ray starts workers at niceness 15; a CPU actor there loses its cores to every nice-0 process
    # (vLLM demo job beside one busy process: 7 s of generation instead of 2.3 s).
    import threading

    write_prompt_shards(local_writer(tmp_path / "in"), 1, 4)
    seen, stop = [], threading.Event()
    poll = threading.Thread(target=_shard_actor_niceness, args=(seen, stop))
    poll.start()
    try:
        assert submit(make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"))).ok
    finally:
        stop.set()
        poll.join()
    assert seen and set(seen) == {os.getpriority(os.PRIO_PROCESS, 0)}


ACTOR_ENV = r"""
import json, os, ray
from batchspec.runner.cluster import actor_runtime_env, init_ray

@ray.remote(num_cpus=1)
class Probe:
    def env(self):
        return {"nice": os.getpriority(os.PRIO_PROCESS, 0), "var": os.environ.get("BATCHSPEC_PROBE")}

def seen(env):
    options = actor_runtime_env(env)
    return {"runtime_env": bool(options), **ray.get(Probe.options(**options).remote().env.remote())}

wanted = {"RAY_worker_niceness": "0", "BATCHSPEC_PROBE": "1"}
init_ray(num_cpus=1)  # as on a Ray this process did not start with the actors' environment
out = {"plain": seen(wanted)}
ray.shutdown()
init_ray(num_cpus=1, worker_env=wanted)
out["driver_env_kept"] = "BATCHSPEC_PROBE" not in os.environ and "RAY_worker_niceness" not in os.environ
out["born_with"] = seen(wanted)
out["any_worker_nice"] = ray.get(ray.remote(lambda: os.getpriority(os.PRIO_PROCESS, 0)).remote())
out["more"] = seen({**wanted, "OMP_WAIT_POLICY": "PASSIVE"})
print("RESULT" + json.dumps(out))
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads niceness")
def test_a_local_ray_gives_its_workers_the_actors_environment_so_actors_need_no_runtime_env():
    """A runtime_env makes Ray start a worker for the actor (0.99-1.44 s to ready on 2 cores)
    instead of handing it one it started in advance (0.33 s). On the local Ray it starts,
    submit gives every worker the actors' environment instead (init_ray's worker_env), and the
    actors go without; on any other Ray they get a runtime_env, as before. A fresh process:
    this needs two Rays of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_worker_niceness", "BATCHSPEC_PROBE")}
    res = result_of(ACTOR_ENV, env=env, timeout=300)
    assert res["plain"] == {"runtime_env": True, "nice": 0, "var": "1"}
    assert res["born_with"] == {"runtime_env": False, "nice": 0, "var": "1"} and res["driver_env_kept"]
    assert res["any_worker_nice"] == 0  # every worker of that Ray, not only the actors: Ray's default is 15
    assert res["more"]["runtime_env"] and res["more"]["var"] == "1"


def test_validate_tells_a_vllm_job_on_cpu_that_latent_attention_was_not_exact(tmp_path, monkeypatch):
    """vLLM's CPU build gave DeepSeek-V3 output that differed from transformers and, speculating,
    from its own plain output (docs/engine.md): a vllm job on CPU actors hears it before it runs,
    from both driver checks (the quick JSON one and the transformers one); a GPU job and the hf
    backend do not."""
    from batchspec.runner import preflight
    from batchspec.runner.preflight import local_model_problems, resolve_models
    from batchspec.spec import spec_from_dict
    from batchspec.testing import build_arch_model, build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    targets = {"deepseek_v3": build_arch_model(tmp_path / "ds", "deepseek_v3", tok),
               "llama": build_arch_model(tmp_path / "llama", "llama", tok)}

    def notes(arch, check, gpus=0, backend="vllm"):
        spec = spec_from_dict({"name": "t", "input": {"path": str(tmp_path / "in")}, "output": {"path": str(tmp_path / "o")},
                               "model": {"target": str(targets[arch]), "draft": {"kind": "ngram"}},
                               "resources": {"gpus_per_actor": gpus}})
        found = []
        with monkeypatch.context() as m:
            if check == "full":  # as for a hub id: the quick check hands over to transformers
                m.setattr(preflight, "local_model_problems", lambda spec, notes=None: None)
            assert (local_model_problems(spec, found) if check == "quick" else resolve_models(spec, backend, found)) == []
        return [n for n in found if "latent attention" in n]

    for check in ("quick", "full"):
        assert len(notes("deepseek_v3", check)) == 1, check
        assert notes("llama", check) == [] and notes("deepseek_v3", check, gpus=1) == []
    assert notes("deepseek_v3", "full", backend="hf") == []


def test_auto_keeps_a_latent_attention_target_off_vllm_on_cpu(tmp_path, monkeypatch, s3):
    """Auto picks the hf engine for a DeepSeek-style target on CPU actors, where vLLM's CPU build
    was not exact (the note above), reading config.json from a local directory, an s3:// prefix or
    the hub's cache; on GPU actors, for other targets, or when the spec says vllm, vLLM serves."""
    import shutil

    import huggingface_hub.constants as hub

    from batchspec.engine import backend as backend_mod
    from batchspec.runner.job import pick_backend
    from batchspec.spec import spec_from_dict
    from batchspec.testing import build_arch_model, build_tokenizer

    monkeypatch.setattr(backend_mod, "vllm_installed", lambda: True)
    tok = build_tokenizer(tmp_path / "tok")
    ds = build_arch_model(tmp_path / "ds", "deepseek_v3", tok)
    llama = build_arch_model(tmp_path / "llama", "llama", tok)
    opts, fs, bucket = s3
    fs.put(str(ds / "config.json"), f"{bucket}/ds/config.json")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub" / "models--acme--tiny-ds" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    shutil.copy(ds / "config.json", snapshot / "config.json")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")

    def pick(target, backend="auto", gpus=0, opts=None):
        return pick_backend(spec_from_dict({
            "name": "t", "input": {"path": "in"}, "output": {"path": "o"}, "resources": {"gpus_per_actor": gpus},
            "model": {"target": str(target), "backend": backend, "draft": {"kind": "ngram"}, "storage_options": opts or {}}}))

    for target, o in ((ds, None), (f"{bucket}/ds", opts), ("acme/tiny-ds", None)):
        name, why = pick(target, opts=o)
        assert name == "hf" and "latent attention" in why, (target, why)
    assert pick(llama)[0] == "vllm" and pick("acme/not-cached")[0] == "vllm"  # unreadable config: not latent
    assert pick(ds, gpus=1)[0] == "vllm" and pick(ds, backend="vllm") == ("vllm", "model.backend is vllm")


def test_submit_logs_what_validate_notes_about_the_models(models_dir, ray_session, tmp_path, caplog):
    """The driver's model check is validate's: what it notes (here a sliding window shorter than
    the rows, which runs them without speculation) is a warning in the submit's log too, once."""
    import logging

    from batchspec.testing import build_arch_model, build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    target = build_arch_model(tmp_path / "mistral", "mistral", tok, window=16)
    write_prompt_shards(local_writer(tmp_path / "in"), 1, 3)
    spec = make_spec(models_dir, str(tmp_path / "in"), str(tmp_path / "out"), model__target=str(target))
    with caplog.at_level(logging.WARNING, logger="batchspec.job"):
        assert submit(spec).ok
    assert sum("16-token window" in r.message for r in caplog.records) == 1, [r.message for r in caplog.records]
