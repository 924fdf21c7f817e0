"""Logging for the driver and the actors: text for people, JSON lines for pipelines.

Records carry ids (job, shard, row) and prompt hashes, never raw prompts or credentials:
    log_event(log, "shard done", job=job_id, shard="prompts-0003", rows=812)
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_FORMAT_ENV = "BATCHSPEC_LOG_FORMAT"


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


def configure(fmt: str = "text", level: str = "INFO") -> None:
    """Configure the batchspec loggers; fmt 'json' or 'text'. Actors inherit fmt through the env."""
    os.environ[_FORMAT_ENV] = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("batchspec")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def configure_worker_logging() -> None:
    configure(os.environ.get(_FORMAT_ENV, "text"), os.environ.get("BATCHSPEC_LOG_LEVEL", "INFO"))


def log_event(logger: logging.Logger, msg: str, level: int = logging.INFO, **ids) -> None:
    logger.log(level, msg, extra={"batchspec_ids": ids})
