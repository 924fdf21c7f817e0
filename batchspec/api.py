"""batchspec from Python: what the CLI runs, for a pipeline or a scheduler to call directly.

    import batchspec

    run = batchspec.submit("jobs/nightly.yaml", params={"ds": "2026-12-05"})
    run.outcome          # Outcome.COMPLETED, COMPLETED_WITH_ERROR_ROWS or FAILED_SHARDS
    run.to_dict()        # figures for an orchestrator's metadata (a Dagster asset, an Airflow XCom)
    batchspec.rerun("jobs/nightly.yaml", params={"ds": "2026-12-05"})   # only the shards not done

A job that cannot run as asked raises a BatchspecError (SpecError, JobRefused, PlanError,
LeaseLost) whose message is the line the CLI prints; Ctrl-C or SIGTERM raise JobInterrupted (a
KeyboardInterrupt) after the run is recorded. A Ray started here stays up for the next call in
this process and stops when it exits. Heavy imports (Ray, torch) happen inside the calls, so
`import batchspec` stays cheap. docs/api.md.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import BatchspecError
from .spec import JobSpec, Overrides, SpecError, load_spec, spec_from_dict

JobLike = str | Path | Mapping[str, Any] | JobSpec


class Outcome(enum.StrEnum):
    """How a run ended. REFUSED, INTERRUPTED and CRASHED are runs that raised: submit and rerun
    raise them, or return them as a Run with `error` under raise_on_error=False."""

    COMPLETED = "completed"
    COMPLETED_WITH_ERROR_ROWS = "completed_with_error_rows"  # every shard committed, some rows hold an error
    FAILED_SHARDS = "failed_shards"  # rerun redoes them
    REFUSED = "refused"
    INTERRUPTED = "interrupted"
    CRASHED = "crashed"


@dataclass(frozen=True)
class Run:
    """One submit or rerun. Shard counts, tokens and acceptance are this run's; rows and error rows
    those of every committed shard after it (the summary line's). `totals` are the output's after
    it, over every committed shard whichever run wrote it (the night so far: tokens,
    actor-seconds, cost, acceptance, the measured saving and its 95% interval), read as `batchspec
    report` reads them; {} when report=False."""

    outcome: Outcome
    job_id: str
    output: str
    params: dict[str, str]
    draft: str  # "model models/legal-draft", "ngram", "none"
    shards_total: int
    shards_done: int  # committed by this run
    shards_skipped: int  # done before it
    failed: dict[str, str]  # shard -> error line
    rows: int
    error_rows: int
    tokens_out: int
    acceptance: float | None  # this run's accepted / drafted tokens
    wall_s: float
    startup: dict[str, float | None] | None  # ready_s (until the first engine could generate), ray_s, engine_load_s
    totals: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why a run that did not run to its end (REFUSED, INTERRUPTED, CRASHED) ended

    @property
    def ok(self) -> bool:
        """Every shard committed (error rows are rows, not failures)."""
        return self.outcome in (Outcome.COMPLETED, Outcome.COMPLETED_WITH_ERROR_ROWS)

    def summary_line(self) -> str:
        """The line `batchspec submit` closes with: shards, rows, tokens, time, start-up, acceptance."""
        from .runner.progress import startup_text

        acc = (f"{self.acceptance:.2f}" if self.acceptance is not None
               else "n/a (speculation off)" if self.tokens_out else "n/a (nothing generated)")
        rate = self.tokens_out / self.wall_s if self.wall_s else 0.0
        return (f"{'done' if self.ok else 'FAILED'}: {self.shards_done} shard(s) run, {self.shards_skipped} already "
                f"done, {len(self.failed)} failed | {self.rows} rows ({self.error_rows} error rows) | {self.tokens_out} "
                f"tokens in {self.wall_s:.1f}s ({rate:.0f} tok/s){startup_text(self.startup)} | acceptance {acc} | "
                f"output {self.output}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready figures (the outcome as its value)."""
        return {**asdict(self), "outcome": self.outcome.value, "ok": self.ok}


def load_job(job: JobLike, params: Mapping[str, str] | None = None, overrides: Overrides | None = None) -> JobSpec:
    """A JobSpec from a spec file, a mapping as the YAML holds it, or a JobSpec (then without params
    or overrides). overrides: {"generation.max_new_tokens": 64} (values as they are), or the CLI's
    ["generation.max_new_tokens=64"] (values read as YAML)."""
    if isinstance(job, JobSpec):
        if params or overrides:
            raise SpecError("params and overrides apply to a spec file or mapping, not to a JobSpec built already")
        return job
    if isinstance(job, Mapping):
        return spec_from_dict(dict(job), overrides, params)
    return load_spec(job, overrides, params)


def submit(job: JobLike, *, params: Mapping[str, str] | None = None,
           overrides: Overrides | None = None, address: str | None = None,
           force: bool = False, report: bool = True, worker_logs: bool = False, metrics_file: str | None = None,
           raise_on_error: bool = True, on_shard: Callable[[dict], None] | None = None, on_plan: Callable[[list, list], None] | None = None) -> Run:
    """Run every shard of the job not yet committed at its output (`batchspec submit`).

    params fill the spec's {name} placeholders (`output.path: out/dt={ds}`); address: a Ray
    cluster (default RAY_ADDRESS, else a local Ray); force: proceed despite a changed spec or
    input, and take over another run's lease; report: also read the output's totals (Run.totals);
    metrics_file: write the run's figures there in Prometheus' text format (batchspec/metrics.py),
    also when it fails or is interrupted; raise_on_error=False: a refused, interrupted or crashed
    run is returned as a Run with that outcome and its `error` instead of raised (a spec that does
    not load still raises SpecError)."""
    return _run(load_job(job, params, overrides), dict(params or {}), address=address, force=force, report=report,
                worker_logs=worker_logs, metrics_file=metrics_file, raise_on_error=raise_on_error,
                on_shard=on_shard, on_plan=on_plan)


def rerun(job: JobLike, *, params: Mapping[str, str] | None = None,
          overrides: Overrides | None = None, address: str | None = None,
          force: bool = False, report: bool = True, worker_logs: bool = False, metrics_file: str | None = None,
          raise_on_error: bool = True, on_shard: Callable[[dict], None] | None = None, on_plan: Callable[[list, list], None] | None = None) -> Run:
    """Redo only the shards not done (`batchspec rerun`); JobRefused where the output has no job yet."""
    from .errors import error_line
    from .runner.outcome import JobRefused
    from .runner.store import OutputStore

    spec = load_job(job, params, overrides)
    try:
        recorded = OutputStore(spec.output.path, spec.output.storage_options).read_job()
    except Exception as e:  # no endpoint, no credentials, no bucket: one line, as the CLI shows it
        raise JobRefused(f"cannot read the output {spec.output.path}: {error_line(e)}") from e
    if recorded is None:
        raise JobRefused(f"nothing to rerun at {spec.output.path} (no _batchspec/job.json): submit the job first")
    return _run(spec, dict(params or {}), address=address, force=force, report=report, worker_logs=worker_logs,
                metrics_file=metrics_file, raise_on_error=raise_on_error, on_shard=on_shard, on_plan=on_plan)


def _run(spec: JobSpec, params: dict[str, str], *, address: str | None, force: bool, report: bool, worker_logs: bool,
         metrics_file: str | None, raise_on_error: bool, on_shard: Callable[[dict], None] | None,
         on_plan: Callable[[list, list], None] | None) -> Run:
    import time

    from .metrics import write_metrics
    from .rates import acceptance_rate
    from .runner.job import submit as run_job

    t0 = time.perf_counter()
    try:
        result = run_job(spec, address=address, force=force, on_shard=on_shard, on_plan=on_plan, worker_logs=worker_logs)
    except BaseException as e:  # refused, interrupted, crashed: not a success, and said so
        if metrics_file:
            write_metrics(metrics_file, spec.name, {}, success=False)
        ended = None if raise_on_error else _ended(spec, params, e, time.perf_counter() - t0)
        if ended is None:
            raise
        return ended
    if metrics_file:
        write_metrics(metrics_file, spec.name, {
            "rows": result.rows, "error_rows": result.error_rows, "completion_tokens": result.completion_tokens,
            "draft_tokens": result.draft_tokens, "accepted_tokens": result.accepted_tokens,
            "shards_done": len(result.done), "failed_shards": len(result.failed), "duration_seconds": result.wall_s},
            success=result.ok)
    outcome = (Outcome.FAILED_SHARDS if result.failed else
               Outcome.COMPLETED_WITH_ERROR_ROWS if result.error_rows else Outcome.COMPLETED)
    startup = result.startup
    return Run(outcome=outcome, job_id=result.job_id, output=spec.output.path, params=params, draft=spec.draft_used(),
               shards_total=result.shards, shards_done=len(result.done), shards_skipped=len(result.skipped),
               failed=dict(result.failed), rows=result.rows, error_rows=result.error_rows,
               tokens_out=result.completion_tokens, acceptance=acceptance_rate(result.accepted_tokens, result.draft_tokens),
               wall_s=round(result.wall_s, 3), startup=startup,
               totals=totals(spec.output.path, spec.output.storage_options) if report else {})


def _ended(spec: JobSpec, params: dict[str, str], e: BaseException, wall_s: float) -> Run | None:
    """The Run of a run that raised, for raise_on_error=False: REFUSED (a BatchspecError: nothing
    ran), INTERRUPTED (Ctrl-C, SIGTERM, or another run that took the output over), CRASHED (any
    other exception); None for what must propagate (a bare KeyboardInterrupt, SystemExit)."""
    from .errors import error_line
    from .runner.lease import LeaseLost
    from .runner.outcome import JobInterrupted

    if isinstance(e, JobInterrupted | LeaseLost):
        outcome = Outcome.INTERRUPTED
    elif isinstance(e, BatchspecError):
        outcome = Outcome.REFUSED
    elif isinstance(e, Exception):
        outcome = Outcome.CRASHED
    else:
        return None
    counts = e.status["shards"] if isinstance(e, JobInterrupted) else {}  # the output's, when the run stopped
    return Run(outcome=outcome, job_id=e.job_id if isinstance(e, JobInterrupted) else "", output=spec.output.path,
               params=params, draft=spec.draft_used(), shards_total=counts.get("total", 0), shards_done=0,
               shards_skipped=0, failed={}, rows=0, error_rows=0, tokens_out=0, acceptance=None,
               wall_s=round(wall_s, 3), startup=None, totals={"shards": counts} if counts else {},
               error=str(e) if isinstance(e, BatchspecError) else error_line(e))


def totals(output: str, storage_options: dict | None = None) -> dict[str, Any]:
    """The output's figures over every committed shard, from its report: what an orchestrator keeps
    per night."""
    from .reports.output import build_report

    r = build_report(output, storage_options)
    keys = ("rows", "error_rows", "prompt_tokens", "completion_tokens", "actor_seconds", "cost_usd",
            "usd_per_million_tokens", "acceptance_rate", "spec_rows", "measured_saving_s", "saving_interval_s",
            "startup_actor_seconds")
    return {k: r.get(k) for k in keys} | {"shards_committed": r["shards_committed"],
                                          "shards_not_committed": len(r["shards_not_committed"])}


def status(output: str | Path, *, params: Mapping[str, str] | None = None,
           storage_options: dict | None = None) -> dict[str, Any]:
    """Shards done, failed and pending of an output (`batchspec status`): an output path, or the
    job's spec file (with its params) naming it; of a folder of outputs, {"complete", "outputs"}."""
    from .reports.trend import find_outputs
    from .runner.record import status as job_status
    from .runner.store import OutputStore

    path, opts = output_of(output, params, storage_options)
    if OutputStore(path, opts).read_job() is None and (outs := find_outputs(path, opts)):
        sts = [job_status(o, opts) for o in outs]
        return {"complete": all(s["complete"] for s in sts), "outputs": sts}
    return job_status(path, opts)


def report(outputs: str | Path | Sequence[str | Path], *, params: Mapping[str, str] | None = None,
           storage_options: dict | None = None, gpu_hour_usd: float | None = None) -> dict[str, Any]:
    """`batchspec report --format json`: of one output (or its job file), its cost, acceptance and
    saving ("kind": "output"); of a folder of outputs (`out/` holding `dt=*/`) or several,
    night over night ("kind": "trend": reports/trend.py)."""
    from .reports import trend
    from .reports.output import build_report, public
    from .runner.store import OutputStore

    targets = [outputs] if isinstance(outputs, str | Path) else list(outputs)
    paths = [output_of(t, params, storage_options) for t in targets]
    path, opts = paths[0]
    if len(paths) == 1 and OutputStore(path, opts).read_job() is not None:
        return {"kind": "output", **public(build_report(path, opts, gpu_hour_usd))}
    return trend.build_trend([p for p, _ in paths], opts, gpu_hour_usd)


def distill(outputs: str | Path | Sequence[str | Path], out: str | Path, *, params: Mapping[str, str] | None = None,
            storage_options: dict | None = None, log: Callable[[str], None] | None = None, **options: Any) -> Any:
    """`batchspec distill`: train a draft on the committed rows of one or more outputs (paths, or
    job files with their params) into `out`, checked on held-out rows with the engine the job ran
    on. options: batchspec.training.Options' fields (start, max_rows, held_out, replay, epochs, ...).
    Returns a training.Result whose `passed` says whether the draft may be used (its `reasons` why
    not); raises DistillError (a BatchspecError) when it cannot run. docs/distill.md."""
    from .training import Options
    from .training import distill as run

    targets = [outputs] if isinstance(outputs, str | Path) else list(outputs)
    paths = [output_of(t, params, storage_options) for t in targets]
    replay = [output_of(r, params, storage_options)[0] for r in options.pop("replay", [])]
    opts = Options(**options, replay=replay, storage_options=paths[0][1])
    return run([p for p, _ in paths], out, opts, log=log or (lambda line: None))


def output_of(target: str | Path, params: Mapping[str, str] | None = None,
              storage_options: dict | None = None) -> tuple[str, dict]:
    """(output path, storage options) from an output path, or a job file (which knows both)."""
    text = str(target)
    if text.endswith((".yaml", ".yml", ".json")) and Path(text).is_file():
        spec = load_spec(text, [], dict(params or {}))
        return spec.output.path, {**spec.output.storage_options, **(storage_options or {})}
    return text, dict(storage_options or {})
