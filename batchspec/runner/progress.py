"""What `submit` and `status` show a person: progress of shards and rows, tokens/s, acceptance."""

from __future__ import annotations

import sys
import time
from datetime import datetime

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from ..rates import acceptance_rate


class Progress:
    """Shard-level progress with running totals; a no-op when disabled (--quiet, JSON logs).

    On a terminal: one live bar (shards, rows, tokens/s, acceptance, failed, time left), failed
    shards told above it. Otherwise (a log file, a pipe): the first shard's line, then one line
    every `every_s` seconds and the last, so a job of thousands of shards writes a line a while,
    not a line a shard; a failed shard always has its own line."""

    def __init__(self, enabled: bool = True, stream=None, every_s: float = 30.0):
        # stream: the real stderr when the driver filters file descriptor 2 (stderr.capture_stderr).
        # soft_wrap: a line longer than the terminal (or than 80 columns, when stderr is a file or
        # a pipe) stays one line; markup/highlight off: shard ids and errors print as they are.
        stream = stream or sys.stderr
        self.console = Console(file=stream, soft_wrap=True, markup=False, highlight=False,
                               force_terminal=stream.isatty())
        self.enabled = enabled and stream.isatty()  # a live bar only on a terminal; plain lines otherwise
        self.printing = enabled
        self.rows = self.tokens = self.accepted = self.drafted = self.failed = self.finished = self.todo = 0
        self.every_s, self.last_line = every_s, float("-inf")
        self.t0 = time.perf_counter()
        self.first_start: float | None = None  # epoch seconds the earliest finished shard started at
        self._bar = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            self._bar = RichProgress(TextColumn("shards", style="bold"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[stats]}"), TimeRemainingColumn(), console=self.console)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def planned(self, shards, todo) -> None:
        self.t0 = time.perf_counter()
        if self.printing:
            self.console.print(f"{len(shards)} shard(s): {len(todo)} to run, {len(shards) - len(todo)} already done")
        self.todo = len(todo)
        if self._bar is not None:
            self._task = self._bar.add_task("shards", total=len(todo), stats="")

    def shard_done(self, m: dict) -> None:
        tok = m.get("tokens") or {}
        self.rows += m.get("rows_out") or 0
        self.tokens += tok.get("completion_tokens", 0)
        self.accepted += tok.get("accepted_tokens", 0)
        self.drafted += tok.get("draft_tokens", 0)
        self.failed += m.get("status") != "done"
        self.finished += 1
        elapsed = time.perf_counter() - self.t0
        rate = self.tokens / max(elapsed, 1e-9)
        accepted = acceptance_rate(self.accepted, self.drafted)
        acc = f"{accepted:.2f}" if accepted is not None else "-"
        stats = f"rows {self.rows}  {rate:.0f} tok/s  acceptance {acc}  failed {self.failed}"
        state = m.get("status")
        # The shard's own rows, then the job's totals so far (a shard of 24 rows read "rows 96" when
        # the totals stood alone).
        own = f", {m.get('rows_out') or 0} rows" if state == "done" else f" ({m.get('error')})"
        line = f"shard {m['shard']}: {state}{own} | so far: {stats}"
        if self._bar is not None:
            self._bar.update(self._task, advance=1, stats=stats)
            if state != "done":  # the reason, above the bar: this display is where failures are told
                self._bar.console.print(line)
        elif self.printing and (state != "done" or self.finished in (1, self.todo)
                                or elapsed - self.last_line >= self.every_s):
            left = (self.todo - self.finished) * self._working(elapsed, m.get("started_at")) / self.finished
            self.console.print(f"{line} | {self.finished}/{self.todo} shards, about {left:.0f}s left")
            self.last_line = elapsed

    def _working(self, elapsed: float, started_at: str | None) -> float:
        """Seconds since the first finished shard started (its manifest's started_at), at most the
        job's elapsed: the time left is priced at the rate shards finish once the actors work. From
        the job's start, start-up (Ray, the engine loads: paid once) made the demo's first line say
        "about 53s left" when the rest took a second."""
        try:
            started = datetime.fromisoformat(started_at).timestamp() if started_at else None
        except ValueError:
            started = None
        if started is not None:
            self.first_start = started if self.first_start is None else min(self.first_start, started)
        if self.first_start is None:
            return elapsed
        return min(elapsed, max(time.time() - self.first_start, 0.0))

    def summary(self, line: str) -> None:
        """The run's closing line (batchspec.api.Run.summary_line)."""
        if self.printing:
            self.console.print(line)


def startup_text(startup: dict | None) -> str:
    """", of which start-up 11.2s (Ray 3.0s, engine load 7.9s)": how much of a run's time went
    before its first engine could generate; what a longer job pays once per actor."""
    if not startup:
        return ""
    parts = ([f"Ray {startup['ray_s']:.1f}s"] if startup.get("ray_s") is not None else []) + \
        [f"engine load {startup['engine_load_s']:.1f}s"]
    return f", of which start-up {startup['ready_s']:.1f}s ({', '.join(parts)})"


LISTED = 50  # status lists every shard up to this many; beyond, only those not done


def print_status(st: dict, stream=None) -> None:
    n = st["shards"]
    shards = st["shard_list"]
    if len(shards) > LISTED:
        shards = [r for r in shards if r["status"] != "done"]
    table = Table(title=f"{st['name']}: {n['done']} done, {n['failed']} failed, {n['pending']} pending"
                        f"{' (complete)' if st['complete'] else ''}; last run {st['job_status']}",
                  caption=(f"{n['done']} done shard(s) not listed; --format json lists every shard"
                           if len(shards) < len(st["shard_list"]) else None))
    for col in ("shard", "status", "rows", "error rows", "attempts", "error"):
        table.add_column(col)
    for r in shards:
        # A shard committed on a rerun says why it failed before: "(failed before: ...)".
        before = r.get("earlier_errors") or []
        error = r["error"] or (f"(failed before: {before[-1]['error']})" if before else "")
        table.add_row(r["shard"], r["status"], str(r["rows"] or ""), str(r["error_rows"]), str(r["attempts"]), error[:80])
    Console(file=stream).print(table)
