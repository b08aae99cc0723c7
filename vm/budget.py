"""The per-call budget: how long one call may run and how many loop iterations it may
take before the interpreter stops it.

Note [Call budget]
~~~~~~~~~~~~~~~~~~
A program loops only through a backward edge (a JUMP or JUMP_IF_FALSE whose target is
at or before it): regions are straight-line and every other edge goes forward, so a
call without a backward edge ends after at most len(code) steps. A program edited to end
in `JUMP @0`, or a `torch.while_loop` whose condition never turns false, would otherwise
run forever and, in a server, hold its worker forever. So the interpreter meters the
backward edges only: each one taken counts one iteration and compares the clock with
the call's deadline. The straight-line path pays nothing; a loop pays one decrement and
one `time.monotonic()` per iteration (~0.1 us, against several us for the tensor work
of any real iteration). Past either bound the call raises `CallBudgetError` naming the
loop's instruction. Time spent inside one long instruction is not interrupted (torch
kernels cannot be); the check comes at the next backward edge.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from dynvm.vm.errors import CallBudgetError, ConfigError


@dataclass(frozen=True)
class CallBudget:
    """Bounds on one call of a program (Note [Call budget])."""

    seconds: float = 60.0
    """Wall-clock time a call may take, checked at each loop iteration (finite)."""
    loop_iterations: int = 10_000_000
    """Backward jumps (loop iterations, all loops together) one call may take."""

    def __post_init__(self) -> None:
        if not (isinstance(self.seconds, int | float) and math.isfinite(self.seconds)
                and self.seconds > 0):
            raise ConfigError(f"CallBudget.seconds must be a finite number > 0, "
                             f"got {self.seconds!r}")
        if type(self.loop_iterations) is not int or self.loop_iterations < 1:
            raise ConfigError(f"CallBudget.loop_iterations must be an integer >= 1, "
                             f"got {self.loop_iterations!r}")

    def meter(self) -> LoopMeter:
        """The mutable per-call counter the interpreter's backward edges decrement."""
        return LoopMeter(self)


class LoopMeter:
    """One call's remaining iterations and its deadline; lives in that call's register
    file, so concurrent calls never share one."""

    __slots__ = ("budget", "deadline", "left", "started")

    def __init__(self, budget: CallBudget) -> None:
        self.budget = budget
        self.started = time.monotonic()
        self.deadline = self.started + budget.seconds
        self.left = budget.loop_iterations

    def over(self, pc: int, instr) -> CallBudgetError:
        """The error for the backward edge at `pc`, once `left` or the clock ran out."""
        elapsed = time.monotonic() - self.started
        taken = self.budget.loop_iterations - self.left  # the refused one included
        if self.left < 0:
            what = (f"would take more than {self.budget.loop_iterations:,} loop "
                    "iterations (the budget)")
        else:
            what = f"ran {elapsed:.3f} s, past its budget of {self.budget.seconds:g} s"
        return CallBudgetError(
            f"call stopped at the loop's back edge, instruction {pc} ({instr}): it {what}; "
            f"{taken - 1:,} iterations in {elapsed:.3f} s", pc=pc, iterations=taken - 1,
            seconds=elapsed)
