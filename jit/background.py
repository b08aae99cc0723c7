"""Background work never makes serving slower: the calls in flight, and the compile
thread's checkpoints that wait for them.

Note [Background work yields to calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The compile thread shares two cores and one GIL with the calls it serves. Its work is
Python (specializing, emitting), torch ops that release the GIL but take the cores, and
oneDNN calls that hold the GIL for their whole length (Note [oneDNN holds the GIL] in
cpu/fusion.py): a calibration question timed beside a call slows that call by its cores, and by
a convoy on the GIL, where every op of the call that released the GIL waits to
take it back (up to the switch interval, 5 ms, behind Python on the compile thread, or
a whole oneDNN call). On BERT-base width (2 cores, bench.full_width's warm-up) that
cost calls at some shapes 1.3-4x the interpreter's p90 while kernels compiled.

So every call of every Runtime in the process (with or without a JIT: both serve) is
counted in flight (`ServingActivity`, one per process, `serving()`), and the compile
thread waits, at checkpoints between its steps, until no call is in flight:

- where: before each compile starts (jit.queue), between specializing and building,
  before each calibration question is built and before each timed run of a candidate
  (jit.calibration): between steps that are short by construction (a calibration run is
  capped at a few ms of GIL, Note [oneDNN holds the GIL]), never inside one, and never
  while holding a lock a call may take (no checkpoint sits inside a `with lock`);
- only on a compile worker (`background_thread`): a synchronous compile (the test
  switch) runs inside the call it would wait for;
- how long: until the last call in flight ends, or `MAX_WAIT_S`, or the worker's wait
  budget, whichever is first. Under traffic with no gap at all a compile must still
  progress (a JIT that never compiles serves at the interpreter's speed for good), and
  one step per `MAX_WAIT_S` is not progress: a step between checkpoints can be a few
  milliseconds (one calibration run), so eight threads calling one Runtime back to back
  saw one compile and no specialized call in 2,400 calls. So a worker earns its waits
  by working: each second of work between checkpoints buys `WAIT_SHARE` seconds of
  waiting (at most `MAX_WAIT_S` banked, as a fresh worker starts), and with the budget
  spent a checkpoint goes on at once. Saturated, a compile gets at least
  1 / (1 + WAIT_SHARE) of the time; with gaps between calls it waits for them as
  before. A step that runs beside a call is timed beside it, a calibration sample
  included: the calibrator's medians and early stops absorb a noisy sample as they do
  under any load;
- the time spent waiting is counted (`waited_seconds`, `waits`), per process;
- a slice of work per wait (Note [A slice of work per wait]).

A call that begins while a step runs still shares the cores with that one step; what
the checkpoints remove is a compile that keeps working through the whole call. What the
step takes from that call is bounded too (Note [A compile worker's task and the GIL]).

Note [A slice of work per wait]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Back-to-back calls (a decode loop, a saturated server) leave no gap: a wait ends when
one call does, and the next begins before the worker's next step, so the step runs
beside that call whatever the wait was. What a wait buys is that at most one step of
background work runs beside each call. Counted in steps, that bound costs as much for a
step of 20 us as for one of 5 ms: the arena questions (Note [Arena by measurement] in
cpu/arena_choice.py) time ops of a few elements, about 20 checkpoints of microseconds
each, and in the first decode generation at batch 4 (the bench Llama, one thread) each
of them waited for a whole 32 ms step: 0.57 of the compile's 0.85 s, while the 0.17 s
of emission before them, with no checkpoint inside, ran beside five steps and left
them at 32-35 ms (the solo step: 33 ms; 2026-12-05 12:08 UTC, load 1.1-1.6). With the
slice the questions waited 17-30 ms in all, and the kernel served B=4 and B=16 from
step 10-14 in three runs, against 10-27 in three without (docs/bench_log.md,
2026-12-05 12:08-12:13, load 1.1-2.2).

So the bound is counted in time: after a wait (or a checkpoint that found no call in
flight) a worker goes on through later checkpoints until it has worked `SLICE_S` since
then, and waits at the first checkpoint past it. A call still sees at most one step of
background work beyond a slice (the step that crosses it), and a step of a few
milliseconds (a calibration run, Note [oneDNN holds the GIL] in cpu/fusion.py) still
waits after it, as before. A fresh worker has no slice: its first checkpoint beside a
call waits, so a queued compile still starts in a gap.

Note [A compile worker's task and the GIL]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The checkpoints decide when a step starts, not what it takes from a call that begins
while it runs, and the steps between two checkpoints are not short: specializing and
emitting a region is Python from end to end (hundreds of ms at BERT-base width, 4
layers), building a kernel packs weights and builds oneDNN primitives, a shadow sample
runs the whole region twice (Note [Probation]), a prewarm once. A step begun in the
gap after one call runs beside the next, and takes from it in two ways:

- the cores: the worker's torch ops run on a team of their own (each thread that
  starts an OpenMP region has its own), as many threads as the calls' team, on the
  same two cores. The worker keeps its priority. A lower one (a nice value the worker
  set on itself before its first parallel region, so that its OpenMP team inherited
  it) was tried and taken out: it starved the compiles, since other processes on the
  host weigh 1024 each against the worker's 110 at nice 10 or 15 at nice 19, and
  BERT-base's 200-call warm-up made 2 compiles at nice 19 (load 8) and 3-5 at nice 10
  (load 3-13) where it made 17 at nice 0 (docs/bench_log.md, 2026-12-06 04:30-05:20
  UTC): a warm-up that compiles a fifth as much passes the bar by not warming up.
  Under traffic with no gap a compile must still progress (Note [Background work
  yields to calls]); a SCHED_IDLE helper beside two busy processes was starved
  outright (Note [Column halves with a helper thread]).
- the GIL: a call's thread gives the GIL up in every torch op, the worker's Python
  takes it, and the call waits up to the switch interval (5 ms by default) to get it
  back, at every op: the convoy of Note [Background work yields to calls]. While a
  worker runs a task (`worker_task`), the switch interval is at most
  `SWITCH_INTERVAL_S` (0.5 ms), restored when the last running task ends unless
  someone set another meanwhile. With no task running nothing changes; while one runs,
  two threads that both want the GIL trade it ten times as often (a few us each). Not
  yet shown by measurement: bench.warmup_bar with it met 14 of 16 BERT shapes (3 runs,
  05:25, load 4.5-2.3) against 15 of 16 without it (5 runs, 04:39, load 7.6-4.5), where
  the bar's own A/A was over 1.1 at 7 of 16 shapes: the host's noise, not a verdict.

So the long steps are cut where they can be: abstract evaluation comes to a checkpoint
per instruction (jit.specialize's ShapeMemo), a kernel's build per linear and per
weight it packs (cpu/onednn_linear.py, cpu/prepack.py), a shadow sample's interpreter
run per step (Note [A shadow sample pauses for calls] in jit.shadow), and a kernel's
run on the worker per line (Note [A kernel's run on the worker pauses for calls]).

Note [A kernel's run on the worker pauses for calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The worker runs whole kernels twice over: a shadow sample's specialized side (Note
[Probation]) and a prewarm (Note [Prewarmed installs]). Each is a call's worth of work,
and a call that begins during one shares the cores with the rest of it: in BERT-base
width's warm-up, once the interpreter's side of the samples paused (2026-12-06 18:55
UTC, per-call telemetry), the JIT's slowest calls were those that began beside a
sample's kernel run (a 1x16 call at 57 ms against its median of 15).

A kernel is generated Python, one line per op, so its run can pause between ops
without touching the code that serves: `run_paced` sets a trace function on the worker
thread alone (sys.settrace is per thread) that follows only frames of generated code
(GENERATED_CODE_PREFIX) and, at each line while a call is in flight (one attribute
read), comes to a checkpoint, which past the worker's slice waits for the call to end.
The calls' threads run untraced, and the worker's other Python (torch's wrappers)
raises one call event per frame and no line events. The pauses are returned, so a timed
run subtracts them. What a pause never splits: a column-halves kernel's helper is not
taken by a worker's run (cpu/column_halves.py), and an op's own C call runs whole. An
arena lease the paused run holds is not waited for: a call of the same kernel leases
another buffer (Note [Arena concurrency] in arena/pool.py). A tracer already set (a
debugger, coverage) is left alone and the run goes unpaused.
"""

