"""An fp32 GEMM of 16-32 rows over a weight packed once into K-major column panels, in a
small C library of dynvm's own (native/panel_linear.c).

Note [A panel GEMM of our own]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At BERT-base width, batch 1 x seq 16, the GEMMs are 83% of the JIT's fp32 call (9.20 of
11.03 ms by wall, `bench.width_profile --walls`), and over its 16 GEMMs (QKV, output,
FFN up and down, four layers, with bias) oneDNN's matmul primitive, which the JIT emits,
took 10.85 ms at M = 16 where ONNX Runtime's MatMul + Add graph (MLAS on its packed
weight) took 8.87 (2026-12-06 08:04 UTC, two threads, OMP passive, interleaved, load
1.8): more than the whole call's distance to ONNX Runtime in the full-width bar. dynvm's
small-M kernel (Note [A small-M GEMM of our own] in native_linear) reads the weight as
the program stores it, [N, K], and takes dot products over K: 10.99 ms there, built for
M <= 16.

This kernel reads a copy of the weight packed once into panels of 16 columns, [K][16]
contiguous, panel after panel, so each thread's share of the weight is one sequential
stream; a block of up to 16 rows keeps 16 vector accumulators and, for each k, loads
one weight vector and does one broadcast FMA a row; a software prefetch runs 8 KiB ahead
in the stream. Bias, ReLU or erf-GELU, and a residual add are its epilogue, as the
oneDNN linears' post-ops. Over the same 16 GEMMs, same process, same window: 9.28 ms at
M = 16 (a second copy of it, as an A/A: 8.91), 12.60 at M = 32 (oneDNN 13.26, ONNX
Runtime 11.80), 20.61 at M = 64 (oneDNN 18.31): it reaches MLAS at 16 rows, sits between
oneDNN and MLAS at 32 and loses at 64, where a block's panel no longer stays in L1 (the
register block spills past 16 rows: 28-row blocks ran 2.3x slower). In cache it runs at
the core's FMA peak on one thread (151-172 GFLOP/s at M = 16-64).

The JIT does not choose it yet: that needs a pass beside the oneDNN linears (Note
[oneDNN linear primitives built once] in onednn_linear) asking the calibrator this
kernel against the primitive per linear at 16-32 rows, the packed copy in the prepack
cache (113 MB at BERT-base's four layers, instead of oneDNN's copy where every kernel of
a weight chose it), and the whole model measured chosen / never. Until then
`python -m bench.small_m_stream --panel` measures it beside the other paths, and the
tests hold it equal to eager.

The library is compiled when dynvm is installed (setup.py; optional) and carries only
target-attributed AVX-512 code, so it loads anywhere; `available()` says whether it may
run here and `unavailable_reason()` why not.
"""

from __future__ import annotations

import ctypes

import torch

from dynvm.jit.backends.cpu.native_linear import find_extension

_LIBRARY_STEM = "_panel_linear"
PANEL_WIDTH = 16
"""Columns a panel (16 or 32: the C kernel's two layouts); 16 measured faster at 16 rows
(the Note)."""
ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2}
"""The epilogue's activations, by the names oneDNN's linear uses (gelu: the erf form)."""
_ALIGN_FLOATS = 16   # 64 bytes: a panel's rows are read with aligned vector loads


def _load() -> tuple[ctypes.CDLL | None, str]:
    path = find_extension(_LIBRARY_STEM)
    if path is None:
        return None, (f"{_LIBRARY_STEM} was not built (setup.py compiles it at install; "
                      "reinstall dynvm with a C compiler present)")
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"{path.name} did not load: {exc}"
    if not library.dynvm_panel_supported():
        return None, "this CPU has no AVX-512F"
    pointer, size = ctypes.c_void_p, ctypes.c_long
    # x, ldx, M, K, packed, width, N, bias, act, add, lda, y, ldy
    library.dynvm_panel_linear.argtypes = [pointer, size, size, size, pointer, size, size,
                                           pointer, ctypes.c_int, pointer, size, pointer,
                                           size]
    library.dynvm_panel_linear.restype = None
    return library, ""


_LIBRARY, _UNAVAILABLE = _load()


def available() -> bool:
    """Whether the panel kernel can run in this process."""
    return _LIBRARY is not None


def unavailable_reason() -> str:
    """Why it cannot ("" when it can)."""
    return _UNAVAILABLE


class PackedPanels:
    """An fp32 weight [N, K] packed into K-major panels of `width` columns (the Note);
    `panels` is [ceil(N / width), K, width], its storage 64-byte aligned."""

    def __init__(self, weight: torch.Tensor, width: int = PANEL_WIDTH) -> None:
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise TypeError(f"panels pack a 2-d float32 weight, not {weight.dtype} "
                            f"{tuple(weight.shape)}")
        if width not in (16, 32):
            raise ValueError(f"a panel is 16 or 32 columns wide, not {width}")
        n, k = weight.shape
        count = -(-n // width)
        storage = torch.empty(count * k * width + _ALIGN_FLOATS)
        skip = (-storage.data_ptr() // 4) % _ALIGN_FLOATS
        self.panels = storage[skip:skip + count * k * width].view(count, k, width)
        padded = torch.zeros(count * width, k)
        padded[:n] = weight
        self.panels.copy_(padded.view(count, width, k).transpose(1, 2))
        self.out_features, self.in_features, self.width = n, k, width


def panel_linear(x: torch.Tensor, packed: PackedPanels, bias: torch.Tensor | None = None,
                 activation: str = "none", add: torch.Tensor | None = None) -> torch.Tensor:
    """`act(F.linear(x, W, bias)) (+ add)` for the W `packed` holds; `add` has the
    result's shape. x may be any view whose last dim is contiguous once its leading dims
    are flattened (others are copied first)."""
    if x.dtype != torch.float32:
        raise TypeError(f"the panel linear takes float32, not {x.dtype}")
    k, n = packed.in_features, packed.out_features
    if activation not in ACTIVATIONS:
        raise ValueError(f"the panel linear's activations are {sorted(ACTIVATIONS)}, "
                         f"not {activation!r}")
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim is {x.shape[-1]}, the weight's in_features {k}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        add_rows, lda = None, 0
        if add is not None:
            add_rows = add.reshape(m, n)
            if add_rows.stride(-1) != 1 or (m > 1 and add_rows.stride(0) < n):
                add_rows = add_rows.contiguous()
            lda = add_rows.stride(0)
        if bias is not None:
            bias = bias.contiguous()
        _LIBRARY.dynvm_panel_linear(
            rows.data_ptr(), rows.stride(0), m, k, packed.panels.data_ptr(), packed.width,
            n, None if bias is None else bias.data_ptr(), ACTIVATIONS[activation],
            None if add_rows is None else add_rows.data_ptr(), lda, y.data_ptr(), n)
    return y.view(*x.shape[:-1], n)
