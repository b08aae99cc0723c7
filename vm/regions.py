"""Control-flow graph, liveness and regions of a program's code.

A region is a maximal straight-line run of instructions that fall through (no jump, no
branch, no return) and that no jump enters except at its first instruction. The
interpreter checks a region's cache slot once at its entry; the JIT specializes whole
regions. Its live-ins are the registers it reads before writing them, its live-outs the
registers it writes that are read after it (or returned).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynvm.vm.instr import Instr
from dynvm.vm.isa import Flow
from dynvm.vm.operands import Label, Reg


@dataclass(frozen=True, slots=True)
class Region:
    """One region of a program's code: instructions `start` to `stop` (exclusive), the
    registers it reads before writing (`live_in`) and those it writes that are read later
    (`live_out`). `index` is its position in `Program.regions`."""

    index: int
    start: int                 # first instruction
    stop: int                  # one past the last instruction
    live_in: tuple[Reg, ...]
    live_out: tuple[Reg, ...]

    def __len__(self) -> int:
        return self.stop - self.start


def successors(code: Sequence[Instr], pc: int) -> tuple[int, ...]:
    """Where control may go after instruction `pc`."""
    instr = code[pc]
    flow = instr.spec.flow
    if flow is Flow.RETURN:
        return ()
    targets = tuple(arg.target for arg in instr.args if isinstance(arg, Label))
    if flow is Flow.JUMP:
        return targets
    following = (pc + 1,) if pc + 1 < len(code) else ()
    return following + targets if flow is Flow.BRANCH_IF_FALSE else following


def jump_targets(code: Sequence[Instr]) -> frozenset[int]:
    """Every instruction index some jump or branch of `code` can go to."""
    return frozenset(arg.target for instr in code for arg in instr.args
                     if isinstance(arg, Label))


def live_in_sets(code: Sequence[Instr]) -> list[frozenset[Reg]]:
    """Registers live on entry to each instruction (backward dataflow to a fixpoint)."""
    n = len(code)
    uses = [frozenset(instr.reads()) for instr in code]
    defs = [frozenset(instr.dsts) for instr in code]
    succ = [successors(code, pc) for pc in range(n)]
    live: list[frozenset[Reg]] = [frozenset()] * n
    changed = True
    while changed:
        changed = False
        for pc in range(n - 1, -1, -1):
            out: set[Reg] = set()
            for s in succ[pc]:
                out |= live[s]
            new = uses[pc] | (frozenset(out) - defs[pc])
            if new != live[pc]:
                live[pc] = new
                changed = True
    return live


def compute_regions(code: Sequence[Instr]) -> tuple[Region, ...]:
    """The regions of `code` (module docstring), in code order, each with its
    live-ins and live-outs."""
    live = live_in_sets(code)
    targets = jump_targets(code)
    bounds: list[tuple[int, int]] = []
    start = None
    for pc, instr in enumerate(code):
        if start is not None and pc in targets:
            bounds.append((start, pc))
            start = None
        if instr.spec.flow is Flow.NEXT:
            if start is None:
                start = pc
        elif start is not None:
            bounds.append((start, pc))
            start = None
    if start is not None:
        bounds.append((start, len(code)))
    regions = []
    for index, (lo, hi) in enumerate(bounds):
        written: set[Reg] = set()
        read_first: list[Reg] = []
        for instr in code[lo:hi]:
            for reg in instr.reads():
                if reg not in written and reg not in read_first:
                    read_first.append(reg)
            written.update(instr.dsts)
        after = live[hi] if hi < len(code) else frozenset()
        live_out = tuple(sorted((r for r in written if r in after), key=lambda r: r.index))
        regions.append(Region(index, lo, hi, tuple(read_first), live_out))
    return tuple(regions)