from __future__ import annotations

import sys
import threading
import time

MAX_WAIT_S = 1.0   # the longest a checkpoint waits for calls to end (module docstring)
WAIT_SHARE = 1.0   # seconds of waiting a second of work between checkpoints earns
SLICE_S = 0.002    # work a worker goes on with beside calls after a wait (Note [A slice
#                    of work per wait]); 0: every checkpoint beside a call waits
SWITCH_INTERVAL_S = 5e-4   # the switch interval at most while a task runs (same Note);
#                            0: unchanged


class ServingActivity:
    """Calls in flight in this process (Note [Background work yields to calls]).
    Thread-safe; `begin`/`end` cost one uncontended lock each."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.in_flight = 0
        self.calls = 0            # calls begun (diagnostics, tests)
        self.waits = 0            # checkpoints that found a call in flight
        self.waited_seconds = 0.0
        self._waiting = 0
        self.pacing = True        # False: checkpoints never wait (an on/off figure)
        self.last_end = 0.0       # time.monotonic() when the last call ended

    def begin(self) -> None:
        """A call starts."""
        with self._cond:
            self.in_flight += 1
            self.calls += 1

    def end(self) -> None:
        """A call ends (wakes the checkpoints waiting for the last one)."""
        with self._cond:
            self.in_flight -= 1
            self.last_end = time.monotonic()
            if self.in_flight <= 0:
                self.in_flight = 0
                if self._waiting:
                    self._cond.notify_all()

    def busy(self) -> bool:
        """Whether a call is in flight now."""
        return self.in_flight > 0

    def wait_idle(self, timeout: float) -> float:
        """Wait until no call is in flight, at most `timeout` seconds; the seconds
        waited (0.0 when none was in flight)."""
        if self.in_flight <= 0:
            return 0.0
        start = time.perf_counter()
        deadline = time.monotonic() + timeout
        with self._cond:
            if self.in_flight <= 0:
                return 0.0
            self._waiting += 1
            try:
                while self.in_flight > 0:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._cond.wait(left):
                        break
            finally:
                self._waiting -= 1
            waited = time.perf_counter() - start
            self.waits += 1
            self.waited_seconds += waited
        return waited


    def wait_gap(self, quiet_s: float, timeout: float) -> bool:
        """Wait until no call is in flight and none has ended for `quiet_s` seconds (a
        gap between calls, not the instant between two back-to-back ones), at most
        `timeout` seconds; whether such a gap came."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._waiting += 1
            try:
                while True:
                    now = time.monotonic()
                    quiet = quiet_s - (now - self.last_end)
                    if self.in_flight <= 0 and quiet <= 0:
                        return True
                    left = deadline - now
                    if left <= 0:
                        return False
                    # An end notifies; a call that begins meanwhile is seen on waking.
                    self._cond.wait(min(left, quiet if self.in_flight <= 0 else left))
            finally:
                self._waiting -= 1


