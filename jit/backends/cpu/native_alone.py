"""A GEMM of 17-32 rows over a small weight: dynvm's small-M kernel on the calling thread.

Note [A small weight at 17-32 rows on one thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The held-out encoder (bench/heldout.py: d=256, 6 layers) at batch 1 x seq 32 runs its
linears at M=32. Its attention output projection (256 x 256, 4.2 MFLOP) took 72-77 us a
call inside the JIT's kernel on oneDNN or torch's team, against ONNX Runtime's MLAS
36 us (its per-node profile, both interleaved with eager; 2-core AMD EPYC Zen 5, no AMX,
2026-12-06 19:49 UTC, load ~2). A GEMM this small gives two threads about 2 MFLOP each:
waking the passive second thread (and, on this loaded 2-core host, sharing its core)
costs more than the half it takes. Alone, weights cold (a 32 MB buffer written between
calls), M=32 (us a call, torch's team / torch one thread / this kernel team / this
kernel one thread): 256x256 71 / 73 / 66 / 36, 768x256 122 / 120 / 102 / 95, 1024x256
158 / 147 / 114 / 124, 256x1024 132 / 135 / 109 / 111 (19:52 UTC, load 1.9).

In the whole model the larger linears gain nothing from the same move: every M=32
linear on this kernel with two threads ran 1.066x the oneDNN kernel, on one thread
1.031x (the GELU then a pass of its own: oneDNN fuses it), only the 256 x 256 ones on one
thread 1.007x with the GELU also moved, and 0.903 / 0.916x with everything else left on
oneDNN (two runs, 300 calls each, interleaved call by call with an A/A 0.989 / 0.992;
/tmp/h38e/ab2.py, 19:57 UTC, load 2.0). So only a GEMM whose weight has at most
`MAX_WEIGHT_ELEMENTS` elements, at one row count of 17-32 (`ROWS`) at every probe, is
put here: fusion.py decides it unmeasured (before the streamed-weight rule), its op
carries `VARIANT` (so the oneDNN primitive pass, which takes over the small-M kernel's
own ops, leaves it), codegen.py calls the small-M kernel for it and one_thread.py runs
it on the calling thread. Fewer rows are the small-M kernel's own range (Note [A small-M
GEMM of our own]); more rows were not measured.

As landed, in the held-out encoder's whole call, runtimes built with and without it in
one process, seasoned and drained, interleaved call by call with an A/A
(/tmp/h38e/ab3.py; 2-core AMD EPYC Zen 5, no AMX; 2 threads, PASSIVE): batch 1 x seq 32
0.976 / 0.967 / 0.931 (A/A 1.001 / 1.004 / 1.003; 19:59-20:01 UTC, load 1.7-1.9; 40, 300,
300 calls), 3.50 -> 3.41 ms, 3.44 -> 3.33, 3.28 -> 3.05; batch 4, 16, 64 (M=128 and up,
not taken) 0.986 / 1.007 / 1.015 (A/A 1.000 / 1.017 / 1.004). Again at 20:09 (load 2.1,
60 calls a batch, a second copy of the new runtime in the rotation): batch 1 0.971 and
0.991 (A/A 1.020), 4 / 16 / 64 1.002 / 1.000 / 1.022 and 1.003 / 0.995 / 1.006 (their
code is the same in both arms). A small gain (~0.1 ms of ~3.3 ms), consistent in sign.
The header's one-thread line counts these GEMMs with the ops the calibrator chose.
"""

from __future__ import annotations

import torch

from dynvm.jit.backends.cpu import native_linear

VARIANT = "native-alone"
"""The variant of a NATIVE_LINEAR op run on the calling thread (the part before "+")."""
ROWS = (17, 32)
"""The row counts (inclusive) this applies at."""
MAX_WEIGHT_ELEMENTS = 1 << 16
"""The largest weight (elements) put on the calling thread: 256 x 256 was measured to gain,
768 x 256 and larger not."""


def applies(probe_rows: set[int], weight: torch.Tensor, input_major: bool) -> str | None:
    """The note of the decision when a GEMM of `probe_rows` over `weight` (stored [K, N]
    when `input_major`) runs on the small-M kernel on one thread, else None."""
    if len(probe_rows) != 1 or not native_linear.available():
        return None
    (rows,) = probe_rows
    if not ROWS[0] <= rows <= ROWS[1] or weight.dtype != torch.float32 \
            or weight.dim() != 2 or weight.numel() > MAX_WEIGHT_ELEMENTS \
            or native_linear.as_stored(weight, input_major) is None:
        return None
    return (f" (not measured: M={rows} over a {weight.shape[0]}x{weight.shape[1]} weight; "
            "on the calling thread, Note [A small weight at 17-32 rows on one thread])")


def is_alone(op) -> bool:
    """Whether `op` is a small-M GEMM to run on the calling thread."""
    return op.variant.split("+")[0] == VARIANT
