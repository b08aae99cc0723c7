"""Run a region's plan on a CUDA device with Triton's normal JIT: each generated kernel
becomes a `triton.jit` function (Note [Loading generated kernels]) launched with the
grid and arguments of `launch.prepare_launch`, exactly as the interpreted runner does.

`warm_up()` compiles every kernel before the specialization is installed (on the JIT's
compile thread), so no call waits for Triton's compiler: one variant per kernel serves
the whole family, because runtime dims and pointer alignment are not specialized on
(`_loading.load_jit`). Written without a GPU at hand; `bench/gpu_check.py` checks it
against eager PyTorch on one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from dynvm.jit.backends.triton._loading import load_jit
from dynvm.jit.backends.triton.kernels import GeneratedKernel
from dynvm.jit.backends.triton.launch import PlanRunner, PreparedLaunch
from dynvm.jit.backends.triton.options import DEFAULT_OPTIONS, TritonOptions
from dynvm.jit.backends.triton.plan import KernelLaunch, RegionPlan


def _launch_options(step: KernelLaunch, options: TritonOptions) -> dict:
    return {"num_warps": step.num_warps, "num_stages": step.num_stages,
            "enable_fp_fusion": options.fp_fusion}


class CudaRegion(PlanRunner):
    """`region(regs)` runs the plan on a CUDA device: torch calls as usual, kernels by
    Triton's JIT (compiled once, in `warm_up`)."""

    def __init__(self, plan: RegionPlan, kernels: Iterable[GeneratedKernel],
                 constants: Sequence[torch.Tensor], device: torch.device | str,
                 options: TritonOptions = DEFAULT_OPTIONS) -> None:
        super().__init__(plan, constants, device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaRegion runs on a CUDA device, got {self.device}")
        self.options = options
        self.kernels = {}
        for k in kernels:
            pointers = [n for n in k.arg_names if k.signature[n].startswith("*")]
            runtime = [n for n in k.arg_names
                       if k.signature[n] != "constexpr" and not k.signature[n].startswith("*")]
            self.kernels[k.name] = load_jit(k.name, k.source, runtime, pointers)
        missing = {s.kernel for s in plan.kernels()} - set(self.kernels)
        if missing:
            raise ValueError(f"plan launches kernels with no source: {sorted(missing)}")
        self.launches = 0

    def warm_up(self) -> None:
        """Compile every kernel of the plan for this device without launching it."""
        with torch.cuda.device(self.device):
            for step in self.plan.kernels():
                statics = {d.name: d.static for d in step.dims
                           if d.in_kernel and d.static is not None}
                runtime = [1 for d in step.dims if d.in_kernel and d.static is None]
                pointers = [torch.float32] * (len(step.inputs) + len(step.stores))
                self.kernels[step.kernel].warmup(*pointers, *runtime, grid=(1,),
                                                 **statics, **dict(step.blocks),
                                                 **_launch_options(step, self.options))

    def launch_kernel(self, step: KernelLaunch, tensors: list[torch.Tensor],
                      outputs: list[torch.Tensor], prepared: PreparedLaunch) -> None:
        self.kernels[step.kernel][prepared.grid](*tensors, *outputs, *prepared.runtime_args,
                                                 **prepared.constexprs,
                                                 **_launch_options(step, self.options))
        self.launches += 1
