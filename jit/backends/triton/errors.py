"""Errors of the Triton backend. Each names the input, what was expected and what came."""

from __future__ import annotations

from dynvm.vm.errors import DynvmError


class TritonBackendError(DynvmError):
    """Base class of the Triton backend's errors."""


class UnsupportedRegion(TritonBackendError):
    """The specialized region cannot be planned by this backend (the JIT keeps the CPU
    backend or the interpreter for it)."""


class ArtifactFormatError(TritonBackendError):
    """Artifact bytes that are not a valid Triton artifact: wrong magic, version,
    checksum, or a missing or mistyped field (the message names it)."""


class ArtifactTargetError(TritonBackendError):
    """An artifact holds no binary for the requested target, or was built by another
    toolchain."""


class LaunchError(TritonBackendError):
    """A kernel's inputs do not fit what it was compiled for (a static dim differs, a
    shape is inconsistent, a size overflows its 32-bit index). Like a guard failure,
    the region falls back to the interpreter for that call."""


class InterpreterUnavailable(TritonBackendError):
    """Triton was imported without TRITON_INTERPRET=1, so its language library (tl.sum,
    tl.cdiv, ...) was built for compiling and cannot run in the interpreter."""
