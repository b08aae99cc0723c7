"""An fp32 GEMM of 8-64 rows over a weight packed once into K-major column panels, in a
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

In BERT-base width's whole fp32 model (exact kernels in one process, `CpuOptions.
panel_linear` on / off with a second "off" runtime as the A/A, interleaved call by call,
2026-12-06 08:17-08:19 UTC, load 0.6-1.2): at 16 rows 0.930 / 0.910 / 0.918 over three
runs (1x16; 2x8 0.914), at 12 rows 0.956, at 8 rows 0.982, where a block of up to 16 rows
reads the weight once; at 4 rows 1.028, and at 20-32 rows 0.996-1.015, where the rows
took two blocks of 16 and the second read the panel again from L2 (A/A 0.996-1.012).

Past one register block (H33M, 2026-12-06) the rows go 32 columns at a time (two
16-column panels side by side: the same packed copy as 8-16 rows) in blocks of up to 11
rows, 22 accumulators, 2 weight loads and 11 broadcasts a 22 FMAs where a 16-row block
at 16 columns needs 17 loads a 16 (one thread, N = 768, the weight mostly in L2: 149-154
GFLOP/s at 24-64 rows against 103-119 for 16-row blocks). K goes in chunks of 256, each
chunk of the two panels read from memory once and by the later row blocks from cache,
the partial sums kept in y; x is packed k-major a row block first (in place a block's
rows at K = 3072 are 12 KiB apart, all in one L1 set); each block prefetches, into L2,
its share of the stream's next chunk, spread over its k. 12-row blocks ran 9-11% slower
than 11-row ones at 24 and 48 rows; a prefetch at a fixed distance in the first block
instead of the shared one won 9% at 24 rows and lost 3% at 32. Over BERT-base's 24
GEMMs, interleaved (10:19 UTC, load 2.1, beside other sessions' tests), M = 16 / 24 / 32
/ 48 / 64: 9.27 / 10.37 / 11.53 / 14.13 / 17.65 ms, the one-block kernel before 9.26 /
12.24 / 13.61 / 17.39 / 21.66, oneDNN's packed linear 13.70 / 14.94 / 16.48 / 18.87 /
21.78. In the whole model, on / off (10:21-10:38, load 1.1-2.2; A/A 0.986-1.024): 1x32
0.963 / 0.900 / 0.909, 2x16 0.961 / 0.894, 1x24 0.930, 2x12 0.938, 1x40 0.997, 1x48
0.924, 3x16 0.913, 1x56 0.962, 64 rows (1x64, 2x32, 4x16) 0.953-0.964 and 0.960-0.968 in
two runs, 1.016-1.029 in a third (A/A up to 1.013), 1x128 1.004; at 8-16 rows as before
(1x16 0.915 / 0.925, 2x8 0.923, 1x8 0.979). In the bar's command after it (10:29, load
1.8-2.1, margin 0.030) JIT / best peer 1x32 0.980, 2x16 1.012, 4x16 0.994, 2x32 0.997
(1.045 / 1.077 / 1.079 / 1.009 at the stop before), 1x64 1.077 (1.058). So `PANEL_ROWS`
is 8-64, and only weights of at least `PANEL_MIN_WEIGHT_BYTES` come here: the kernel's
gain is in streaming a weight larger than a core's L2, which a repeated calibration call
(the weight hot) does not see (as Note [Streamed GEMVs stay on torch] found for GEMVs).
The packed copy is shared through the prepack cache (key `panel`; 113 MB at BERT-base's
four layers). A linear it takes builds no oneDNN primitive and no oneDNN copy of its
weight; the fused call's packed copy that fusion made stays only while another kernel
reads it. The panels are collapsed into 2 MiB pages after the compile, as oneDNN's packed
weights are (Note [Packed weights on huge pages]): with and without in one process
(BERT-base width, exact fp32 kernels, interleaved call by call with an A/A, 30 rounds,
2026-12-06 11:23 UTC, load 1.0-1.1) 1x16 0.957, 1x32 0.950, 2x16 0.965, 1x64 0.959 (A/A
0.986-0.999); 4x32 (128 rows, no panels) 0.999.
`CpuOptions.panel_linear = "off"` keeps every linear on its primitive (the in-process
A/B's other arm). Not yet done: a per-linear choice by measurement with the weights
streaming as the model's calls meet them, and other hosts' figures. `python -m
bench.small_m_stream --panel` measures the kernel beside the other GEMM paths, and the
tests hold it equal to eager.

The library is compiled when dynvm is installed (setup.py; optional) and carries only
target-attributed AVX-512 code, so it loads anywhere; `available()` says whether it may
run here and `unavailable_reason()` why not.
"""

from __future__ import annotations

