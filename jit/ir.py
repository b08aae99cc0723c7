"""The specialized-region IR: what the specializer produces and backends consume.

Plain frozen data: operations over values that are run-time variables (named by the
register that first held them), literals known at specialization time, or program
constants.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Var:
    """A value computed at run time, named by the register that first held it."""

    reg: int


@dataclass(frozen=True)
class Literal:
    """A value known when the specialization was built (a folded dim, a flag, a dtype)."""

    value: object


@dataclass(frozen=True)
class ConstRef:
    """A program constant (weight)."""

    index: int


Value = Var | Literal | ConstRef


@dataclass(frozen=True)
class SpecOp:
    """One operation of the specialized region: `dsts = opcode(args)`."""

    opcode: str
    dsts: tuple[int, ...]
    args: tuple[object, ...]        # Value, or a list of Values (int lists, tensor lists)
    source_pc: int                  # the instruction it came from, for comments
    frees: tuple[int, ...] = ()     # registers (Vars) dead after this op
    variant: str = ""               # a backend variant of the opcode ("inplace", ...)


@dataclass(frozen=True)
class SpecializedRegion:
    """A region specialized for one signature or family: the straight-line ops
    that replace its instructions, where each live-out comes from, which live-ins die, and
    the notes of the rewrites applied. What backends emit code from and what travels to
    other replicas (Note [Portable specializations])."""

    region_index: int
    live_in: tuple[int, ...]
    ops: tuple[SpecOp, ...]
    outputs: tuple[tuple[int, Value], ...]   # live-out register -> its value
    dead_live_ins: tuple[int, ...]           # live-in registers to clear (dead after)
    assumes_shapes: bool
    notes: tuple[str, ...]
    instructions: int                        # of the original region
    abstract: tuple = field(default=(), compare=False, repr=False)
    """Per probe (the first is the planning probe), register -> abstract value (meta
    tensor or scalar), so that a backend can pick shape-specific kernels."""
