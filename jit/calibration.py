"""Choosing between equivalent forms of an operation by measuring them on this device.

Note [Calibration]
~~~~~~~~~~~~~~~~~~
Whether a rewrite pays is a property of the device and of the operation's size, not of
the rewrite: on this CPU, `linear(x, w, b, out=buf)` into a planned arena block measured
slower than letting linear allocate its result (the allocator hands back a cache-warm
block of the size just freed, and the out= form takes another path through ATen); on a
GPU, where allocation synchronizes and fragments, the answer differs. So a backend that
has two forms of an operation asks a `Calibrator` which one to use instead of following
a rule:

- `choose(op, size_class, candidates)` runs each candidate (a zero-argument callable
  doing one execution of that form on representative operands) once to warm it, then
  `rounds` rounds in which every candidate runs once, the order rotating per round so
  that a cache or frequency drift hits all of them alike; each candidate's figure is
  the median of its rounds;
- the first candidate is the default (what the code did before calibration); another
  wins only if its median beats the default's by more than `margin` (a fraction), so a
  tie, or noise, never changes the code;
- the choice is cached per (device, op, size class) for the life of the process: the
  measurement costs a few executions of the operation once, not once per compile.
  `size_class` is whatever key the caller decides groups sizes that behave alike;
  `size_class(numel)` (powers of two) is the usual one;
- `candidates` may be a zero-argument callable returning the dict: representative
  operands (random inputs, a packed weight) are then built only when the answer is not
  cached, so a compile whose questions were all answered before builds none of them;
- a clear difference stops early: after `min_rounds` rounds, when every sample of the
  fastest candidate beats every sample of each other one by more than `decisive` (a
  fraction), more rounds could not change the choice. Most of the compile-time
  questions (oneDNN against torch at a size where one is 1.5-3x the other) end there;
- a costly question stops early too: after `min_rounds` rounds, once the rounds have
  taken `budget_s` in all (the arena's allocate-or-out= question at a family's upper
  bound, batch 64 x seq 32 through a 1024-wide linear, took 1.2 s of a 3.4 s compile
  at 7 rounds). Three rounds still give a median, and a close call keeps the default.
  The budget (0.2 s) is above what seven rounds of a capped GEMM question take (M <= 512,
  a few ms per pair), so those keep every round: with 50 ms, one roofline run at load
  6-10 kept 6 of the Transformer's 30 GEMMs on torch (the JIT at 34% of the peak GEMM);
  the next, with 0.2 s, kept none (72%). One run each: a sign, not a proof.
- a costly question with an overwhelming answer stops after one round: once past
  `budget_s`, when every run of one candidate, its warm-up run included, took at most
  1 / `overwhelming` of every run of each other one. The layout question of ResNet-50's
  family kernel (batch 2..4) runs the whole region each way: NCHW 0.44-0.99 s a run
  against channels-last's 0.12-0.31 (2026-12-05 23:10 UTC, the warm-up of
  bench.warmup_bar, load 1.6-2.9), and min_rounds made that four NCHW runs, each one
  step of the compile thread that a call beginning meanwhile shares the cores with
  (Note [Background work yields to calls]); two runs of each already separate them
  3-8x, more than a call beside a run moves it.

One `Calibrator` per device for the whole process (`calibrator_for`): it measures the
device, not a Runtime, and two Runtimes asking the same question must not pay twice.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dynvm.jit.background import checkpoint

Candidates = dict[str, Callable[[], object]] | Callable[[], dict[str, Callable[[], object]]]


@dataclass(frozen=True)
class Choice:
    """A calibrated answer: the chosen candidate and every candidate's median seconds
    (`fastest`: each one's fastest sample, for callers that derive a cost from a
    difference of two candidates, which the host's noise, always positive, inflates
    least at the minimum; Note [oneDNN at a new row count])."""

    name: str
    seconds: dict[str, float]
    default: str
    fastest: dict[str, float] = field(default_factory=dict)

    @property
    def gain(self) -> float:
        """Fraction of the default's time the chosen candidate saves (0 if default)."""
        base = self.seconds[self.default]
        return 0.0 if base <= 0 else 1.0 - self.seconds[self.name] / base


def size_class(numel: int) -> int:
    """Power-of-two class of an element count: n in [2**k, 2**(k+1)) -> k."""
    return max(0, int(numel).bit_length() - 1)


