"""Triton artifacts for the fleet's GPU targets: what the compile service publishes so
that GPU replicas launch prebuilt kernels (issue 5: "The compile service will do exactly
this for the cluster's GPU targets").

`triton_fields(spec, program, targets)` takes a Specialization the service compiled
(any backend: only its IR is used, `spec.ir`), generates the region's Triton kernels,
compiles them ahead of time for `targets` (no GPU needed; a child process, see
dynvm.jit.backends.triton.aot) and returns the store key and the sealable fields:

* the usual artifact fields (backend "triton", target "cuda:90" or "cuda:80,cuda:90",
  toolchain, kernel name, generated source, guard, notes, compile seconds) that
  `dynvm.cluster.store._signed.seal` checks;
* `metadata`: the program hash, the fusion groups and the operations left to torch (the
  vendor library) with their reasons, and the portable record of the specialization
  (its guard and IR, Note [Portable specializations]);
* `triton_artifact`: the `TritonArtifact` bytes (source, plan, sm_XX binaries, its own
  checksum), which a GPU replica reads with `TritonArtifact.from_bytes` after
  `open_sealed` verified the entry, and installs without compiling (Note [GPU replicas
  in the fleet] in dynvm.cluster.fleet._gpu).

The key is the Triton artifact's one cache key (`artifact_key`: program hash, region,
family key or signature, backend "triton", the targets, toolchain, Triton options), so it
never collides with the CPU record of the same specialization.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dynvm.jit.backends.triton import DEFAULT_TARGETS, TritonOptions, compile_region
from dynvm.jit.backends.triton.artifact import targets_text
from dynvm.jit.backends.triton.options import DEFAULT_OPTIONS
from dynvm.jit.guards import describe
from dynvm.jit.portable import encode
from dynvm.vm.errors import ConfigError


def triton_fields(spec, program, targets: Sequence = DEFAULT_TARGETS,
                  options: TritonOptions = DEFAULT_OPTIONS, jobs: int = 1) -> tuple[str, dict]:
    """(store key, sealable fields) of the Triton artifact of `spec` (a compiled
    `dynvm.jit.region_jit.Specialization` of `program`) for `targets`, e.g.
    [("cuda", 90, 32)]. Raises `TritonBackendError` (`UnsupportedRegion`,
    `AotCompileError`) when the region cannot be built for them."""
    if spec.ir is None:
        raise ValueError("the specialization carries no IR (spec.ir) to build from")
    if not targets:
        raise ConfigError("triton_fields needs at least one target, e.g. ('cuda', 90, 32)")
    family_key = spec.family.key if spec.family is not None else describe(spec.signature)
    start = time.perf_counter()
    artifact = compile_region(spec.ir, program.constants, program_hash=program.content_hash,
                              family_key=family_key, targets=targets, options=options,
                              jobs=jobs)
    seconds = time.perf_counter() - start
    kernels = [k.name for k in artifact.kernels]
    fields = {
        "key": artifact.key, "backend": artifact.backend,
        "target": targets_text(artifact.targets), "toolchain": dict(artifact.toolchain),
        "kernel_name": f"triton_region{artifact.region_index}_{artifact.key[:10]}",
        "source": artifact.source, "guard": spec.strength.value,
        "notes": list(artifact.notes), "compile_seconds": seconds,
        "metadata": {
            "program": program.content_hash, "kernels": kernels,
            "groups": list(artifact.groups),
            "vendor_ops": [{"opcode": s.opcode, "source_pc": s.source_pc, "reason": s.reason}
                           for s in artifact.vendor_ops()],
            "portable": encode(spec.ir, spec.strength, spec.signature, spec.family)},
        "triton_artifact": artifact.to_bytes(),
    }
    return artifact.key, fields
