"""A specialized region -> its fusion groups, generated kernels and launch plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynvm.jit.backends.triton._facts import Facts
from dynvm.jit.backends.triton.kernels import GeneratedKernel, generate_kernel
from dynvm.jit.backends.triton.options import DEFAULT_OPTIONS, TritonOptions
from dynvm.jit.backends.triton.partition import TORCH_GROUP, FusionGroup, partition
from dynvm.jit.backends.triton.plan import RegionPlan, TorchCall, step_frees
from dynvm.jit.ir import SpecializedRegion


@dataclass(frozen=True)
class RegionCode:
    """Everything generated for one region: deterministic for the same inputs."""

    groups: tuple[FusionGroup, ...]
    kernels: tuple[GeneratedKernel, ...]   # distinct kernels, in order of first use
    plan: RegionPlan


def generate_region(spec: SpecializedRegion, constants: Sequence[object],
                    options: TritonOptions = DEFAULT_OPTIONS) -> RegionCode:
    """Partition `spec` (Note [Fusion groups]) and generate a kernel per fused group.
    `constants` are the program's constants, real or meta tensors (only their shapes,
    dtypes and layouts are read)."""
    groups = partition(spec, constants, options)
    facts = Facts(spec, constants)
    kernels: dict[str, GeneratedKernel] = {}
    steps = []
    for group in groups:
        if group.kind == TORCH_GROUP:
            steps += [TorchCall(op.opcode, op.dsts, op.args, op.source_pc, reason)
                      for op, reason in zip(group.ops, group.reasons)]
            continue
        kernel, launch = generate_kernel(group, facts, options)
        kernels.setdefault(kernel.name, kernel)
        steps.append(launch)
    plan = RegionPlan(spec.region_index, spec.live_in, tuple(steps), spec.outputs,
                      spec.dead_live_ins, step_frees(steps, spec.outputs))
    return RegionCode(groups, tuple(kernels.values()), plan)
