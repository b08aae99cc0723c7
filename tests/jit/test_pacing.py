"""Background work yields to calls (Note [Background work yields to calls] in
dynvm.jit.background): every Runtime call is counted in flight; a compile worker's
checkpoints wait while one is, a synchronous compile's never do; a queued compile and a
calibration's timed runs start only once no call is in flight; an exact specialization
is run once on the compile side before its install (Note [Prewarmed installs] in
dynvm.jit.prewarm); a kernel's run and a shadow sample's interpreter run on the worker
pause for a call begun during them (Note [A kernel's run on the worker pauses for
calls]). Mechanism only: no
speed is asserted here (bench.full_width and bench.warmup_trace measure it).
"""

from __future__ import annotations

import importlib
import sys
import threading
import time

import pytest
import torch

import dynvm
from dynvm.jit.background import (
    GENERATED_CODE_PREFIX,
    background_thread,
    checkpoint,
    run_paced,
    serving,
    waited_here,
)
from dynvm.jit.calibration import Calibrator
from dynvm.jit.prewarm import warm_registers
from dynvm.jit.queue import CompileQueue

h = importlib.import_module("tests.jit._jit_helpers")

QUIET = 0.15   # how long a waiting thread is watched to stay waiting


class _InFlight:
    """One call in flight for the duration of the `with` block."""

    def __enter__(self):
        serving().begin()
        return self

    def __exit__(self, *exc):
        serving().end()


def _on_worker(fn) -> tuple[threading.Thread, threading.Event, list]:
    """Run `fn` on a thread marked as a compile worker; (thread, done, results)."""
    done, results = threading.Event(), []

    def run():
        background_thread()
        results.append(fn())
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done, results


def test_a_worker_checkpoint_waits_for_the_call_in_flight_and_counts_the_wait():
    with _InFlight():
        thread, done, results = _on_worker(lambda: (checkpoint(5.0), waited_here()))
        assert not done.wait(QUIET), "the checkpoint ran beside a call in flight"
    assert done.wait(5.0), "the checkpoint did not resume when the call ended"
    thread.join()
    waited, counted = results[0]
    assert waited >= QUIET and counted == pytest.approx(waited)


def test_a_checkpoint_off_the_workers_never_waits():
    # A synchronous compile runs inside the call it would wait for.
    with _InFlight():
        assert checkpoint(5.0) == 0.0


def test_pacing_off_makes_checkpoints_return_at_once():
    activity = serving()
    activity.pacing = False
    try:
        with _InFlight():
            _, done, results = _on_worker(lambda: checkpoint(5.0))
            assert done.wait(5.0)
        assert results == [0.0]
    finally:
        activity.pacing = True


def test_a_checkpoint_waits_at_most_its_bound():
    # Under traffic with no gap a compile must still progress.
    with _InFlight():
        _, done, results = _on_worker(lambda: checkpoint(0.05))
        assert done.wait(5.0), "a checkpoint outwaited its bound"
    assert results[0] >= 0.05


def test_a_queued_compile_starts_only_once_no_call_is_in_flight():
    queue = CompileQueue(threads=1)
    started = threading.Event()
    try:
        with _InFlight():
            future = queue.submit("k", 1.0, lambda: started.set() or "done")
            assert not started.wait(QUIET), "the compile started beside a call in flight"
        assert future.result(timeout=5.0) == "done"
    finally:
        queue.close()


def test_calibration_times_no_candidate_while_a_call_is_in_flight():
    calibrator = Calibrator("cpu", rounds=3, min_rounds=3)
    runs: list[str] = []
    candidates = {"a": lambda: runs.append("a"), "b": lambda: runs.append("b")}
    with _InFlight():
        _, done, results = _on_worker(lambda: calibrator.choose("op", 0, candidates))
        assert not done.wait(QUIET)
        assert runs == [], "a candidate ran beside a call in flight"
    assert done.wait(5.0)
    assert results[0].name in ("a", "b") and len(runs) == 2 * (1 + 3)
    # The wait is not calibration time.
    assert calibrator.waited_seconds >= QUIET
    assert calibrator.seconds < calibrator.waited_seconds


PROGRAM = """
   0  %1 = RELU %0
   1  %2 = TANH %1
   2  RETURN {%2}
"""


