"""What the frontend's bytecode passes share: where registers are written and read,
which instructions one straight-line block holds, and rebuilding the code with some
instructions replaced while every jump keeps its target."""

from __future__ import annotations

from collections import defaultdict

from dynvm.vm.instr import Instr
from dynvm.vm.isa import Flow
from dynvm.vm.operands import Label


def writers_and_readers(code) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """register index -> the pcs writing it, and -> the pcs reading it (a pc once per
    operand that reads it)."""
    writers: dict[int, list[int]] = defaultdict(list)
    readers: dict[int, list[int]] = defaultdict(list)
    for pc, instr in enumerate(code):
        for dst in instr.dsts:
            writers[dst.index].append(pc)
        for reg in instr.reads():
            readers[reg.index].append(pc)
    return writers, readers


def block_of(code) -> list[int]:
    """The straight-line block each pc belongs to: a block starts at a jump target and
    after an instruction that is not a fall-through."""
    targets = {arg.target for instr in code for arg in instr.args if isinstance(arg, Label)}
    blocks, block = [], 0
    for pc, instr in enumerate(code):
        if pc in targets and pc > 0:
            block += 1
        blocks.append(block)
        if instr.spec.flow is not Flow.NEXT:
            block += 1
    return blocks


def rebuild(code, replaced: dict[int, list[Instr]]) -> tuple[Instr, ...]:
    """The code with instruction `pc` replaced by `replaced[pc]` (an empty list drops
    it); a jump to a pc goes to the first instruction that now stands in its place (or
    after it, where it was dropped)."""
    new_pc, out = [], []
    for pc, instr in enumerate(code):
        new_pc.append(len(out))
        out.extend(replaced.get(pc, [instr]))
    new_pc.append(len(out))

    def moved(arg):
        return Label(new_pc[arg.target]) if isinstance(arg, Label) else arg

    return tuple(Instr(i.op, i.dsts, tuple(moved(a) for a in i.args))
                 if any(isinstance(a, Label) for a in i.args) else i for i in out)
