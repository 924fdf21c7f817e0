"""Logging for the driver and the actors: text for people, JSON lines for pipelines.

Records carry ids (job, shard, row) and prompt hashes, never raw prompts or credentials:
    log_event(log, "shard done", job=job_id, shard="prompts-0003", rows=812)

What a user sees on stderr is the driver's: a line per shard and a summary (text), or one JSON
object per line (json). Actors log to Ray's session log files (docs/operations.md says where);
`--worker-logs` forwards them too, with Ray's "(MapWorker(MapBatches(CallMap)) pid=...)" prefix
(Ray Data's name for the shard actor; JSON records name it ShardWorker).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import threading
import time
from typing import TextIO

_FORMAT_ENV = "BATCHSPEC_LOG_FORMAT"
# Third-party loggers that print on the driver: quiet them to warnings and, in JSON mode, route
# them through the JSON formatter so every line parses.
_FOREIGN = ("ray", "ray.data", "ray.train", "ray.tune", "transformers", "vllm", "py.warnings", "filelock", "fsspec",
            "s3fs", "botocore", "urllib3")


def _ids(record: logging.LogRecord) -> dict:
    """The ids log_event attached. Other attributes are not ours to print: vLLM's record factory,
    for one, adds vllm_process_name to every record in the process."""
    return getattr(record, "batchspec_ids", {})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)), "level": record.levelname,
                "logger": record.name, "msg": record.getMessage()}
        data.update(_ids(record))
        return json.dumps(data, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in _ids(record).items())
        base = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname:<7} {record.getMessage()}"
        return f"{base} {extra}".rstrip()


# Ray's notices that say nothing to a batchspec user (we turn the progress bars off ourselves;
# token auth is about Ray's dashboard, which a local run does not start).
_NOISE = ("Progress bars disabled", "Token authentication is enabled")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in _NOISE)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (a test runner swaps it, and a
    handler bound to a swapped-out stream fails with "I/O operation on closed file")."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


# (format, foreign level) of the last configure(); what quiet_foreign_loggers re-applies.
_configured: tuple[str, str] = ("text", "WARNING")
# The real stderr once capture_stderr has put its filter on file descriptor 2.
_real_stderr: TextIO | None = None


def _handler(fmt: str) -> logging.Handler:
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_DropNoise())
    return handler


def configure(fmt: str = "text", level: str = "INFO", foreign_level: str = "WARNING") -> None:
    """Configure the batchspec loggers; fmt 'json' or 'text'. Actors inherit fmt through the env.
    Third-party loggers (Ray, transformers, vLLM, warnings) print at foreign_level and above,
    through a handler of their own in batchspec's format."""
    os.environ[_FORMAT_ENV] = fmt
    root = logging.getLogger("batchspec")
    root.handlers[:] = [_handler(fmt)]
    root.setLevel(level)
    root.propagate = False
    logging.captureWarnings(True)
    global _configured
    _configured = (fmt, foreign_level)
    for name in _FOREIGN:
        _take_over(logging.getLogger(name), fmt, foreign_level)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error" if foreign_level != "INFO" else "warning")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _take_over(logger: logging.Logger, fmt: str, level: str) -> None:
    """Replace a library's console handlers with ours (file handlers, e.g. Ray's session logs, stay)."""
    keep = [h for h in logger.handlers if isinstance(h, logging.FileHandler) or type(h).__name__ == "SessionFileHandler"]
    logger.handlers[:] = keep + [_handler(fmt)]
    logger.setLevel(level)
    logger.propagate = False


def quiet_foreign_loggers() -> None:
    """Run after `import ray`, ray.init and `import ray.data`: each installs Ray's own console handlers."""
    fmt, level = _configured
    for name in ("ray", "ray.data"):
        _take_over(logging.getLogger(name), fmt, level)
    logging.getLogger("ray.data").handlers[-1].addFilter(_drop_handled)  # records of its child loggers too


def _drop_handled(record: logging.LogRecord) -> bool:
    """Ray Data's traceback for a call it gave up on (max_errored_blocks): the runner fails that
    call's shards and says so in one line each."""
    return "max_errored_blocks" not in record.getMessage()


