"""Which values of a specialized region share storage, and until when it is used.

Views share their source's storage, and so do the results of MOVE, RESHAPE_IF (which
may return its operand) and of operations rewritten to work in place. Buffer reuse
(Note [In-place reuse]) and arena planning (Note [Arena layout]) both ask the same two
questions of a region: who owns the storage a value lives in, and when is that storage
last used (by anything sharing it, or by the region's outputs after the region).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from dynvm.jit.ir import SpecOp, Var
from dynvm.vm.opcodes import ALL_OPS

# Ops whose result may share operand 0's storage: views, and those that may return
# operand 0 itself (MOVE, RESHAPE_IF), from the opcode table.
_SHARES_STORAGE = frozenset(spec.name for spec in ALL_OPS
                            if spec.is_view or spec.returns_operand)


def flat_values(args: Iterable) -> Iterator:
    """An op's operands with list operands (int lists, tensor lists) flattened."""
    for arg in args:
        if isinstance(arg, list):
            yield from arg
        else:
            yield arg


def shares_operand_storage(op: SpecOp) -> bool:
    """Whether `op`'s result may share storage with its first operand (an
    in-place variant, a view, or an op that may return the operand itself)."""
    return op.variant == "inplace" or op.opcode in _SHARES_STORAGE


def storage_roots(ops: list[SpecOp]) -> tuple[dict[int, int], set[int]]:
    """(Var -> the Var owning its storage, the Vars whose storage this region allocated).

    A view of a constant is its own root but not owned: its storage is a weight's."""
    roots: dict[int, int] = {}
    owned: set[int] = set()
    for op in ops:
        aliases = shares_operand_storage(op)
        source = op.args[0] if op.args else None
        for dst in op.dsts:
            if not aliases:
                roots[dst] = dst
                owned.add(dst)
            elif isinstance(source, Var):
                roots[dst] = roots.get(source.reg, source.reg)
            else:
                roots[dst] = dst
    return roots, owned


def last_use_of_roots(ops: list[SpecOp], roots: dict[int, int],
                      leaving: Iterable[int] = ()) -> dict[int, int]:
    """Root -> position of the last op using any value stored in it; `len(ops)` for the
    storage of a region output (it is used after the region)."""
    last: dict[int, int] = {}
    for position, op in enumerate(ops):
        for arg in flat_values(op.args):
            if isinstance(arg, Var):
                last[roots.get(arg.reg, arg.reg)] = position
    for reg in leaving:
        last[roots.get(reg, reg)] = len(ops)
    return last
