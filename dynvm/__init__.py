"""dynvm: a bytecode VM and shape-specializing JIT for PyTorch models with dynamic shapes.

    program = dynvm.compile(module, example_inputs, dynamic_shapes=...)
    dynvm.save(program, "model.dvm"); program = dynvm.load("model.dvm")
    runtime = dynvm.Runtime(program, device="cpu")
    outputs = runtime(*inputs)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for readers and type checkers; at run time see __getattr__
    from dynvm.vm.program import Program

# Note [Lazy top level]
# ~~~~~~~~~~~~~~~~~~~~~
# Importing any dynvm.<layer> module first runs this file, so anything it imported
# eagerly would be loaded by every layer: `import dynvm.vm.isa` used to pull in the
# Runtime, hence the JIT, the arena, shape clustering and the OpenTelemetry SDK, and
# jit.artifact -> dynvm -> _runtime -> jit.engine was a cycle that only worked because
# the version was read late. The public names are therefore resolved on first use
# (PEP 562 module __getattr__) and cached in the module's namespace, so `dynvm.Runtime`
# costs one import once and a plain attribute read after that; `import dynvm.vm` loads
# the VM alone (tests/dynvm/test_layering.py checks both).
_LAZY: dict[str, str] = {
    "Runtime": "dynvm._runtime",
    "JitConfig": "dynvm.jit.config",
    "CallBudget": "dynvm.vm.budget",
    "Program": "dynvm.vm.program",
    "RegionStats": "dynvm._runtime_stats",
    "RuntimeStats": "dynvm._runtime_stats",
    "Generator": "dynvm._generate",
    "GenerationStats": "dynvm._generate",
    "GeneratorMemory": "dynvm._generate_memory",
    "compile_generator": "dynvm._generate",
    "save_generator": "dynvm._serve_generate_bundle",
    "Sampling": "dynvm._sampling",
    **{name: "dynvm.vm.errors" for name in (
        "AssembleError", "CallBudgetError", "ConfigError", "ConfigTypeError",
        "DvmFormatError", "DynvmError", "ExecutionError", "InputError", "SaveError",
        "ShapeError", "UnregisteredOpError", "UnsupportedOpError", "VerifyError")},
}


def __getattr__(name: str):
    if name == "__version__":
        # One source of truth: the version pyproject.toml gave the installed distribution.
        from importlib.metadata import version

        value = version("dynvm")
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'dynvm' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "__version__"})


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
    "AssembleError", "CallBudget", "CallBudgetError", "ConfigError", "ConfigTypeError",
    "DvmFormatError", "DynvmError", "ExecutionError", "InputError", "SaveError",
    "GenerationStats", "Generator", "GeneratorMemory", "JitConfig", "Sampling",
    "compile_generator", "Program", "RegionStats", "Runtime", "RuntimeStats", "ShapeError",
    "UnregisteredOpError", "UnsupportedOpError", "VerifyError", "compile", "load", "save",
    "save_generator",
]
