"""GPU replicas in the fleet: installing the compile service's Triton artifacts from their
stored binaries, with no compile in the replica.

Note [GPU replicas in the fleet]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The compile service compiles each promotion once for the CPU (its portable record, Note
[Portable specializations]) and, with GPU targets configured, builds the region's Triton
kernels for all of them (dynvm.cluster.fleet._triton: sm_80, sm_90, ... binaries in one
artifact, no GPU needed). The Triton entry is sealed with target = the configured
targets' text ("cuda:80,cuda:90"), listed in its own index (`index_key(program, that
text)`) and announced under that text; every GPU replica of the cluster is configured
with the same targets (FleetOptions.gpu_targets), so it opens exactly those entries. CPU
replicas keep reading the "cpu" index: a mixed fleet shares one promotion, and each
replica takes the form that fits its device.

A GPU replica (FleetLink with a CUDA device) installs an entry by

1. verifying it (the HMAC of Note [Signed artifacts], then `TritonArtifact.from_bytes`'s
   checksum and field checks), and checking that the artifact is the one its record
   describes: key, program, region and family (or signature) must agree, and the
   toolchain must be this process's;
2. choosing the binary for its GPU (Note [Stored binaries on other GPUs]) and loading
   every kernel as Triton's launchable object (dynvm.jit.backends.triton.loader), the
   module loaded on the device at once, on the link's thread;
3. installing the plan runner (`run_binary.BinaryRegion`) under the record's guard,
   re-targeted to its device (`dynvm.jit.portable.retarget`), with `Jit.install_loaded`.

When no stored binary fits (an older GPU than every target), or loading fails (the
driver cannot compile the PTX, too little shared memory), the entry is not installed and
the replica compiles its promotions itself, in the background (`compiles_locally()`
answers True from then on). Which way each artifact went is counted (`stats()`:
gpu_cubin, gpu_ptx, gpu_local_compile, gpu_load_failures) and, with telemetry on, is the
`dynvm.gpu_load` attribute of a `dynvm.gpu_install` span (a child of the announcement's
`dynvm.fleet_install`, or on its own at warm start).

Its observations are reported with the CPU as their device (`fleet_signature`): the
service aggregates one shape from every replica, whatever its device, and promotes it
once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from opentelemetry import trace

from dynvm.jit.backends.triton.aot import parse_target, target_text
from dynvm.jit.backends.triton.artifact import targets_text
from dynvm.jit.guards import describe
from dynvm.jit.portable import PortableError, decode, retarget
from dynvm.vm.errors import ConfigError

logger = logging.getLogger(__name__)
TRITON_BACKEND = "triton"


def gpu_fleet_target(targets: Sequence) -> str:
    """The fleet's GPU target text, "cuda:80,cuda:90": the sealed entries' target, the
    index's and the announcements' (the same on the service and every GPU replica)."""
    texts = [target_text(parse_target(t) if isinstance(t, str) else tuple(t))
             for t in targets]
    if not texts:
        raise ConfigError("a GPU fleet target needs at least one target, e.g. ('cuda', 90, 32)")
    return targets_text(texts)


def fleet_signature(encoded: list, device_text: str) -> list:
    """An encoded signature (portable.encode_signature) with every tensor's device set to
    `device_text`, the device the compile service specializes on."""
    return [[*entry[:5], device_text] if entry and entry[0] == "t" else entry
            for entry in encoded]


class GpuInstaller:
    """Installs Triton entries for one CUDA replica (Note [GPU replicas in the fleet])."""

    def __init__(self, runtime, targets: Sequence, boundary) -> None:
        self.jit = runtime.jit
        self.program = runtime.program
        self.boundary = boundary
        self.arch = boundary.arch
        self.target = gpu_fleet_target(targets)
        self.constants = [runtime.interpreter.constant(i)
                          for i in range(len(self.program.constants))]
        self.tracer = runtime.telemetry.tracer if runtime.telemetry is not None else None
        self._loaded: dict = {}      # one loaded object per binary, across artifacts
        self.needs_local_compile = False
        self.load_seconds = 0.0
        self.counters = {"gpu_cubin": 0, "gpu_ptx": 0, "gpu_local_compile": 0,
                         "gpu_load_failures": 0}

    def install(self, key: str, fields: Mapping):
        """Install the opened entry `fields` stored under `key`; the Specialization, or
        None (already installed, region not watched, or compiled locally instead).
        Raises PortableError for an entry that is not what it claims to be."""
        if self.tracer is None:
            return self._install(key, fields)
        with self.tracer.start_as_current_span("dynvm.gpu_install", attributes={
                "dynvm.cache_key": key, "dynvm.gpu_arch": self.arch}):
            return self._install(key, fields)

    def _install(self, key: str, fields: Mapping):
        from dynvm.jit.backends.triton import TritonArtifact, TritonBackendError
        from dynvm.jit.backends.triton.loader import choose_binary, load_kernels
        from dynvm.jit.backends.triton.run_binary import BinaryRegion

        if fields.get("backend") != TRITON_BACKEND:
            raise PortableError(f"backend {fields.get('backend')!r} is not a Triton entry")
        metadata = fields.get("metadata")
        if not isinstance(metadata, dict) or metadata.get("program") != self.program.content_hash:
            raise PortableError("entry belongs to another program")
        portable = decode(metadata.get("portable"), self.program)
        data = fields.get("triton_artifact")
        if not isinstance(data, bytes):
            raise PortableError("entry carries no Triton artifact bytes")
        try:
            artifact = TritonArtifact.from_bytes(data)
            artifact.check_toolchain()
        except TritonBackendError as error:
            raise PortableError(f"Triton artifact: {error}") from None
        self._check_matches(artifact, key, portable)
        start = time.perf_counter()
        choice = choose_binary(artifact, self.arch)
        span = trace.get_current_span()
        if choice.target is None:
            return self._local(key, choice.how, f"no binary for sm_{self.arch} in "
                                                f"{sorted(artifact.binaries)}", span)
        try:
            loaded = load_kernels(artifact, choice, self._loaded)
            runner = BinaryRegion(artifact.plan, loaded, self.constants, self.boundary)
            runner.prepare()
        # The driver raises RuntimeError (a PTX it cannot compile, out of resources).
        except (TritonBackendError, RuntimeError, ValueError) as error:
            self.counters["gpu_load_failures"] += 1
            return self._local(key, "load-failed", f"{type(error).__name__}: {error}", span)
        seconds = time.perf_counter() - start
        self.load_seconds += seconds
        self.counters[f"gpu_{choice.how}"] += 1
        span.set_attribute("dynvm.gpu_load", choice.how)
        how = f"triton-binary ({choice.how} of {choice.target} on sm_{self.arch})"
        kinds = sorted({s.kind for s in artifact.plan.kernels()})
        note = (f"triton ({how}): {len(artifact.plan.kernels())} kernel launches "
                f"({', '.join(kinds)}), loaded from the fleet's artifact, not compiled here")
        vendor = [{"opcode": s.opcode, "source_pc": s.source_pc, "reason": s.reason}
                  for s in artifact.vendor_ops()]
        return self.jit.install_loaded(
            retarget(portable, self.boundary.device), key, runner, backend=TRITON_BACKEND,
            kernel_name=str(fields.get("kernel_name", key[:16])), source=artifact.source,
            notes=(*artifact.notes, note),
            metadata={"runner": how, "gpu_load": choice.how, "kernels": sorted(loaded),
                      "groups": list(artifact.groups), "vendor_ops": vendor,
                      "triton_key": artifact.key},
            load_seconds=seconds)

    def _check_matches(self, artifact, key: str, portable) -> None:
        """The artifact must be the one its record describes (the HMAC binds the entry
        to its key; this binds the binaries inside it to the record's guard)."""
        family_key = (portable.family.key if portable.family is not None
                      else describe(portable.signature))
        problems = [what for what, ok in (
            ("key", artifact.key == key),
            ("program", artifact.program_hash == self.program.content_hash),
            ("region", artifact.region_index == portable.region),
            ("family or signature", artifact.family_key == family_key)) if not ok]
        if problems:
            raise PortableError(f"Triton artifact {artifact.key[:12]} does not match its "
                                f"record ({', '.join(problems)} differ)")

    def _local(self, key: str, how: str, why: str, span):
        self.needs_local_compile = True
        self.counters["gpu_local_compile"] += 1
        span.set_attribute("dynvm.gpu_load", how)
        logger.warning("Triton artifact %s not loaded on sm_%d (%s): compiling locally",
                       key[:16], self.arch, why)
        return None

    def stats(self) -> dict:
        return {**self.counters, "gpu_arch": self.arch, "gpu_target": self.target,
                "gpu_load_seconds": self.load_seconds,
                "gpu_compiles_locally": self.needs_local_compile}