class Calibrator:
    """Measured choices for one device; see Note [Calibration]. Thread-safe."""

    def __init__(self, device: torch.device | str, rounds: int = 7,
                 margin: float = 0.05, min_rounds: int = 3, decisive: float = 0.5,
                 budget_s: float = 0.2, overwhelming: float = 2.5) -> None:
        self.device = torch.device(device)
        self.rounds = rounds
        self.margin = margin
        self.min_rounds = min(min_rounds, rounds)
        self.decisive = decisive
        self.budget_s = budget_s
        self.overwhelming = overwhelming
        self._choices: dict[tuple, Choice] = {}
        self._lock = threading.Lock()
        self.measurements = 0     # choices measured (not answered from the cache)
        self.seconds = 0.0        # wall seconds spent measuring them, warm-up runs included
        self.waited_seconds = 0.0   # ... not counted: waits for calls in flight (checkpoint)
        self.seconds_by_op: dict[str, float] = {}   # the same per op (diagnostics)

    def known(self, op: str, size_class_key) -> Choice | None:
        return self._choices.get((op, size_class_key))

    def choose(self, op: str, size_class_key, candidates: Candidates) -> Choice:
        """The candidate to use for `op` at this size class (the first is the default);
        `candidates` is the dict, or a callable building it (only when measured)."""
        key = (op, size_class_key)
        choice = self._choices.get(key)
        if choice is not None:
            return choice
        # Note [Background work yields to calls]: operands are built, and every run is
        # timed, once no call is in flight; the waits are not calibration time.
        waited = checkpoint()
        start = time.perf_counter()
        if callable(candidates):
            candidates = candidates()
        # Measured outside the lock: a compile thread and a calibration elsewhere may
        # overlap; the first answer stored wins, so every caller sees one choice.
        choice, waited_measuring = self._measure(candidates)
        with self._lock:
            self.measurements += 1
            self.waited_seconds += waited + waited_measuring
            spent = time.perf_counter() - start - waited_measuring
            self.seconds += spent
            self.seconds_by_op[op] = self.seconds_by_op.get(op, 0.0) + spent
            return self._choices.setdefault(key, choice)

    def _measure(self, candidates: dict[str, Callable[[], object]]) -> tuple[Choice, float]:
        """The choice, and the seconds its checkpoints waited for calls (Note
        [Background work yields to calls])."""
        names = list(candidates)
        default = names[0]
        waited = 0.0
        clock = time.perf_counter
        warm: dict[str, float] = {}
        for name, fn in candidates.items():
            waited += checkpoint()
            start = clock()
            fn()
            self._sync()
            warm[name] = clock() - start
        samples: dict[str, list[float]] = {name: [] for name in names}
        began = clock()
        for round_ in range(self.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                fn = candidates[name]
                wait = checkpoint()
                waited += wait
                began += wait   # the budget counts measuring, not waiting
                start = clock()
                fn()
                self._sync()
                samples[name].append(clock() - start)
            if round_ + 1 >= self.min_rounds and (
                    clock() - began > self.budget_s or self._decided(samples)):
                break
            if clock() - began > self.budget_s and self._overwhelmed(samples, warm):
                break   # Note [Calibration]: a costly question, an overwhelming answer
        medians = {name: statistics.median(times) for name, times in samples.items()}
        best = min(names, key=medians.__getitem__)
        if medians[best] >= medians[default] * (1.0 - self.margin):
            best = default
        return Choice(best, medians, default,
                      {name: min(times) for name, times in samples.items()}), waited

    def _decided(self, samples: dict[str, list[float]]) -> bool:
        """Whether one candidate's slowest sample beats every other's fastest by
        `decisive`: no further round could change the choice."""
        slowest = {name: max(times) for name, times in samples.items()}
        best = min(slowest, key=slowest.__getitem__)
        return all(min(times) > slowest[best] * (1.0 + self.decisive)
                   for name, times in samples.items() if name != best)

    def _overwhelmed(self, samples: dict[str, list[float]], warm: dict[str, float]) -> bool:
        """Whether one candidate's every run, warm-up included, took at most 1 /
        `overwhelming` of every run of each other candidate."""
        runs = {name: [warm[name], *times] for name, times in samples.items()}
        slowest = {name: max(times) for name, times in runs.items()}
        best = min(slowest, key=slowest.__getitem__)
        return all(min(times) >= slowest[best] * self.overwhelming
                   for name, times in runs.items() if name != best)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def decisive_answer(self, op: str, related: Callable[[object], bool],
                        ratio: float) -> tuple[object, Choice] | None:
        """A measured answer to `op` at another size class whose key `related` accepts,
        where the chosen candidate's median was at most `ratio` times every other's, or
        every other's at least 1 / `ratio` times it when the default was kept (a clear
        verdict, which a nearby size class is taken not to flip); None if there is none.
        The one at the smallest key first (the callers' keys order by size)."""
        with self._lock:
            found = [(key, choice) for (asked, key), choice in self._choices.items()
                     if asked == op and related(key)]
        with contextlib.suppress(TypeError):   # keys of unlike shapes: any clear one
            found.sort(key=lambda kc: kc[0])
        for key, choice in found:
            chosen = choice.seconds[choice.name]
            others = [s for name, s in choice.seconds.items() if name != choice.name]
            if others and all(chosen <= ratio * other for other in others):
                return key, choice
        return None

    def entries(self) -> dict[tuple, Choice]:
        """Every cached choice, (op, size class) -> Choice (for diagnostics)."""
        with self._lock:
            return dict(self._choices)


class _Registry:
    """The process's calibrators, one per device (see Note [Calibration])."""

    def __init__(self) -> None:
        self._by_device: dict[str, Calibrator] = {}
        self._lock = threading.Lock()

    def get(self, device) -> Calibrator:
        name = str(torch.device(device))
        with self._lock:
            found = self._by_device.get(name)
            if found is None:
                found = self._by_device[name] = Calibrator(name)
            return found


# One per process, as the interned shape table is (dynvm.vm.shapes): a calibration
# measures the device, which every Runtime in the process shares.
_REGISTRY = _Registry()


def calibrator_for(device) -> Calibrator:
    """The process-wide Calibrator of `device`."""
    return _REGISTRY.get(device)