import ctypes

import torch

from dynvm.jit.backends.cpu.huge_pages import to_huge_pages
from dynvm.jit.backends.cpu.native_linear import as_rows, load_extension

_LIBRARY_STEM = "_panel_linear"
PANEL_WIDTH = 16
"""Columns a panel (16 or 32: the C kernel's two layouts); 16 measured faster at 16 rows
(the Note)."""
ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2}
"""The epilogue's activations, by the names oneDNN's linear uses (gelu: the erf form)."""
_ALIGN_FLOATS = 16   # 64 bytes: a panel's rows are read with aligned vector loads
PANEL_ROWS = (8, 64)
"""The row counts (inclusive) of an exact kernel whose linears run here (the Note's
whole-model figures: at 4 rows and at 128 none gained)."""
PANEL_MIN_WEIGHT_BYTES = 2 << 20
"""A weight smaller than this stays on oneDNN's primitive: it need not stream from
memory (a core's L2 on this project's host is 2 MiB), and the kernel's gain is in the
streaming."""


def _load() -> tuple[ctypes.CDLL | None, str]:
    library, why = load_extension(_LIBRARY_STEM, "dynvm_panel_supported")
    if library is None:
        return None, why
    pointer, size = ctypes.c_void_p, ctypes.c_long
    # x, ldx, M, K, packed, width, N, bias, act, add, lda, y, ldy, scratch
    library.dynvm_panel_linear.argtypes = [pointer, size, size, size, pointer, size, size,
                                           pointer, ctypes.c_int, pointer, size, pointer,
                                           size, pointer]
    library.dynvm_panel_linear.restype = None
    library.dynvm_panel_scratch_floats.argtypes = [size, size, size]
    library.dynvm_panel_scratch_floats.restype = size
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

    def nbytes(self) -> int:
        """Bytes of the packed copy (the prepack cache's accounting)."""
        return self.panels.numel() * self.panels.element_size()


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
    rows = as_rows(x, k)
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        add_rows = None if add is None else as_rows(add, n)
        lda = 0 if add_rows is None else add_rows.stride(0)
        if bias is not None:
            bias = bias.contiguous()
        # past one register block the kernel packs x's rows here first (the Note)
        floats = _LIBRARY.dynvm_panel_scratch_floats(m, k, packed.width)
        scratch = torch.empty(floats) if floats else None
        _LIBRARY.dynvm_panel_linear(
            rows.data_ptr(), rows.stride(0), m, k, packed.panels.data_ptr(), packed.width,
            n, None if bias is None else bias.data_ptr(), ACTIVATIONS[activation],
            None if add_rows is None else add_rows.data_ptr(), lda, y.data_ptr(), n,
            None if scratch is None else scratch.data_ptr())
    return y.view(*x.shape[:-1], n)


def _activation_name(activation: tuple[str, list, str] | None) -> str | None:
    """This kernel's name for a linear's activation (attr, scalars, algorithm), or None
    where it has none of its own (tanh-GELU and the other eltwise post-ops)."""
    if activation is None:
        return "none"
    attr, _, algorithm = activation
    if attr == "relu" or (attr == "gelu" and algorithm in ("", "none")):
        return attr
    return None


class PanelLinear:
    """A linear of an exact kernel on this kernel, called as the oneDNN `PrimitiveLinear`
    it stands for would be: (x, the residual add's operand or None)."""

    def __init__(self, packed: PackedPanels, bias: torch.Tensor | None,
                 activation: str) -> None:
        self._packed, self._bias, self._activation = packed, bias, activation

    def impls(self) -> set[str]:
        return {"dynvm panel"}

    def __call__(self, x: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
        return panel_linear(x, self._packed, self._bias, self._activation, other)


def panel_of(plain, bias: torch.Tensor | None, activation: tuple[str, list, str] | None,
             binary: str | None, prepacked, weight_index: int,
             transposed: bool) -> PanelLinear | None:
    """An fp32 linear of weight `plain()` ([N, K]) on this kernel, the weight packed once
    per engine in `prepacked`; None where the kernel cannot compute its epilogue, the
    weight is under PANEL_MIN_WEIGHT_BYTES, or the library is not available."""
    name = _activation_name(activation)
    if not available() or name is None or binary not in (None, "add"):
        return None
    weight = plain()
    if weight.dtype != torch.float32 or weight.numel() * 4 < PANEL_MIN_WEIGHT_BYTES:
        return None
    packed = prepacked.get((weight_index, "panel", transposed, PANEL_WIDTH),
                           lambda: PackedPanels(weight.contiguous()))
    to_huge_pages(packed.panels)    # the panels stream (the Note); asked once a tensor
    return PanelLinear(packed, bias, name)
