"""The interpreter: a thin loop over pre-decoded instructions.

Note [Pre-decoding]
~~~~~~~~~~~~~~~~~~~
When an `Interpreter` is made, every instruction is decoded once into a step: a small
closure that reads its operand registers, calls the opcode's `impl` from the ISA table
and writes its result registers. Operand kinds, constant lookups, the runtime device
and the shape of the argument list are all resolved then, so a step does no work per
call beyond the operation itself. The steps of a region run in a plain `for` loop; the
main loop only moves between regions and control instructions, each of which returns
the next program counter.

A call gets a fresh register file (a list), so concurrent calls share nothing mutable.
Constants live at the end of the register file template, so a constant operand is read
exactly like a register.

Note [Register kills]
~~~~~~~~~~~~~~~~~~~~~
Each step also clears the registers whose value is dead after it (from liveness). Without
that, a call would keep every intermediate tensor alive until it returns: at batch 64
the encoder's frame held hundreds of MB, every call paid fresh page faults for it, and
the interpreter ran ~1.4x slower than eager. With kills, tensors die exactly where they
would in eager PyTorch and the allocator reuses their memory.

Loops are bounded per call: see Note [Call budget] in dynvm.vm.budget. The register file
has one slot for the call's loop meter, before the return slot, so that only backward
edges pay for the budget.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence

import torch

from dynvm.vm.budget import CallBudget
from dynvm.vm.errors import DynvmError, ExecutionError
from dynvm.vm.isa import Flow
from dynvm.vm.operands import Const, Imm, IntList, Operand, Reg, RegList
from dynvm.vm.regions import live_in_sets, successors
from dynvm.vm.slots import RegionSlot

_RETURN = -1


class Interpreter:
    """Runs one program on one device. Thread-safe: each call has its own registers."""

    def __init__(self, program, device: str | torch.device = "cpu",
                 budget: CallBudget | None = None) -> None:
        self.program = program
        self.budget = budget if budget is not None else CallBudget()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._const_base = program.n_regs
        # The register file: registers, then constants, the loop meter, the return slot.
        self._template = ([None] * program.n_regs
                          + [c.to(self.device) for c in program.constants] + [None, None])
        self._meter_slot = len(self._template) - 2
        self._loops = any(_is_back_edge(pc, instr) for pc, instr in enumerate(program.code))
        kills = _dead_after(program.code)
        # Every instruction decoded once, here (Note [Pre-decoding]).
        self._steps = [self._decode(instr, kills[pc]) for pc, instr in enumerate(program.code)]
        self._slots: list[RegionSlot | None] = [None] * len(program.regions)
        self._plan: list[tuple[Callable[[list], int], int] | None] = [None] * len(program.code)
        for region in program.regions:
            self._plan_region(region)
        for pc, instr in enumerate(program.code):
            if instr.spec.flow is not Flow.NEXT:
                self._plan[pc] = (self._control_unit(pc, instr), 1)
        self.instructions_executed = 0

    # -- public ------------------------------------------------------------------------

    def run(self, inputs: Sequence[torch.Tensor], budget: CallBudget | None = None) -> list:
        """Run the program on flat inputs (already validated by count); returns the flat
        outputs in RETURN order. `budget` (default: the interpreter's) bounds its loops;
        past it, `CallBudgetError` (Note [Call budget])."""
        regs = self._template.copy()
        regs[: len(inputs)] = inputs
        if self._loops:
            regs[self._meter_slot] = (budget or self.budget).meter()
        plan = self._plan
        pc = 0
        executed = 0
        while pc != _RETURN:
            unit, size = plan[pc]
            executed += size
            pc = unit(regs)
        self.instructions_executed += executed
        return regs[-1]

    def install_slot(self, region_index: int, slot: RegionSlot | None) -> None:
        """Attach (or with None, detach) the JIT's cache slot of a region. Safe while
        other threads run the program: the new unit is built first, then bound with one
        list-item store into the plan; a call in flight finishes with the unit it read
        (a detached slot still works), the next one reads the new unit."""
        self._slots[region_index] = slot
        self._plan_region(self.program.regions[region_index])

    def region_steps(self, region_index: int) -> list[Callable[[list], None]]:
        region = self.program.regions[region_index]
        return self._steps[region.start:region.stop]

    def constant(self, index: int) -> torch.Tensor:
        """Program constant `index`, as this interpreter holds it (on its device)."""
        return self._template[self._const_base + index]

    def const_register(self, const: Const) -> int:
        return self._const_base + const.index

    # -- decoding ------------------------------------------------------------------------

    def _resolve_device(self, value: object) -> object:
        if isinstance(value, torch.device):
            return self.device
        if isinstance(value, tuple):
            return tuple(self._resolve_device(v) for v in value)
        return value

    def _register(self, operand: Reg | Const) -> int:
        return operand.index if isinstance(operand, Reg) else self.const_register(operand)

    def _decode(self, instr, kills: tuple[int, ...]) -> Callable[[list], None] | None:
        spec = instr.spec
        if spec.flow is not Flow.NEXT:
            return None
        fn = spec.impl
        template: list[object] = []
        reg_positions: list[tuple[int, int]] = []
        list_positions: list[tuple[int, tuple]] = []
        for position, arg in enumerate(instr.args):
            template.append(self._static_value(arg))
            if isinstance(arg, Reg | Const):
                reg_positions.append((position, self._register(arg)))
            elif isinstance(arg, IntList) and not arg.is_static:
                list_positions.append((position, tuple(
                    (True, item.index) if isinstance(item, Reg) else (False, item)
                    for item in arg.items)))
            elif isinstance(arg, RegList):
                list_positions.append((position, tuple(
                    (True, self._register(item)) for item in arg.items)))
        dsts = tuple(d.index for d in instr.dsts)
        fused = _fused_step(fn, tuple(template), reg_positions, list_positions, dsts, kills)
        if fused is not None:
            return fused
        call = _make_call(fn, tuple(template), reg_positions, list_positions)
        return _make_store(call, dsts, kills)

    def _static_value(self, arg: Operand) -> object:
        if isinstance(arg, Imm):
            return self._resolve_device(arg.value)
        if isinstance(arg, IntList) and arg.is_static:
            return list(arg.items)
        return None  # filled per call

    def _plan_region(self, region) -> None:
        steps = tuple(self._steps[region.start:region.stop])
        first_pc = region.start
        stop = region.stop if region.stop < len(self.program.code) else _RETURN
        slot = self._slots[region.index]
        program = self.program

        def run_steps(regs: list) -> None:
            step = None
            try:
                for step in steps:
                    step(regs)
            except DynvmError:
                raise
            except Exception as exc:
                pc = first_pc + steps.index(step)
                raise ExecutionError(f"instruction {pc} ({program.code[pc]}) failed: "
                                     f"{type(exc).__name__}: {exc}") from exc

        if slot is None:
            def unit(regs: list) -> int:
                run_steps(regs)
                return stop
        else:
            enter, leave, clock = slot.enter, slot.leave, time.perf_counter

            def unit(regs: list) -> int:
                ticket = enter(regs)
                if ticket is None:
                    return stop
                start = clock()
                run_steps(regs)
                leave(ticket, clock() - start)
                return stop

        self._plan[region.start] = (unit, len(region))

    def _control_unit(self, pc: int, instr) -> Callable[[list], int]:
        unit = self._forward_control_unit(pc, instr)
        if not _is_back_edge(pc, instr):
            return unit
        meter_slot, clock = self._meter_slot, time.monotonic

        def back_edge(regs: list) -> int:
            target = unit(regs)
            if target <= pc:  # taken: one more iteration (Note [Call budget])
                meter = regs[meter_slot]
                meter.left -= 1
                if meter.left < 0 or clock() > meter.deadline:
                    raise meter.over(pc, instr)
            return target

        return back_edge

    def _forward_control_unit(self, pc: int, instr) -> Callable[[list], int]:
        flow = instr.spec.flow
        if flow is Flow.JUMP:
            target = instr.args[0].target
            return lambda regs: target
        if flow is Flow.BRANCH_IF_FALSE:
            cond, label = instr.args
            target: int = label.target
            following = pc + 1
            if isinstance(cond, Imm):
                constant = bool(cond.value)
                return lambda regs: following if constant else target
            index = self._register(cond)
            program = self.program

            def branch(regs: list) -> int:
                try:
                    return following if regs[index] else target
                except Exception as exc:  # e.g. a tensor condition of several elements
                    raise ExecutionError(f"instruction {pc} ({program.code[pc]}) failed: "
                                         f"{type(exc).__name__}: {exc}") from exc

            return branch
        if flow is Flow.RETURN:
            indices = tuple(self._register(item) for item in instr.args[0].items)

            def finish(regs: list) -> int:
                regs[-1] = [regs[i] for i in indices]
                return _RETURN

            return finish
        raise AssertionError(f"no control unit for {instr.op}")


def _is_back_edge(pc: int, instr) -> bool:
    """A JUMP or JUMP_IF_FALSE to itself or an earlier instruction: the only way a
    program loops (Note [Call budget])."""
    flow = instr.spec.flow
    if flow is Flow.JUMP:
        return instr.args[0].target <= pc
    if flow is Flow.BRANCH_IF_FALSE:
        return instr.args[1].target <= pc
    return False


def _dead_after(code) -> list[tuple[int, ...]]:
    """Per instruction, the registers it reads or writes that no later instruction reads
    (see Note [Register kills])."""
    live = live_in_sets(code)
    kills = []
    for pc, instr in enumerate(code):
        after: set[Reg] = set()
        for succ in successors(code, pc):
            after |= live[succ]
        touched = set(instr.reads()) | set(instr.dsts)
        kills.append(tuple(sorted(r.index for r in touched - after)))
    return kills


def _fused_step(fn, template, reg_positions, list_positions, dsts, kills):
    """One-frame steps for the shapes of instruction that dominate real programs: one
    result, and operands that are all registers, or one register then literals."""
    if len(dsts) != 1 or list_positions:
        return None
    dst = dsts[0]
    positions = [p for p, _ in reg_positions]
    if positions == list(range(len(template))) and len(positions) > 1:
        getter = operator.itemgetter(*(r for _, r in reg_positions))

        def step(regs: list) -> None:
            regs[dst] = fn(*getter(regs))
            for dead in kills:
                regs[dead] = None

        return step
    if positions == [0]:
        only = reg_positions[0][1]
        rest = template[1:]
        if not rest:
            def step(regs: list) -> None:
                regs[dst] = fn(regs[only])
                for dead in kills:
                    regs[dead] = None
        else:
            def step(regs: list) -> None:
                regs[dst] = fn(regs[only], *rest)
                for dead in kills:
                    regs[dead] = None
        return step
    return None


def _make_call(fn, template: tuple, reg_positions, list_positions) -> Callable[[list], object]:
    """A closure calling `fn` with its operands read from the register file."""
    n = len(template)
    if not list_positions and [p for p, _ in reg_positions] == list(range(n)):
        # Every operand is a register (or constant): fetch them in C.
        if n == 1:
            only = reg_positions[0][1]
            return lambda regs: fn(regs[only])
        getter = operator.itemgetter(*(r for _, r in reg_positions))
        return lambda regs: fn(*getter(regs))
    if not list_positions and len(reg_positions) == 1 and reg_positions[0][0] == 0:
        # One leading register, the rest literal: VIEW, SOFTMAX, TRANSPOSE, ...
        only = reg_positions[0][1]
        rest = template[1:]
        return lambda regs: fn(regs[only], *rest)

    def call(regs: list) -> object:
        args = list(template)
        for position, index in reg_positions:
            args[position] = regs[index]
        for position, items in list_positions:
            args[position] = [regs[v] if is_reg else v for is_reg, v in items]
        return fn(*args)

    return call


def _make_store(call, dsts: tuple[int, ...], kills: tuple[int, ...]) -> Callable[[list], None]:
    if not dsts:
        def step(regs: list) -> None:
            call(regs)
            for dead in kills:
                regs[dead] = None
    elif len(dsts) == 1:
        dst = dsts[0]

        def step(regs: list) -> None:
            regs[dst] = call(regs)
            for dead in kills:
                regs[dead] = None
    else:
        def step(regs: list) -> None:
            results = call(regs)
            if len(results) != len(dsts):
                raise ExecutionError(f"expected {len(dsts)} results, got {len(results)}")
            for dst, value in zip(dsts, results):
                regs[dst] = value
            for dead in kills:
                regs[dead] = None
    return step

