"""SIGINT and SIGTERM for a process that stops what it started in order (`dynvm serve`):
the first signal asks for a graceful stop, a second one, or a stop that outlives its
deadline, forces it.

Note [Stop signals]
~~~~~~~~~~~~~~~~~~~
Python runs a signal's handler in the main thread between bytecodes, so a main thread
blocked in a long C call (a `ray.get` inside `serve.shutdown`) would hear a second
Ctrl-C only once that call returns. So the handlers here do nothing themselves: the C
level writes each signal's number to a wakeup socket (`signal.set_wakeup_fd`), and a
watcher thread reads it at once, whatever the main thread is doing. The first
SIGINT/SIGTERM sets `requested` (the main thread then stops everything in order); a
second one, or a stop still running `deadline_s` after the main thread began it
(`stopping()`: a signal during start-up waits for the start-up, whose length the stop
should not pay for), calls `on_force(signum)` (None for the deadline) in the watcher
thread, which must end the process.

Ray's `ray.init` installs its own SIGTERM handlers in the driver (a Python one that
kills the node's processes and exits 1, and the C++ core worker's fatal-signal handler,
which prints "*** SIGTERM received" with a stack and dies): `install()` again after
`ray.init` puts these back (issue 35).
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """The stop signals of one process: `install()` (main thread; again after anything
    that installs its own), `requested` (set by the first one), `close()`."""

    def __init__(self, on_force: Callable[[int | None], None],
                 deadline_s: float | None = None) -> None:
        self.on_force = on_force
        self.deadline_s = deadline_s
        self.requested = threading.Event()
        self.signum: int | None = None
        self._stop_began: float | None = None
        self._reader, self._writer = socket.socketpair()
        self._reader.settimeout(0.2)
        self._writer.setblocking(False)
        self._previous: dict[int, object] = {}
        self._previous_fd: int | None = None
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="dynvm-stop-signals",
                                         daemon=True)
        self._watcher.start()

    @staticmethod
    def _noop(signum, frame) -> None:
        # The watcher thread acts on the byte the C handler wrote (Note [Stop signals]).
        return None

    def install(self) -> StopSignals:
        """Take SIGINT and SIGTERM (again), from the main thread."""
        fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        if self._previous_fd is None:
            self._previous_fd = fd
        for signum in STOP_SIGNALS:
            previous = signal.signal(signum, self._noop)
            self._previous.setdefault(signum, previous)
        return self

    def _watch(self) -> None:
        seen = 0
        while not self._closed.is_set():
            try:
                data = self._reader.recv(64)
            except TimeoutError:
                data = b""
            except OSError:
                return
            for signum in data:
                if signum not in STOP_SIGNALS:
                    continue
                seen += 1
                if seen == 1:
                    self.signum = signum
                    self.requested.set()
                else:
                    self.on_force(signum)
            began = self._stop_began
            if (began is not None and self.deadline_s is not None
                    and not self._closed.is_set()
                    and time.monotonic() - began > self.deadline_s):
                self.on_force(None)
                return

    def stopping(self) -> None:
        """The main thread begins its stop: from now on, `deadline_s` runs."""
        if self._stop_began is None:
            self._stop_began = time.monotonic()

    def close(self) -> None:
        """Stop watching; the previous handlers and wakeup fd are back (main thread)."""
        self._closed.set()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
        self._watcher.join(timeout=1.0)
        self._reader.close()
        self._writer.close()
