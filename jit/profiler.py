"""Per-region shape profile: what the interpreter saw, how often, and how long it took.

Recording is the first of the two levels of Note [Promotion]: everything is recorded,
nothing is compiled here. The table is bounded: beyond `4 x window` signatures, those
seen least recently are forgotten, so a shape storm cannot grow it without limit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

STALL_CAP = 2.0   # Note [Stall-capped mean]: a key's mean counts at most this x its fastest

# Note [Stall-capped mean]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Every decision that prices a key by its time (promotion, Note [Promotion] in
# jit.policy; tier 2's check, Note [Tier-2 checks] in jit.tiering; the cold check, Note
# [Cold regions] in jit.region_watch) uses its mean time capped at STALL_CAP x its
# fastest call. A loaded host preempts calls: one call of a 25 us loop region took 27
# ms on the test machine, and a mean keeps such a call for the key's whole life while a
# minimum never sees it. Uncapped, one stall in a signature's first calls multiplied its
# benefit and promoted it: test_batch_jitter_compiles_at_most_a_tenth_of_the_signatures
# made 7 compiles (bound 6.3; 7 promotions, no drop) in three loaded rehearsals
# (2026-12-06), where the cold check, capped, already said the same keys were far from
# paying. The fastest call alone undervalues a key on a loaded host (albert's mean is
# 1.3x its fastest call there, and a bound at the fastest call detached a region the
# policy was about to promote), so the cap is a multiple, not the minimum. All three
# take it from `stall_capped_mean`, so they never disagree about one key.


def stall_capped_mean(total_seconds: float, calls: int, fastest_seconds: float) -> float:
    """The mean time of `calls` calls that took `total_seconds`, at most STALL_CAP x the
    fastest of them (Note [Stall-capped mean]); 0.0 with no call."""
    if calls <= 0:
        return 0.0
    return min(total_seconds / calls, STALL_CAP * fastest_seconds)


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

    @property
    def capped_mean_seconds(self) -> float:
        """Its mean time, stalls capped (Note [Stall-capped mean]): what decisions use."""
        return stall_capped_mean(self.total_seconds, self.count, self.min_seconds)


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
