"""One writer per output: a lease file created with a create-only write.

    <output>/_batchspec/lease.json   {"job_id", "owner": "host:pid", "acquired_at", "heartbeat_at"}

The first submit creates it (O_EXCL locally, a conditional PUT `If-None-Match: *` on S3), a
background thread refreshes heartbeat_at while the job runs, and the job deletes it at the end.
A second submit finds it and is refused, unless its heartbeat is older than the timeout (the
run that held it died) or --force. Taking over a stale lease is not atomic: two drivers that
both find the same stale lease at the same moment could both take it; keep reruns of one output
in one scheduler to rule that out.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from .store import OutputStore

DEFAULT_TIMEOUT_S = 600.0  # a heartbeat older than this means the holder is gone
HEARTBEAT_S = 30.0


class LeaseHeld(RuntimeError):
    pass


class Lease:
    def __init__(self, store: OutputStore, job_id: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.store, self.job_id, self.timeout_s = store, job_id, timeout_s
        self.path = store.meta_path("lease.json")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, acquired_at: float) -> dict:
        return {"job_id": self.job_id, "owner": f"{socket.gethostname()}:{os.getpid()}", "acquired_at": acquired_at,
                "heartbeat_at": time.time()}

    def acquire(self, force: bool = False) -> str | None:
        """Take the lease; returns a note when a stale or forced lease was taken over."""
        if self.store.create_exclusive(self.path, self._record(time.time())):
            self._start()
            return None
        held = self.store.read_json(self.path) or {}
        age = time.time() - float(held.get("heartbeat_at", 0))
        if age < self.timeout_s and not force:
            raise LeaseHeld(
                f"output is in use by job {held.get('job_id')} ({held.get('owner')}), last heartbeat {age:.0f}s ago; "
                f"wait for it, or use --force if that run is dead (a lease goes stale after {self.timeout_s:.0f}s)")
        self.store.write_json(self.path, self._record(time.time()))
        self._start()
        why = "forced" if age < self.timeout_s else f"stale for {age:.0f}s"
        return f"took over the lease of job {held.get('job_id')} ({held.get('owner')}): {why}"

    def _start(self) -> None:
        acquired = time.time()

        def beat():
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    self.store.write_json(self.path, self._record(acquired))
                except Exception:  # a missed heartbeat is retried at the next beat
                    pass

        self._thread = threading.Thread(target=beat, name="batchspec-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        held = self.store.read_json(self.path) or {}
        if held.get("job_id") == self.job_id:
            self.store.delete(self.path)
