"""The incremental, memoized form of `cluster`, for the request path.

Note [Family memo]
~~~~~~~~~~~~~~~~~~
A region call asks for its signature's family, so a signature seen before must cost
about one dict lookup. The memo maps a signature to (family, group, observed):

- `group` is the record of the signature's structure that the family was computed from.
  When an observation makes a new dim vary, the structure gets a new record and the old
  one is marked stale, which invalidates every memo entry computed from it at the cost of
  one attribute check on a hit: a family computed with fewer varying dims is never
  returned afterwards, and no scan of the memo is needed to find the structure's entries.
  (A structure's varying set only grows, at most once per dim, so this is rare.)
- `observed` says the signature was passed to `observe`, so observing it again cannot
  change any varying set and returns at once.

The memo is bounded by `memo_limit`: when it is full it is cleared. LRU bookkeeping
would cost on every hit, the path this memo exists for; a clear costs one recomputation
(a few microseconds) per signature that comes back, and the limit only bites when more
distinct signatures than that are in play, a shape storm in which no eviction policy
keeps a useful working set anyway.

Concurrency: a hit takes no lock (a dict lookup and an attribute read are atomic under
the GIL). Updates to the structure records and to the memo take one lock. A lookup that
races with the observation making a dim vary may return the family from just before it.
"""

from __future__ import annotations

import operator
import threading

from dynvm.shape_cluster.buckets import check_ratio
from dynvm.shape_cluster.families import (
    Family,
    differing_dims,
    family_bounds,
    live_in_dims,
    structure_key,
)
from dynvm.vm.errors import ConfigError


class _Group:
    """What the index knows of one structure. `varying` never changes: a structure whose
    varying set grows gets a new _Group, and the old one is marked `stale`."""

    __slots__ = ("reference", "varying", "stale", "families")

    def __init__(self, reference: tuple | None, varying: frozenset[tuple[int, int]]) -> None:
        self.reference = reference   # dims of the first observed signature; None if none yet
        self.varying = varying
        self.stale = False
        # bounds -> its Family: one object (and key text) per family, not per signature
        # (a shape storm brings a new signature on every call, few new families).
        self.families: dict[tuple, Family] = {}


class FamilyIndex:
    """Signature -> family, updated one observation at a time; see Note [Family memo].

    After observing any sequence of signatures, `family_of(s)` is the family that
    `cluster` assigns to `s` for that sequence (None where `cluster` leaves `s` out).

    One small record per structure is kept for the index's lifetime, since its varying
    set is what makes later answers agree with `cluster`; only the memo is bounded.
    """

    def __init__(self, ratio: int = 4, memo_limit: int = 4096) -> None:
        self._ratio = check_ratio(ratio)
        memo_limit = operator.index(memo_limit)
        if memo_limit < 1:
            raise ConfigError(f"memo_limit must be >= 1, got {memo_limit}")
        self._memo_limit = memo_limit
        self._memo: dict[tuple, tuple[Family | None, _Group, bool]] = {}
        self._groups: dict[tuple, _Group] = {}
        self._lock = threading.Lock()

    @property
    def memo_size(self) -> int:
        """Signatures memoized now (at most `memo_limit`)."""
        return len(self._memo)

    def observe(self, signature: tuple) -> Family | None:
        """Record `signature` and return its current family."""
        entry = self._memo.get(signature)
        if entry is not None and entry[2] and not entry[1].stale:
            return entry[0]
        structure = structure_key(signature)
        dims = live_in_dims(signature)
        with self._lock:
            group = self._groups.get(structure)
            if group is None:
                group = self._groups[structure] = _Group(dims, frozenset())
            elif group.reference is None:
                group.reference = dims
            else:
                grown = differing_dims(group.reference, dims) - group.varying
                if grown:
                    group.stale = True
                    group = self._groups[structure] = _Group(group.reference,
                                                             group.varying | grown)
        return self._remember(signature, structure, group, observed=True)

    def family_of(self, signature: tuple) -> Family | None:
        """The current family of `signature` (observed or not), without recording it."""
        entry = self._memo.get(signature)
        if entry is not None and not entry[1].stale:
            return entry[0]
        structure = structure_key(signature)
        group = self._groups.get(structure)
        if group is None:
            with self._lock:
                group = self._groups.setdefault(structure, _Group(None, frozenset()))
        return self._remember(signature, structure, group,
                              observed=entry is not None and entry[2])

    def _remember(self, signature: tuple, structure: tuple, group: _Group,
                  observed: bool) -> Family | None:
        bounds = family_bounds(signature, structure, group.varying, self._ratio)
        family = None
        if bounds is not None:
            family = group.families.get(bounds)
            if family is None:
                family = Family(structure, bounds)
        with self._lock:
            if family is not None and len(group.families) < self._memo_limit:
                family = group.families.setdefault(bounds, family)
            if len(self._memo) >= self._memo_limit and signature not in self._memo:
                self._memo.clear()
            self._memo[signature] = (family, group, observed)
        return family
