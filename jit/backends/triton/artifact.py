"""The Triton artifact: generated source, binaries per target, launch plan, one key.

Bytes are msgpack (never pickle): an envelope {"format", "version", "sha256", "body"},
the body a map of plain fields. `from_bytes` checks the envelope, the checksum, and
every field's presence and type before building anything, and raises
`ArtifactFormatError` naming the first bad field. Signing (who may publish an artifact)
is the kernel store's job; this format only makes corruption and version skew
detectable. The key is `dynvm.jit.artifact.cache_key` with backend "triton" and as
target the artifact's targets ("cuda:90", or "cuda:80,cuda:90" for several).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgpack

from dynvm.jit.artifact import cache_key, toolchain_versions
from dynvm.jit.backends.triton.aot import CompiledBinary
from dynvm.jit.backends.triton.codegen import RegionCode
from dynvm.jit.backends.triton.errors import ArtifactFormatError, ArtifactTargetError
from dynvm.jit.backends.triton.kernels import GeneratedKernel
from dynvm.jit.backends.triton.options import TritonOptions
from dynvm.jit.backends.triton.plan import (
    RegionPlan,
    TorchCall,
    check_launch,
    decode_plan,
    encode_plan,
    need,
)

FORMAT = "dynvm-triton-artifact"
VERSION = 1
BACKEND = "triton"


def targets_text(targets) -> str:
    """The key's target field: the sorted targets, comma-separated ("none" if none)."""
    return ",".join(sorted(targets)) or "none"


def artifact_key(program_hash: str, region_index: int, family_key: str, targets,
                 options: TritonOptions, toolchain: dict | None = None) -> str:
    """The one cache key of a Triton artifact (see dynvm.jit.artifact.cache_key)."""
    return cache_key(program_hash, region_index, family_key, BACKEND, targets_text(targets),
                     options.as_key(), toolchain)


