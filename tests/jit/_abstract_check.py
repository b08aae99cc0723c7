"""Abstract evaluation against real execution, register by register (docs/ARCHITECTURE.md,
Invariants: "abstract evaluation gives every register the shape, dtype and strides real
execution gives it").

`region_entries` runs a program in the interpreter and records, at each region entry,
the live-in values; `disagreements` re-runs the region's instructions on those values
for real (the opcode's `impl`, as the interpreter calls it) and abstractly (its
`shape_fn` on meta tensors, `dynvm.vm.abstract.evaluate_region`) and lists every
register whose shape, dtype or strides (or scalar value) differ. Usable on any program:
the zoo tests may import it.
"""

from __future__ import annotations

import torch

from dynvm.vm.abstract import CheckFailed, _operand, evaluate_region, to_abstract
from dynvm.vm.operands import Const, Imm, IntList, Reg, RegList


class _Recorder:
    """A region slot that never specializes: it keeps the live-ins of each entry."""

    def __init__(self, region, entries: list) -> None:
        self.region = region
        self.entries = entries

    def enter(self, regs: list):
        self.entries.append((self.region, {r.index: regs[r.index]
                                           for r in self.region.live_in}))
        return self

    def leave(self, ticket, seconds: float) -> None:
        pass


def region_entries(runtime, *inputs) -> list:
    """[(region, live-in values)] of one interpreted call of `runtime` (a jit=False
    Runtime); its slots are restored to none afterwards."""
    entries: list = []
    interpreter = runtime.interpreter
    for region in runtime.program.regions:
        interpreter.install_slot(region.index, _Recorder(region, entries))
    try:
        with torch.inference_mode():
            runtime(*inputs)
    finally:
        for region in runtime.program.regions:
            interpreter.install_slot(region.index, None)
    return entries


def _real_operand(arg, values: dict, interpreter):
    if isinstance(arg, Reg):
        return values[arg.index]
    if isinstance(arg, Const):
        return interpreter.constant(arg.index)
    if isinstance(arg, Imm):
        return interpreter._resolve_device(arg.value)
    if isinstance(arg, IntList):
        return [values[i.index] if isinstance(i, Reg) else i for i in arg.items]
    if isinstance(arg, RegList):
        return [_real_operand(i, values, interpreter) for i in arg.items]
    raise TypeError(arg)


def real_values(program, region, live_in: dict, interpreter) -> dict:
    values = dict(live_in)
    with torch.inference_mode():
        for pc in range(region.start, region.stop):
            instr = program.code[pc]
            result = instr.spec.impl(*[_real_operand(a, values, interpreter)
                                       for a in instr.args])
            if not instr.dsts:
                continue
            if len(instr.dsts) == 1:
                values[instr.dsts[0].index] = result
            else:
                for dst, value in zip(instr.dsts, result):
                    values[dst.index] = value
    return values


def significant_strides(t: torch.Tensor) -> tuple:
    """Strides of the dims that have more than one element (None for the others): the
    stride of a dim of size 0 or 1 never moves an index, torch's meta kernels and real
    kernels may disagree on it, and no view or kernel choice depends on it (torch tests
    its own meta kernels the same way)."""
    return tuple(s if n > 1 else None for n, s in zip(t.shape, t.stride()))


def _describe(value):
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, significant_strides(value))
    return value


def disagreements(program, region, live_in: dict, interpreter) -> list[str]:
    """Every register of `region` whose abstract value differs from its real one (after
    the first instruction whose shape function raises, nothing more is compared)."""
    real = real_values(program, region, live_in, interpreter)
    try:
        evaluate_region(program, region, live_in)
        failure = None
    except CheckFailed:
        raise
    except Exception as exc:  # noqa: BLE001 — located below, instruction by instruction
        failure = exc
    # The same evaluation, one instruction at a time, to name the first register that
    # differs (the evaluation above is the one the JIT runs; this one must agree with it).
    constants = [to_abstract(c) for c in program.constants]
    abstract = {index: to_abstract(value) for index, value in live_in.items()}
    found = []
    for pc in range(region.start, region.stop):
        instr = program.code[pc]
        if any(abstract.get(r.index) is None for r in instr.reads()):
            results = None
        else:
            try:
                results = instr.spec.shape_fn(*[_operand(a, abstract, constants)
                                                for a in instr.args])
            except Exception as exc:  # noqa: BLE001
                found.append(f"{pc} {instr}: shape function failed: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0]}")
                return found
        outs = [results] if len(instr.dsts) == 1 else (
            [None] * len(instr.dsts) if results is None else list(results))
        for dst, got in zip(instr.dsts, outs):
            abstract[dst.index] = got
            want = real.get(dst.index)
            if got is None:  # data-dependent: abstract evaluation does not know it
                continue
            if _describe(want) != _describe(got) or \
                    isinstance(want, torch.Tensor) != isinstance(got, torch.Tensor):
                found.append(f"{pc} {instr}: %{dst.index} real {_describe(want)}, "
                             f"abstract {_describe(got)}")
    if failure is not None and not found:
        found.append(f"abstract evaluation failed: {type(failure).__name__}: {failure}")
    return found


def check_program(runtime, *inputs) -> list[str]:
    """Disagreements over every region entry of one call of `runtime` (jit=False)."""
    found = []
    for region, live_in in region_entries(runtime, *inputs):
        found += [f"region {region.index}: {line}" for line in
                  disagreements(runtime.program, region, live_in, runtime.interpreter)]
    return found
