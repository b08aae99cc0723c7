"""A generator replica's background threads end before the interpreter does.

Note [Scheduler threads end before exit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A scheduler's thread is a daemon (a wedged step must not keep a process alive), and a
step runs torch operations with the GIL released. A daemon thread still inside one when
the interpreter finalizes races the native libraries' destructors (torch's, oneDNN's,
libgomp's). A run of the whole suite once passed every test and then died of SIGSEGV at
interpreter exit, after faulthandler was off, on a thread other than the main one whose
instruction pointer was in freed memory (2026-12-05 19:23, kernel log; issue 33). So
each owner stops and joins its thread at exit, bounded: a scheduler after the step it
is in (`close_at_exit`, at most EXIT_WAIT_S), the compile queue's workers after their
compile (Note [Exit with a compile running] in dynvm.jit.queue), the huge-page
collapser after its collapse (Note [Collapser stopped at exit] in
dynvm.jit.backends.cpu.huge_pages); and `close()` joins the threads it owns
(`GenerateScheduler.close`, `Generator.close`), so a process that closes what it made
leaves none running. atexit runs its hooks last-registered first: a scheduler, made
after its generator's compile queues, stops stepping before they stop compiling.
"""

from __future__ import annotations

import atexit
import weakref

EXIT_WAIT_S = 5.0
"""Longest wait at interpreter exit for one owner's thread to end what it is doing."""


def _close(owner_ref, wait_s: float) -> None:
    owner = owner_ref()
    if owner is not None:
        owner.close(wait_s)


def close_at_exit(owner, wait_s: float = EXIT_WAIT_S) -> None:
    """Note [Scheduler threads end before exit]: call `owner.close(wait_s)` at interpreter
    exit if `owner` is still alive then (held weakly: closing early or dropping it is
    fine; its running thread, holding a bound method, keeps it alive)."""
    atexit.register(_close, weakref.ref(owner), wait_s)
