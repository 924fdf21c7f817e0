"""The command line as a user meets it, run as a real process where the terminal matters: one
line per shard and one summary, a truly quiet --quiet, JSON on every stderr line, Ctrl-C that
says what is done, user mistakes as one line and exit 2, a status a pipeline can read, and an
output directory that polars, pandas, pyarrow and duckdb all open."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import local_writer, write_prompt_shards
from typer.testing import CliRunner

from batchspec.cli import app

BATCHSPEC = str(Path(sys.executable).with_name("batchspec"))


def write_job(models_dir, tmp_path, name="job", shards=3, rows=4, max_new=8, **model) -> Path:
    inp = tmp_path / f"{name}-in"
    if not inp.exists():
        write_prompt_shards(local_writer(inp), shards, rows)
    spec = {"name": name, "input": {"path": str(inp), "id_column": "doc_id"}, "output": {"path": str(tmp_path / f"{name}-out")},
            "model": {"target": str(models_dir / "llama-target"), "draft": {"kind": "ngram"}, "backend": "hf", **model},
            "generation": {"max_new_tokens": max_new}, "resources": {"actors": 1, "batch_size": 4}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_cli(*args, timeout=300, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "60"}  # a narrow terminal width must not wrap lines into a file
    return subprocess.run([BATCHSPEC, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def test_default_output_in_a_log_is_the_plan_progress_lines_and_one_summary(models_dir, tmp_path):
    """stderr is not a terminal here: the first and the last shard print (the others would once
    --progress-every seconds passed; 0 prints every one), then the summary."""
    job = write_job(models_dir, tmp_path)
    res = run_cli("submit", str(job))
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0] == "3 shard(s): 3 to run, 0 already done"
    assert [line.split(":")[0][:15] for line in lines[1:3]] == ["shard prompts-0"] * 2
    assert lines[1].endswith("1/3 shards, about " + lines[1].rsplit("about ", 1)[1]) and "3/3 shards" in lines[2]
    assert lines[3].startswith("done: 3 shard(s) run") and lines[3].endswith(f"output {tmp_path / 'job-out'}")
    assert len(lines) == 4, res.stderr  # no Ray banner, no worker lines, no loading bars, no wrapped summary
    again = run_cli("rerun", str(job)).stderr.splitlines()  # nothing to run: no acceptance, and not "speculation off"
    assert again[-1].startswith("done: 0 shard(s) run, 3 already done") and "acceptance n/a (nothing generated)" in again[-1]
    every = run_cli("submit", str(job), "--progress-every", "0", "--set", f"output.path={tmp_path / 'every'}")
    assert sorted(line.split(":")[0] for line in every.stderr.splitlines()[1:4]) == [
        f"shard prompts-000{i}" for i in range(3)]


def test_a_batchspec_folder_in_the_working_directory_does_not_reach_the_actors(models_dir, tmp_path):
    """Ray puts the driver's working directory first on its workers' sys.path: run from the parent
    of a checkout (here a folder named batchspec/ with a package that cannot be imported), every
    shard failed with "cannot import name '__version__' from 'batchspec'". The local Ray's workers
    now import the installed package before that path is added."""
    (tmp_path / "batchspec").mkdir()
    (tmp_path / "batchspec" / "__init__.py").write_text("raise ImportError('not the installed batchspec')\n")
    job = write_job(models_dir, tmp_path, shards=2)
    res = run_cli("submit", str(job), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "done: 2 shard(s) run, 0 already done, 0 failed" in res.stderr, res.stderr[-3000:]


def test_joining_a_cluster_from_beside_a_batchspec_folder_is_refused_in_one_line(tmp_path, monkeypatch):
    """A Ray this process joins started its workers itself, so the preload cannot reach them: the
    run is refused before anything is written, naming the folder."""
    from batchspec.runner.cluster import shadowed_package

    monkeypatch.chdir(tmp_path)
    assert shadowed_package() is None
    (tmp_path / "batchspec").mkdir()
    assert "run from another directory or rename it" in (shadowed_package() or "")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # a checkout of batchspec, run from its root
    assert shadowed_package() is None


def test_a_failed_shard_is_told_once_with_its_reason_and_quiet_still_tells_it(models_dir, tmp_path):
    job = write_job(models_dir, tmp_path, name="bad", shards=2)
    (tmp_path / "bad-in" / "prompts-0009.parquet").write_bytes(b"not a parquet file")
    res = run_cli("submit", str(job), "--set", "generation.max_new_tokens=6")
    assert res.returncode == 1, res.stderr
    told = [line for line in res.stderr.splitlines() if "prompts-0009" in line]
    assert len(told) == 2, res.stderr  # the shard's line and the closing `error: ... rerun` line
    assert told[0].startswith("shard prompts-0009: failed (") and "Parquet" in told[0]
    assert told[1].startswith("error: 1 shard(s) failed: prompts-0009.")
    # The hint keeps the overrides: without them the spec differs and rerun would refuse (exit 2).
    assert f"`batchspec rerun {job} --set generation.max_new_tokens=6` redoes only" in told[1]
    quiet = run_cli("rerun", str(job), "--set", "generation.max_new_tokens=6", "--quiet")
    assert quiet.returncode == 1  # no display: the warning carries the reason
    assert [line for line in quiet.stderr.splitlines() if "shard failed" in line and "Parquet" in line], quiet.stderr


def test_quiet_prints_nothing_on_success_and_json_is_json(models_dir, tmp_path):
    job = write_job(models_dir, tmp_path)
    quiet = run_cli("submit", str(job), "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr

    job2 = write_job(models_dir, tmp_path, name="json")
    res = run_cli("submit", str(job2), "--log-format", "json")
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in res.stderr.splitlines()]  # every line parses
    assert all(isinstance(r, dict) for r in records)
    msgs = [r["msg"] for r in records]
    assert msgs[0] == "job started" and msgs[-1] == "job succeeded"
    assert sorted(r["shard"] for r in records if r["msg"] == "shard done") == [f"prompts-000{i}" for i in range(3)]
    assert all(r["logger"].startswith("batchspec") for r in records), msgs  # nothing foreign got through


def test_json_logs_with_worker_logs_give_each_actor_line_as_its_own_record(models_dir, tmp_path):
    """--worker-logs forwards the actors' stderr through Ray, which prefixes each line with a
    coloured "(ShardWorker pid=N)"; in JSON the actor's own record comes out with `actor` and
    `pid`, not as the string of a "stderr" record."""
    job = write_job(models_dir, tmp_path, name="wlogs")
    res = run_cli("submit", str(job), "--log-format", "json", "--worker-logs")
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in res.stderr.splitlines()]
    from_actor = [r for r in records if r.get("actor") == "ShardWorker"]
    assert from_actor and all(isinstance(r["pid"], int) for r in from_actor), records
    assert any(r["logger"].startswith("batchspec") for r in from_actor), from_actor  # the actor's records, parsed
    assert not [r for r in records if "\x1b[" in str(r.get("msg")) or "pid=" in str(r.get("msg"))], records


def test_json_logs_with_worker_logs_on_vllm_leave_stdout_empty_and_keep_vllms_levels(tmp_path):
    """vLLM's own handler wrote to the actor's stdout, which --worker-logs forwards to the driver's
    stdout: 45 raw, coloured lines of a demo run beside the JSON records on stderr. Now they are
    records on stderr, with vLLM's level, logger "vllm" and the source line."""
    from batchspec.engine.backend import vllm_installed

    if not vllm_installed():
        pytest.skip("vllm is not installed (make installs it)")
    root = Path(__file__).resolve().parents[1]
    res = run_cli("submit", str(root / "jobs/summarize_legal_small.yaml"), "--log-format", "json", "--worker-logs",
                  "--set", f"output.path={tmp_path / 'out'}", "--set", "model.backend=vllm")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == ""
    records = [json.loads(line) for line in res.stderr.splitlines()]
    from_vllm = [r for r in records if r.get("logger") == "vllm" and r.get("actor") == "ShardWorker"]
    assert any("non-default args" in r["msg"] for r in from_vllm), records
    assert {r["level"] for r in from_vllm} >= {"INFO", "WARNING"} and all(":" in r["source"] for r in from_vllm)


