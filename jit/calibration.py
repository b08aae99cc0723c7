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
  `size_class(numel)` (powers of two) is the usual one.

One `Calibrator` per device for the whole process (`calibrator_for`): it measures the
device, not a Runtime, and two Runtimes asking the same question must not pay twice.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Choice:
    """A calibrated answer: the chosen candidate and every candidate's median seconds."""

    name: str
    seconds: dict[str, float]
    default: str

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
                 margin: float = 0.05) -> None:
        self.device = torch.device(device)
        self.rounds = rounds
        self.margin = margin
        self._choices: dict[tuple, Choice] = {}
        self._lock = threading.Lock()
        self.measurements = 0     # choices measured (not answered from the cache)

    def known(self, op: str, size_class_key) -> Choice | None:
        return self._choices.get((op, size_class_key))

    def choose(self, op: str, size_class_key,
               candidates: dict[str, Callable[[], object]]) -> Choice:
        """The candidate to use for `op` at this size class (the first is the default)."""
        key = (op, size_class_key)
        choice = self._choices.get(key)
        if choice is not None:
            return choice
        # Measured outside the lock: a compile thread and a calibration elsewhere may
        # overlap; the first answer stored wins, so every caller sees one choice.
        choice = self._measure(candidates)
        with self._lock:
            self.measurements += 1
            return self._choices.setdefault(key, choice)

    def _measure(self, candidates: dict[str, Callable[[], object]]) -> Choice:
        names = list(candidates)
        default = names[0]
        for fn in candidates.values():
            fn()
            self._sync()
        samples: dict[str, list[float]] = {name: [] for name in names}
        clock = time.perf_counter
        for round_ in range(self.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                fn = candidates[name]
                start = clock()
                fn()
                self._sync()
                samples[name].append(clock() - start)
        medians = {name: statistics.median(times) for name, times in samples.items()}
        best = min(names, key=medians.__getitem__)
        if medians[best] >= medians[default] * (1.0 - self.margin):
            best = default
        return Choice(best, medians, default)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
