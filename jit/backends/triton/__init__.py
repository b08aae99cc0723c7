"""The Triton backend: a specialized region as fused Triton kernels plus torch calls.

    code = generate_region(spec, constants)                # groups, kernels, plan
    artifact = compile_region(spec, constants, program_hash=..., family_key=...,
                              targets=[("cuda", 90, 32)])  # + sm_90 binaries, no GPU
    TritonArtifact.from_bytes(artifact.to_bytes())         # msgpack, validated
    InterpretedRegion(code.plan, code.kernels, constants)(regs)   # CPU, TRITON_INTERPRET=1

Pipeline: `partition` (Note [Fusion groups]) -> `kernels` (readable @triton.jit source,
Note [Block sizes]) -> `plan` (launch steps as data) -> `aot` (binaries per target in a
child process, Note [Launching binaries]) -> `artifact` (msgpack, one cache key).
fp32 only for now. The JIT uses this backend with JitConfig(backend="triton"|"auto")
through `specialization.build_specialization`: Triton's JIT on CUDA (`run_cuda`), the
interpreter on a CPU (`run_interpreted`); `launch.PlanRunner` is the part every runner
shares. A GPU replica of the fleet launches an artifact's stored binaries without
Triton's compiler: `loader` builds Triton's kernel objects from them, `run_binary` runs
the plan with them (Note [Launching binaries]).
"""

from __future__ import annotations

from collections.abc import Sequence

from dynvm.jit.backends.triton.aot import (
    DEFAULT_TARGETS,
    AotCompileError,
    CompiledBinary,
    build_binaries,
)
from dynvm.jit.backends.triton.artifact import TritonArtifact, artifact_key, build_artifact
from dynvm.jit.backends.triton.codegen import RegionCode, generate_region
from dynvm.jit.backends.triton.errors import (
    ArtifactFormatError,
    ArtifactTargetError,
    InterpreterUnavailable,
    LaunchError,
    TritonBackendError,
    UnsupportedRegion,
)
from dynvm.jit.backends.triton.kernels import GeneratedKernel
from dynvm.jit.backends.triton.options import DEFAULT_OPTIONS, TritonOptions
from dynvm.jit.backends.triton.partition import FusionGroup, partition
from dynvm.jit.backends.triton.plan import KernelLaunch, RegionPlan, TorchCall
from dynvm.jit.ir import SpecializedRegion


def compile_region(spec: SpecializedRegion, constants: Sequence[object], *,
                   program_hash: str, family_key: str,
                   targets: Sequence = DEFAULT_TARGETS,
                   options: TritonOptions = DEFAULT_OPTIONS, toolchain: dict | None = None,
                   jobs: int = 1) -> TritonArtifact:
    """Generate the region's kernels and compile them for `targets` (no GPU needed;
    an empty `targets` keeps source only). `family_key` is the Family's key, or for an
    exact specialization the signature's text."""
    code = generate_region(spec, constants, options)
    binaries = build_binaries(code.kernels, targets, options, jobs) if targets else {}
    return build_artifact(code, program_hash=program_hash, family_key=family_key,
                          binaries=binaries, options=options, toolchain=toolchain,
                          notes=spec.notes)


__all__ = [
    "DEFAULT_TARGETS", "AotCompileError", "ArtifactFormatError", "ArtifactTargetError",
    "CompiledBinary", "FusionGroup", "GeneratedKernel", "InterpreterUnavailable",
    "KernelLaunch", "LaunchError",
    "RegionCode", "RegionPlan", "TorchCall", "TritonArtifact", "TritonBackendError",
    "TritonOptions", "UnsupportedRegion", "artifact_key", "build_artifact",
    "build_binaries", "compile_region", "generate_region", "partition",
]
