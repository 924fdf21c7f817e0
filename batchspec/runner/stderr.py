"""What reaches the driver's file descriptor 2 (Ray's C++ core, Ray's own processes, an actor's
lines forwarded by `--worker-logs` with Ray's "(MapWorker(MapBatches(CallMap)) pid=...)" prefix,
vLLM's own handler, a library's print), as the user asked for it: one JSON object per line in json
mode, and Ray's repeated or empty notices dropped in either mode.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from typing import TextIO

# The real stderr once capture_stderr has put its filter on file descriptor 2.
_real_stderr: TextIO | None = None

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
    pass, the rest are wrapped as {"level": "INFO", "logger": "stderr", "msg": line}), and file
    descriptor 1 joins it, so stdout stays empty (Ray's driver prints its raylet's errors, such as
    an actor killed at a SIGTERM, to stdout). One pipe keeps the order. Returns a stream on the real stderr, for the live progress display, or None
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
    if fmt == "json":  # stdout stays empty: what reaches fd 1 (Ray prints its raylet's errors there) joins stderr's records
        sys.stdout.flush()
        os.dup2(write_fd, 1)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
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
        if fmt == "json":  # fd 1 writes to the pipe too: it must let go of it, or the pump never ends
            sys.stdout.flush()
            os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)  # the pipe loses its last writer here (Ray's children end first)
        thread.join(timeout=2)

    import atexit

    atexit.register(drain)
    _real_stderr = out
    return out
