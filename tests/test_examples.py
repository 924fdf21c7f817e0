"""The scheduler examples in examples/, run as a pipeline runs them (issue 60): three nights of a
job through the Dagster asset with daily partitions, one night SIGTERMed by a scheduler's timeout
and finished by the asset, one with a truncated shard that fails its materialization until the
file is fixed; then the night-over-night report, and every row of every night written once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import polars as pl
import yaml
from conftest import local_writer, write_prompt_shards

import batchspec

REPO = Path(__file__).resolve().parents[1]
BATCHSPEC = str(Path(sys.executable).with_name("batchspec"))
NIGHTS = ("2026-12-04", "2026-12-05", "2026-12-06")
SHARDS, ROWS = 6, 12


def test_the_example_spec_takes_the_night_as_a_parameter():
    spec = batchspec.load_job(REPO / "examples" / "nightly.yaml", params={"ds": "2026-12-05"})
    assert (spec.input.path, spec.output.path) == ("in/dt=2026-12-05", "out/dt=2026-12-05")
    assert "{contract}" in (spec.input.template or "")  # a column, filled per row


def tiny_nightly_job(models_dir, tmp_path) -> Path:
    """A job on the tiny test target with the night as its parameter: in/dt={ds} to out/dt={ds}."""
    spec = {"name": "nightly", "input": {"path": str(tmp_path / "in" / "dt={ds}"), "id_column": "doc_id"},
            "output": {"path": str(tmp_path / "out" / "dt={ds}")},
            "model": {"target": str(models_dir / "llama-target"), "draft": {"kind": "ngram"}, "backend": "hf"},
            "generation": {"max_new_tokens": 8}, "resources": {"actors": 1, "batch_size": 4}}
    job = tmp_path / "nightly.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job


def sigterm_after_first_shard(job: Path, ds: str, err: Path) -> int:
    """`batchspec submit JOB --param ds=DS`, SIGTERMed (a scheduler's timeout) once its first shard
    is committed: the exit code."""
    with open(err, "w") as f:
        proc = subprocess.Popen([BATCHSPEC, "submit", str(job), "--param", f"ds={ds}"], stderr=f,
                                stdout=subprocess.DEVNULL)
        deadline = time.time() + 240
        while " rows | so far: " not in err.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=60)


def materialize(asset, ds: str) -> dg.ExecuteInProcessResult:
    return dg.materialize([asset], partition_key=ds, instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)


def test_three_nights_through_the_dagster_asset(models_dir, ray_session, tmp_path, monkeypatch):
    spec = {"name": "nightly", "input": {"path": str(tmp_path / "in" / "dt={ds}"), "id_column": "doc_id"},
            "output": {"path": str(tmp_path / "out" / "dt={ds}")},
            "model": {"target": str(models_dir / "llama-target"), "draft": {"kind": "ngram"}, "backend": "hf"},
            "generation": {"max_new_tokens": 96}, "speculation": {"mode": "on"},
            "resources": {"actors": 1, "batch_size": 4}}
    job = tmp_path / "nightly.yaml"
    job.write_text(yaml.safe_dump(spec))
    ids = {}
    for i, ds in enumerate(NIGHTS):
        folder = tmp_path / "in" / f"dt={ds}"
        write_prompt_shards(local_writer(folder), SHARDS, ROWS, seed=10 * i)
        ids[ds] = set(pl.read_parquet(folder / "*.parquet")["doc_id"].to_list())
    broken = tmp_path / "in" / f"dt={NIGHTS[2]}" / "prompts-0003.parquet"
    whole = broken.read_bytes()
    broken.write_bytes(whole[:100])  # the third night's shard arrives truncated
    monkeypatch.setenv("BATCHSPEC_JOB", str(job))
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    from dagster_nightly import defs, nightly_summaries

    assert defs.resolve_asset_graph().get_all_asset_keys() == {nightly_summaries.key}

    first = materialize(nightly_summaries, NIGHTS[0])
    assert first.success
    metadata = first.asset_materializations_for_node("nightly_summaries")[0].metadata
    assert metadata["rows"].value == SHARDS * ROWS and metadata["outcome"].value == "completed"
    assert metadata["draft"].value == "ngram" and metadata["completion_tokens"].value > 0

    # The second night: the scheduler's timeout SIGTERMs a run; the asset then finishes the night.
    assert sigterm_after_first_shard(job, NIGHTS[1], tmp_path / "stderr.txt") == 143
    second = materialize(nightly_summaries, NIGHTS[1])
    assert second.success
    meta2 = second.asset_materializations_for_node("nightly_summaries")[0].metadata
    assert meta2["shards_already_done"].value >= 1 and meta2["rows"].value == SHARDS * ROWS

    # The third: the truncated shard fails the materialization, with its cause; fixed, it runs alone.
    third = materialize(nightly_summaries, NIGHTS[2])
    assert not third.success
    failure = next(e for e in third.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    assert "prompts-0003: " in failure.step_failure_data.user_failure_data.description
    broken.write_bytes(whole)
    again = materialize(nightly_summaries, NIGHTS[2])
    assert again.success
    meta3 = again.asset_materializations_for_node("nightly_summaries")[0].metadata
    assert (meta3["shards_run"].value, meta3["shards_already_done"].value) == (1, SHARDS - 1)

    # Night over night: each night's figures, the interrupted and the failed nights' runs included.
    trend = batchspec.report(tmp_path / "out")
    assert [n["partition"]["dt"] for n in trend["nights"]] == list(NIGHTS)
    assert [[r["status"] for r in n["runs"]] for n in trend["nights"]] == [
        ["succeeded"], ["interrupted", "succeeded"], ["failed", "succeeded"]]
    interrupted = trend["nights"][1]["runs"][0]
    assert interrupted["wall_s"] > 0 and 1 <= interrupted["shards_committed"] < SHARDS
    assert trend["nights"][2]["runs"][0]["failed_shards"] == ["prompts-0003"]
    assert trend["nights"][2]["rerun_shards"] == ["prompts-0003"]
    assert all(n["complete"] and n["rows"] == SHARDS * ROWS for n in trend["nights"])

    # Nothing lost, nothing twice: every row of every night exactly once, read as a hive dataset.
    rows = pl.read_parquet(tmp_path / "out" / "**" / "data" / "*.parquet", hive_partitioning=True)
    for ds in NIGHTS:
        night = rows.filter(pl.col("dt").cast(pl.Utf8) == ds)["id"].to_list()
        assert len(night) == len(set(night)) == SHARDS * ROWS and set(night) == ids[ds]


AIRFLOW_RUN = """
import json, sys
import pendulum
sys.path.insert(0, sys.argv[1])
import airflow_nightly as dags

night = pendulum.datetime(2026, 12, 5, tz="UTC")
print("RESULT" + json.dumps({"nightly": str(dags.nightly.test(logical_date=night).state),
                             "consumer": str(dags.consumer.test(logical_date=night).state)}))
"""


def test_the_airflow_dag_runs_a_night_by_its_logical_date_and_the_sensor_sees_success(models_dir, tmp_path):
    """Both DAGs of examples/airflow_nightly.py for the logical date 2026-12-05, with `dag.test()` on
    a SQLite metadata database of their own: the BashOperator's `{{ ds }}` becomes the spec's ds, the
    night's shards are written there, and the consumer's FileSensor finds its _SUCCESS. In a process
    of its own: Airflow configures logging and signals for the process it runs in."""
    import os
    import shutil

    home, dags = tmp_path / "airflow", tmp_path / "airflow" / "dags"
    dags.mkdir(parents=True)
    shutil.copy(REPO / "examples" / "airflow_nightly.py", dags)
    job = tiny_nightly_job(models_dir, tmp_path)
    write_prompt_shards(local_writer(tmp_path / "in" / "dt=2026-12-05"), 2, 3)
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW_CONN_FS_DEFAULT": '{"conn_type": "fs"}', "BATCHSPEC_JOB": str(job), "BATCHSPEC_OUT": str(tmp_path / "out"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    migrate = subprocess.run([str(Path(sys.executable).with_name("airflow")), "db", "migrate"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert migrate.returncode == 0, migrate.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-c", AIRFLOW_RUN, str(dags)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert lines, (proc.stdout + proc.stderr)[-4000:]
    import json

    assert json.loads(lines[0][6:]) == {"nightly": "success", "consumer": "success"}, (proc.stdout + proc.stderr)[-6000:]
    marker = json.loads((tmp_path / "out" / "dt=2026-12-05" / "_batchspec" / "_SUCCESS").read_text())
    assert marker["rows"] == 6 and marker["shards"] == 2


def test_the_cron_script_runs_a_night_on_a_cluster_through_ray_job_submit(models_dir, tmp_path):
    """examples/cron_nightly.sh against a cluster started with `ray start --head` (its job server on,
    token authentication as Ray 2.60 sets it): a night completes (exit 0); a night with a truncated
    shard exits 1, which `ray job submit` alone would say of any failure, the script because the
    output is not complete; fixed, the same command finishes it."""
    import os
    import socket

    from test_reliability import RayNodes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dashboard = s.getsockname()[1]
    job = tiny_nightly_job(models_dir, tmp_path)
    for ds in ("2026-12-05", "2026-12-06"):
        write_prompt_shards(local_writer(tmp_path / "in" / f"dt={ds}"), 2, 3)
    broken = tmp_path / "in" / "dt=2026-12-06" / "prompts-0001.parquet"
    whole = broken.read_bytes()
    broken.write_bytes(whole[:100])
    cluster = RayNodes(tmp_path, dashboard_port=dashboard)
    env = {**cluster.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "BATCHSPEC_JOB": str(job),
           "RAY_JOB_ADDRESS": f"http://127.0.0.1:{dashboard}"}
    cluster.env = env  # the head's processes, and the job drivers they start, find batchspec on PATH
    script = str(REPO / "examples" / "cron_nightly.sh")
    try:
        cluster.start("--num-cpus=2")
        ray = str(Path(sys.executable).with_name("ray"))
        deadline = time.time() + 120  # `ray start` returns before the head's job agent takes jobs ("No available agent")
        while subprocess.run([ray, "job", "submit", "--address", env["RAY_JOB_ADDRESS"], "--", "true"], env=env,
                             capture_output=True, timeout=120).returncode != 0 and time.time() < deadline:
            time.sleep(2)
        ok = subprocess.run(["bash", script, "2026-12-05"], env=env, capture_output=True, text=True, timeout=400)
        assert ok.returncode == 0, (ok.stdout + ok.stderr)[-4000:]
        assert "batchspec night 2026-12-05: complete" in ok.stdout
        failed = subprocess.run(["bash", script, "2026-12-06"], env=env, capture_output=True, text=True, timeout=400)
        assert failed.returncode == 1 and "2026-12-06: not complete" in failed.stderr, (failed.stdout + failed.stderr)[-4000:]
        broken.write_bytes(whole)
        fixed = subprocess.run(["bash", script, "2026-12-06"], env=env, capture_output=True, text=True, timeout=400)
        assert fixed.returncode == 0, (fixed.stdout + fixed.stderr)[-4000:]
    finally:
        cluster.stop()
    for ds in ("2026-12-05", "2026-12-06"):
        marker = (tmp_path / "out" / f"dt={ds}" / "_batchspec" / "_SUCCESS").read_text()
        assert '"rows": 6' in marker
