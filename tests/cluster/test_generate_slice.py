"""The short time slice a generator replica's step threads ask the kernel for (Note
[Short slices for the step's threads]): set on the calling thread only, clamped to what
the kernel accepts, read back from the kernel's own report."""

from __future__ import annotations

import threading

import pytest

from dynvm.cluster.serving._generate_slice import (
    SLICE_MIN_S,
    request_slice,
    thread_slice,
)


def _in_thread(fn):
    """fn() on a fresh thread (a slice is per thread: the test's own stays as it is)."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()))
    thread.start()
    thread.join(10)
    return out["value"]


@pytest.fixture()
def custom_slices():
    if _in_thread(thread_slice) is None:
        pytest.skip("this kernel reports no per-thread slice (EEVDF custom slices, "
                    "Linux 6.12+)")


def test_a_thread_gets_the_slice_it_asks_for_and_others_keep_theirs(custom_slices):
    before = thread_slice()

    def ask():
        return request_slice(0.0005), thread_slice()

    applied, after = _in_thread(ask)
    assert applied is True
    assert after == pytest.approx(0.0005)
    assert thread_slice() == before   # this thread's own is untouched


def test_a_slice_below_the_kernels_bound_is_clamped_to_it(custom_slices):
    applied, after = _in_thread(lambda: (request_slice(1e-6), thread_slice()))
    assert applied is True
    assert after == pytest.approx(SLICE_MIN_S)


def test_no_slice_asked_changes_nothing(custom_slices):
    before, applied, after = _in_thread(
        lambda: (thread_slice(), request_slice(0.0), thread_slice()))
    assert applied is False
    assert after == before


def test_the_schedulers_thread_asks_for_its_configured_slice(custom_slices):
    """SchedulerConfig.thread_slice_s reaches the scheduler's own thread (and only it),
    and the scheduler reports what the kernel gave; 0 leaves the kernel's default."""
    import time

    import dynvm
    from dynvm.cluster.serving._generate_scheduler import GenerateScheduler, SchedulerConfig
    from tests.cluster._generate_helpers import tiny_programs

    default = _in_thread(thread_slice)
    with dynvm.Generator(tiny_programs(), jit=False, compile_ahead=False) as generator:
        for wanted, expected in ((0.0005, 0.0005), (0.0, default)):
            scheduler = GenerateScheduler(generator, SchedulerConfig(thread_slice_s=wanted))
            try:
                deadline = time.monotonic() + 10
                while scheduler.thread_slice is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert scheduler.thread_slice == pytest.approx(expected)
            finally:
                scheduler.close()
    assert thread_slice() == pytest.approx(default)
