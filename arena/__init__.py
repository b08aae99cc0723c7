"""dynvm.arena: memory arenas for specialized regions.

- `plan_arena` (planner.py): byte offsets for a specialization's intermediates, so that
  tensors live at the same time never share bytes; a pure function of its blocks.
- `ArenaPool` (pool.py): the arena buffers at run time, one per in-flight call, reused
  across calls within a per-device budget.
- `count_allocations` (alloc_count.py): how many fresh storages a call's ATen ops
  create, to check that a planned forward allocates (almost) nothing.

Imports only torch and dynvm.vm (docs: docs/ARCHITECTURE.md, Layout).
"""

from dynvm.arena.alloc_count import AllocationCounter, count_allocations
from dynvm.arena.planner import ArenaPlan, ArenaPlanError, Block, lower_bound, plan_arena
from dynvm.arena.pool import ArenaPool

__all__ = [
    "AllocationCounter",
    "ArenaPlan",
    "ArenaPlanError",
    "ArenaPool",
    "Block",
    "count_allocations",
    "lower_bound",
    "plan_arena",
]
