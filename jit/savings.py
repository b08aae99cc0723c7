"""What a region's kernels measured against the interpreter, by kind (Note [Promotion
by kind] in jit.policy): the speed-up the policy expects of the next exact or family
kernel."""

from __future__ import annotations

from collections import deque

from dynvm.jit.policy import EXACT, FAMILY


class KernelSavings:
    """Probation's recent verdicts of one region's kernels, by kind."""

    def __init__(self, prior: float, keep: int = 8) -> None:
        self.prior = prior   # JitConfig.expected_speedup
        self._verdicts: dict[str, deque[float]] = {EXACT: deque(maxlen=keep),
                                                   FAMILY: deque(maxlen=keep)}

    def record(self, kind: str, ratio: float) -> None:
        """A kernel of `kind` measured `ratio` x the interpreter (Note [Probation])."""
        self._verdicts[kind].append(ratio)

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
