"""Background compiles (docs/ARCHITECTURE.md: no call ever waits for a compile): calls made while a
compile runs are interpreted and return at once; a finished compile is installed from
the compile thread; one cache key is compiled once; the queue serves the highest benefit
first and drops the lowest beyond its length; a failing compile backs off.
"""

from __future__ import annotations

import importlib
import threading
import time

import pytest
import torch

import dynvm
from dynvm.jit.policy import decide
from dynvm.jit.queue import CompileQueue

h = importlib.import_module("tests.jit._jit_helpers")

SLEEP = 1.5


def recommender_inputs(b: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    sparse = tuple(torch.randint(0, rows, (b, bag), generator=gen)
                   for rows, bag in ((1000, 3), (800, 5), (1200, 1), (500, 4)))
    return (torch.randn(b, 13, generator=gen), *sparse)


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class SlowCompiles:
    """Wraps a real Jit's `_compile` so that each compile sleeps first."""

    def __init__(self, jit, sleep: float = SLEEP) -> None:
        self.original = jit._compile
        self.sleep = sleep
        self.started = threading.Event()
        self.finished = threading.Event()
        self.attempts = 0
        jit._compile = self

    def __call__(self, region_jit, signature, key):
        self.attempts += 1
        self.started.set()
        time.sleep(self.sleep)
        try:
            return self.original(region_jit, signature, key)
        finally:
            self.finished.set()


class FailingCompiles:
    """Wraps a real Jit's `_compile` so that its first `failures` compiles raise."""

    def __init__(self, jit, failures: int) -> None:
        self.original = jit._compile
        self.failures = failures
        self.attempts = 0
        jit._compile = self

    def __call__(self, region_jit, signature, key):
        self.attempts += 1
        if self.attempts <= self.failures:
            raise RuntimeError(f"injected compile failure #{self.attempts}")
        return self.original(region_jit, signature, key)


# ---------------------------------------------------------------- never blocking -------


def test_calls_during_a_slow_compile_are_interpreted_and_do_not_wait():
    program = h.compiled("recommender")
    interp = dynvm.Runtime(program, jit=False)
    inputs = recommender_inputs()
    expected = interp(*inputs)
    with h.torch_threads(1), dynvm.Runtime(program, jit=h.eager_config(sync=False)) as rt:
        slow = SlowCompiles(rt.jit)
        durations = []
        start = time.perf_counter()
        out = rt(*inputs)  # promotes (K=1) and queues the compile
        durations.append(time.perf_counter() - start)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert slow.started.wait(10), "the compile never started"
        during = 0
        while not slow.finished.is_set():
            start = time.perf_counter()
            out = rt(*inputs)
            durations.append(time.perf_counter() - start)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            during += 1
            time.sleep(0.02)
        stats = rt.stats()
        assert during >= 5, during
        assert max(durations) < SLEEP / 3, f"a call waited for the compile: {max(durations)}"
        # Every call so far (each began before the compile ended) was interpreted ...
        assert stats["specialized_region_calls"] == 0
        assert stats["interpreted_region_calls"] >= during
        # ... and the repeated signature was promoted and compiled once, not per call.
        assert slow.attempts == 1
        assert stats["promotions"] == 1
        wait_for(lambda: rt.jit.regions[0].strong)
        h.wait_drained(rt)
        assert rt.stats()["compiles"] == 1
        before = rt.stats()["specialized_region_calls"]
        for _ in range(3):
            torch.testing.assert_close(rt(*inputs), expected, rtol=1e-5, atol=1e-6)
        assert rt.stats()["specialized_region_calls"] == before + 3


def test_the_same_cache_key_is_never_compiled_twice():
    program = h.compiled("recommender")
    inputs = recommender_inputs()
    with dynvm.Runtime(program, jit=h.eager_config(sync=False)) as rt:
        slow = SlowCompiles(rt.jit, sleep=0.3)
        for _ in range(10):
            rt(*inputs)
        h.wait_drained(rt)
        wait_for(lambda: rt.jit.regions[0].strong)
        rj = rt.jit.regions[0]
        (signature,) = rj.strong
        # Promote the same signature again, as a region would after an eviction: the
        # queue hands back the finished future and its specialization is reinstalled.
        decision = decide(rt.jit.config, 5, 1, 1e-3, 1.0, 0.0)
        for _ in range(3):
            rt.jit.promote(rj, signature, decision)
        assert slow.attempts == 1
        assert rt.stats()["compiles"] == 1
        assert len(rt.jit.artifacts) == 1
        assert rt.jit.key_for(rj, signature) in rt.jit.artifacts


@pytest.mark.parametrize("sync", [True, False])
def test_queue_returns_the_same_future_for_the_same_key(sync):
    queue = CompileQueue(threads=1, sync=sync)
    runs = []
    gate = threading.Event()
    if sync:
        gate.set()

    def task():
        gate.wait(10)
        runs.append(1)
        return "kernel"

    first = queue.submit("key", 1.0, task)
    second = queue.submit("key", 9.0, task)
    assert first is second
    gate.set()
    assert first.result(timeout=10) == "kernel"
    assert queue.submit("key", 1.0, task) is first
    assert runs == [1]
    other = queue.submit("other", 1.0, task)
    assert other is not first and other.result(timeout=10) == "kernel"
    assert runs == [1, 1] and queue.completed == 2
    queue.close()


def test_queue_serves_highest_benefit_first_and_drops_the_lowest():
    queue = CompileQueue(threads=1, max_length=3, sync=False)
    running, release = threading.Event(), threading.Event()
    order: list[str] = []

    def blocker():
        running.set()
        release.wait(10)
        return "blocker"

    def task(name):
        def run():
            order.append(name)
            return name
        return run

    blocked = queue.submit("blocker", 100.0, blocker)
    assert running.wait(10)
    benefits = {"b5": 5.0, "b1": 1.0, "b9": 9.0, "b3": 3.0, "b7": 7.0, "b2": 2.0}
    futures = {name: queue.submit(name, benefit, task(name))
               for name, benefit in benefits.items()}
    assert len(queue) == 3
    assert queue.dropped == 3
    for name in ("b1", "b3", "b2"):
        assert futures[name].cancelled(), name
    release.set()
    assert blocked.result(timeout=10) == "blocker"
    for name in ("b9", "b7", "b5"):
        assert futures[name].result(timeout=10) == name
    assert order == ["b9", "b7", "b5"]
    # A dropped key may be submitted again: it gets a fresh future and runs.
    again = queue.submit("b1", 1.0, task("b1"))
    assert again is not futures["b1"] and again.result(timeout=10) == "b1"
    queue.close()


def test_dropped_compiles_are_counted_and_their_signatures_promotable_again():
    program = h.compiled("recommender")
    config = h.eager_config(sync=False, max_queue_length=1)
    with dynvm.Runtime(program, jit=config) as rt:
        slow = SlowCompiles(rt.jit, sleep=0.5)
        rt(*recommender_inputs(2))       # runs on the compile thread
        assert slow.started.wait(10)
        for b in (3, 4, 5):              # queue of one: two of these are dropped
            rt(*recommender_inputs(b))
        stats = rt.stats()
        assert stats["dropped_tasks"] == 2
        assert stats["queue_length"] == 1
        h.wait_drained(rt)               # dropped futures are cancelled: nothing pending
        assert slow.attempts == 2
        assert rt.stats()["compiles"] == 2


def test_close_cancels_waiting_compiles_and_calls_keep_working():
    queue = CompileQueue(threads=1, sync=False)
    running, release = threading.Event(), threading.Event()

    def blocker():
        running.set()
        release.wait(10)

    queue.submit("a", 1.0, blocker)
    assert running.wait(10)
    waiting = queue.submit("b", 1.0, lambda: "b")
    queue.close()
    release.set()
    assert waiting.cancelled()
    assert len(queue) == 0


# ---------------------------------------------------------------- failures -------------


def test_failed_compile_backs_off_then_retries():
    program = h.compiled("recommender")
    interp = dynvm.Runtime(program, jit=False)
    inputs = recommender_inputs()
    expected = interp(*inputs)
    config = h.eager_config(failed_compile_backoff_calls=5)
    with dynvm.Runtime(program, jit=config) as rt:
        failing = FailingCompiles(rt.jit, failures=1)
        torch.testing.assert_close(rt(*inputs), expected, rtol=0, atol=0)
        assert failing.attempts == 1
        stats = rt.stats()
        assert stats["compile_failures"] == 1 and stats["compiles"] == 0
        # Note [Failure accounting]: counted by reason, logged once per region and reason
        reason = "RuntimeError: injected compile failure #1"
        assert stats["specialize_failures"] == {reason: 1}
        assert stats["specialize_failures_total"] == 1
        assert [line for line in rt.jit.event_log if reason in line] == [
            f"region 0: specialization failed (a dynvm bug, reported once per region and "
            f"reason): {reason}"], rt.jit.event_log
        rj = rt.jit.regions[0]
        assert not rj.pending
        # Within the backoff window (5 region calls) the signature is not retried.
        for _ in range(4):
            torch.testing.assert_close(rt(*inputs), expected, rtol=0, atol=0)
        assert failing.attempts == 1
        assert rt.stats()["interpreted_region_calls"] == 5
        # After it, the compile is retried (and this time succeeds).
        torch.testing.assert_close(rt(*inputs), expected, rtol=0, atol=0)
        assert failing.attempts == 2
        stats = rt.stats()
        assert stats["compiles"] == 1 and stats["compile_failures"] == 1
        torch.testing.assert_close(rt(*inputs), expected, rtol=1e-5, atol=1e-6)
        assert rt.stats()["specialized_region_calls"] == 1


def test_backoff_doubles_on_each_further_failure():
    program = h.compiled("recommender")
    inputs = recommender_inputs()
    config = h.eager_config(failed_compile_backoff_calls=3)
    with dynvm.Runtime(program, jit=config) as rt:
        failing = FailingCompiles(rt.jit, failures=10**6)
        attempts_at = []
        for call in range(1, 30):
            rt(*inputs)
            if failing.attempts > len(attempts_at):
                attempts_at.append(call)
        # Failures at call 1, then after 3, 6 and 12 more interpreted calls.
        assert attempts_at == [1, 4, 10, 22], attempts_at
        assert rt.stats()["compile_failures"] == 4
        assert rt.stats()["compiles"] == 0


def test_failing_background_compile_keeps_calls_correct():
    program = h.compiled("recommender")
    interp = dynvm.Runtime(program, jit=False)
    with dynvm.Runtime(program, jit=h.eager_config(sync=False)) as rt:
        FailingCompiles(rt.jit, failures=10**6)
        for b in (1, 2, 3, 2, 1):
            inputs = recommender_inputs(b, seed=b)
            torch.testing.assert_close(rt(*inputs), interp(*inputs), rtol=0, atol=0)
        h.wait_drained(rt)

        def failures():
            return [line for line in rt.jit.event_log if "injected" in line]

        wait_for(lambda: len(failures()) == 3)
        stats = rt.stats()
        assert stats["compile_failures"] == 3 and stats["compiles"] == 0
        assert stats["specialized_region_calls"] == 0
