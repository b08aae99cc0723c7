"""A GEMM of a few rows over a dense fp32 weight, in a small C library of dynvm's own.

Note [A small-M GEMM of our own]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At 2 to 16 rows (a decode step at batch 2..16, an encoder call at batch 1 x a short
sequence) a GEMM reads each weight byte once and uses it a few times: it is bound by how
fast the weight streams from memory, not by arithmetic. Measured with
`python -m bench.small_m_stream --native` over BERT-base's 24 weights (113 MB) in a chain
(2026-12-05 11:55, load 0.6, two threads): every path torch exposes moved the weights at
35-55% of what a plain reduction streams (33 GB/s), oneDNN on its packed weight the best
of them (M=4 8.42 ms, M=8 10.17, M=16 11.08); a plain AVX-512 loop over the dense weight
took 6.96 / 7.74 / 9.83 ms (1.21 / 1.31 / 1.13x faster), and at one thread, M=2, 8.63
against oneDNN's 9.97 and MKL's 9.35. The loop keeps a block of outputs in registers and
reads each weight row once, splitting the output columns across torch's own OpenMP team.

It also holds no copy of the weight: oneDNN's packed weight is a second copy of every
weight it serves (189.8 MiB for the bench Llama at batch 4, Note [A generator's resident
memory] in dynvm._generate_memory), which this kernel reads where the program keeps it,
in either layout the program stores (torch's [N, K] or input-major [K, N], Note [LM head
stored input-major]). And it releases the GIL for its whole call (ctypes does), where a
oneDNN call holds it (Note [oneDNN holds the GIL]).

The CPU backend calls it where the rows are the same at every probe, 2..16 of them, over
weights that stream (Note [Few rows over a streamed weight] in streamed_gemv), with a
residual add folded in when that is the GEMM's only consumer. At one row the GEMV itself
is as fast as MKL's (the bench Llama's 16 layer weights cycled: 7.14 vs 7.25 ms, its
input-major head 5.85 vs 5.73; 2026-12-05 12:26, load 2.6), so one row over a weight
stored [N, K] comes here too, for the residual adds it folds in: the B=1 decode step
0.957x (14.64 vs 15.29 ms p50, two generators over the same programs, 8 interleaved
generations each, 13:04, load ~1, tokens equal); over an input-major weight (the LM
head) MKL's GEMV stays (Note [Streamed GEMVs stay on torch]).

The library is compiled when dynvm is installed (setup.py; optional: an install without
a C compiler still works) and carries only target-attributed AVX-512 code, so it loads
anywhere; `available()` says whether the kernels may run here and `unavailable_reason()`
why not, and the backend keeps oneDNN where they may not.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

import torch

_LIBRARY_STEM = "_small_m_linear"
NATIVE = "native"
"""The name of this kernel's choice, beside row_gate's TORCH and ONEDNN."""
NATIVE_ROWS = (2, 16)
"""The row counts (inclusive) the backend sends to this kernel (and one row over a weight
stored [N, K]: the Note)."""


def find_extension(stem: str) -> Path | None:
    """The C library `stem` that setup.py built beside these modules, or None (not
    built: no C compiler at install). Shared by every native kernel of the backend."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"{stem}{suffix}"
        if candidate.exists():
            return candidate
    return None


def load_extension(stem: str, supported: str) -> tuple[ctypes.CDLL | None, str]:
    """The C library `stem` loaded through ctypes, or None and why not: not built, not
    loadable, or its function `supported` says this CPU lacks AVX-512F. Shared by the
    backend's AVX-512 kernels called through ctypes."""
    path = find_extension(stem)
    if path is None:
        return None, (f"{stem} was not built (setup.py compiles it at install; "
                      "reinstall dynvm with a C compiler present)")
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"{path.name} did not load: {exc}"
    if not getattr(library, supported)():
        return None, "this CPU has no AVX-512F"
    return library, ""


def _load() -> tuple[ctypes.CDLL | None, str]:
    library, why = load_extension(_LIBRARY_STEM, "dynvm_small_m_supported")
    if library is None:
        return None, why
    pointer, size = ctypes.c_void_p, ctypes.c_long
    for name in ("dynvm_small_m_linear_nk", "dynvm_small_m_linear_kn"):
        fn = getattr(library, name)
        # x, ldx, M, K, w, ldw, N, bias, add, lda, y, ldy
        fn.argtypes = [pointer, size, size, size, pointer, size, size, pointer, pointer,
                       size, pointer, size]
        fn.restype = None
    return library, ""


_LIBRARY, _UNAVAILABLE = _load()


def available() -> bool:
    """Whether the native kernels can run in this process."""
    return _LIBRARY is not None


def library() -> ctypes.CDLL | None:
    """The loaded library (None where unavailable), for the other kernels built into it
    (native_decode)."""
    return _LIBRARY


def unavailable_reason() -> str:
    """Why they cannot ("" when they can)."""
    return _UNAVAILABLE


def fits(weight: torch.Tensor, input_major: bool) -> bool:
    """Whether `weight` ([N, K], or [K, N] when `input_major`) can be read in place: fp32
    on the CPU, rows contiguous."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.stride(1) == 1)


def as_stored(weight: torch.Tensor, input_major: bool) -> tuple[torch.Tensor, bool] | None:
    """The tensor this kernel reads for a GEMM's constant `weight` ([N, K], or [K, N] when
    `input_major`) and the layout it reads it in, or None when neither layout's rows are
    contiguous. A transposed view of a contiguous tensor (a LINEAR over the transpose of an
    input-major head, Note [LM head stored input-major]) is read as the tensor under it."""
    if fits(weight, input_major):
        return weight, input_major
    if weight.dim() == 2 and fits(weight.t(), not input_major):
        return weight.t(), not input_major
    return None


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` as [rows, width] whose rows a C kernel reads by a row stride: a view where
    its elements allow (last dim contiguous, rows apart), else a contiguous copy."""
    rows = t.reshape(-1, width)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < width):
        rows = rows.contiguous()
    return rows


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   add: torch.Tensor | None, input_major: bool) -> torch.Tensor:
    """`F.linear(x, W, bias) (+ add)` for W = `weight` ([N, K]) or, with `input_major`,
    `weight.t()` (`weight` [K, N]); `add` has the result's shape. x may be any view
    whose last dim is contiguous once its leading dims are flattened (others are
    copied first)."""
    if x.dtype != torch.float32:
        raise TypeError(f"the native small-M linear takes float32, not {x.dtype}")
    k = x.shape[-1]
    rows = as_rows(x, k)
    m = rows.shape[0]
    n = weight.shape[1] if input_major else weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        add_rows = None if add is None else as_rows(add, n)
        lda = 0 if add_rows is None else add_rows.stride(0)
        kernel = (_LIBRARY.dynvm_small_m_linear_kn if input_major
                  else _LIBRARY.dynvm_small_m_linear_nk)
        kernel(rows.data_ptr(), rows.stride(0), m, k, weight.data_ptr(), weight.stride(0), n,
               None if bias is None else bias.data_ptr(),
               None if add_rows is None else add_rows.data_ptr(), lda, y.data_ptr(), n)
    return y.view(*x.shape[:-1], n)
