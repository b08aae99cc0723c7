"""bench.full_width waits for a JIT's running background task before a timed call
(Note [Quiet before each timed call]): a probation shadow sample leaves the queue when
it starts and is never pending, so an empty queue alone is not quiet."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from bench import full_width
from dynvm.jit.queue import CompileQueue


def test_drain_waits_for_a_running_task_that_left_the_queue():
    queue = CompileQueue(threads=1)
    started, release = threading.Event(), threading.Event()

    def task():
        started.set()
        release.wait(5)
        return "done"

    runtime = SimpleNamespace(jit=SimpleNamespace(queue=queue, regions={}))
    try:
        future = queue.submit("shadow sample", 1.0, task)
        assert started.wait(5)
        assert len(queue) == 0 and queue.running() == 1   # what an empty-queue check missed
        assert full_width._busy(runtime)
        threading.Timer(0.05, release.set).start()
        full_width._drain(runtime, timeout=5)
        assert future.done() and future.result() == "done"
        deadline = time.monotonic() + 5   # the worker forgets the task after its future
        while queue.running() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not full_width._busy(runtime)
    finally:
        release.set()
        queue.close(wait_s=5)


def test_a_runtime_without_a_jit_is_never_busy():
    assert not full_width._busy(SimpleNamespace(jit=None))
    full_width._drain(SimpleNamespace(jit=None), timeout=0.01)