def test_json_line_reads_vllms_own_format_and_leaves_other_lines_whole():
    from batchspec.runner.stderr import json_line

    vllm = json.loads(json_line("\x1b[36m(ShardWorker pid=7)\x1b[0m (MainProcess pid=7) WARNING 12-01 06:55:52 "
                                "[api_utils.py:286] seed [set]"))
    assert {k: vllm[k] for k in ("level", "logger", "actor", "pid", "source", "msg")} == {
        "level": "WARNING", "logger": "vllm", "actor": "ShardWorker", "pid": 7, "source": "api_utils.py:286",
        "msg": "seed [set]"}
    mapped = json.loads(json_line('\x1b[36m(MapWorker(MapBatches(CallMap)) pid=8)\x1b[0m {"msg": "shard done"}'))
    assert mapped == {"msg": "shard done", "actor": "ShardWorker", "pid": 8}  # Ray Data's name for the shard actor
    other = json.loads(json_line("WARNING: something [x] else"))
    assert (other["level"], other["logger"], other["msg"]) == ("INFO", "stderr", "WARNING: something [x] else")
    assert json_line("   ") is None


def interrupt_when(job: Path, tmp_path, *markers: str, sig: int = signal.SIGINT) -> tuple[int, str]:
    """`batchspec submit JOB`, sent sig (SIGINT) as soon as its stderr shows each marker in turn:
    (exit code, stderr)."""
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        # As a shell starts a foreground command: SIGINT at its default. A background job of a shell
        # without job control (`bash -c '... &'`, how CI may run) inherits it ignored, and Python
        # then never raises KeyboardInterrupt: these tests failed that way, not batchspec.
        proc = subprocess.Popen([BATCHSPEC, "submit", str(job)], stderr=f, stdout=subprocess.DEVNULL,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        for marker in markers:
            deadline = time.time() + 240
            while marker not in err.read_text() and time.time() < deadline and proc.poll() is None:
                time.sleep(0.02)
            proc.send_signal(sig)
        code = proc.wait(timeout=60)
    return code, err.read_text()


def test_a_jobs_second_run_starts_from_the_memory_its_first_left(models_dir, tmp_path):
    """The user's path for the policy memory: BATCHSPEC_POLICY_MEMORY set where `submit` runs
    reaches the actors of the Ray it starts; the second run calibrates nothing and says where its
    numbers come from. (A local Ray's workers inherit the driver's environment anyway; that the
    driver passes the variable to a cluster started without it showed in the bench's Ray-up runs,
    which decided from memory: docs/benchmarks.md.)"""
    job = write_job(models_dir, tmp_path, name="nightly")
    env = {**os.environ, "BATCHSPEC_POLICY_MEMORY": str(tmp_path / "memory")}
    for out in ("night1", "night2"):
        res = subprocess.run([BATCHSPEC, "submit", str(job), "--quiet", "--set", f"output.path={tmp_path / out}"],
                             capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stderr
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "memory").iterdir()) == ["costs", "job"]
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "night2" / "_batchspec" / "shards").glob("*.json")]
    assert len(manifests) == 3 and all(m["timings"]["calibrate_s"] == 0 for m in manifests)
    # The actor's first call says so (its later ones rest on this run's own measurements too).
    first = [d for m in manifests for d in m["decisions"] if "measured on this node)" in d["reason"]]
    assert len(first) == 1 and first[0]["numbers"]["remembered"].startswith("job nightly-"), manifests


