"""The background compile queue.

Compiles are futures keyed by the artifact's cache key: asking twice for the same key
returns the same future, so nothing is compiled twice in a process. Waiting tasks are
served highest expected benefit first; when more than `max_length` wait, the
lowest-benefit ones are dropped (their futures cancelled, counted). Finished futures are
kept so that asking again (a specialization evicted and promoted anew) costs nothing,
but only the newest `keep_finished`: a shape storm must not grow the table forever.

Note [Compile deadline]
~~~~~~~~~~~~~~~~~~~~~~~
A compile that hangs (a pathological region, a wedged toolchain) must not hold the
queue: every later promotion would wait behind it forever. A Python thread cannot be
killed, so past `timeout_s` its future fails with `CompileTimeout` (the region backs
off as after any failed compile), the worker is abandoned (whatever it finishes later
is discarded) and a fresh worker takes the next task. A watchdog thread checks every
`timeout_s / 4` (the hung worker cannot check for itself).

With `sync=True` a
task runs on the submitting thread, which makes tests deterministic (and makes that
call wait: debugging only).
"""

from __future__ import annotations

import atexit
import contextlib
import heapq
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from dynvm.jit.background import background_thread, checkpoint, worker_task
from dynvm.vm.errors import DynvmError


class CompileTimeout(DynvmError, TimeoutError):
    """A compile ran past the queue's deadline (Note [Compile deadline])."""


EXIT_WAIT_S = 30.0


# Note [Exit with a compile running]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Workers are daemon threads, so that a hung compile can never keep a process alive; but
# one still inside a torch operation when the interpreter finalizes makes the process
# abort ("terminate called without an active exception", exit status 134). So at exit,
# waiting tasks are cancelled and a running compile is given up to EXIT_WAIT_S (at most
# its deadline) to finish.


def _close_at_exit(queue_ref) -> None:
    """Close the queue, if it still exists, at interpreter exit (Note [Exit with a
    compile running])."""
    queue = queue_ref()
    if queue is not None:
        limit = EXIT_WAIT_S if queue.timeout_s is None else min(EXIT_WAIT_S, queue.timeout_s)
        queue.close(wait_s=limit)


