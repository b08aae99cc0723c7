"""`ServingLimits`: the bounds a replica puts on every request (docs/ARCHITECTURE.md, Invariants:
every call and request is bounded). One frozen dataclass, handed to `serve_models`,
`model_application` and `ModelReplica`; `dynvm serve` sets it from its flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dynvm.cluster.serving._config_flags import cli
from dynvm.vm.budget import CallBudget
from dynvm.vm.errors import ConfigError


@dataclass(frozen=True)
class ServingLimits:
    """Per-request bounds of a model replica."""

    call_seconds: float = 30.0
    """Wall-clock budget of one VM call (Note [Call budget]): a call still looping past
    it stops, its requests get a 500 with an error id, and the worker is free again."""
    call_loop_iterations: int = 10_000_000
    """Loop iterations one VM call may take (Note [Call budget])."""
    max_concurrent_requests: int = 64
    """Infer requests a replica holds at once (reading, parsing, queued, running);
    beyond it a request is answered 503 with Retry-After at once."""
    retry_after_s: int = 1
    """The Retry-After of that 503, in seconds."""
    parse_threads: int = 2
    """Threads that decode request bodies and encode responses, off the event loop
    (Note [Bounded JSON]); they also bound how many bodies are decoded at once."""
    require_signed_programs: bool = field(default=False, metadata=cli("--require-signed"))
    """True: the replica loads its .dvm file only with a signature made with the fleet's
    store secret (Note [Signed programs] in dynvm.vm.dvm_signature); needs `fleet`."""
    refuse_non_finite: bool = False
    """True: NaN or Inf in a float input is a 400 naming the input (Note [Non-finite
    JSON numbers]); False: they are values like any other."""

    def __post_init__(self) -> None:
        if not (isinstance(self.call_seconds, int | float) and math.isfinite(self.call_seconds)
                and self.call_seconds > 0):
            raise ConfigError(f"ServingLimits.call_seconds must be a finite number > 0, "
                             f"got {self.call_seconds!r}")
        self.call_budget()  # checks call_loop_iterations
        for name in ("max_concurrent_requests", "retry_after_s", "parse_threads"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"ServingLimits.{name} must be an integer >= 1, "
                                 f"got {value!r}")

    def call_budget(self) -> CallBudget:
        return CallBudget(seconds=float(self.call_seconds),
                          loop_iterations=self.call_loop_iterations)