def test_ctrl_c_records_the_run_and_says_how_to_continue(models_dir, tmp_path):
    # 12 shards of 3 micro-batches, ~1 s each: the signal after the first lands with most to do,
    # and the rerun is short (at 40 rows a shard this test took 85-89 s, now 57 s).
    job = write_job(models_dir, tmp_path, shards=12, rows=12, max_new=128)
    code, text = interrupt_when(job, tmp_path, " rows | so far: ")
    assert code == 130
    assert "interrupted:" in text and f"`batchspec rerun {job}` runs only those" in text
    record = json.loads((tmp_path / "job-out" / "_batchspec" / "job.json").read_text())
    assert record["status"] == "interrupted" and record["runs"][-1]["status"] == "interrupted"
    assert record["runs"][-1]["pending"] > 0
    assert not (tmp_path / "job-out" / "_batchspec" / "lease.json").exists()  # released: rerun starts at once
    res = run_cli("rerun", str(job), "--quiet")
    assert res.returncode == 0, res.stderr
    st = json.loads(run_cli("status", str(job), "--format", "json").stdout)
    assert st["complete"] and st["shards"]["done"] == 12


def test_sigterm_stops_a_run_as_ctrl_c_does(models_dir, tmp_path):
    """What a scheduler sends at a timeout. Before, Ray's handlers printed a C++ stack dump and
    exited, leaving job.json saying "running"; now the run is recorded as interrupted (by SIGTERM),
    the lease released, and the exit code is 143 (128 + 15)."""
    job = write_job(models_dir, tmp_path, name="termed", shards=12, rows=40, max_new=128)
    code, text = interrupt_when(job, tmp_path, " rows | so far: ", sig=signal.SIGTERM)
    assert code == 143, text
    assert "terminated (SIGTERM): " in text and f"`batchspec rerun {job}` runs only those" in text, text
    assert "SIGTERM received" not in text and "Traceback" not in text, text
    record = json.loads((tmp_path / "termed-out" / "_batchspec" / "job.json").read_text())
    assert record["status"] == "interrupted" and record["runs"][-1]["interrupted_by"] == "SIGTERM"
    assert not (tmp_path / "termed-out" / "_batchspec" / "lease.json").exists()


