"""Which GEMMs a CPU kernel keeps on torch without asking the calibrator: GEMVs over
weights that stream from memory on every real call.

Note [Streamed GEMVs stay on torch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At one row (M = 1 at every probe: a decode step at batch 1) a GEMM is a GEMV that
reads its weight once, so the weight streams from memory each call once it is larger
than the core's L2; the calibration's repeated calls read it from cache instead, and
measure something that real calls never see. Measured on the bench Llama's decode
step with its 17 weights cycled as in decoding (2026-12-05, one thread, load 1-2):
oneDNN on packed weights 0.96-1.00x torch's MKL GEMV (within noise), oneDNN's linear
+ residual add on the 768 x 768 output projection 1.01x, the LM head through oneDNN
on its dense weight 1.21x. What a oneDNN choice costs is certain: a packed copy of
the weight (94 MiB for that LM head), and calibration calls of 6-17 ms each (that
head's, in kernel headers) on the compile thread with the GIL held (Note [oneDNN
holds the GIL]) while decode steps wait. So such a GEMV stays on torch, unasked,
past `STREAMED_BYTES`; smaller weights (which a small model keeps in cache between
calls) are still measured.
"""

from __future__ import annotations

import torch

STREAMED_BYTES = 4 << 20
"""Past this a weight is taken to stream from memory between a decode step's calls
(above a core's L2 with the rest of the step's weights between two reads of it)."""


def streamed_gemv(probe_rows: set[int], weight: torch.Tensor) -> str | None:
    """Why a GEMM with these probe row counts over `weight` stays on torch unasked, or
    None when it is measured as usual (Note [Streamed GEMVs stay on torch])."""
    weight_bytes = weight.numel() * weight.element_size()
    if probe_rows == {1} and weight_bytes > STREAMED_BYTES:
        return (f"a GEMV over {weight_bytes / 2**20:.1f} MiB streamed from memory: torch's, "
                f"not asked")
    return None
