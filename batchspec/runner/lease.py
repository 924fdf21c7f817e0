"""One writer per output: a lease file created with a create-only write.

    <output>/_batchspec/lease.json   {"job_id", "owner": "host:pid", "host", "pid", "pid_started",
                                      "acquired_at", "heartbeat_at", "heartbeat_s"}

The first submit creates it (a hard link of a fully written file locally, a conditional PUT
`If-None-Match: *` on S3), a background thread refreshes heartbeat_at every `heartbeat_s` while
the job runs, and the job deletes it at the end. A later submit that finds it:

- takes it over at once when the holder ran on this host and its process is gone (killed, OOM,
  reboot): the pid is not alive, or now belongs to a process started later;
- takes it over when its heartbeat is older than the staleness limit (a holder on another host
  died): `stale_s`, at least three of the holder's own heartbeat intervals;
- is refused otherwise, unless --force.

A holder that was alive after all (forced, or cut off from the store for longer than the limit)
finds another job's lease at its next heartbeat: it stops beating, and its job stops before its
next shard without writing job.json again (LeaseLost), so the two runs do not both record the
output. Its shards already committed stay: a part is a function of its shard.

Defaults: a heartbeat every 10 s, stale after 60 s; BATCHSPEC_LEASE_HEARTBEAT_S and
BATCHSPEC_LEASE_STALE_S change them (docs/operations.md). A takeover, a heartbeat and the release
change the lease only if it is still the version they read: on S3 a conditional PUT or DELETE
(If-Match on its ETag), locally a compare of the bytes and the write under an flock of the
_batchspec folder (store.py). So of two drivers that find the same stale lease at once one wins
and the other is refused, a heartbeat never overwrites a takeover that landed after its read,
and a run that ends never deletes the lease of one that took over. On stores with neither
(other fsspec filesystems) they are plain writes, and those races stay open for the
milliseconds between read and write.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from ..errors import BatchspecError
from .lease_state import DEFAULT_TIMEOUT_S, HEARTBEAT_S, lease_path, process_started, stale_after, takeover_reason
from .store import OutputStore


class LeaseHeld(RuntimeError):
    pass


class LeaseLost(BatchspecError, RuntimeError):
    """Another run took this run's lease over while it ran (`--force`, or a heartbeat that went
    stale): this run stops before its next shard and writes no more of the job's records."""


class Lease:
    def __init__(self, store: OutputStore, job_id: str, timeout_s: float | None = None,
                 heartbeat_s: float | None = None):
        self.store, self.job_id = store, job_id
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self.path = lease_path(store)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # who took the lease over from this run (--force, or stale)

    def _record(self, acquired_at: float) -> dict:
        host, pid = socket.gethostname(), os.getpid()
        return {"job_id": self.job_id, "owner": f"{host}:{pid}", "host": host, "pid": pid,
                "pid_started": process_started(pid), "acquired_at": acquired_at, "heartbeat_at": time.time(),
                "heartbeat_s": self.heartbeat_s}

    def acquire(self, force: bool = False) -> str | None:
        """Take the lease; returns a note when a dead, stale or forced lease was taken over."""
        for _ in range(3):  # a lease released between the create and the read: create again
            if self.store.create_exclusive(self.path, self._record(time.time())):
                self._start()
                return None
            read, tag = self.store.read_json_tagged(self.path)
            if read is not None:
                break
        held = read or {}
        why = takeover_reason(held, self.timeout_s)
        if why is None and not force:
            age = time.time() - float(held.get("heartbeat_at", 0))
            raise LeaseHeld(
                f"output is in use by job {held.get('job_id')} ({held.get('owner')}), last heartbeat {age:.0f}s ago; "
                f"wait for it, or use --force if that run is dead (a lease goes stale after "
                f"{stale_after(held, self.timeout_s):.0f}s without a heartbeat)")
        for _ in range(5):
            if self.store.replace_json_if(self.path, self._record(time.time()), tag):
                break
            now, tag = self.store.read_json_tagged(self.path)
            now = now or {}
            if force and now.get("job_id") == held.get("job_id"):
                continue  # the holder's heartbeat landed between the read and the write: force again
            raise LeaseHeld(f"output is in use by job {now.get('job_id')} ({now.get('owner')}), which took it over "
                            f"from job {held.get('job_id')} a moment before this run could")
        else:
            raise LeaseHeld(f"output is in use by job {held.get('job_id')} ({held.get('owner')}), whose heartbeats "
                            f"kept landing before this run's takeover; try again")
        self._start()
        why = why or "forced"
        return f"took over the lease of job {held.get('job_id')} ({held.get('owner')}): {why}"

    def _start(self) -> None:
        acquired = time.time()

        def beat():
            while not self._stop.wait(self.heartbeat_s) and self.beat(acquired):
                pass

        self._thread = threading.Thread(target=beat, name="batchspec-lease", daemon=True)
        self._thread.start()

    def beat(self, acquired: float) -> bool:
        """One heartbeat; False once another run holds the lease (self.lost says which)."""
        try:
            held, tag = self.store.read_json_tagged(self.path)
            if held is None:  # deleted by hand: this run still holds the output
                self.store.create_exclusive(self.path, self._record(acquired))
            elif held.get("job_id") != self.job_id:
                # Another run took it over. Beating on would overwrite its lease, and the job
                # stops at its next shard (LeaseLost) rather than write beside it.
                self.lost = f"job {held.get('job_id')} ({held.get('owner')}) took over this output's lease"
                return False
            else:  # on S3 only if nobody replaced it since the read: the next beat sees who did
                self.store.replace_json_if(self.path, self._record(acquired), tag)
        except Exception:  # a missed heartbeat is retried at the next beat
            pass
        return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:  # a beat in flight could otherwise re-create the lease just deleted
            self._thread.join(timeout=30)
        held, tag = self.store.read_json_tagged(self.path)
        if (held or {}).get("job_id") == self.job_id:  # and only that version: not a takeover since
            self.store.delete_if(self.path, tag)
