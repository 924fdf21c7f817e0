"""Ctrl-C and SIGTERM around a run: deferred while Ray starts, an interrupt once it runs."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM during the block (a scheduler's timeout, `kill PID`) stops the run as Ctrl-C does:
    recorded as interrupted, lease released, Ray stopped. Before, ray.init's own handler (sys.exit,
    below Ray's C++ handler that prints six lines of '*** SIGTERM received ... PC: @') left job.json
    saying "running". Entered after ray.init, which installs that handler. The handler raises a
    plain KeyboardInterrupt and records the signal in sigterm_seen: Ray turns a KeyboardInterrupt
    raised inside ray.wait into a new one, so a subclass would not survive."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame):
        sigterm_seen.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


sigterm_seen = threading.Event()  # set by sigterm_as_interrupt's handler


@contextlib.contextmanager
def ctrl_c_kept():
    """A first Ctrl-C during the block raises KeyboardInterrupt when the block ends (starting a
    local Ray takes ~2.5 s); a second one at once. Raised where it lands, a Ctrl-C during `import
    ray` could be swallowed by module registration code, printed as "Exception ignored in: <module
    'collections.abc'> ... KeyboardInterrupt", and the job then ran to its end (seen in CI)."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if threading.current_thread() is not threading.main_thread() or ignored:
        # Ignored: started in the background by a shell without job control, which asks exactly that
        # (Python then installs no KeyboardInterrupt either); a handler here would undo it.
        yield
        return
    pressed = []

    def on_sigint(signum, frame):
        pressed.append(signum)
        if len(pressed) > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt
