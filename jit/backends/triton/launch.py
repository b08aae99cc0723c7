"""Launching a plan: per-call dims, grids and output buffers, and the walk over the
steps. Shared by every way of running generated kernels (the interpreter on the CPU in
`run_interpreted`, compiled binaries on a GPU), so they agree on what is launched.

Per call, a kernel's dims are read off its actual inputs (`Dim.rule`): a runtime dim is
passed as an argument, a static one must equal its constexpr (else `LaunchError`, which
the JIT treats like a guard failure: the interpreter runs that call). Outputs are
allocated contiguous, with the domain's shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dynvm.jit.backends.triton.errors import LaunchError
from dynvm.jit.backends.triton.plan import MATMUL, ROW, KernelLaunch, RegionPlan, TorchCall
from dynvm.jit.ir import ConstRef, Literal, Var
from dynvm.vm.opcodes import opcode

INDEX_LIMIT = 2**31 - 1   # kernels index with 32-bit integers


@dataclass(frozen=True)
class PreparedLaunch:
    """One kernel launch resolved for a call's shapes: grid, runtime dims,
    constexprs and the output's shape."""

    grid: tuple[int, ...]
    runtime_args: tuple[int, ...]   # the runtime dims, in parameter order
    constexprs: dict[str, int]      # static dims and block sizes
    out_shape: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return math.prod(self.grid) == 0


def _read_dim(rule: tuple, tensors: Sequence[torch.Tensor]) -> int:
    what, index = rule[0], rule[1]
    tensor = tensors[index]
    if what == "numel":
        return tensor.numel()
    if what == "rows":
        return math.prod(tensor.shape[:-1])
    if what == "dim":
        return tensor.shape[rule[2]]
    raise LaunchError(f"unknown dim rule {rule!r}")


def prepare_launch(step: KernelLaunch, tensors: Sequence[torch.Tensor]) -> PreparedLaunch:
    """Dims, grid and output shape of `step` for these input tensors, checked."""
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
            raise LaunchError(f"{step.kernel}: input {index} is "
                              f"{getattr(tensor, 'dtype', type(tensor).__name__)}, "
                              "expected a float32 tensor")
    values = {}
    for dim in step.dims:
        actual = _read_dim(dim.rule, tensors)
        if dim.static is not None and actual != dim.static:
            raise LaunchError(f"{step.kernel}: dim {dim.name} is {actual}, the kernel was "
                              f"compiled for {dim.static}")
        values[dim.name] = actual
    if step.kind == MATMUL:
        out_shape = (*tensors[0].shape[:-1], values["N"])
    else:
        out_shape = tuple(tensors[step.full_inputs[0]].shape)
    for index in step.full_inputs:
        if tuple(tensors[index].shape) != tuple(out_shape):
            raise LaunchError(f"{step.kernel}: input {index} has shape "
                              f"{tuple(tensors[index].shape)}, expected {tuple(out_shape)}")
    for tensor_numel in (*(t.numel() for t in tensors), math.prod(out_shape)):
        if tensor_numel > INDEX_LIMIT:
            raise LaunchError(f"{step.kernel}: {tensor_numel} elements exceed 32-bit "
                              "indexing")
    blocks = dict(step.blocks)
    if step.kind == MATMUL:
        grid = (_cdiv(values["M"], blocks["BLOCK_M"]) * _cdiv(values["N"], blocks["BLOCK_N"]),)
    elif step.kind == ROW:
        grid = (values["ROWS"] if values["N"] else 0,)
    else:
        grid = (_cdiv(values["NUMEL"], blocks["BLOCK"]),)
    runtime = tuple(values[d.name] for d in step.dims if d.in_kernel and d.static is None)
    static = {d.name: d.static for d in step.dims if d.in_kernel and d.static is not None}
    return PreparedLaunch(grid, runtime, static | blocks, tuple(out_shape))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PlanRunner:
    """Runs a `RegionPlan` over a register file, as a specialization's `fn(regs)` does
    (the register file changes only after every step succeeded). Subclasses launch the
    kernels (`launch_kernel`)."""

    def __init__(self, plan: RegionPlan, constants: Sequence[torch.Tensor],
                 device: torch.device | str) -> None:
        self.plan = plan
        self.constants = constants
        self.device = torch.device(device)
        self._impls = {s.opcode: opcode(s.opcode).impl for s in plan.vendor_calls()}

    def launch_kernel(self, step: KernelLaunch, tensors: list[torch.Tensor],
                      outputs: list[torch.Tensor], prepared: PreparedLaunch) -> None:
        raise NotImplementedError

    def __call__(self, regs: list) -> None:
        plan = self.plan
        env = {reg: regs[reg] for reg in plan.live_in}
        for step, dead in zip(plan.steps, plan.frees):
            if isinstance(step, TorchCall):
                self._torch(step, env)
            else:
                self._kernel(step, env)
            for reg in dead:
                env.pop(reg, None)
        for reg in plan.dead_live_ins:
            regs[reg] = None
        for reg, value in plan.outputs:
            regs[reg] = self._value(value, env)

    def _value(self, value, env):
        if isinstance(value, Var):
            return env[value.reg]
        if isinstance(value, ConstRef):
            return self.constants[value.index]
        if isinstance(value, Literal):
            return self._literal(value.value)
        if isinstance(value, list):
            return [self._value(v, env) for v in value]
        raise TypeError(f"unexpected value {value!r}")

    def _literal(self, value):
        # Device operands mean "the runtime's device", as in the interpreter.
        if isinstance(value, torch.device):
            return self.device
        if isinstance(value, tuple):
            return tuple(self.device if isinstance(v, torch.device) else v for v in value)
        return value

    def _torch(self, step: TorchCall, env: dict) -> None:
        result = self._impls[step.opcode](*(self._value(a, env) for a in step.args))
        if len(step.dsts) == 1:
            env[step.dsts[0]] = result
        elif step.dsts:
            for reg, item in zip(step.dsts, result, strict=True):
                env[reg] = item

    def _kernel(self, step: KernelLaunch, env: dict) -> None:
        tensors = [self._value(v, env) for v in step.inputs]
        # A family's live-ins are contiguous; an intermediate from a torch call may not
        # be on every device (layouts differ between kernels): copy, never misread.
        tensors = [t if not isinstance(t, torch.Tensor) or t.is_contiguous()
                   else t.contiguous() for t in tensors]
        prepared = prepare_launch(step, tensors)
        device = tensors[0].device
        outputs = [torch.empty(prepared.out_shape, dtype=torch.float32, device=device)
                   for _ in step.stores]
        if not prepared.empty:
            self.launch_kernel(step, tensors, outputs, prepared)
        for reg, out in zip(step.stores, outputs):
            env[reg] = out
