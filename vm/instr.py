"""Instructions: frozen, slotted records of an opcode name, result registers and typed
operands. What an opcode accepts is declared in the ISA table (`dynvm.vm.opcodes`)."""

from __future__ import annotations

from dataclasses import dataclass

from dynvm.vm.isa import OpSpec
from dynvm.vm.opcodes import opcode
from dynvm.vm.operands import Operand, Reg, registers_read


@dataclass(frozen=True, slots=True)
class Instr:
    """`dsts = OP args`. `op` is the opcode's name, the stable key stored in files."""

    op: str
    dsts: tuple[Reg, ...]
    args: tuple[Operand, ...]

    @property
    def spec(self) -> OpSpec:
        return opcode(self.op)

    def reads(self) -> tuple[Reg, ...]:
        """Registers this instruction reads, in operand order (duplicates kept)."""
        found: list[Reg] = []
        for arg in self.args:
            found.extend(registers_read(arg))
        return tuple(found)

    def __str__(self) -> str:
        from dynvm.vm.asm import format_instr

        return format_instr(self)
