"""The region cache-slot interface: the only way the VM reaches the JIT.

The VM defines it and the JIT implements it (docs/ARCHITECTURE.md, Layout). At each entry of a
region that has a slot, the interpreter calls `enter(regs)`:

- it returns None when a specialization's guard passed and the specialized code has run
  the region (it wrote the region's live-outs into `regs`); the interpreter goes on after
  the region;
- otherwise it returns a ticket (anything but None, typically the signature it built);
  the interpreter runs the region itself and then calls `leave(ticket, seconds)` with the
  time it took, so the JIT can profile it.

A guard failure is therefore an ordinary return of a ticket: no exception, nothing to
roll back (Note [Guard strength] in dynvm.jit says which checks a guard makes).
"""

from __future__ import annotations

from typing import Protocol


class RegionSlot(Protocol):
    """What a region's cache slot implements (the JIT's RegionJit): `enter(regs)`
    returns None when specialized code ran the region, else a ticket that the interpreter
    hands back to `leave(ticket, seconds)` after running the region itself."""

    def enter(self, regs: list) -> object | None: ...

    def leave(self, ticket: object, seconds: float) -> None: ...