def test_every_runtime_call_is_in_flight_while_it_runs_and_only_then():
    program = h.build(PROGRAM, regs=3, inputs=('"x" float32 [n:1..64]',))
    x = torch.randn(8)
    expected = torch.tanh(torch.relu(x))
    activity = serving()

    class Probe:
        """A region slot that reads the count (and raises when told to)."""

        def __init__(self) -> None:
            self.seen: list[int] = []
            self.boom = False

        def enter(self, regs):
            self.seen.append(activity.in_flight)
            if self.boom:
                raise RuntimeError("injected")
            return 0   # a ticket: the interpreter runs the region

        def leave(self, ticket, seconds):
            pass

    with dynvm.Runtime(program, jit=False) as interp:
        probe = Probe()
        interp.interpreter.install_slot(program.regions[0].index, probe)
        before = activity.calls
        torch.testing.assert_close(interp(x), expected)
        assert probe.seen and min(probe.seen) >= 1
        assert activity.calls == before + 1 and activity.in_flight == 0
        probe.boom = True
        with pytest.raises(RuntimeError, match="injected"):
            interp(x)
        assert activity.in_flight == 0, "a call that raised stayed in flight"


def test_an_exact_specialization_runs_once_on_the_compile_side_before_its_install():
    # Note [Prewarmed installs]: the first call's one-time costs are not a request's.
    program = h.build(PROGRAM, regs=3, inputs=('"x" float32 [n:1..64]',))
    x = torch.randn(16)[2::2]   # a strided, offset view: the warm inputs take its layout
    with dynvm.Runtime(program, jit=h.eager_config(sync=True)) as rt:
        for _ in range(3):
            torch.testing.assert_close(rt(x), torch.tanh(torch.relu(x)))
        assert rt.stats()["compiles"] >= 1
        assert rt.jit.counters.prewarm_seconds > 0.0
        region = rt.jit.regions[0]
        signature = next(iter(region.strong))
        regs = warm_registers(program.n_regs, rt.jit._constants, region.live_in,
                              signature, torch.device("cpu"))
        warm = regs[region.live_in[0]]
        assert (warm.shape, warm.stride(), warm.storage_offset()) == \
            (x.shape, x.stride(), x.storage_offset())
        assert not warm.any()


def test_a_shadow_sample_runs_on_the_compile_worker_not_on_the_call(monkeypatch):
    # Note [Probation]: the hit that is due a shadow sample runs the kernel alone; the
    # interpreter and the kernel are timed on a copy of its registers, in the background.
    # Back-to-back calls meet the samples; unspaced, as this test counts them (Note
    # [Shadow samples beside calls]: tests/jit/test_shadow_pacing.py).
    import types

    from dynvm.jit import shadow

    monkeypatch.setattr(shadow, "SHADOW_SPACING", 0)
    shadow.shadow_pacing().next_at = 0

    from dynvm.jit.config import JitConfig
    from dynvm.jit.guards import GuardStrength
    from dynvm.jit.probation import EARLY_SAMPLES
    from dynvm.jit.region_jit import Specialization

    program = h.build(PROGRAM, regs=3, inputs=('"x" float32 [n:1..64]',))
    x = torch.randn(8)
    config = JitConfig(families=False, compile_seconds_base=1e9, probation_shadow_every=1)
    threads: dict[str, list[str]] = {"kernel": [], "interpreter": []}
    with dynvm.Runtime(program, jit=config) as rt:
        region_jit = rt.jit.regions[0]
        (out,) = [r.index for r in program.regions[0].live_out]

        def kernel(regs):
            threads["kernel"].append(threading.current_thread().name)
            regs[out] = torch.tanh(torch.relu(regs[0]))

        interpret = region_jit._interpret

        def timed_interpret(regs, activity=None):
            threads["interpreter"].append(threading.current_thread().name)
            return interpret(regs, activity)

        region_jit._interpret = timed_interpret
        regs = [None] * program.n_regs
        regs[0] = x
        spec = Specialization(signature=region_jit._sign(regs), strength=GuardStrength.STRONG,
                              fn=kernel, artifact=types.SimpleNamespace(kernel_name="k",
                                                                        key="k"))
        region_jit.install(spec)
        # The warm-up hit and one sampled hit per early sample: no verdict (which would
        # end the kernel's hits) can come before the last of these calls.
        calls = EARLY_SAMPLES + 1
        for _ in range(calls):
            torch.testing.assert_close(rt(x), torch.tanh(torch.relu(x)))
        deadline = time.monotonic() + 30
        # After the warm-up hit every hit is due a sample, until a verdict ends them.
        while (spec.probation is not None and len(threads["interpreter"]) < calls - 1
               and time.monotonic() < deadline):
            time.sleep(0.01)
        me = threading.current_thread().name
        assert spec.calls == calls and threads["kernel"].count(me) == calls
        assert threads["interpreter"] and set(threads["interpreter"]) == {"dynvm-compile"}
        # A sample counts itself after its interpreter run returns: wait for the count
        # to catch up with the runs (one may still be between the two).
        counted = -1
        while time.monotonic() < deadline:
            counted, ran = rt.stats()["probation"]["shadow_calls"], len(threads["interpreter"])
            if counted == ran:
                break
            time.sleep(0.01)
        assert counted == len(threads["interpreter"])


