"""Reading an output's lease (runner/lease.py): who holds it, and whether its holder is gone.
What `status` and a shard actor ask, and what a new run checks before it takes the lease over.
"""

from __future__ import annotations

import os
import socket
import time

from .store import OutputStore

HEARTBEAT_S = float(os.environ.get("BATCHSPEC_LEASE_HEARTBEAT_S", 10))
DEFAULT_TIMEOUT_S = float(os.environ.get("BATCHSPEC_LEASE_STALE_S", 60))  # no heartbeat for this long: holder gone


def process_started(pid: int) -> float | None:
    """When process `pid` on this host started (epoch s), or None if there is no such process or
    only its zombie is left (a killed driver whose parent has not reaped it yet: `rerun` one second
    after a SIGKILL from a backgrounded shell found the lease "in use", heartbeat 3 s ago)."""
    import psutil

    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def lease_path(store: OutputStore) -> str:
    return store.meta_path("lease.json")


def read_lease(store: OutputStore) -> dict | None:
    """The output's lease record, or None when no run holds it."""
    return store.read_json(lease_path(store))


def taken_over_by(store: OutputStore, job_id: str) -> str | None:
    """The job that holds the output's lease now, when it is not job_id (None when job_id holds it,
    or nothing does). What a shard actor asks before each call: Ray Data runs calls ahead of the
    driver, so the driver's own check after each call would come after the next ones started."""
    held = read_lease(store)
    return held["job_id"] if held and held.get("job_id") not in (None, job_id) else None


def holder_is_gone(held: dict) -> str | None:
    """Why a lease's holder is certainly dead, when it ran on this host; None if alive or elsewhere."""
    if held.get("host") != socket.gethostname() or not isinstance(held.get("pid"), int):
        return None
    started = process_started(held["pid"])
    if started is None:
        return f"its process {held['pid']} on this host is gone"
    if held.get("pid_started") is not None and abs(started - held["pid_started"]) > 1.0:
        return f"its process {held['pid']} on this host is gone (the pid now belongs to another process)"
    return None


def stale_after(held: dict, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """Seconds without a heartbeat after which a lease counts as abandoned: the staleness limit,
    and never less than three of the holder's own heartbeat intervals."""
    return max(timeout_s, 3 * float(held.get("heartbeat_s", 0)))


def takeover_reason(held: dict, timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """Why a held lease may be taken over now (its holder on this host is gone, or it is stale);
    None while its holder may still be alive."""
    gone = holder_is_gone(held)
    if gone:
        return gone
    age = time.time() - float(held.get("heartbeat_at", 0))
    return f"no heartbeat for {age:.0f}s" if age >= stale_after(held, timeout_s) else None
