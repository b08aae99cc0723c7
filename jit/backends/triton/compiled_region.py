"""A specialized region as the JIT runs it with the Triton backend: generated kernels
plus torch calls behind one `fn(regs)`, and what the JIT's artifact records about them.

`build_specialization` raises a `TritonBackendError` when this backend cannot take the
region (`UnsupportedRegion`: nothing fuses, a register written twice, a device that is
neither CUDA nor CPU; `InterpreterUnavailable` on a CPU whose Triton was imported without
TRITON_INTERPRET=1); the engine then compiles that specialization with the CPU backend
and keeps the reason as a note. On CUDA the kernels run through Triton's JIT, compiled
here, before the specialization is installed (`run_cuda`); on a CPU, through Triton's
interpreter (`run_interpreted`: slow, for tests on machines without a GPU).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dynvm.jit.backends.triton.artifact import build_artifact
from dynvm.jit.backends.triton.codegen import generate_region
from dynvm.jit.backends.triton.errors import UnsupportedRegion
from dynvm.jit.backends.triton.options import DEFAULT_OPTIONS, TritonOptions
from dynvm.jit.ir import SpecializedRegion


@dataclass(frozen=True)
class TritonSpecialization:
    """What the Triton backend gives the engine for one region: the function that
    runs it on a register file, plus its name, sources, notes and metadata."""

    fn: Callable[[list], None]
    kernel_name: str
    """The region's name in diagnostics (its kernels are listed in `metadata`)."""
    source: str
    """Every generated kernel's source."""
    notes: tuple[str, ...]
    metadata: dict
    """runner, kernels, groups (per fusion group: kind, opcodes, source pcs, kernel or
    why torch runs it), vendor_ops (operations run by torch, the vendor library, with
    the reason) and the Triton artifact's own key."""


def build_specialization(ir: SpecializedRegion, constants: Sequence[torch.Tensor],
                         device: torch.device, *, program_hash: str, family_key: str,
                         options: TritonOptions = DEFAULT_OPTIONS) -> TritonSpecialization:
    """Generate, compile and wrap the Triton code of `ir` for `device` (CUDA, or
    interpreted on a CPU); UnsupportedRegion when nothing of it fuses into a kernel."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise UnsupportedRegion(f"region {ir.region_index}: the Triton backend runs on "
                                f"CUDA (or interpreted on a CPU), not on {device}")
    code = generate_region(ir, constants, options)
    if not code.kernels:
        reasons = sorted({s.reason for s in code.plan.vendor_calls()})
        raise UnsupportedRegion(f"region {ir.region_index}: no operation fuses into a "
                                f"Triton kernel ({'; '.join(reasons[:3]) or 'no ops'})")
    if device.type == "cuda":
        from dynvm.jit.backends.triton.run_cuda import CudaRegion

        runner = CudaRegion(code.plan, code.kernels, constants, device, options)
        runner.warm_up()
        how = "triton-jit"
    else:
        from dynvm.jit.backends.triton.run_interpreted import InterpretedRegion

        runner = InterpretedRegion(code.plan, code.kernels, constants)
        how = "triton-interpreter"
    artifact = build_artifact(code, program_hash=program_hash, family_key=family_key,
                              binaries={}, options=options, notes=ir.notes)
    vendor = [{"opcode": s.opcode, "source_pc": s.source_pc, "reason": s.reason}
              for s in code.plan.vendor_calls()]
    kinds = {}
    for step in code.plan.kernels():
        kinds[step.kind] = kinds.get(step.kind, 0) + 1
    launched = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    note = (f"triton ({how}): {len(code.plan.kernels())} kernel launches ({launched}), "
            f"{len(vendor)} ops in torch (vendor library)")
    digest = hashlib.sha256(artifact.source.encode()).hexdigest()[:10]
    return TritonSpecialization(
        fn=runner, kernel_name=f"triton_region{ir.region_index}_{digest}",
        source=artifact.source, notes=(*ir.notes, note),
        metadata={"runner": how, "kernels": [k.name for k in code.kernels],
                  "groups": list(artifact.groups), "vendor_ops": vendor,
                  "triton_key": artifact.key})