class _Serving:
    """Begin/end as a context manager (Runtime wraps each call in it)."""

    __slots__ = ("activity",)

    def __init__(self, activity: ServingActivity) -> None:
        self.activity = activity

    def __enter__(self) -> None:
        self.activity.begin()

    def __exit__(self, *exc) -> None:
        self.activity.end()


# One per process, as the calibrator is (jit.calibration): every Runtime's calls share
# the cores that every compile thread uses.
_ACTIVITY = ServingActivity()
_SERVING = _Serving(_ACTIVITY)
_LOCAL = threading.local()


def serving() -> ServingActivity:
    """The process's calls in flight."""
    return _ACTIVITY


def serving_call() -> _Serving:
    """A context manager counting one call in flight (reentrant across threads)."""
    return _SERVING


def background_thread(enabled: bool = True) -> None:
    """Mark the current thread as a compile worker whose checkpoints wait for calls
    (Note [Background work yields to calls])."""
    _LOCAL.background = enabled


def on_worker() -> bool:
    """Whether the current thread is a compile worker (`background_thread`)."""
    return getattr(_LOCAL, "background", False)


class _WorkerTasks:
    """The tasks running on compile workers, and the switch interval they lowered (Note
    [A compile worker's task and the GIL])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = 0
        self._saved: float | None = None   # the interval before the first task lowered it
        self._set: float | None = None     # the one it set

    def __enter__(self) -> None:
        with self._lock:
            self.running += 1
            if self.running == 1 and 0 < SWITCH_INTERVAL_S < sys.getswitchinterval():
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_INTERVAL_S)
                self._set = sys.getswitchinterval()

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.running -= 1
            if self.running == 0 and self._saved is not None:
                if sys.getswitchinterval() == self._set:   # else: someone else's now
                    sys.setswitchinterval(self._saved)
                self._saved = self._set = None


_TASKS = _WorkerTasks()


def worker_task() -> _WorkerTasks:
    """A context manager around one task on a compile worker: the switch interval is at
    most `SWITCH_INTERVAL_S` while any runs (Note [A compile worker's task and
    the GIL])."""
    return _TASKS


def checkpoint(max_wait_s: float = MAX_WAIT_S, gap: bool = False) -> float:
    """A point between two steps of background work: on a compile worker, wait while a
    call is in flight (at most `max_wait_s`); elsewhere return at once. The seconds
    waited. `gap`: the next step is timed (a shadow sample's run), so it waits for a
    gap even inside its slice (Note [Shadow samples beside calls] in jit.shadow)."""
    if not getattr(_LOCAL, "background", False):
        return 0.0
    # The wait budget (module docstring): work since the last checkpoint earns waiting.
    now = time.perf_counter()
    last = getattr(_LOCAL, "last", None)
    budget = getattr(_LOCAL, "budget", max_wait_s)   # a fresh worker may wait a full one
    if last is not None:
        budget = min(max_wait_s, budget + (now - last) * WAIT_SHARE)
    waited = 0.0
    if _ACTIVITY.in_flight <= 0:
        _LOCAL.slice_end = now + SLICE_S   # Note [A slice of work per wait]
    elif _ACTIVITY.pacing and budget > 0 and (gap or now >= getattr(_LOCAL, "slice_end", 0.0)):
        waited = _ACTIVITY.wait_idle(min(max_wait_s, budget))
        budget -= waited
        _LOCAL.waited = getattr(_LOCAL, "waited", 0.0) + waited
        _LOCAL.slice_end = time.perf_counter() + SLICE_S
    _LOCAL.budget, _LOCAL.last = budget, time.perf_counter()
    return waited


def waited_here() -> float:
    """Seconds this thread's checkpoints have waited so far (a compile's own time is
    its wall time less what it waited for calls)."""
    return getattr(_LOCAL, "waited", 0.0)


def pause_for_calls(clock=time.perf_counter) -> float:
    """A checkpoint inside a timed run on a compile worker (a call is in flight): the
    seconds it paused, by the run's own `clock` (0.0 when it went on within its slice)."""
    before = clock()
    return clock() - before if checkpoint() > 0.0 else 0.0


# Generated kernels are compiled under file names that start so (cpu/codegen.py's
# `_define`, triton's loaders): the frames `run_paced` pauses in.
GENERATED_CODE_PREFIX = "<dynvm"


def run_paced(fn, *args, clock=time.perf_counter) -> tuple[object, float]:
    """`fn(*args)`, and the seconds (by `clock`) it paused for calls: on a compile
    worker, its generated code comes to a checkpoint at each line run while a call is in
    flight (Note [A kernel's run on the worker pauses for calls]); elsewhere, or under
    a tracer already set (a debugger, coverage), it runs as it is."""
    if not getattr(_LOCAL, "background", False) or sys.gettrace() is not None:
        return fn(*args), 0.0
    activity, paused = _ACTIVITY, 0.0

    def on_line(frame, event, arg):
        nonlocal paused
        if event == "line" and activity.in_flight > 0:
            paused += pause_for_calls(clock)
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename.startswith(GENERATED_CODE_PREFIX) \
            else None

    sys.settrace(on_call)   # this thread's only
    try:
        result = fn(*args)
    finally:
        sys.settrace(None)
    return result, paused