class CompileQueue:
    """Background compiles as futures keyed by cache key (module docstring):
    `submit(key, benefit, task)` returns the key's future, running the task on one of
    `threads` workers, highest benefit first, at most `max_length` waiting; `sync=True`
    runs it on the caller's thread; `timeout_s` bounds each compile (Note [Compile
    deadline])."""

    def __init__(self, threads: int = 1, max_length: int = 32, sync: bool = False,
                 keep_finished: int = 256, timeout_s: float | None = None) -> None:
        self.sync = sync
        self.keep_finished = keep_finished
        self.timeout_s = timeout_s
        self._running: dict[threading.Thread, tuple[float, str, Future]] = {}
        self._watchdog: threading.Thread | None = None
        # Note [Exit with a compile running]
        atexit.register(_close_at_exit, weakref.ref(self))
        self._stopped = threading.Event()
        self.timed_out = 0
        self.max_length = max_length
        self._threads_wanted = threads
        self._heap: list[tuple[float, int, str, Callable[[], object]]] = []
        self._futures: dict[str, Future] = {}
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._workers: list[threading.Thread] = []
        self._closed = False
        self.dropped = 0
        self.completed = 0
        self.failed = 0

    def submit(self, key: str, benefit: float, task: Callable[[], object]) -> Future:
        """The future of `key`'s compile, queueing `task` if it is not known yet."""
        with self._cond:
            future = self._futures.get(key)
            # A dropped or failed compile may be asked for again (the region's backoff
            # decides when); only a waiting, running or successful one is shared.
            if future is not None and not future.cancelled() and not (
                    future.done() and future.exception() is not None):
                return future
            future = self._futures[key] = Future()
            if not self.sync:
                heapq.heappush(self._heap, (-benefit, next(self._order), key, task))
                self._drop_excess()
                self._ensure_workers()
                self._cond.notify()
                return future
        self._run(key, task, future)
        return future

    def __len__(self) -> int:
        return len(self._heap)

    def running(self) -> int:
        """Tasks running now (not counted by len(): a probation shadow sample, which no
        region marks pending, runs for up to a second after the queue looks empty)."""
        return len(self._running)

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the workers after the task each is running; waiting tasks are cancelled.
        With `wait_s`, wait up to that long for running compiles to finish."""
        self._stopped.set()
        with self._cond:
            self._closed = True
            for _, _, key, _ in self._heap:
                self._futures[key].cancel()
            self._heap.clear()
            self._cond.notify_all()
            workers = list(self._workers)
            if self._watchdog is not None:   # it wakes on _stopped and returns
                workers.append(self._watchdog)
        deadline = time.monotonic() + wait_s
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join(max(0.0, deadline - time.monotonic()))

    def _drop_excess(self) -> None:
        while len(self._heap) > self.max_length:
            lowest = max(self._heap)  # least negative benefit = lowest benefit
            self._heap.remove(lowest)
            heapq.heapify(self._heap)
            self._futures.pop(lowest[2]).cancel()
            self.dropped += 1

    def _ensure_workers(self) -> None:
        while len(self._workers) < self._threads_wanted:
            worker = threading.Thread(target=self._work, name="dynvm-compile", daemon=True)
            self._workers.append(worker)
            worker.start()
        if self.timeout_s is not None and self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="dynvm-compile-watch",
                                              daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        # Its own event, not _cond: a notify meant for a worker must never wake it.
        while not self._stopped.wait(self.timeout_s / 4):
            with self._cond:
                self._expire()

    def _expire(self) -> None:
        """Fail compiles past the deadline and replace their workers (holding _cond)."""
        if self.timeout_s is None:
            return
        now = time.monotonic()
        for worker, (started, key, future) in list(self._running.items()):
            if now - started <= self.timeout_s:
                continue
            del self._running[worker]
            if worker in self._workers:
                self._workers.remove(worker)
            self.timed_out += 1
            self.failed += 1
            with contextlib.suppress(InvalidStateError):  # it finished at the last moment
                future.set_exception(CompileTimeout(
                    f"compile {key[:16]} ran past {self.timeout_s:g} s; abandoned"))
        if not self._closed:
            self._ensure_workers()

    def _work(self) -> None:
        me = threading.current_thread()
        background_thread()   # Note [Background work yields to calls]
        while True:
            with self._cond:
                while not self._heap and not self._closed and me in self._workers:
                    self._cond.wait()
                if self._closed or me not in self._workers:
                    return
            # A promotion comes from a call's `leave`, so the task usually arrives while
            # that call is still in flight: it starts once no call is (Note [Background
            # work yields to calls]), outside the lock and before its deadline runs.
            checkpoint()
            with self._cond:
                if self._closed or me not in self._workers:
                    return
                if not self._heap:
                    continue
                _, _, key, task = heapq.heappop(self._heap)
                future = self._futures[key]
                self._running[me] = (time.monotonic(), key, future)
            if future.set_running_or_notify_cancel():
                with worker_task():   # Note [A compile worker's task and the GIL]
                    self._run(key, task, future, started=True)
            with self._cond:
                self._running.pop(me, None)
                if me not in self._workers:
                    return  # abandoned after its deadline: a replacement took over

    def _run(self, key: str, task, future: Future, started: bool = False) -> None:
        if not started and not future.set_running_or_notify_cancel():
            return
        try:
            result = task()
        except BaseException as exc:  # the task's error belongs to its future
            if not future.done():
                self.failed += 1
                future.set_exception(exc)
        else:
            try:
                future.set_result(result)
                self.completed += 1
            except InvalidStateError:  # timed out meanwhile: the late result is dropped
                pass
        self._forget_finished()

    def _forget_finished(self) -> None:
        with self._cond:
            # dicts keep insertion order: the first finished ones are the oldest.
            excess = len(self._futures) - self.keep_finished - len(self._heap)
            if excess <= 0:
                return
            for key in [k for k, f in self._futures.items() if f.done()][:excess]:
                del self._futures[key]