# "[2026-11-30 16:47:16,884 W 25974 25974] gcs_client.cc:210: message": Ray's C++ core on stderr.
_RAY_CORE_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+ [A-Z] \d+ \d+\] (.*)$")
# Ray core warns on every run that Ray Data's actors have constructor arguments in the object store
# (ray-project/ray#53727): they would be lost only if the driver let go of them, and it holds them
# for the whole run. It tells a batchspec user nothing.
_RAY_CORE_NOISE = re.compile(r"core_worker\.cc:\d+: Actor with class name: .* has constructor arguments in the object store")
# "\x1b[36m(ShardWorker pid=19036)\x1b[0m {...}": an actor's line forwarded by Ray (--worker-logs).
# Ray Data's map actor is "(MapWorker(MapBatches(CallMap)) pid=N)": that is the shard actor.
_RAY_ACTOR_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)?\(([\w()]+?) pid=(\d+)(?:, ip=[^)]*)?\)(?:\x1b\[[0-9;]*m)? ?(.*)$")
_ACTOR_NAMES = {"MapWorker(MapBatches(CallMap))": "ShardWorker"}


# "(MainProcess pid=7376) WARNING 12-01 06:55:52 [api_utils.py:286] message": vLLM's own handler.
_VLLM_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[([^\]]+)\] (.*)$")


def json_line(line: str) -> str | None:
    """One stderr line as one JSON log record, or None for a blank one. A JSON record passes as it
    is. An actor's line that Ray forwarded is its own record with the actor named (`actor`, `pid`)
    instead of a record of type "stderr" holding Ray's colour codes and the actor's JSON as a
    string. A line of vLLM's own format keeps its level, as {"logger": "vllm", "source":
    "file.py:line"}. Anything else is wrapped as {"level": "INFO", "logger": "stderr", "msg": line}."""
    if not line.strip():
        return None
    actor = _RAY_ACTOR_PREFIX.match(line)
    body, where = ((actor.group(3), {"actor": _ACTOR_NAMES.get(actor.group(1), actor.group(1)),
                                     "pid": int(actor.group(2))}) if actor else (line, {}))
    try:
        record = json.loads(body)
    except ValueError:
        record = None
    if isinstance(record, dict):
        return json.dumps({**record, **where}) if where else line
    now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    vllm = _VLLM_LINE.match(body)
    if vllm:
        return json.dumps({"ts": now, "level": vllm.group(1), "logger": "vllm", **where, "source": vllm.group(2),
                           "msg": vllm.group(3)})
    return json.dumps({"ts": now, "level": "INFO", "logger": "stderr", **where, "msg": body})


def capture_stderr(fmt: str):
    """Put a filter on file descriptor 2, whoever writes to it (Ray's C++ core, Ray's own
    processes, a library's print): with fmt "json" every line becomes one JSON object (JSON lines
    pass, the rest are wrapped as {"level": "INFO", "logger": "stderr", "msg": line}). One pipe
    keeps the order. Returns a stream on the real stderr, for the live progress display, or None
    when stderr is not the process's own (under a test runner) and nothing was changed."""
    global _real_stderr
    if _real_stderr is not None:
        return _real_stderr
    err = sys.stderr
    if err is not sys.__stderr__ or err is None:
        return None
    try:
        err.flush()
        real = os.dup(2)
    except (OSError, ValueError):
        return None
    tty = os.isatty(real)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    out = os.fdopen(real, "w", buffering=1)
    # A method replaced (setattr: mypy refuses the assignment): the progress display draws a live
    # bar only on a terminal.
    setattr(out, "isatty", lambda: tty)  # noqa: B010

    def emit(line: str) -> None:
        shown = json_line(line) if fmt == "json" else line
        if shown is not None:
            out.write(shown + "\n")

    def pump():
        # Ray's C++ core repeats a line once a second while it retries (a cluster whose token does
        # not match: 20 lines in 20 s); one copy and a count say the same.
        last, repeats = None, 0

        def count_repeats() -> None:
            if repeats:
                emit(f"(the line above repeated {repeats} more time{'s' * (repeats > 1)})")

        with os.fdopen(read_fd, "rb") as src:
            for raw in src:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                core = _RAY_CORE_LINE.match(line)
                if core and _RAY_CORE_NOISE.search(core.group(1)):
                    continue
                if core and core.group(1) == last:
                    repeats += 1
                    continue
                count_repeats()
                last, repeats = core.group(1) if core else None, 0
                emit(line)
            count_repeats()

    thread = threading.Thread(target=pump, name="batchspec-stderr", daemon=True)
    thread.start()

    def drain():
        sys.stderr.flush()
        os.dup2(out.fileno(), 2)  # the pipe loses its last writer here (Ray's children end first)
        thread.join(timeout=2)

    import atexit

    atexit.register(drain)
    _real_stderr = out
    return out


def configure_worker_logging() -> None:
    configure(os.environ.get(_FORMAT_ENV, "text"), os.environ.get("BATCHSPEC_LOG_LEVEL", "INFO"))
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars, once per actor
    except ImportError:
        pass


def log_event(logger: logging.Logger, msg: str, level: int = logging.INFO, **ids) -> None:
    logger.log(level, msg, extra={"batchspec_ids": ids})


def worker_id() -> str:
    """host:pid, the `worker` of manifests, rows and actor starts."""
    return f"{socket.gethostname()}:{os.getpid()}"
