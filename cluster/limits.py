"""`ServingLimits`: the bounds a replica puts on every request (DESIGN.md, Invariants:
every call and request is bounded). One frozen dataclass, handed to `serve_models`,
`model_application` and `ModelReplica`; `dynvm serve` sets it from its flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynvm.vm.budget import CallBudget


@dataclass(frozen=True)
class ServingLimits:
    """Per-request bounds of a model replica."""

    call_seconds: float = 30.0
    """Wall-clock budget of one VM call (Note [Call budget]): a call still looping past
    it stops, its requests get a 500 with an error id, and the worker is free again."""
    call_loop_iterations: int = 10_000_000
    """Loop iterations one VM call may take (Note [Call budget])."""

    def __post_init__(self) -> None:
        if not (isinstance(self.call_seconds, int | float) and math.isfinite(self.call_seconds)
                and self.call_seconds > 0):
            raise ValueError(f"ServingLimits.call_seconds must be a finite number > 0, "
                             f"got {self.call_seconds!r}")
        self.call_budget()  # checks call_loop_iterations

    def call_budget(self) -> CallBudget:
        return CallBudget(seconds=float(self.call_seconds),
                          loop_iterations=self.call_loop_iterations)
