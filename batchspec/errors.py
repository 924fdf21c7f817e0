"""One line for an exception wherever batchspec shows or stores one: row errors, shard errors in
manifests, the CLI's messages, log events.

pyarrow, botocore and jinja put details on later lines of their messages, and a multi-line error
breaks a manifest's one-line `error`, a `batchspec status` table and a log line a pipeline greps.
"""

from __future__ import annotations


class BatchspecError(Exception):
    """What a caller of batchspec's API catches: the job cannot run as asked (SpecError, JobRefused,
    PlanError, LeaseLost). str() is the one message the CLI prints for it."""


def error_line(e: BaseException, limit: int = 300, message: str | None = None) -> str:
    """'Type: first non-empty line of the message' (at most `limit` characters of it); the type
    alone when the message is empty, e.g. 'KeyboardInterrupt'. message: the text to take the line
    from instead of str(e) (e.g. pydantic's validator message)."""
    text = str(e) if message is None else message
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:limit]}" if first else type(e).__name__