@dataclass(frozen=True)
class TritonArtifact:
    """A compiled Triton region as the store keeps it: its key and what went into
    it, the generated kernels, the launch plan, the fusion groups and the target binaries."""

    key: str
    program_hash: str
    region_index: int
    family_key: str
    targets: tuple[str, ...]
    toolchain: dict
    options: dict
    kernels: tuple[GeneratedKernel, ...]
    plan: RegionPlan
    groups: tuple[dict, ...]
    """Per fusion group: kind, opcodes, source pcs, kernel name or why torch runs it."""
    binaries: dict = field(default_factory=dict)
    """target text -> kernel name -> CompiledBinary."""
    notes: tuple[str, ...] = ()
    backend: str = BACKEND

    @property
    def source(self) -> str:
        """Every kernel's source, as `dynvm explain` shows it."""
        return "\n\n".join(k.source for k in self.kernels)

    def vendor_ops(self) -> tuple[TorchCall, ...]:
        """Operations that run as torch calls (vendor library), with the reason."""
        return self.plan.vendor_calls()

    def binary(self, target: str, kernel: str) -> CompiledBinary:
        per_target = self.binaries.get(target)
        if per_target is None:
            raise ArtifactTargetError(f"artifact {self.key[:12]} has no binaries for target "
                                      f"{target!r}; it has {sorted(self.binaries)}")
        if kernel not in per_target:
            raise ArtifactTargetError(f"artifact {self.key[:12]} has no {target} binary for "
                                      f"kernel {kernel!r}")
        return per_target[kernel]

    def check_toolchain(self, toolchain: dict | None = None) -> None:
        """Refuse an artifact built by another Triton or torch than this process's."""
        current = toolchain if toolchain is not None else toolchain_versions()
        for name in ("triton", "torch"):
            if self.toolchain.get(name) != current.get(name):
                raise ArtifactTargetError(f"artifact {self.key[:12]} was built with {name} "
                                          f"{self.toolchain.get(name)}, this process has "
                                          f"{current.get(name)}")

    # -- bytes -------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        body = {
            "key": self.key, "backend": self.backend, "program_hash": self.program_hash,
            "region_index": self.region_index, "family_key": self.family_key,
            "targets": list(self.targets), "toolchain": dict(self.toolchain),
            "options": dict(self.options),
            "kernels": [_encode_kernel(k) for k in self.kernels],
            "plan": encode_plan(self.plan), "groups": list(self.groups),
            "binaries": {target: {name: _encode_binary(b) for name, b in per.items()}
                         for target, per in self.binaries.items()},
            "notes": list(self.notes),
        }
        packed = msgpack.packb(body, use_bin_type=True)
        return msgpack.packb({"format": FORMAT, "version": VERSION,
                              "sha256": hashlib.sha256(packed).hexdigest(), "body": packed},
                             use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> TritonArtifact:
        envelope = _unpack(data, "envelope")
        if need(envelope, "envelope", "format", str) != FORMAT:
            raise ArtifactFormatError(f"envelope.format: expected {FORMAT!r}, got "
                                      f"{envelope['format']!r}")
        version = need(envelope, "envelope", "version", int)
        if version != VERSION:
            raise ArtifactFormatError(f"envelope.version: this dynvm reads version {VERSION}, "
                                      f"the artifact is version {version}")
        packed = need(envelope, "envelope", "body", bytes)
        digest = need(envelope, "envelope", "sha256", str)
        if hashlib.sha256(packed).hexdigest() != digest:
            raise ArtifactFormatError("envelope.sha256: checksum mismatch (corrupt body)")
        body = _unpack(packed, "body")
        if need(body, "body", "backend", str) != BACKEND:
            raise ArtifactFormatError(f"body.backend: expected {BACKEND!r}, got "
                                      f"{body['backend']!r}")
        kernels = tuple(_decode_kernel(k) for k in need(body, "body", "kernels", list))
        plan = decode_plan(need(body, "body", "plan", dict))
        by_name = {k.name: k for k in kernels}
        names = set(by_name)
        missing = {s.kernel for s in plan.kernels()} - names
        if missing:
            raise ArtifactFormatError(f"body.plan: launches kernels with no source: "
                                      f"{sorted(missing)}")
        for step in plan.kernels():
            kernel = by_name[step.kernel]
            check_launch(step, kernel.arg_names, kernel.constexprs)
        groups = need(body, "body", "groups", list)
        if not all(isinstance(g, dict) for g in groups):
            raise ArtifactFormatError("body.groups: expected a list of maps")
        binaries = {}
        for target, per in need(body, "body", "binaries", dict).items():
            if not isinstance(target, str) or not isinstance(per, dict):
                raise ArtifactFormatError(f"body.binaries: malformed entry for {target!r}")
            binaries[target] = {name: _decode_binary(b, f"binaries[{target}][{name}]")
                                for name, b in per.items()}
            unknown = set(binaries[target]) - names
            if unknown:
                raise ArtifactFormatError(f"body.binaries[{target}]: binaries for unknown "
                                          f"kernels {sorted(unknown)}")
        return cls(
            key=need(body, "body", "key", str),
            program_hash=need(body, "body", "program_hash", str),
            region_index=need(body, "body", "region_index", int),
            family_key=need(body, "body", "family_key", str),
            targets=tuple(_strings(need(body, "body", "targets", list), "body.targets")),
            toolchain=need(body, "body", "toolchain", dict),
            options=need(body, "body", "options", dict),
            kernels=kernels, plan=plan,
            groups=tuple(groups),
            binaries=binaries,
            notes=tuple(_strings(need(body, "body", "notes", list), "body.notes")))


def build_artifact(code: RegionCode, *, program_hash: str, family_key: str,
                   binaries: dict, options: TritonOptions,
                   toolchain: dict | None = None, notes=()) -> TritonArtifact:
    """The TritonArtifact of generated `code` with its `binaries` (per target),
    keyed by everything that affects them."""
    toolchain = toolchain if toolchain is not None else toolchain_versions()
    targets = tuple(sorted(binaries))
    key = artifact_key(program_hash, code.plan.region_index, family_key, targets, options,
                       toolchain)
    launches = iter(code.plan.kernels())
    groups = []
    for group in code.groups:
        entry = {"kind": group.kind, "opcodes": [op.opcode for op in group.ops],
                 "source_pcs": [op.source_pc for op in group.ops]}
        if group.kind == "torch":
            entry["reasons"] = list(group.reasons)
        else:
            entry["kernel"] = next(launches).kernel
            entry["stores"] = list(group.stores)
        groups.append(entry)
    return TritonArtifact(key, program_hash, code.plan.region_index, family_key, targets,
                          dict(toolchain), options.as_key(), code.kernels, code.plan,
                          tuple(groups), binaries, tuple(notes))


# -- fields ------------------------------------------------------------------------------


def _encode_kernel(k: GeneratedKernel) -> dict:
    return {"name": k.name, "kind": k.kind, "source": k.source,
            "arg_names": list(k.arg_names), "signature": dict(k.signature),
            "constexprs": dict(k.constexprs), "num_warps": k.num_warps,
            "num_stages": k.num_stages}


def _decode_kernel(data) -> GeneratedKernel:
    where = "kernel"
    name = need(data, where, "name", str)
    where = f"kernel {name}"
    signature = need(data, where, "signature", dict)
    arg_names = tuple(_strings(need(data, where, "arg_names", list), f"{where}.arg_names"))
    if list(signature) != list(arg_names) or not all(
            isinstance(t, str) for t in signature.values()):
        raise ArtifactFormatError(f"{where}.signature: does not match arg_names")
    constexprs = need(data, where, "constexprs", dict)
    if not all(isinstance(v, int) and signature.get(k) == "constexpr"
               for k, v in constexprs.items()):
        raise ArtifactFormatError(f"{where}.constexprs: not ints of constexpr parameters")
    return GeneratedKernel(name, need(data, where, "kind", str),
                           need(data, where, "source", str), arg_names, signature,
                           constexprs, need(data, where, "num_warps", int),
                           need(data, where, "num_stages", int))


def _encode_binary(b: CompiledBinary) -> dict:
    return {"kernel": b.kernel, "target": b.target, "entry": b.entry,
            "binary_ext": b.binary_ext, "binary": b.binary, "ptx": b.ptx,
            "metadata_json": b.metadata_json, "num_warps": b.num_warps,
            "num_stages": b.num_stages, "shared": b.shared, "triton_hash": b.triton_hash,
            "compile_seconds": b.compile_seconds}


def _decode_binary(data, where: str) -> CompiledBinary:
    return CompiledBinary(
        need(data, where, "kernel", str), need(data, where, "target", str),
        need(data, where, "entry", str), need(data, where, "binary_ext", str),
        need(data, where, "binary", bytes), need(data, where, "ptx", str),
        need(data, where, "metadata_json", str), need(data, where, "num_warps", int),
        need(data, where, "num_stages", int), need(data, where, "shared", int),
        need(data, where, "triton_hash", str), need(data, where, "compile_seconds", float))


def _unpack(data, where: str) -> dict:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ArtifactFormatError(f"{where}: expected bytes, got {type(data).__name__}")
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ArtifactFormatError(f"{where}: not msgpack ({type(exc).__name__}: {exc})") \
            from exc
    if not isinstance(value, dict):
        raise ArtifactFormatError(f"{where}: expected a map, got {type(value).__name__}")
    return value


def _strings(values: list, where: str) -> list[str]:
    if not all(isinstance(v, str) for v in values):
        raise ArtifactFormatError(f"{where}: expected strings, got {values!r}")
    return values
