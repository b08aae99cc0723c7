"""Per-region shape profile: what the interpreter saw, how often, and how long it took.

Recording is the first of the two levels of Note [Promotion]: everything is recorded,
nothing is compiled here. The table is bounded: beyond `4 x window` signatures, those
seen least recently are forgotten, so a shape storm cannot grow it without limit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class SignatureStats:
    """How often a signature was seen in a region and how long its calls took."""

    count: int = 0
    total_seconds: float = 0.0
    last_seen: int = 0          # the region call number of its latest call
    first_seen: int = 0         # ... and of its first (its rate: Note [Settled])
    # Its fastest call: what the region costs without the stalls a loaded machine adds
    # (a preempted call can take 1000x the usual; a mean keeps it, a minimum never does).
    min_seconds: float = float("inf")

    @property
    def mean_seconds(self) -> float:
        return self.total_seconds / self.count if self.count else 0.0


class RegionProfile:
    """Signature -> stats, plus the counts of each signature in the last `window` calls."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.calls = 0
        self.table: dict[tuple, SignatureStats] = {}
        self._recent: deque[tuple] = deque()
        self._in_window: dict[tuple, int] = {}

    def record(self, signature: tuple, seconds: float) -> SignatureStats:
        self.calls += 1
        stats = self.table.get(signature)
        if stats is None:
            if len(self.table) >= 4 * self.window:
                self._forget_oldest()
            stats = self.table[signature] = SignatureStats(first_seen=self.calls)
        stats.count += 1
        stats.total_seconds += seconds
        if seconds < stats.min_seconds:
            stats.min_seconds = seconds
        stats.last_seen = self.calls
        self._recent.append(signature)
        self._in_window[signature] = self._in_window.get(signature, 0) + 1
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            left = self._in_window[old] - 1
            if left:
                self._in_window[old] = left
            else:
                del self._in_window[old]
        return stats

    def recurrence(self, signature: tuple) -> int:
        """How many of the last `window` calls had this signature."""
        return self._in_window.get(signature, 0)

    def _forget_oldest(self) -> None:
        by_age = sorted(self.table.items(), key=lambda item: item[1].last_seen)
        for signature, _ in by_age[: len(by_age) // 4 or 1]:
            if signature not in self._in_window:
                del self.table[signature]
