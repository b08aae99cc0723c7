"""What a region's slot holds and counts: an installed specialization and the region's
counters (dynvm.jit.region_jit uses them; the engine builds specializations)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dynvm.jit.guards import GuardStrength, weak_of
from dynvm.jit.probation import Probation


@dataclass(frozen=True)
class BuiltCode:
    """A backend's code for one specialized region, before it is installed (or loaded
    ready-made from a store): what the engine turns into an Artifact and a Specialization
    (`Jit._finish_build`)."""

    backend: str           # "cpu" or "triton"
    kernel_name: str
    source: str            # the generated source, for the artifact and `dynvm explain`
    fn: Callable           # fn(regs): runs the region
    notes: tuple[str, ...] = ()
    metadata: dict = field(default_factory=dict)
    arena: bool = False    # takes an arena per call (never captured as a CUDA graph)


@dataclass
class Specialization:
    """An installed specialization of a region: its guard (signature or family)
    and strength, the code, its artifact, and its measured calls and time."""

    signature: tuple            # exact: its signature; family: the one that promoted it
    strength: GuardStrength
    fn: object
    artifact: object
    family: object = None       # the Family a family kernel serves, else None
    calls: int = 0
    seconds: float = 0.0
    last_used: int = 0
    installed_at: int = 0       # region calls when it was installed
    ir: object = None           # the SpecializedRegion it was built from (portable form)
    arena: bool = False         # its code writes into a planned arena (Note [Arena layout])
    # Note [Probation]: the measurement in progress (None once decided or when off), the
    # measured ratio (specialized / interpreted), the key it was promoted under.
    probation: Probation | None = None
    ratio: float | None = None
    promoted_as: object = None
    # A family kernel's served signatures (Note [Eviction by what a kernel still serves]).
    served: set = field(default_factory=set)

    @property
    def target(self):
        """What was compiled: a signature, or a family's key."""
        return self.signature if self.family is None else self.family.key

    @property
    def guard_key(self) -> tuple:
        return self.signature if self.strength is GuardStrength.STRONG else weak_of(
            self.signature)


@dataclass
class RegionCounters:
    """A region's counters: calls interpreted and specialized, guard failures,
    deopts, evictions, promotions, cold periods, and the back-off of failed signatures."""

    interpreted: int = 0
    specialized: int = 0
    guard_failures: int = 0
    deopts: int = 0
    evictions: int = 0
    promotions: int = 0
    cold_periods: int = 0       # times the region went unwatched (Note [Cold regions])
    last_guard_failure: str | None = None
    failed: dict = field(default_factory=dict)   # signature -> (retry at call, failures)
