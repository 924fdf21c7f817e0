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

from .store import OutputStore

HEARTBEAT_S = float(os.environ.get("BATCHSPEC_LEASE_HEARTBEAT_S", 10))
DEFAULT_TIMEOUT_S = float(os.environ.get("BATCHSPEC_LEASE_STALE_S", 60))  # no heartbeat for this long: holder gone


class LeaseHeld(RuntimeError):
    pass


class LeaseLost(RuntimeError):
    """Another run took this run's lease over while it ran (`--force`, or a heartbeat that went
    stale): this run stops before its next shard and writes no more of the job's records."""


def _process_started(pid: int) -> float | None:
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
    started = _process_started(held["pid"])
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
                "pid_started": _process_started(pid), "acquired_at": acquired_at, "heartbeat_at": time.time(),
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