def test_ctrl_c_while_ray_starts_records_nothing_and_says_submit(models_dir, tmp_path):
    """Ray is joined before the run is recorded; a Ctrl-C there leaves a new output without
    job.json, and `rerun` would refuse it: the hint says `submit`."""
    job = write_job(models_dir, tmp_path, name="early")
    code, text = interrupt_when(job, tmp_path, "shard(s): ")
    assert code == 130 and f"`batchspec submit {job}` runs only those" in text, text
    assert "Traceback" not in text, text
    assert not (tmp_path / "early-out" / "_batchspec" / "job.json").exists()
    assert not (tmp_path / "early-out" / "_batchspec" / "lease.json").exists()


def test_a_run_started_with_sigint_ignored_keeps_ignoring_it():
    """A background job of a shell without job control starts with SIGINT ignored, and Python
    raises no KeyboardInterrupt then; the deferral around Ray's start must not install a handler
    that undoes it (the run would stop at a Ctrl-C meant for the shell's foreground job)."""
    from batchspec.runner.signals import ctrl_c_kept

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ctrl_c_kept():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_after_the_summary_is_ignored_while_ray_stops(models_dir, tmp_path):
    """The output is complete once the summary is printed; a Ctrl-C during Ray's shutdown after it
    must not print a traceback or change the exit code."""
    code, text = interrupt_when(write_job(models_dir, tmp_path, name="late"), tmp_path, "\ndone: ")
    assert "\ndone: 3 shard(s) run" in text
    assert code == 0 and "Traceback" not in text and "Exception ignored" not in text, text


def test_a_second_ctrl_c_while_an_interrupted_job_stops_ray_is_ignored(models_dir, tmp_path):
    """The run is recorded before the "interrupted:" line; a user pressing Ctrl-C again while Ray
    shuts down must get exit 130 and no traceback, not Python's atexit complaint."""
    job = write_job(models_dir, tmp_path, name="twice", shards=12, rows=40, max_new=128)
    code, text = interrupt_when(job, tmp_path, " rows | so far: ", "interrupted: ")
    assert code == 130 and "interrupted: " in text
    assert "Traceback" not in text and "Exception ignored" not in text, text
    record = json.loads((tmp_path / "twice-out" / "_batchspec" / "job.json").read_text())
    assert record["status"] == "interrupted"


def one_line_error(res, after: str | None = None) -> str:
    """The one `error: ` line of a refused command (exit 2); after: the one line allowed before it."""
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    if after is not None:
        assert lines[:1] == [after], res.output
        lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    return lines[0]


def test_user_mistakes_are_one_line_and_exit_2(models_dir, tmp_path, monkeypatch):
    cli = CliRunner()
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    typo = write_job(models_dir, tmp_path, name="typo", target="models/legal-targt")
    assert "model directory models/legal-targt does not exist" in one_line_error(cli.invoke(app, ["submit", str(typo)]))

    (tmp_path / "afile").write_text("")
    spec = yaml.safe_load(write_job(models_dir, tmp_path, name="under").read_text())
    spec["output"]["path"] = str(tmp_path / "afile" / "out")
    (tmp_path / "under.yaml").write_text(yaml.safe_dump(spec))
    assert "which is a file" in one_line_error(cli.invoke(app, ["submit", str(tmp_path / "under.yaml")]))
    res = cli.invoke(app, ["validate", str(tmp_path / "under.yaml")])
    assert res.exit_code == 2 and "which is a file" in res.output

    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        spec["output"]["path"] = str(locked / "out")
        (tmp_path / "locked.yaml").write_text(yaml.safe_dump(spec))
        assert "no write permission" in one_line_error(cli.invoke(app, ["submit", str(tmp_path / "locked.yaml")]))

    assert "no batchspec job" in one_line_error(cli.invoke(app, ["status", str(tmp_path / "nothing")]))

    # `rerun OUTPUT` (the interrupted-run hint says `rerun JOB`): a traceback before, one line now.
    (tmp_path / "out" / "_batchspec").mkdir(parents=True)
    (tmp_path / "out" / "_batchspec" / "job.json").write_text("{}")
    assert "is a job's output: give the job file" in one_line_error(cli.invoke(app, ["rerun", str(tmp_path / "out")]))
    assert "is a directory, not a job spec file" in one_line_error(cli.invoke(app, ["submit", str(tmp_path)]))


