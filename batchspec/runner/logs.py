"""Logging for the driver and the actors: text for people, JSON lines for pipelines.

Records carry ids (job, shard, row) and prompt hashes, never raw prompts or credentials:
    log_event(log, "shard done", job=job_id, shard="prompts-0003", rows=812)

What a user sees on stderr is the driver's: a line per shard and a summary (text), or one JSON
object per line (json). Actors log to Ray's session log files (docs/operations.md says where);
`--worker-logs` forwards them too; runner/stderr.py turns what reaches file descriptor 2 into
JSON lines in json mode.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time

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
        if record.exc_info:  # a traceback stays inside its one record
            data["traceback"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in _ids(record).items() if v is not None)  # json keeps nulls
        base = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname:<7} {record.getMessage()}"
        trace = f"\n{self.formatException(record.exc_info)}" if record.exc_info else ""
        return f"{base} {extra}".rstrip() + trace


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
