"""dynvm: a bytecode VM and shape-specializing JIT for PyTorch models with dynamic shapes.

    program = dynvm.compile(module, example_inputs, dynamic_shapes=...)
    dynvm.save(program, "model.dvm"); program = dynvm.load("model.dvm")
    runtime = dynvm.Runtime(program, device="cpu")
    outputs = runtime(*inputs)
"""

from __future__ import annotations

from dynvm._runtime import Runtime
from dynvm.jit.config import JitConfig
from dynvm.vm.budget import CallBudget
from dynvm.vm.errors import (
    AssembleError,
    CallBudgetError,
    DvmFormatError,
    DynvmError,
    ExecutionError,
    InputError,
    ShapeError,
    UnsupportedOpError,
    VerifyError,
)
from dynvm.vm.program import Program

__version__ = "0.1.0"


def compile(module, example_inputs, dynamic_shapes=None, name: str | None = None) -> Program:
    """Lower `module` to a dynvm Program.

    `example_inputs` is a tuple of tensors; `dynamic_shapes` is exactly what
    `torch.export.export` takes (torch.export.Dim with min/max per dynamic dim). The
    declared ranges become the program's input checks.
    """
    from dynvm.vm.frontend import lower_module

    return lower_module(module, example_inputs, dynamic_shapes, name)


def save(program: Program, path) -> None:
    """Write `program` to a .dvm file (atomically)."""
    from dynvm.vm.dvm_file import save as _save

    _save(program, path)


def load(path) -> Program:
    """Read and validate a .dvm file."""
    from dynvm.vm.dvm_file import load as _load

    return _load(path)


__all__ = [
    "AssembleError", "CallBudget", "CallBudgetError", "DvmFormatError", "DynvmError",
    "ExecutionError", "InputError",
    "JitConfig",
    "Program", "Runtime", "ShapeError", "UnsupportedOpError", "VerifyError", "compile",
    "load", "save",
]