def test_params_fill_the_spec_and_a_missing_one_is_named(models_dir, tmp_path):
    """Issue 60: `output.path: out/dt={ds}` with --param ds=..., on every command that reads the
    spec; without it, one line naming the parameter, exit 2, nothing written."""
    job = write_job(models_dir, tmp_path, shards=1, rows=2, max_new=4)
    spec = yaml.safe_load(job.read_text())
    spec["output"]["path"] = str(tmp_path / "out" / "dt={ds}")
    job.write_text(yaml.safe_dump(spec))
    missing = run_cli("submit", str(job))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "output.path has the parameter {ds} but no value for it: pass --param ds=VALUE" in missing.stderr
    assert not (tmp_path / "out").exists()
    res = run_cli("submit", str(job), "--param", "ds=2026-12-05", "--quiet")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "dt=2026-12-05" / "_batchspec" / "_SUCCESS").exists()
    st = run_cli("status", str(job), "--param", "ds=2026-12-05", "--json")
    assert json.loads(st.stdout)["complete"] and st.returncode == 0
    assert run_cli("validate", str(job), "--param", "ds=2026-12-05", "--skip-model").returncode == 0
    typo = run_cli("status", str(job), "--param", "dS=2026-12-05")
    assert typo.returncode == 2 and "{ds} but no value" in typo.stderr


def test_a_crash_of_batchspec_itself_is_exit_3_one_record_and_recorded(models_dir, tmp_path):
    """Issue 60: a crash (here the runner raising once Ray is up and the lease taken) was exit 1,
    like a failed shard, with the traceback spread over many records and job.json left `running`.
    Now: exit 3, stdout empty, every stderr line JSON, the traceback inside one record, the run
    recorded as crashed with its wall time, and `status` agreeing."""
    job = write_job(models_dir, tmp_path, shards=1, rows=2)
    code = ("import sys, batchspec.runner.job as j\n"
            "def boom(plan):\n    raise RuntimeError('the runner broke\\nsecond line')\n"
            "j.run = boom\nfrom batchspec.cli import main\n"
            "sys.argv = ['batchspec', 'submit', sys.argv[1], '--log-format', 'json']\nmain()\n")
    res = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 3, res.stderr
    assert res.stdout == ""
    records = [json.loads(line) for line in res.stderr.splitlines()]
    crashed = [r for r in records if r["msg"].startswith("run crashed")]
    assert len(crashed) == 1 and "Traceback" in crashed[0]["traceback"] and "second line" in crashed[0]["traceback"]
    assert any(r["msg"].startswith("error: the run crashed (RuntimeError: the runner broke)") for r in records), records
    recorded = json.loads((tmp_path / "job-out" / "_batchspec" / "job.json").read_text())
    run = recorded["runs"][-1]
    assert recorded["status"] == run["status"] == "crashed" and run["error"] == "RuntimeError: the runner broke"
    assert run["wall_s"] > 0 and run["pending"] == 1
    st = run_cli("status", str(job), "--json")
    assert st.returncode == 1 and json.loads(st.stdout)["job_status"] == "crashed"


