"""Run a region's plan with kernels loaded from an artifact's stored binaries
(`loader.load_kernels`): what a GPU replica of the fleet runs, with no Triton compile
anywhere in the process.

The device sits behind a small boundary object, the only part that touches CUDA:

* `prepare(kernel)`: load the module on the device now (on the install thread), so a
  bad binary, a PTX the driver cannot compile, or too little shared memory fails the
  install, not a request;
* `launch(kernel, grid, args)`: one launch on the current stream.

`CudaBoundary` is the real one. A test on a machine without a GPU may give another with
the same two methods (tests/triton/_fake_device.py runs the artifact's kernel source in
Triton's interpreter): everything above the boundary, from the artifact bytes to the
launcher's argument list, is then the code a GPU replica runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dynvm.jit.backends.triton.launch import PlanRunner, PreparedLaunch
from dynvm.jit.backends.triton.loader import LoadedKernel
from dynvm.jit.backends.triton.plan import KernelLaunch, RegionPlan


class CudaBoundary:
    """Launches loaded kernels on a CUDA device through Triton's launcher."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaBoundary needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def arch(self) -> int:
        major, minor = torch.cuda.get_device_capability(self.device)
        return major * 10 + minor

    def prepare(self, kernel: LoadedKernel) -> None:
        with torch.cuda.device(self.device):
            kernel.compiled.run  # noqa: B018  (the property loads the module: cuModuleLoadData)

    def launch(self, kernel: LoadedKernel, grid: Sequence[int], args: Sequence) -> None:
        compiled = kernel.compiled
        gx, gy, gz = (*grid, 1, 1)[:3]
        # The caller's stream (torch's current one), so launches join a CUDA graph that
        # is being captured on it (dynvm.jit.backends.triton.graphs).
        stream = torch.cuda.current_stream(self.device).cuda_stream
        compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *args)


class BinaryRegion(PlanRunner):
    """`region(regs)` runs the plan: torch calls as usual, kernels from stored binaries
    launched through `boundary`."""

    def __init__(self, plan: RegionPlan, kernels: Mapping[str, LoadedKernel],
                 constants: Sequence[torch.Tensor], boundary) -> None:
        super().__init__(plan, constants, boundary.device)
        missing = {s.kernel for s in plan.kernels()} - set(kernels)
        if missing:
            raise ValueError(f"plan launches kernels that were not loaded: {sorted(missing)}")
        self.kernels = dict(kernels)
        self.boundary = boundary
        self.launches = 0

    def prepare(self) -> None:
        """Load every kernel on the device (install time, never on a request)."""
        for kernel in self.kernels.values():
            self.boundary.prepare(kernel)

    def launch_kernel(self, step: KernelLaunch, tensors: list[torch.Tensor],
                      outputs: list[torch.Tensor], prepared: PreparedLaunch) -> None:
        kernel = self.kernels[step.kernel]
        self.boundary.launch(kernel, prepared.grid, kernel.args(tensors, outputs, prepared))
        self.launches += 1
