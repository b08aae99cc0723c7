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
horizon is `JitConfig.horizon_calls` or the region's calls so far, whichever is more
(Note [Rent or buy]). The
speed-up starts at `JitConfig.expected_speedup` and becomes the measured saving of the
region's kernels of the same kind (exact or family); the compile cost starts from the
config's per-instruction estimate and, once compiles of that kind have finished, follows
the lower median of their measured seconds per instruction (Note [Compile cost
estimate] in jit.engine, Note [Promotion by kind] below).

Note [A family that does not pay]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A miss of a family with several members was always weighed as the family (one key, the
members' recurrence together, the family kind's speed-up and compile cost). That shut
its members out of tier 1 for good once the family stopped paying. efficientnet, warmed
as `dynvm bench zoo` warms it (H40Z, 2026-12-06, one torch thread, 2-core AMD EPYC Zen
5, no AMX): its family [2..4, 3, 65..256, 65..256] measured 1.09x the interpreter and
was dropped; the family kind then expected a 1% saving (Note [Promotion by kind]
below) against a measured 630 ms compile, so the family's benefit stayed under its
cost at any age, while each of its two member shapes, a quarter of the calls each,
would have saved ~7x its 48 ms exact compile (exact kernels of that region measure
0.55-0.75x). The JIT served half the calls and measured 0.73-0.93x the interpreter from
run to run. So a member that recurs K times is weighed as its own exact key when its
family backs off (dropped, or its compile failed) or does not pay for its compile at
the family's figures; a family compiling meanwhile keeps its members waiting (it will
serve them). A family that pays still comes first, once for all its members (Note
[Tiering] in jit.region_jit); its members tier up from its hits. Measured with H40Z's zoo-like probe
(2026-12-07 00:12 UTC, load 1.2, same host): where the family was dropped (at 0.96-1.0x,
a held verdict, Note [One noisy verdict] in jit.savings) its members were interpreted
until the family's retry at call ~1120-1200, after the zoo's 1,024 seasoning calls (18-33% of
the steady calls interpreted); now they are compiled exactly during its back-off (calls
123 and 140, 0.77-0.80x) and every steady call is specialized.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynvm.jit.config import JitConfig

# Note [Rent or buy]
# ~~~~~~~~~~~~~~~~~~
# A fixed horizon (1000 calls) judges a compile by what it saves over the next thousand
# calls, whether the process has served ten calls or ten million. In a serving process
# that has run N calls of a region, N more is the best guess without other knowledge,
# so the horizon grows with the region's calls: max(horizon_calls, calls so far). Then
# `benefit > cost` reads: the time a specialization would already have saved on this
# key (its share x calls so far x mean x speed-up) exceeds the compile. That is the
# rent-or-buy rule (keep paying the interpreter until what it cost over the specialized
# code equals the compile, then compile), which never spends more than twice the best
# choice made in hindsight. Measured on the zoo with the fixed horizon on a quiet host:
# bert, llama and 13 other small transformers were never promoted (each shape a quarter
# of the window, ~0.3 ms a call, benefit within 4x of the compile at any age), though
# their kernels measure 0.75-0.9x the interpreter; the benches and cluster tests set
# horizon_calls=1e7-1e9 to make anything promote. The probation still drops a
# specialization that does not earn its place (jit.probation), and its loss lowers the
# region's speed-up estimate, so an old region whose kernels lose stops promoting.


# Note [Promotion by kind]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The policy's speed-up and compile cost are learned from the region's kernels
# (probation's verdicts) and the process's compiles. An exact kernel and a family kernel
# are different code, and cost differently to build: the exact one knows every dim, so
# it gets the static layout choice, a planned arena and fused convolutions of fixed
# shape, while the family one takes its varying dims as run-time values and asks its
# calibration questions over a range. Pooled, one family kernel decided the exact
# shapes' fate. efficientnet, warmed as `dynvm bench zoo` warms it (2026-12-05 10:15 UTC,
# load ~1.5, three fresh Runtimes): when a family [2..4, 3, 65..160, 65..160] was the
# first promotion, its probation ratio (0.91, 0.95) became the region's speed-up (0.09,
# 0.05) and its compile (0.47 s for 80 instructions) the cost of every compile, so the
# two exact points (a quarter of the calls each) never paid: the region went cold for
# them, or, with the family dropped at 0.95, detached, and the JIT served 0-2 of the 4
# points; when exact kernels came first they measured 0.57x and all four were served.
# So each kind learns from its own: the speed-up from its kind's verdicts, and before
# any, `JitConfig.expected_speedup` or the other kind's measured saving, whichever is
# more (a region's exact and family kernels share most of their code: a family that
# wins says its exact shapes will too, one that ties says little about them); the
# compile cost from its kind's compiles, starting at the config's per-instruction
# estimate. A region whose exact kernels keep losing still stops promoting exact shapes,
# as one whose family kernels lose stops promoting families.
EXACT = "exact"
FAMILY = "family"


@dataclass(frozen=True)
class PolicyInputs:
    """What the policy needs of a region beside a key's own figures, by kind (Note
    [Promotion by kind]): the expected speed-up and compile seconds of an exact and of a
    family kernel."""

    exact_speedup: float
    family_speedup: float
    exact_seconds: float
    family_seconds: float

    def speedup(self, kind: str) -> float:
        return self.family_speedup if kind == FAMILY else self.exact_speedup

    def cost(self, kind: str) -> float:
        return self.family_seconds if kind == FAMILY else self.exact_seconds


def horizon(config: JitConfig, calls_so_far: int) -> int:
    """The calls a promotion is expected to pay back over (Note [Rent or buy])."""
    return max(config.horizon_calls, calls_so_far)


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
                    speedup: float, calls_so_far: int = 0) -> float:
    """The seconds a key seen `recurrence` times in the window is expected to save over
    the horizon (Note [Promotion]) of a region that has run `calls_so_far` calls; the
    cold check (Note [Cold regions]) bounds with it."""
    return (recurrence / config.window * horizon(config, calls_so_far) * mean_seconds
            * speedup)


def decide(config: JitConfig, recurrence: int, threshold: int, mean_seconds: float,
           speedup: float, compile_seconds: float, calls_so_far: int = 0) -> Decision:
    """Promote when seen at least K times and the benefit beats the compile cost."""
    benefit = benefit_seconds(config, recurrence, mean_seconds, speedup, calls_so_far)
    promote = recurrence >= threshold and benefit > compile_seconds
    return Decision(promote, recurrence, threshold, benefit, compile_seconds)
