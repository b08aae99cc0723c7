"""Probation: an installed specialization stays only while it measures faster than the
interpreter on its own calls.

Note [Probation]
~~~~~~~~~~~~~~~~
Promotion (Note [Promotion]) bets that a specialization will be faster; installing it
does not make it so. On this CPU a family kernel of the demo encoder, writing LINEAR and
LAYER_NORM results into arena blocks, ran 7% slower than the interpreter, and the loop
body's kernel slower still. So every installed specialization is measured, and the
measurement decides:

- What is compared. Interpreted times recorded before the install are not comparable:
  they were taken minutes earlier, under another load, on another mix of shapes (a
  family kernel serves shapes the interpreter may never have timed). Instead, while on
  probation, one hit in `probation_shadow_every` is a *shadow* call: the region runs in
  the interpreter (the interpreter's own pre-decoded steps) and in the specialization,
  back to back, on copies of that hit's register list (the same input tensors; the
  hit's own registers are written once, by the hit), each timed. The order alternates
  from one shadow call to the next, so neither side always finds the caches warmed by
  the other. The pair runs on the compile worker, not on the call: queued ahead of any
  compile, and each half started once no call is in flight (Note [Background work
  yields to calls] in jit.background), so the hit itself costs what any hit does plus
  a list copy. It ran on the call once, so a shadow call took the interpreter's time
  plus the kernel's: at BERT-base width, with 11-13 warm-up calls per shape, two of
  them at a shape put its p90 near 1 + the kernel's ratio (~1.85x the interpreter's,
  by that arithmetic), where the speed issue's bar is 1.1x. The verdict the samples
  reach is acted on by the next hit, on its call's thread (a drop may detach the
  region, Note [Detached regions], which counts the call in progress). Under the
  synchronous switch the pair runs on the call, before it. A region that writes state
  (KV_APPEND: `OpSpec.writes_state`) has no probation: its shadow pair would write the
  hit's keys and values into the cache twice more, later, into a slot a continuous
  batch may have given to another sequence by then. The specialized side is also charged
  the time of building the call's signature (measured in the same shadow call): the
  interpreter alone, with no JIT, pays none, and in a region of a few microseconds
  (a loop body: ~5 us of signing and bookkeeping against ~20 us of work) that is what
  decides. It is also charged its
  share of the signatures of the region's misses since the install (misses per hit x
  one signature): a kernel that serves one bucket of a loop body whose other buckets
  miss pays for their signing too, which the interpreter alone never does. And it is
  charged the region's mean cost per call of resolving new layouts (a strong signature,
  interned shapes, the family lookup): on gnn and loop, shape storms, most calls are a
  new layout, and a loop-front family kernel confirmed at <= 0.95 without that charge
  left the program 7% slower than the interpreter. A shadow call costs one extra
  interpreted run of the region and one of the kernel, in the background, only during
  probation.
- The verdict. After `probation_samples` shadow calls, the median of the per-call ratios
  (specialized / interpreted) is the specialization's measured ratio (a median of
  paired ratios: a noisy neighbour that slows one call slows both of its halves, and
  the odd preempted call does not move a median). It stays only if the ratio is at most
  `1 - probation_margin`: it must be faster by the margin, so that noise alone never
  keeps a kernel that is really no faster. A clear loser is decided early: once
  `EARLY_SAMPLES` shadow calls all measured it at least `EARLY_LOSS` times the
  interpreter, the median of those is its ratio (a gnn family kernel hit on a quarter
  of the region's calls measured 3x the interpreter, yet waited ~170 calls for its 12th
  sample, slower all along). A clear winner likewise: once `EARLY_SAMPLES` shadow calls
  all measured it at most `EARLY_WIN` times the interpreter, the median of those is its
  ratio. Each shadow call runs the region twice, and the zoo's kernels that win (t5,
  convnext, regnet at 0.55-0.7x) paid 12 of them, a doubled call in four over their
  first ~50 hits (when the pair ran on the call); four paired ratios all at or under
  0.8 from a kernel no faster than the interpreter would take a noise floor far wider
  than the one measured (A/A p10 of a paired ratio: 0.86 on a quiet host). Anything
  in between waits for every sample.
  The two bars are not symmetric on purpose: keeping a loser costs every later call,
  dropping a winner costs a back-off and a later retry. So a loser goes at four samples
  all at or over 1.05 (a kernel that would pass at <= 0.95 almost never measures that
  four times in a row; gnn's family kernel at 1.19x took all 12 shadow calls with the
  bar at 1.25), a winner stays only at four all at or under 0.8.
  The early samples are taken on consecutive hits (all but the first, which warms up),
  the rest on one hit in `probation_shadow_every`, each deferred a few hits while the
  process's samples keep meeting calls (Note [Shadow samples beside calls] in
  jit.shadow): at one in four, gnn's kernels, each
  hit on a fraction of the calls, still ran ~16 hits at 2.7x before the early verdict,
  and two of three were undecided after 300 calls. A shadow call costs one extra
  interpreted run of the region and one of the kernel, in the background.
- Failing it. A specialization that planned an arena is first *demoted*: the same IR is
  re-emitted without the arena (a background task, no re-specialization), installed in
  its place, and put on probation again. One that fails without an arena is *dropped*:
  it leaves the region's tables and its key backs off like a failed compile (Note [Cold
  regions]): not promoted again for `failed_compile_backoff_calls` region calls,
  doubling each time. Until a demoted kernel's replacement is installed, its calls run
  in the interpreter. A region whose specializations were dropped expects no saving
  from the next (its speed-up estimate is the measured ratios), so its cold check
  (Note [Cold regions]) soon stops watching it, and its calls no longer pay for a
  signature either. But a drop that was not a clear loss (its ratio under
  `EARLY_LOSS`) is held out of that estimate until the key's retry, after its
  back-off, measures it again on fresh samples (Note [One noisy verdict] in
  jit.savings); the back-off keeps doubling across retries (an install no longer
  resets its count).

Each step is counted (stats()["probation"]), logged in the event log and sent as an
event on the call's span; `dynvm explain` shows each specialization's measured ratio.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

CONFIRMED = "confirmed"
DEMOTE = "demote"
DROP = "drop"
EARLY_SAMPLES = 4    # Note [Probation]: a clear loser is decided after this many samples
EARLY_LOSS = 1.05    # ... when every one of them is at least this ratio
EARLY_WIN = 0.8      # ... or at most this one
MAX_DEFERRED = 7      # Note [Shadow samples beside calls] in jit.shadow: hits a due sample
#                       may wait, in a row, for the process's samples to be spaced


@dataclass
class Probation:
    """One specialization's probation: its paired measurements so far."""

    every: int                  # one hit in this many is a shadow call
    samples: int                # shadow calls before the verdict
    margin: float               # the ratio must be <= 1 - margin to stay
    countdown: int = 0
    ratios: list[float] = field(default_factory=list)
    deferred: int = 0           # hits the due sample has waited so far (MAX_DEFERRED)
    # A family kernel's early samples are never deferred: the region's next family
    # waits for them (Note [Shadow samples beside calls] in jit.shadow).
    early_unspaced: bool = False

    def __post_init__(self) -> None:
        self.countdown = 2   # the first hit warms up; the next ones are the early samples

    def due(self, spaced=None) -> bool:
        """Whether this hit is a shadow call (not thread-safe: a lost decrement under a
        race only shifts one shadow call): every hit after the first until there are
        `EARLY_SAMPLES` ratios, then one in `every` (Note [Probation]). `spaced()`: False
        defers a due sample to the next hit, at most MAX_DEFERRED hits in a row (Note
        [Shadow samples beside calls] in jit.shadow)."""
        self.countdown -= 1
        if self.countdown > 0:
            return False
        if spaced is not None and self.deferred < MAX_DEFERRED and not (
                self.early_unspaced and len(self.ratios) < EARLY_SAMPLES) and not spaced():
            self.deferred += 1
            self.countdown = 1
            return False
        self.deferred = 0
        self.countdown = 1 if len(self.ratios) + 1 < EARLY_SAMPLES else self.every
        return True

    def add(self, specialized_seconds: float, interpreted_seconds: float) -> float | None:
        """Record one shadow call; returns the measured ratio once there are enough."""
        if interpreted_seconds > 0:
            self.ratios.append(specialized_seconds / interpreted_seconds)
        if len(self.ratios) < self.samples:
            early = len(self.ratios) >= EARLY_SAMPLES and (
                min(self.ratios) >= EARLY_LOSS or max(self.ratios) <= EARLY_WIN)
            return statistics.median(self.ratios) if early else None
        return statistics.median(self.ratios)

    def passes(self, ratio: float) -> bool:
        return ratio <= 1.0 - self.margin


@dataclass
class ProbationCounters:
    """Engine-wide counts of Note [Probation]'s steps (stats()["probation"])."""

    shadow_calls: int = 0
    confirmed: int = 0
    demotions: int = 0          # re-planned without the arena
    drops: int = 0              # removed, key backing off

    def as_dict(self) -> dict:
        return {"shadow_calls": self.shadow_calls, "confirmed": self.confirmed,
                "demotions": self.demotions, "drops": self.drops}
