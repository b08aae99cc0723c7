"""A stand-in for the CUDA device at the one boundary where the Triton backend touches it
(`dynvm.jit.backends.triton.run_binary`: `prepare` and `launch`), for machines without a
GPU.

Everything above the boundary is the real path: the artifact's bytes, its stored sm_XX
binaries turned into Triton's `CompiledKernel` objects, the launcher's argument list.
Where a GPU would run the cubin, this runs the same kernel's generated source (which the
artifact carries and its checksum covers) in Triton's interpreter, on CPU tensors, with
exactly the argument list the launcher would get. So a test proves that the loaded
objects are complete and the arguments right; on a GPU, the gpu-marked tests launch the
cubins themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch


class InterpretedBoundary:
    """Claims a GPU of compute capability `arch`; launches interpreted on the CPU."""

    def __init__(self, arch: int = 90) -> None:
        from dynvm.jit.backends.triton._loading import interpreter_ready

        if not interpreter_ready():
            raise RuntimeError("the fake device needs TRITON_INTERPRET=1 before triton's "
                               "first import")
        self.device = torch.device("cpu")
        self.arch = arch
        self.prepared: list[str] = []
        self.launched: list[tuple[str, tuple, int]] = []
        self._interpreted = {}

    def prepare(self, kernel) -> None:
        # What the real boundary loads: the object must hold the binary and metadata.
        compiled = kernel.compiled
        assert compiled.kernel == (kernel.binary.binary if kernel.how == "cubin"
                                   else kernel.binary.ptx.encode() + b"\0")
        assert compiled.metadata.name == kernel.binary.entry
        self.prepared.append(kernel.kernel.name)

    def launch(self, kernel, grid: Sequence[int], args: Sequence) -> None:
        from dynvm.jit.backends.triton._loading import load_interpreted

        name = kernel.kernel.name
        if name not in self._interpreted:
            self._interpreted[name] = load_interpreted(name, kernel.kernel.source)
        signature = kernel.kernel.signature
        names = kernel.kernel.arg_names
        # The launcher skips constexpr parameters (they are in the binary); the
        # interpreter takes them by name.
        positional = [a for n, a in zip(names, args) if signature[n] != "constexpr"]
        constexprs = {n: a for n, a in zip(names, args) if signature[n] == "constexpr"}
        with numpy.errstate(divide="ignore", invalid="ignore", over="ignore"):
            self._interpreted[name][tuple(grid)](*positional, **constexprs)
        self.launched.append((name, tuple(grid), len(args)))