def test_a_worker_under_calls_without_a_gap_still_gets_half_the_time():
    """Note [Background work yields to calls]: with a call always in flight, each
    checkpoint waits only what the work since the last one earned (WAIT_SHARE per
    second, MAX_WAIT_S banked at most), so ten steps take ten steps' work and about as
    much waiting, not ten MAX_WAIT_S."""
    from dynvm.jit import background

    steps, work_s = 10, 0.02
    done = {}

    def worker():
        background_thread()
        start, worked = time.perf_counter(), 0.0
        for _ in range(steps):
            step = time.perf_counter()
            while time.perf_counter() - step < work_s:
                pass
            worked += time.perf_counter() - step
            checkpoint()
        done["waited"], done["wall"], done["worked"] = (
            waited_here(), time.perf_counter() - start, worked)

    activity = serving()
    activity.begin()   # a call in flight for the whole test: no gap to wait for
    try:
        thread = threading.Thread(target=worker, name="dynvm-compile")
        thread.start()
        thread.join(60)
    finally:
        activity.end()
    assert not thread.is_alive()
    allowed = background.MAX_WAIT_S + background.WAIT_SHARE * done["worked"]
    assert done["waited"] <= allowed + 0.5, done   # + a loaded host's wake-up delays
    assert done["waited"] < steps * background.MAX_WAIT_S / 2, done


def test_after_a_wait_a_worker_goes_on_for_a_slice_of_work_then_waits_again():
    """Note [A slice of work per wait]: back to back calls leave no gap, so waiting at
    every checkpoint of microsecond steps (the arena questions' timed runs) cost a whole
    call each; after a wait the worker goes on until it has worked SLICE_S, then the
    first checkpoint past it waits for the call in flight."""
    from dynvm.jit import background

    slice_s = background.SLICE_S
    background.SLICE_S = 1.0   # wide enough that a loaded host's scheduling fits in it
    woke, next_call, past_slice = threading.Event(), threading.Event(), threading.Event()
    waits: list[float] = []

    def worker():
        background_thread()
        waits.append(checkpoint(5.0))         # beside the first call: waits for its end
        woke.set()
        next_call.wait(5.0)                   # ... and the next call has begun
        waits.extend(checkpoint(5.0) for _ in range(3))   # within the slice: go on
        time.sleep(1.0)                       # work past the slice
        past_slice.set()
        waits.append(checkpoint(5.0))         # waits for the call in flight
        return waits

    activity = serving()
    try:
        activity.begin()
        thread, done, results = _on_worker(worker)
        assert not done.wait(QUIET)
        activity.end()
        assert woke.wait(5.0)
        activity.begin()   # the next call
        next_call.set()
        assert past_slice.wait(5.0)
        assert not done.wait(QUIET), "a checkpoint past the slice ran beside a call"
        activity.end()
        assert done.wait(5.0)
        thread.join()
    finally:
        background.SLICE_S = slice_s
    first, *within, last = results[0]
    assert first >= QUIET and within == [0.0, 0.0, 0.0] and last >= QUIET


def test_the_switch_interval_is_lowered_while_a_task_runs_and_restored_after():
    """Note [A compile worker's task and the GIL]: at most SWITCH_INTERVAL_S while a
    worker runs a task, the application's own again once none runs."""
    from dynvm.jit import background

    before = sys.getswitchinterval()
    queue = CompileQueue()
    try:
        during = queue.submit("interval", 1.0, sys.getswitchinterval).result(10)
        deadline = time.monotonic() + 10
        while queue.running() and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        queue.close(wait_s=5)
    assert during == pytest.approx(min(before, background.SWITCH_INTERVAL_S))
    assert sys.getswitchinterval() == before


