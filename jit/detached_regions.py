"""`DetachedRegions`: which of a Jit's regions are detached, until which program call,
and the program-call clock that re-attaches them (Note [Detached regions] in
dynvm.jit.region_watch). The engine (dynvm.jit.engine.Jit) holds one and does the slot
work; this object keeps the books, under its own lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_NEVER = 1 << 62   # `reattach_at` with no region detached


class DetachedRegions:
    """Region index -> the program call at which it is re-attached; per region, the
    program calls it missed; the count of program calls done (`program_calls`, set by
    the Runtime through `Jit.program_call_done`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()   # never held while taking a region's lock
        self.until: dict[int, int] = {}
        self._from: dict[int, int] = {}    # index -> first program call not seen
        self._missed: dict[int, int] = {}  # index -> program calls not seen, ended
        self.program_calls = 0
        self.reattach_at = _NEVER
        self.detachments = 0
        self.reattachments = 0

    def __contains__(self, index: int) -> bool:
        return index in self.until

    def __len__(self) -> int:
        return len(self.until)

    def detach(self, index: int, period: int, unplug: Callable[[], None]) -> bool:
        """Detach region `index` for `period` program calls; `unplug()` (the slot's
        removal from the interpreter) runs under the lock. False if it is detached
        already."""
        with self._lock:
            if index in self.until:
                return False
            unplug()
            at = self.program_calls + 1 + period   # the call in progress is not counted yet
            self.until[index] = at
            self._from[index] = self.program_calls + 2
            self.reattach_at = min(self.reattach_at, at)
            self.detachments += 1
        return True

    def reattach_due(self, program_calls: int, plug: Callable[[int], None],
                     everything: bool = False) -> list[int]:
        """Re-attach the regions whose period has ended by `program_calls` (all of them
        with `everything`): `plug(index)` for each, under the lock; returns their indices."""
        with self._lock:
            due = [index for index, at in self.until.items()
                   if everything or at <= program_calls]
            for index in due:
                del self.until[index]
                self._missed[index] = self._missed.get(index, 0) + max(
                    0, program_calls + 1 - self._from.pop(index))
                plug(index)
                self.reattachments += 1
            self.reattach_at = min(self.until.values(), default=_NEVER)
        return due

    def program_calls_of(self, index: int) -> int:
        """Program calls that ran region `index` without its slot (its entries in them
        are counted nowhere else): a straight-line region's interpreted + specialized +
        this is its entries."""
        since = self._from.get(index)
        current = max(0, self.program_calls + 1 - since) if since is not None else 0
        return self._missed.get(index, 0) + current
