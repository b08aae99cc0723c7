"""What a region's kernels measured against the interpreter, by kind (Note [Promotion
by kind] in jit.policy): the speed-up the policy expects of the next exact or family
kernel."""

from __future__ import annotations

from collections import deque

from dynvm.jit.policy import EXACT, FAMILY
from dynvm.jit.probation import EARLY_LOSS

HELD_LIMIT = 256   # keys with held verdicts (or a retry due) remembered; past it, forgotten

# Note [One noisy verdict]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A kernel's probation verdict is a median of paired ratios, and a loaded host moves it:
# bloom's only kernel (a family at 0.85-0.95x the interpreter in every quiet zoo run)
# measured no faster than the interpreter beside the suite's load in 2 of 7 processes
# (2026-12-06 00:44 UTC), and was dropped. Its region then expected no saving (the
# speed-up estimate is the measured ratios, Note [Promotion by kind] in jit.policy), so
# the cold check (Note [Cold regions]) stopped watching it, the policy never promoted
# again, and the zoo timed it interpreted: 1.020x the interpreter, 0% specialized, for
# the life of the process. So one verdict that lost but not clearly (its ratio under
# EARLY_LOSS, Note [Probation]: within what noise does to a kernel that would pass) is
# *held*: the key is dropped and backs off as before, but the region's estimates do not
# hear of it, so after the back-off the policy promotes the key again (jit.queue still
# holds the compiled code) and a fresh probation measures it again. The key's next
# verdict, whatever it is, releases the held one: from then on both count, as measured on
# more than one probation. A demotion's verdict (Note [Probation]: re-planned without the
# arena) belongs to the same probation as the drop that may follow, so it is held with it.
# A clear loss (at or over EARLY_LOSS: gnn's family kernel at 1.19-3x) counts at once, and
# its key's back-off doubles as before; a kernel held once and losing again counts, and
# backs off twice as long.


class KernelSavings:
    """Probation's recent verdicts of one region's kernels, by kind."""

    def __init__(self, prior: float, keep: int = 8) -> None:
        self.prior = prior   # JitConfig.expected_speedup
        self._verdicts: dict[str, deque[float]] = {EXACT: deque(maxlen=keep),
                                                   FAMILY: deque(maxlen=keep)}
        # Note [One noisy verdict]: key -> its held (kind, ratio) verdicts; keys whose
        # held probation ended in a drop, so that their next probation is the retry.
        self._held: dict[object, list[tuple[str, float]]] = {}
        self._retrying: set = set()

    def record(self, kind: str, ratio: float, key=None, lost: bool = False) -> bool:
        """A kernel of `kind`, promoted under `key`, measured `ratio` x the interpreter
        (Note [Probation]); `lost`: it failed its probation. Returns whether the verdict
        is held (Note [One noisy verdict]): a loss under EARLY_LOSS on the key's first
        probation."""
        if key is not None and lost and ratio < EARLY_LOSS and key not in self._retrying:
            if key not in self._held and len(self._held) >= HELD_LIMIT:
                self._held.clear()
            self._held.setdefault(key, []).append((kind, ratio))
            return True
        self._retrying.discard(key)
        for held_kind, held_ratio in self._held.pop(key, ()):
            self._verdicts[held_kind].append(held_ratio)
        self._verdicts[kind].append(ratio)
        return False

    def dropped(self, key) -> None:
        """`key`'s kernel was dropped: if its verdicts are held, its next probation is
        the retry, and counts (Note [One noisy verdict])."""
        if key in self._held:
            if len(self._retrying) >= HELD_LIMIT:
                self._retrying.clear()
            self._retrying.add(key)

    def retry_due(self, key) -> bool:
        """Whether `key` was dropped on a held verdict and waits for its retry."""
        return key in self._retrying

    def expected(self, kind: str, installed, table) -> float:
        """The fraction of interpreted time a kernel of `kind` is expected to save: its
        kind's measured saving; before any, the prior or the other kind's, whichever is
        more. `installed`: the region's specializations; `table`: its exact profile."""
        measured = self.measured(kind, installed, table)
        if measured is not None:
            return measured
        other = self.measured(FAMILY if kind == EXACT else EXACT, installed, table)
        return max(self.prior, other or 0.0)

    def measured(self, kind: str, installed, table) -> float | None:
        """The measured fraction of interpreted time the region's kernels of `kind`
        save, None before any was measured."""
        # Measured against the interpreter (Note [Probation]), dropped ones included: a
        # region whose specializations keep losing expects little of the next one.
        savings = [1.0 - ratio for ratio in self._verdicts[kind]]
        for spec in installed if kind == EXACT else ():
            if spec.ratio is not None or spec.family is not None:
                continue
            stats = table.get(spec.signature)
            if spec.calls >= 8 and stats is not None and stats.mean_seconds > 0:
                savings.append(1.0 - (spec.seconds / spec.calls) / stats.mean_seconds)
        if not savings:
            return None
        return min(0.95, max(0.01, sum(savings) / len(savings)))