def test_tasks_overlapping_restore_the_interval_after_the_last_and_keep_one_set_meanwhile():
    from dynvm.jit import background
    from dynvm.jit.background import worker_task

    before = sys.getswitchinterval()
    try:
        with worker_task():
            with worker_task():   # a second worker's task
                pass
            assert sys.getswitchinterval() == pytest.approx(
                min(before, background.SWITCH_INTERVAL_S))   # one still runs
        assert sys.getswitchinterval() == before
        with worker_task():
            sys.setswitchinterval(0.002)   # the application's, set meanwhile
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)


def _generated(source: str, name: str, namespace: dict):
    """A function compiled as the CPU backend compiles its kernels (a file name under
    GENERATED_CODE_PREFIX), so that `run_paced` follows its lines."""
    exec(compile(source, f"{GENERATED_CODE_PREFIX} {name}>", "exec"), namespace)
    return namespace[name]


def _call_begins_then_ends_after(hold_s: float, log: list) -> None:
    """Begin a call now (as a request arriving during a run would) and end it from
    another thread `hold_s` later, logging when."""
    serving().begin()

    def end():
        time.sleep(hold_s)
        log.append(("ended", time.perf_counter()))
        serving().end()

    threading.Thread(target=end, daemon=True).start()


def test_a_kernels_run_on_the_worker_pauses_between_lines_for_a_call_begun_during_it():
    log: list = []
    kernel = _generated(
        "def kernel(log):\n"
        "    log.append(('first line', time.perf_counter()))\n"
        "    begin(QUIET, log)\n"
        "    log.append(('after the call', time.perf_counter()))\n"
        "    return 'result'\n", "kernel",
        {"time": time, "begin": _call_begins_then_ends_after, "QUIET": QUIET})
    thread, done, results = _on_worker(lambda: run_paced(kernel, log))
    assert done.wait(10.0)
    thread.join()
    result, paused = results[0]
    events = dict(log)
    assert result == "result"
    # The line after the call's begin ran only once the call had ended, and the pause
    # (reported, so that a timed run leaves it out) is about the call's length.
    assert events["after the call"] >= events["ended"]
    assert QUIET * 0.9 <= paused <= events["after the call"] - events["first line"]
    assert sys.gettrace() is None


def test_a_kernels_run_off_the_workers_or_under_a_tracer_runs_as_it_is():
    log: list = []
    kernel = _generated(
        "def kernel(log):\n"
        "    begin(QUIET, log)\n"
        "    log.append(('after the call', time.perf_counter()))\n", "kernel",
        {"time": time, "begin": _call_begins_then_ends_after, "QUIET": QUIET})
    assert run_paced(kernel, log)[1] == 0.0   # the call's thread: never pauses
    _until_no_call_in_flight()
    assert [event for event, _ in log] == ["after the call", "ended"]

    def tracer(frame, event, arg):
        return None

    def traced():
        sys.settrace(tracer)
        try:
            return run_paced(kernel, log), sys.gettrace()
        finally:
            sys.settrace(None)

    thread, done, results = _on_worker(traced)
    assert done.wait(10.0)
    thread.join()
    (_, paused), after = results[0]
    assert paused == 0.0 and after is tracer   # a debugger's or coverage's tracer kept
    _until_no_call_in_flight()
    assert [event for event, _ in log[2:]] == ["after the call", "ended"]


def _until_no_call_in_flight() -> None:
    deadline = time.monotonic() + 5.0
    while serving().busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not serving().busy()


def test_a_shadow_samples_interpreter_run_pauses_between_steps_and_leaves_the_pause_out():
    program = h.build(PROGRAM, regs=3, inputs=('"x" float32 [n:1..64]',))
    log: list = []
    with dynvm.Runtime(program, jit=dynvm.JitConfig(families=False)) as rt:
        region_jit = rt.jit.regions[0]
        region_jit._steps = [
            lambda regs: log.append(("first step", time.perf_counter())),
            lambda regs: _call_begins_then_ends_after(QUIET, log),
            lambda regs: log.append(("after the call", time.perf_counter()))]
        started = time.perf_counter()
        thread, done, results = _on_worker(
            lambda: region_jit._interpret([None] * program.n_regs, serving()))
        assert done.wait(10.0)
        thread.join()
    events = dict(log)
    assert events["after the call"] >= events["ended"]
    # Its time is its steps', not the wait for the call.
    assert results[0] is not None and results[0] < QUIET / 2
    assert time.perf_counter() - started >= QUIET
