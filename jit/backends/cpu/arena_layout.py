"""Planned memory for CPU specializations: `out=` kernels writing into one arena.

Note [Arena layout]
~~~~~~~~~~~~~~~~~~~
A specialization knows (for a family: bounds) the shape of every intermediate, so its
intermediates can live at planned offsets of one buffer instead of each call asking the
allocator for each of them. Which results go to the arena:

- results of operations that have an `out=` form (the opcode table's `out` field,
  gathered in `OUT_KERNELS`) and, by default, measured faster with it on this device
  (Note [Arena by measurement]), plus the scratch outputs some of them need (layer
  norm's mean and rstd);
- never a region output, nor anything a region output views: the caller keeps outputs
  after the call, and the arena is handed to the next call (docs/ARCHITECTURE.md, Invariants);
- not an operation rewritten in place (it writes into its operand's storage already) or
  to a kernel without `out=` (SDPA): those allocate as before. SDPA
  was tried in its math form with out= buffers: its strided q/k/v views made matmul
  copy them, which allocated more than the fused kernel does.
- nothing at all in a specialization with a weak guard (Note [Guard strength]): the
  guard admits any shape of the same rank and element count, e.g. [1, 32] for a plan
  made at [4, 8], where a sum over dim 0 gives 32 elements instead of 8; the out=
  kernel would resize its block past the planned bytes, over its neighbours.

A block lives from the operation that writes it to the last use of anything sharing its
storage (its views, and the results of in-place operations over it), which is what
`dynvm.arena.plan_arena` packs. Blocks are sized at the planning probe (the family's
upper bounds, Note [Probes]); a block that would be larger at another probe is not
planned. At run time each call leases a buffer from the device's ArenaPool (Note [Arena
concurrency]) together with zero-size `out` tensors over its storage at the planned
offsets; an `out=` kernel resizes them to the actual shape in place, which never moves
them since the storage is the whole arena.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from dynvm.arena import ArenaPlan, Block, plan_arena
from dynvm.jit.aliasing import last_use_of_roots, storage_roots
from dynvm.jit.ir import SpecOp
from dynvm.vm.isa import OutForm
from dynvm.vm.opcodes import ALL_OPS

# opcode -> its out= form (the opcode table's `out`: fn, scratch, accepts).
OUT_KERNELS: dict[str, OutForm] = {spec.name: spec.out for spec in ALL_OPS
                                   if spec.out is not None}


@dataclass(frozen=True)
class ArenaLayout:
    """Where a specialization's arena results live (Note [Arena layout]): the plan,
    each op's blocks, each block's offset and dtype, and what was left out and why."""

    plan: ArenaPlan
    outs: dict[int, tuple[int, ...]]     # op position -> its blocks (result, scratch...)
    blocks: tuple[tuple[int, torch.dtype], ...]   # block key -> (offset, dtype), key order
    notes: tuple[str, ...]


def plan_layout(ops: list[SpecOp], probes: tuple, operand_values,
                leaving: set[int], pays=None) -> ArenaLayout | None:
    """Blocks and offsets for the ops that can write into an arena, or None if none can.

    `operand_values(op, probe)` gives an op's abstract operands at a probe; `pays(op,
    form)` whether an op that can use its out= form should (Note [Arena by
    measurement]; None: every one that can)."""
    roots, _ = storage_roots(ops)
    last_use = last_use_of_roots(ops, roots)
    escaping = {roots.get(reg, reg) for reg in leaving}
    blocks: list[Block] = []
    dtypes: list[torch.dtype] = []
    outs: dict[int, tuple[int, ...]] = {}
    notes: list[str] = []
    for position, op in enumerate(ops):
        kernel = OUT_KERNELS.get(op.opcode)
        if kernel is None or op.variant or len(op.dsts) != 1:
            continue
        dst = op.dsts[0]
        if dst in escaping:
            continue
        tensors = _planned_tensors(op, kernel, probes, operand_values)
        if tensors is None:
            continue
        if pays is not None and not pays(op, kernel):
            notes.append(f"{op.source_pc}: {op.opcode} allocates (measured faster here "
                         f"than into the arena)")
            continue
        keys = []
        for index, (nbytes, dtype) in enumerate(tensors):
            end = max(last_use.get(dst, position), position) if index == 0 else position
            keys.append(len(blocks))
            blocks.append(Block(len(blocks), max(nbytes, 1), position, end))
            dtypes.append(dtype)
        outs[position] = tuple(keys)
        notes.append(f"{op.source_pc}: {op.opcode} writes into the arena")
    if not blocks:
        return None
    plan = plan_arena(blocks)
    return ArenaLayout(plan, outs, tuple((plan.offsets[b.key], dtypes[b.key]) for b in blocks),
                       tuple(notes))


def _planned_tensors(op, kernel, probes, operand_values):
    """[(bytes at the planning probe, dtype)] of the result and scratch, or None when
    the op cannot use its out= form at every probe (or would outgrow its block)."""
    sizes = None
    for probe in probes:
        operands = operand_values(op, probe)
        if operands is None:
            return None
        if kernel.accepts is not None and not kernel.accepts(*operands):
            return None
        result = probe.get(op.dsts[0])
        # An out tensor over the arena is contiguous; a result the kernel would lay out
        # otherwise (an elementwise op over transposed operands keeps their layout)
        # must keep its own layout: later views and kernel choices depend on it.
        if not isinstance(result, torch.Tensor) or not result.is_contiguous():
            return None
        tensors = [result]
        if kernel.scratch is not None:
            tensors += list(kernel.scratch(*operands))
        here = [(t.numel() * t.element_size(), t.dtype) for t in tensors]
        if sizes is None:
            sizes = here
        elif any(n > planned or d != want for (n, d), (planned, want) in zip(here, sizes)):
            return None
    return sizes


class Lease:
    """One call's hold on an arena buffer and its out tensors."""

    __slots__ = ("buffer", "outs")

    def __init__(self, buffer: torch.Tensor, outs: tuple) -> None:
        self.buffer = buffer
        self.outs = outs


class ArenaBinding:
    """A specialization's arena: leases a pool buffer per call with out tensors over it.

    Out tensors are made once per buffer and cached with it (weakly: a buffer the pool
    frees takes its out tensors along: entries whose buffer died are pruned when a new
    buffer arrives). A family kernel's out tensors are shrunk back to
    zero elements on each lease, because an `out=` kernel warns when it must resize a
    non-empty tensor to another shape; an exact kernel's keep their one shape."""

    def __init__(self, pool, owner: str, layout: ArenaLayout, device: torch.device,
                 shapes_vary: bool) -> None:
        self.pool = pool
        self.owner = owner
        self.layout = layout
        self.device = device
        self.shapes_vary = shapes_vary
        # id(buffer) -> (weak reference to it, its out tensors). Keyed by id, not by the
        # tensor: a dict would compare tensors with ==, which is elementwise.
        self._outs: dict[int, tuple[weakref.ref, tuple]] = {}

    def acquire(self) -> Lease | None:
        buffer = self.pool.acquire(self.owner, self.layout.plan.size)
        if buffer is None:
            return None
        cached = self._outs.get(id(buffer))
        if cached is None or cached[0]() is not buffer:
            outs = self._make_outs(buffer)
            self._outs = {key: entry for key, entry in self._outs.items()
                          if entry[0]() is not None}
            self._outs[id(buffer)] = (weakref.ref(buffer), outs)
        else:
            outs = cached[1]
        if cached is not None and self.shapes_vary:
            for out in outs:
                out.resize_(0)
        return Lease(buffer, outs)

    def release(self, lease: Lease) -> None:
        self.pool.release(self.owner, lease.buffer)

    def _make_outs(self, buffer: torch.Tensor) -> tuple:
        storage = buffer.untyped_storage()
        outs = []
        for offset, dtype in self.layout.blocks:
            itemsize = torch.empty((), dtype=dtype).element_size()
            out = torch.empty(0, dtype=dtype, device=self.device)
            out.set_(storage, offset // itemsize, (0,), (1,))
            outs.append(out)
        return tuple(outs)
