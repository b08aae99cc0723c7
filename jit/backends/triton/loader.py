"""Loading an artifact's stored binaries as Triton's launchable kernel objects, without
ever running Triton's compiler (the plan of Note [Launching binaries] in
dynvm.jit.backends.triton.aot, built).

    choice = choose_binary(artifact, arch=90)          # cubin, PTX through the driver, or none
    kernels = load_kernels(artifact, choice)           # name -> LoadedKernel (no compile)
    kernels[name].args(tensors, outputs, prepared)     # the launcher's argument list

Note [Stored binaries on other GPUs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The compile service builds binaries for the cluster's configured targets (sm_80, sm_90,
...). A replica picks, per artifact:

1. "cubin": the binary built for its own architecture, loaded as is;
2. "ptx": when none was, the PTX of the newest configured architecture older than its
   own, handed to the driver (`cuModuleLoadData` accepts PTX and compiles it for the
   device it runs on, once, at load). Only PTX for a plain `sm_XX` qualifies: Triton
   builds Hopper kernels for `sm_90a`, whose arch-specific features no other GPU has, so
   that PTX is not forward compatible and is never offered to another architecture;
3. none: nothing stored fits (an older GPU than every target): the replica compiles the
   region itself in the background (its local JIT), as a replica without a fleet would.

The choice is made once per artifact, at install, off the request path, and reported
(`BinaryChoice.how`) in stats and spans. Loading (`cuModuleLoadData`, the PTX JIT
included) is forced at install too (`run_binary.CudaBoundary.prepare`), so its cost and
its failures never reach a request.

How the object is built: Triton's `CompiledKernel(src, metadata_group, hash)` reads the
metadata JSON and the binary from files named `<entry>.json` and `<entry>.cubin`; they
are written from the artifact into a private temporary folder, read, and removed. `src`
gives Triton's launcher what it reads from a kernel's source object: the parameter
names, their types ("constexpr" for compile-time ones, which the launcher skips) and the
constexpr values. Nothing here imports Triton's compiler stages or a JIT function; a
test replaces `triton.compile` and the CUDA backend's stages with functions that raise
and loads every kernel kind.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dynvm.jit.backends.triton.aot import CompiledBinary
from dynvm.jit.backends.triton.artifact import TritonArtifact
from dynvm.jit.backends.triton.errors import ArtifactTargetError, LaunchError
from dynvm.jit.backends.triton.kernels import GeneratedKernel
from dynvm.jit.backends.triton.launch import PreparedLaunch

CUBIN, PTX = "cubin", "ptx"
_PTX_TARGET = re.compile(r"^\s*\.target\s+sm_(\d+)([a-z]?)", re.MULTILINE)


@dataclass(frozen=True)
class BinaryChoice:
    """Which stored binaries a device of `arch` launches (Note [Stored binaries on
    other GPUs]); `target` None means none fits and the replica compiles locally."""

    arch: int
    target: str | None
    how: str
    """"cubin", "ptx" (the driver compiles `target`'s PTX) or "local-compile"."""


def _arch(target: str) -> int:
    return int(target.partition(":")[2])


def portable_ptx(ptx: str) -> bool:
    """Whether PTX may be compiled by the driver for a newer GPU: its `.target` is a
    plain sm_XX (not an arch-specific sm_XXa)."""
    match = _PTX_TARGET.search(ptx)
    return match is not None and match.group(2) == ""


def choose_binary(artifact: TritonArtifact, arch: int) -> BinaryChoice:
    """The binaries a device of compute capability `arch` (90 for 9.0) launches."""
    own = f"cuda:{arch}"
    if own in artifact.binaries:
        return BinaryChoice(arch, own, CUBIN)
    older = sorted((t for t in artifact.binaries
                    if t.startswith("cuda:") and _arch(t) < arch), key=_arch, reverse=True)
    for target in older:
        if all(portable_ptx(b.ptx) for b in artifact.binaries[target].values()):
            return BinaryChoice(arch, target, PTX)
    return BinaryChoice(arch, None, "local-compile")


class _LaunchSource:
    """What Triton's launcher reads from a kernel's source object: parameter names, their
    types and the constexpr values (by parameter index, as Triton keys them)."""

    def __init__(self, kernel: GeneratedKernel) -> None:
        self.name = kernel.name
        self.fn = _Names(kernel.arg_names)
        self.signature = dict(kernel.signature)
        self.constants = {(kernel.arg_names.index(name),): value
                          for name, value in kernel.constexprs.items()}
        self.attrs = {}


@dataclass(frozen=True)
class _Names:
    arg_names: tuple[str, ...]


@dataclass
class LoadedKernel:
    """One kernel ready to launch: Triton's CompiledKernel over the stored binary."""

    kernel: GeneratedKernel
    compiled: object          # triton.compiler.CompiledKernel
    binary: CompiledBinary
    how: str

    def args(self, tensors: Sequence, outputs: Sequence,
             prepared: PreparedLaunch) -> tuple:
        """Every parameter in the kernel's order (input and output pointers, runtime dims,
        constexprs): what the launcher takes; it skips the constexprs."""
        k = self.kernel
        positional = (*tensors, *outputs, *prepared.runtime_args)
        rest = k.arg_names[len(positional):]
        if any(k.signature[n] == "constexpr" for n in k.arg_names[:len(positional)]) or \
                any(k.signature[n] != "constexpr" for n in rest):
            raise LaunchError(f"{k.name}: {len(positional)} runtime arguments for the "
                              f"parameters {k.arg_names}")
        try:
            constexprs = tuple(prepared.constexprs[n] for n in rest)
        except KeyError as missing:
            raise LaunchError(f"{k.name}: no value for constexpr {missing}") from None
        for name, value in zip(rest, constexprs):
            if k.constexprs.get(name, value) != value:
                raise LaunchError(f"{k.name}: {name} is {value}, the binary was built for "
                                  f"{k.constexprs[name]}")
        return (*positional, *constexprs)


def load_kernel(kernel: GeneratedKernel, binary: CompiledBinary, how: str) -> LoadedKernel:
    """Triton's launchable object for `binary` (no compile; nothing touches a GPU until
    its first launch, or `run_binary.CudaBoundary.prepare`)."""
    from triton.compiler import CompiledKernel

    if binary.kernel != kernel.name:
        raise ArtifactTargetError(f"binary of {binary.kernel!r} offered for kernel "
                                  f"{kernel.name!r}")
    if binary.binary_ext != CUBIN:
        raise ArtifactTargetError(f"{kernel.name}: {binary.binary_ext} binaries are not "
                                  "loadable here (CUDA cubins only)")
    # cuModuleLoadData takes PTX text as the image too (null-terminated): the driver
    # compiles it for the current device when the module is loaded.
    image = binary.binary if how == CUBIN else binary.ptx.encode() + b"\0"
    with tempfile.TemporaryDirectory(prefix="dynvm-triton-load-") as folder:
        files = {f"{binary.entry}.json": binary.metadata_json.encode(),
                 f"{binary.entry}.{CUBIN}": image}
        group = {}
        for name, data in files.items():
            path = Path(folder) / name
            path.write_bytes(data)
            group[name] = str(path)
        compiled = CompiledKernel(_LaunchSource(kernel), group, binary.triton_hash)
    # Scratch would be allocated per launch through Triton's process-wide allocator,
    # which dynvm does not set; the generated kernels need none (no TMA, no profiling),
    # so a binary that does is refused here rather than failing on a request.
    scratch = getattr(compiled.metadata, "global_scratch_size", 0) or 0
    if scratch or (getattr(compiled.metadata, "profile_scratch_size", 0) or 0):
        raise ArtifactTargetError(f"{kernel.name}: the binary needs global scratch memory "
                                  f"({scratch} bytes per program), which dynvm does not "
                                  "allocate")
    if compiled.name != binary.entry:
        raise ArtifactTargetError(f"{kernel.name}: metadata names entry {compiled.name!r}, "
                                  f"the artifact {binary.entry!r}")
    return LoadedKernel(kernel, compiled, binary, how)


def load_kernels(artifact: TritonArtifact, choice: BinaryChoice,
                 cache: dict | None = None) -> dict[str, LoadedKernel]:
    """Every kernel the artifact's plan launches, loaded from `choice.target`'s binaries.
    `cache` (kept by the caller across artifacts) shares one loaded object per binary:
    the same layer norm in several regions' artifacts is one module on the device."""
    if choice.target is None:
        raise ArtifactTargetError(f"artifact {artifact.key[:12]} has no binary an sm_"
                                  f"{choice.arch} GPU can load (targets "
                                  f"{sorted(artifact.binaries)})")
    by_name = {k.name: k for k in artifact.kernels}
    needed = sorted({step.kernel for step in artifact.plan.kernels()})
    loaded = {}
    for name in needed:
        binary = artifact.binary(choice.target, name)
        key = (binary.triton_hash, binary.entry, choice.how,
               hashlib.sha256(binary.binary).hexdigest())
        kernel = cache.get(key) if cache is not None else None
        if kernel is None or kernel.kernel != by_name[name]:
            kernel = load_kernel(by_name[name], binary, choice.how)
            if cache is not None:
                cache[key] = kernel
        loaded[name] = kernel
    return loaded
