"""Promotion: which recorded signatures are worth a compile.

Note [Promotion]
~~~~~~~~~~~~~~~~
Compiling every new shape on first sight causes compile storms: with batch jitter, CPUs
compile while GPUs idle and callers see stalls. dynvm promotes in two levels, as the
design article settled on after production experience:

1. record every signature (RegionProfile);
2. promote one only when it was seen at least K times in the region's last W calls AND
   its expected benefit beats its expected compile cost:

       benefit = (recurrence / W) x horizon_calls x mean interpreted seconds x speed-up
       cost    = compile seconds estimated for a region of this size

K adapts to region size: about 2 for small regions, up to 8 for large ones (a big
region's compile is expensive, so its shape must prove itself stable for longer). The
speed-up starts at `JitConfig.expected_speedup` and becomes the measured saving of the
region's specializations once one has run; the compile cost starts from the config's
per-instruction estimate and, once compiles have finished, follows the lower median of
their measured seconds per instruction (Note [Compile cost estimate] in jit.engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from dynvm.jit.config import JitConfig


def recurrence_threshold(config: JitConfig, region_instructions: int) -> int:
    """K for a region of this many instructions."""
    k = config.min_recurrence + region_instructions // config.instructions_per_recurrence_step
    return max(config.min_recurrence, min(config.max_recurrence, k))


@dataclass(frozen=True)
class Decision:
    """Whether a signature is promoted, and the figures that decided it (Note [Promotion])."""

    promote: bool
    recurrence: int
    threshold: int
    benefit_seconds: float
    cost_seconds: float

    @property
    def reason(self) -> str:
        verdict = "promote" if self.promote else "wait"
        return (f"{verdict}: seen {self.recurrence} of the last calls (K={self.threshold}), "
                f"benefit {self.benefit_seconds * 1e3:.2f} ms vs compile cost "
                f"{self.cost_seconds * 1e3:.2f} ms")


def benefit_seconds(config: JitConfig, recurrence: int, mean_seconds: float,
                    speedup: float) -> float:
    """The seconds a key seen `recurrence` times in the window is expected to save over
    the horizon (Note [Promotion]); the cold check (Note [Cold regions]) bounds with it."""
    return recurrence / config.window * config.horizon_calls * mean_seconds * speedup


def decide(config: JitConfig, recurrence: int, threshold: int, mean_seconds: float,
           speedup: float, compile_seconds: float) -> Decision:
    """Promote when seen at least K times and the benefit beats the compile cost."""
    benefit = benefit_seconds(config, recurrence, mean_seconds, speedup)
    promote = recurrence >= threshold and benefit > compile_seconds
    return Decision(promote, recurrence, threshold, benefit, compile_seconds)
