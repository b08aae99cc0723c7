"""Run a region's plan with its generated kernels on CPU tensors, through Triton's
interpreter (what TRITON_INTERPRET=1 selects; chosen here explicitly, see Note [Loading
generated kernels]). Slow (numpy per program instance) and meant for correctness: tests
compare it with eager PyTorch on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy
import torch

from dynvm.jit.backends.triton._loading import interpreter_ready, load_interpreted
from dynvm.jit.backends.triton.errors import InterpreterUnavailable
from dynvm.jit.backends.triton.kernels import GeneratedKernel
from dynvm.jit.backends.triton.launch import PlanRunner, PreparedLaunch
from dynvm.jit.backends.triton.plan import KernelLaunch, RegionPlan


class InterpretedRegion(PlanRunner):
    """`region(regs)` runs the plan: torch calls as usual, kernels interpreted."""

    def __init__(self, plan: RegionPlan, kernels: Iterable[GeneratedKernel],
                 constants: Sequence[torch.Tensor]) -> None:
        if not interpreter_ready():
            raise InterpreterUnavailable("Triton was imported without TRITON_INTERPRET=1; "
                                         "set it before the first `import triton`")
        super().__init__(plan, constants, "cpu")
        self.kernels = {k.name: load_interpreted(k.name, k.source) for k in kernels}
        self.launches = 0
        missing = {s.kernel for s in plan.kernels()} - set(self.kernels)
        if missing:
            raise ValueError(f"plan launches kernels with no source: {sorted(missing)}")

    def launch_kernel(self, step: KernelLaunch, tensors: list[torch.Tensor],
                      outputs: list[torch.Tensor], prepared: PreparedLaunch) -> None:
        kernel = self.kernels[step.kernel]
        # Masked-off lanes compute on filler values (x / 0 past the end of a row) and
        # are never stored; numpy would warn about them.
        with numpy.errstate(divide="ignore", invalid="ignore", over="ignore"):
            kernel[prepared.grid](*tensors, *outputs, *prepared.runtime_args,
                                  **prepared.constexprs)
        self.launches += 1
