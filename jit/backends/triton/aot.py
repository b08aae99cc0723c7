"""Ahead-of-time binaries: generated kernels compiled for named GPU targets, on any
machine (no GPU needed), by `triton.compile(ASTSource(...), target=GPUTarget(...))`.

Compiles run in a child process (`_aot_worker.py`, which imports only triton and
msgpack): its Triton is never in interpreter mode nor patched by the interpreter (a
process that has interpreted kernels cannot compile them; see Note [Loading generated
kernels]), a compiler crash cannot take the caller down, and `jobs` children compile in
parallel.

Note [Launching binaries]
~~~~~~~~~~~~~~~~~~~~~~~~~
What a GPU process needs to launch a kernel is all in the artifact, so it never runs
Triton's compiler: the cubin, the metadata JSON Triton wrote next to it (name, num_warps,
shared memory, scratch sizes, target, ...), the parameter order and types (`arg_names`,
`signature`, `constexprs` of the kernel) and, per call, the grid and arguments from
`dynvm.jit.backends.triton.launch.prepare_launch`. The loader
(dynvm.jit.backends.triton.loader, run by run_binary.BinaryRegion; which binary a GPU
takes: Note [Stored binaries on other GPUs])

1. writes `<entry>.json` and `<entry>.cubin` from the artifact into a private directory
   and builds `triton.compiler.CompiledKernel(src, metadata_group, hash)` over them, `src`
   being a small object with the kernel's `signature` and `constants` (what Triton's
   launcher reads); or call `triton.runtime.driver.active.utils.load_binary(entry,
   cubin, shared, device)` directly for the CUfunction;
2. launches with `compiled[grid](*pointers, *runtime_dims)` or, lower down,
   `compiled.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, None,
   None, *args)` on the caller's stream (binaries that need global scratch are refused).

Triton's launcher stub is host C code built once per signature; the kernel itself is the
stored cubin (or, for a newer GPU, its PTX through the driver's JIT).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack

from dynvm._env import child_environment
from dynvm.jit.backends.triton.errors import TritonBackendError
from dynvm.jit.backends.triton.kernels import GeneratedKernel
from dynvm.jit.backends.triton.options import DEFAULT_OPTIONS, TritonOptions
from dynvm.vm.errors import ConfigError

WORKER = Path(__file__).with_name("_aot_worker.py")
DEFAULT_TARGETS = (("cuda", 90, 32),)


class AotCompileError(TritonBackendError):
    """Triton failed to compile a generated kernel for a target."""


@dataclass(frozen=True)
class CompiledBinary:
    """One kernel compiled for one target: everything needed to launch it."""

    kernel: str
    target: str            # "cuda:90"
    entry: str             # the symbol in the binary (Triton's metadata name)
    binary_ext: str        # "cubin"
    binary: bytes
    ptx: str
    metadata_json: str     # Triton's metadata file, as written next to the binary
    num_warps: int
    num_stages: int
    shared: int            # bytes of shared memory per program
    triton_hash: str
    compile_seconds: float


def target_text(target: Sequence) -> str:
    """A (backend, arch, ...) target as its text form, `cuda:90`."""
    backend, arch = target[0], target[1]
    return f"{backend}:{arch}"


def parse_target(text: str) -> tuple[str, int, int]:
    """"cuda:90" -> ("cuda", 90, 32)."""
    backend, _, arch = text.partition(":")
    if backend != "cuda" or not arch.isdigit():
        raise ConfigError(f"target must look like 'cuda:90', got {text!r}")
    return backend, int(arch), 32


def build_binaries(kernels: Iterable[GeneratedKernel],
                   targets: Sequence[Sequence] = DEFAULT_TARGETS,
                   options: TritonOptions = DEFAULT_OPTIONS, jobs: int = 1,
                   timeout: float = 900.0) -> dict[str, dict[str, CompiledBinary]]:
    """target text -> kernel name -> binary, for every kernel and target.

    `targets` are (backend, arch, warp_size) like ("cuda", 90, 32) or texts like
    "cuda:80". No GPU is needed. Raises AotCompileError with Triton's message."""
    kernels = list(kernels)
    targets = [parse_target(t) if isinstance(t, str) else tuple(t) for t in targets]
    payloads = [{"name": k.name, "source": k.source, "signature": k.signature,
                 "constexprs": k.constexprs, "num_warps": k.num_warps,
                 "num_stages": k.num_stages} for k in kernels]
    chunks = [payloads[i::max(1, jobs)] for i in range(max(1, jobs))]
    env = child_environment(without=("TRITON_INTERPRET",), extra={
        "TRITON_DEFAULT_FP_FUSION": "1" if options.fp_fusion else "0"})
    children = []
    for chunk in filter(None, chunks):
        request = msgpack.packb({"kernels": chunk, "targets": [list(t) for t in targets],
                                 "options": {"fp_fusion": options.fp_fusion}},
                                use_bin_type=True)
        child = subprocess.Popen([sys.executable, "-P", str(WORKER)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env)
        children.append((child, request))
    results: dict[str, dict[str, CompiledBinary]] = {target_text(t): {} for t in targets}
    for child, request in children:
        try:
            out, err = child.communicate(request, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            child.kill()
            child.communicate()
            raise AotCompileError(f"Triton compile did not finish in {timeout} s") from exc
        if child.returncode != 0 or not out:
            raise AotCompileError(f"Triton compile worker exited with {child.returncode}: "
                                  f"{err.decode(errors='replace')[-2000:]}")
        reply = msgpack.unpackb(out, raw=False)
        if "error" in reply:
            raise AotCompileError(reply["error"])
        for item in reply["binaries"]:
            binary = CompiledBinary(item["name"], item["target"], item["entry"],
                                    item["binary_ext"], item["binary"], item["ptx"],
                                    item["metadata_json"], item["num_warps"],
                                    item["num_stages"], item["shared"], item["triton_hash"],
                                    item["compile_seconds"])
            results[binary.target][binary.kernel] = binary
    return results