def exit_path(args: list[str], sig: int | None = None, marker: str = '"shard done"') -> tuple[int, list[dict]]:
    """`batchspec ARGS --log-format json` (sent sig once its stderr shows marker): exit code, records."""
    proc = subprocess.Popen([BATCHSPEC, *args, "--log-format", "json"], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if sig is not None and marker in line:
            proc.send_signal(sig)
            sig = None
    code = proc.wait(timeout=120)
    assert proc.stdout is not None and proc.stdout.read() == ""  # stdout stays empty on every path
    return code, [json.loads(line) for line in lines]


def test_every_exit_path_says_its_code_its_last_record_and_job_json_and_status_agree(models_dir, tmp_path):
    """Issue 60's contract, path by path under --log-format json: completed, error rows, a failed
    shard, refused, SIGTERM, Ctrl-C (a crash: test_a_crash_of_batchspec_itself_...). Each: its
    exit code, its last log record, and job.json's run status equal to what `status` says."""

    def agree(job: Path, out: Path, expected: str) -> dict:
        recorded = json.loads((out / "_batchspec" / "job.json").read_text())
        st = json.loads(run_cli("status", str(job), "--json").stdout)
        assert recorded["status"] == recorded["runs"][-1]["status"] == st["job_status"] == expected, (recorded, st)
        return st

    job = write_job(models_dir, tmp_path, shards=2, rows=3)
    code, records = exit_path(["submit", str(job)])
    assert code == 0 and records[-1]["msg"] == "job succeeded"
    assert agree(job, tmp_path / "job-out", "succeeded")["complete"]

    refused, records = exit_path(["submit", str(job), "--set", "generation.seed=5"])  # a changed spec
    assert refused == 2 and records[-1]["msg"].startswith("error: ") and "generation.seed: 0 there, 5 here" in records[-1]["msg"]
    agree(job, tmp_path / "job-out", "succeeded")  # nothing recorded for a refused run

    import pyarrow as pa
    import pyarrow.parquet as pq

    errors = write_job(models_dir, tmp_path, name="errors", shards=1, rows=3)
    pq.write_table(pa.table({"prompt": ["a lease", "", "a tenant"], "doc_id": ["x", "y", "z"]}),
                   tmp_path / "errors-in" / "prompts-0000.parquet")
    code, records = exit_path(["submit", str(errors)])
    assert code == 0 and records[-1]["msg"] == "job succeeded"
    assert agree(errors, tmp_path / "errors-out", "succeeded")["error_rows"] == 1

    failing = write_job(models_dir, tmp_path, name="failing", shards=2, rows=3)
    shard = tmp_path / "failing-in" / "prompts-0001.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    code, records = exit_path(["submit", str(failing)])
    assert code == 1 and records[-1]["msg"].startswith("error: 1 shard(s) failed: prompts-0001.")
    assert any(r["msg"] == "job failed" for r in records)
    assert not agree(failing, tmp_path / "failing-out", "failed")["complete"]

    for name, sig, code_expected, said in (("termed", signal.SIGTERM, 143, "terminated (SIGTERM): "),
                                            ("ctrlc", signal.SIGINT, 130, "interrupted: ")):
        slow = write_job(models_dir, tmp_path, name=name, shards=8, rows=12, max_new=96)
        code, records = exit_path(["submit", str(slow)], sig=sig)
        assert code == code_expected and records[-1]["msg"].startswith(said), records[-3:]
        assert any(r["msg"] == "job interrupted" for r in records)
        assert not agree(slow, tmp_path / f"{name}-out", "interrupted")["complete"]
        run = json.loads((tmp_path / f"{name}-out" / "_batchspec" / "job.json").read_text())["runs"][-1]
        assert run["wall_s"] > 0 and len(run["startup"]["actors"]) == 1  # an interrupted run is counted too


def test_status_and_report_on_s3_without_endpoint_are_one_line(monkeypatch):
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for cmd in ("status", "report"):
        line = one_line_error(CliRunner().invoke(app, [cmd, "s3://no-such-bucket-batchspec/out"]))
        assert "endpoint_url" in line and "job file" in line


def test_status_reads_the_job_file_on_s3_and_prints_json(models_dir, ray_session, s3, tmp_path):
    from batchspec.runner.job import submit
    from batchspec.spec import load_spec

    opts, fs, bucket = s3
    from conftest import s3_writer

    write_prompt_shards(s3_writer(fs, f"{bucket}/in"), 2, 3)
    spec = {"name": "s3job", "input": {"path": f"{bucket}/in", "id_column": "doc_id", "storage_options": opts},
            "output": {"path": f"{bucket}/out", "storage_options": opts},
            "model": {"target": str(models_dir / "llama-target"), "draft": {"kind": "ngram"}, "backend": "hf"},
            "generation": {"max_new_tokens": 4}, "resources": {"actors": 1}}
    job = tmp_path / "s3job.yaml"
    job.write_text(yaml.safe_dump(spec))
    assert submit(load_spec(str(job))).ok
    res = CliRunner().invoke(app, ["status", str(job), "--format", "json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.stdout)
    assert st["complete"] is True and st["shards"] == {"done": 2, "failed": 0, "pending": 0, "total": 2}
    assert st["rows"] == 6 and st["error_rows"] == 0
    table = CliRunner().invoke(app, ["status", str(job)])  # the default table, as a person reads it
    assert table.exit_code == 0 and not isinstance(table.exception, Exception), table.output
    assert "2 done, 0 failed, 0 pending (complete)" in table.output and "prompts-0001" in table.output
    # A committed part deleted afterwards: incomplete again, whatever _SUCCESS says.
    fs.rm(f"{bucket}/out/data/part-prompts-0000.parquet")
    res = CliRunner().invoke(app, ["status", str(job), "--format", "json"])
    st = json.loads(res.stdout)
    assert res.exit_code == 1 and st["complete"] is False and st["shards"]["pending"] == 1
    table = CliRunner().invoke(app, ["status", str(job)])
    assert table.exit_code == 1 and not isinstance(table.exception, Exception), table.output  # no crash
    assert "1 done, 0 failed, 1 pending" in table.output and "(complete)" not in table.output
    report = CliRunner().invoke(app, ["report", str(job), "--format", "json"])  # the job file knows the endpoint
    assert report.exit_code == 0 and json.loads(report.stdout)["rows"] == 3


def test_every_reader_opens_the_output(models_dir, ray_session, tmp_path):
    import duckdb
    import pandas as pd
    import polars as pl
    import pyarrow.dataset as ds

    from batchspec.runner.job import submit
    from batchspec.spec import load_spec

    job = write_job(models_dir, tmp_path, shards=3, rows=4)
    assert submit(load_spec(str(job))).ok
    data = tmp_path / "job-out" / "data"
    expected = 12
    assert pl.read_parquet(data).height == expected
    assert pl.read_parquet(f"{data}/*.parquet").height == expected
    assert len(pd.read_parquet(data)) == expected
    assert len(pd.read_parquet(tmp_path / "job-out")) == expected  # pandas skips _batchspec/ on its own
    assert ds.dataset(data).count_rows() == expected
    assert duckdb.sql(f"select count(*) from read_parquet('{data}/*.parquet')").fetchall()[0][0] == expected
    assert duckdb.sql(f"select count(distinct id) from '{data}/*.parquet'").fetchall()[0][0] == expected


def test_a_model_the_engine_cannot_serve_is_refused_by_the_driver_before_anything_is_written(models_dir, tmp_path):
    """A recurrent model (here a Mamba config) is refused by the driver in one line, exit 2, before
    anything is written: not an ActorDiedError from every actor. The check that finds it imports
    transformers, so it runs while Ray starts (runner/job.py, _ModelCheck): the plan line comes
    first."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models_dir / "tokenizer")
    mamba = tmp_path / "mamba"
    AutoConfig.for_model("mamba", vocab_size=len(tok), hidden_size=64, num_hidden_layers=2).save_pretrained(mamba)
    tok.save_pretrained(mamba)
    job = write_job(models_dir, tmp_path, name="mamba", target=str(mamba))
    line = one_line_error(CliRunner().invoke(app, ["submit", str(job)]), after="3 shard(s): 3 to run, 0 already done")
    assert "model type 'mamba' has layers of type linear_attention" in line and "model.backend: vllm" in line
    assert not (tmp_path / "mamba-out").exists()
    res = CliRunner().invoke(app, ["validate", str(job)])
    assert res.exit_code == 2 and "model type 'mamba'" in res.output


def test_a_cluster_that_does_not_answer_is_refused_at_once(models_dir, tmp_path):
    """`submit --address` to a cluster that is down hung for 13 minutes inside ray.init (20 tries,
    each blocked in a call Ctrl-C does not reach) with the output's lease held and job.json saying
    running. Now one line, exit 2, in the time of one connection attempt, and nothing recorded."""
    import socket

    from batchspec.runner.cluster import cluster_unreachable

    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "no Ray cluster answers at 127.0.0.1:" in cluster_unreachable(f"127.0.0.1:{port}")
    assert "no Ray cluster answers at ray://127.0.0.1:" in cluster_unreachable(f"ray://127.0.0.1:{port}")
    with socket.create_server(("127.0.0.1", 0)) as listening:
        assert cluster_unreachable(f"127.0.0.1:{listening.getsockname()[1]}") is None

    job = write_job(models_dir, tmp_path, name="away")
    t = time.perf_counter()
    run = run_cli("submit", str(job), "--quiet", "--address", f"127.0.0.1:{port}", timeout=120)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: no Ray cluster answers"), run.stderr
    assert time.perf_counter() - t < 60
    out = yaml.safe_load(job.read_text())["output"]["path"]
    assert not (Path(out) / "_batchspec" / "job.json").exists()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_line_ray_repeats_every_second_is_printed_once_with_a_count(fmt):
    """Ray's C++ core writes the same warning once a second while it retries (20 lines for a
    cluster whose token does not match); batchspec's stderr filter prints it once and counts."""
    script = f"""
import os
from batchspec.runner.stderr import capture_stderr
capture_stderr({fmt!r})
for i in range(20):
    os.write(2, f"[2026-11-30 16:47:{{i:02d}},884 W 25974 25974] gcs_client.cc:210: Failed to get cluster ID\\n".encode())
os.write(2, b"[2026-11-30 16:47:21,001 W 25974 25974] other.cc:1: something else\\n")
os.write(2, b"[2026-11-30 16:47:22,001 W 25974 25974] other.cc:1: something else\\n")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    lines = run.stderr.splitlines()
    if fmt == "json":
        lines = [json.loads(line)["msg"] for line in lines]
    assert run.returncode == 0 and len(lines) == 4, run.stderr
    assert lines[0].endswith("gcs_client.cc:210: Failed to get cluster ID")
    assert lines[1] == "(the line above repeated 19 more times)"
    assert lines[2].endswith("other.cc:1: something else")
    assert lines[3] == "(the line above repeated 1 more time)"


def test_progress_in_a_log_is_a_line_a_while_not_a_line_a_shard():
    """Not a terminal (a log file, a pipe): the first shard, every failed shard and the last print;
    the others only once --progress-every seconds have passed since the last line."""
    import io

    from batchspec.runner.progress import Progress

    def run(every_s: float) -> list[str]:
        out = io.StringIO()
        p = Progress(stream=out, every_s=every_s)
        p.planned(list(range(100)), list(range(100)))
        for i in range(100):
            p.shard_done({"shard": f"s{i}", "status": "failed" if i == 50 else "done", "rows_out": 2,
                          "error": "bad input" if i == 50 else None, "tokens": {"completion_tokens": 10}})
        return out.getvalue().splitlines()[1:]  # after "100 shard(s): 100 to run, 0 already done"

    quiet = run(3600)
    assert [line.split(":")[0] for line in quiet] == ["shard s0", "shard s50", "shard s99"], quiet
    assert "failed (bad input)" in quiet[1] and quiet[2].endswith("100/100 shards, about 0s left")
    assert len(run(0)) == 100  # every shard when asked

    # Time left is priced from when the first finished shard started, not from the job's start
    # (start-up is paid once): 1 of 4 shards done 2 s after it started, 60 s into the job: about 6 s.
    from datetime import UTC, datetime, timedelta

    out = io.StringIO()
    p = Progress(stream=out, every_s=3600)
    p.planned(list(range(4)), list(range(4)))
    p.t0 -= 60
    started = (datetime.now(UTC) - timedelta(seconds=2)).isoformat(timespec="seconds")
    p.shard_done({"shard": "s0", "status": "done", "rows_out": 2, "tokens": {}, "started_at": started})
    left = float(out.getvalue().splitlines()[-1].rsplit("about ", 1)[1].split("s left")[0])
    assert 5 <= left <= 12, out.getvalue()


def test_status_of_many_shards_lists_only_those_not_done():
    import io

    from batchspec.runner.progress import print_status

    shards = [{"shard": f"s{i}", "status": "failed" if i == 7 else "done", "rows": 1, "error_rows": 0, "attempts": 1,
               "error": "boom" if i == 7 else None} for i in range(1200)]
    out = io.StringIO()
    print_status({"name": "big", "shards": {"done": 1199, "failed": 1, "pending": 0, "total": 1200}, "complete": False,
                  "job_status": "failed", "shard_list": shards}, stream=out)
    text = out.getvalue()
    assert " s7 " in text and " s8 " not in text and "1199 done shard(s) not listed" in text
