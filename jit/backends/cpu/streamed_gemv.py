"""Which GEMMs a CPU kernel decides without asking the calibrator: those over weights
that stream from memory on every real call, at one row or a few (torch, dynvm's small-M
kernel or oneDNN).

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
past `STREAMED_BYTES` (or in a kernel whose weights together are: Note [Few rows over a
streamed weight]); smaller weights of a small kernel (which a small model keeps in
cache between calls) are still measured. At a few rows the answer is the other way, unasked too
(Note [Few rows over a streamed weight]).

Note [Few rows over a streamed weight]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At 4 to 16 rows (one M at every probe: a decode step at batch 4..16) over a weight
past `STREAMED_BYTES`, oneDNN on its packed weight is the faster GEMM by a margin no
calibration answer has come near, and asking costs the first generation at that batch
size its specialized steps: the question packs the weight a second time (the LM head
stored input-major is first copied contiguous: 68 + 50 ms for its 94 MiB) and times
calls of 9-15 ms each, every one behind a checkpoint that waits for a decode call
(Note [Background work yields to calls]). Measured on the bench Llama's 29 weights
cycled as in decoding, torch (the layout the program holds: the LM head input-major,
Note [LM head stored input-major]) against oneDNN packed, per weight medians of 10
interleaved rounds (2026-12-05 09:26, load 2.5-4), the 13 weights past 4 MiB summed,
oneDNN / torch: one thread M=4 0.62x, M=8 0.59x, M=16 0.62x (the LM head 9.1 vs 14.3
ms at M=4; the gate/up projection 0.59 vs 1.14; the down projection 0.64 vs 0.85); two
threads M=4 0.63x, M=8 0.65x, M=16 0.65x (the down projection alone at M=4 0.43 vs
0.43 ms: equal, the slowest case). At M=2 the layers' weights split (down 0.62 vs 0.51
ms on one thread, torch ahead), so 2 and 3 rows are still measured, as are M past 16
and GEMMs whose M varies (a family's probes), which RowGate's build questions decide
(Note [oneDNN at a new row count]). An epilogue fused with such a GEMM (a residual add,
an activation) goes with it: the post-op reads M x N values, nothing beside the weight.

Which weights stream: between two calls of one of a decode step's GEMMs the step reads
every other weight of its kernel, so at these row counts, and at one row, a weight is
taken to stream when it, or its kernel's GEMM weights together, are past
`STREAMED_BYTES`. The bench
Llama's smaller weights (the stacked q/k/v projection, 3.75 MiB; the output projection,
2.25 MiB) are then unasked too: their questions were the ones left in that step's
first compile at B=4, and every timed run of a question waits behind a checkpoint for
the decode call in flight, 0.8 s of waits there (2026-12-05 09:33, load 2-3.7), while
the calibrator had answered oneDNN for both (M=4 0.18 vs 0.29 ms, 0.13 vs 0.16), and
cycled as in decoding they are equal within 6% either way at M=4..8 and oneDNN's at
M=16 (the 768 x 768 weight one thread 0.39 vs 0.39 ms at M=4, 0.50 vs 0.69 at M=16).
At one row the same holds (a GEMV over a small weight of such a kernel stays on torch
unasked): cycled as above at M=1, the 768 x 768 projection 0.25 ms on torch against
0.31 on oneDNN's packed weight (one thread, 09:26), and a calibration that had put the
output projection + residual on oneDNN at B=1 (1.01x either way cached) held 9 MiB of
packed copies (`dynvm bench generate`, 08:14).

Where dynvm's own small-M kernel runs (Note [A small-M GEMM of our own] in native_linear),
2 to 16 rows over a streamed weight go to it instead, unasked as well: it reads the weight
where the program keeps it, so the compile packs nothing and the engine holds no second
copy, and 2 and 3 rows need no question either. So does one row over a weight stored
[N, K] (as fast as MKL's GEMV, with the residual add folded in); one row over an
input-major weight stays torch's.
"""

from __future__ import annotations

import torch

from dynvm.jit.backends.cpu import native_linear
from dynvm.jit.backends.cpu.native_linear import NATIVE, NATIVE_ROWS
from dynvm.jit.backends.cpu.row_gate import ONEDNN, TORCH
from dynvm.jit.ir import ConstRef
from dynvm.vm.opcodes import OPCODES

STREAMED_BYTES = 4 << 20
"""Past this a weight is taken to stream from memory between a decode step's calls
(above a core's L2 with the rest of the step's weights between two reads of it)."""

FEW_ROWS = (4, 16)
"""The row counts (inclusive) at which a GEMM over a streamed weight goes to oneDNN
unasked (Note [Few rows over a streamed weight]) where dynvm's own small-M kernel cannot
run (Note [A small-M GEMM of our own]: 2..16 rows go there where it can)."""


def gemm_weight_bytes(ops, constants) -> int:
    """Bytes of the distinct constant GEMM weights that `ops` read."""
    weights = {}
    for op in ops:
        spec = OPCODES.get(op.opcode)
        gemm = spec.gemm if spec is not None else None
        if gemm is not None and gemm.b < len(op.args) and isinstance(op.args[gemm.b], ConstRef):
            weights[op.args[gemm.b].index] = constants[op.args[gemm.b].index]
    return sum(t.numel() * t.element_size() for t in weights.values()
               if isinstance(t, torch.Tensor))


def streamed_decision(probe_rows: set[int], weight: torch.Tensor, ops=(),
                      constants=(), input_major: bool = False) -> tuple[str, str] | None:
    """(where the GEMM runs: TORCH, ONEDNN or NATIVE, the note's reason) for a GEMM with
    these probe row counts over `weight` (stored [K, N] when `input_major`), in a kernel
    of `ops` over `constants`, decided without the calibrator (Note [Streamed GEMVs stay
    on torch], Note [Few rows over a streamed weight], Note [A small-M GEMM of our own]);
    None when it is measured as usual."""
    if len(probe_rows) != 1:
        return None
    (rows,) = probe_rows
    stored = native_linear.as_stored(weight, input_major) if native_linear.available() \
        else None
    # one row over a weight stored [N, K] too: the GEMV itself as fast as MKL's, its
    # residual add folded in (over an input-major weight MKL's GEMV stays the faster)
    native = stored is not None and (NATIVE_ROWS[0] <= rows <= NATIVE_ROWS[1]
                                     or (rows == 1 and not stored[1]))
    if rows != 1 and not native and not FEW_ROWS[0] <= rows <= FEW_ROWS[1]:
        return None
    weight_bytes = weight.numel() * weight.element_size()
    together = max(weight_bytes, gemm_weight_bytes(ops, constants))
    if together <= STREAMED_BYTES:
        return None
    streamed = f"streamed from memory, {together / 2**20:.1f} MiB of the kernel's"
    if rows == 1 and not native:
        return TORCH, (f"a GEMV over {weight_bytes / 2**20:.1f} MiB {streamed}: torch's, "
                       f"not asked")
    if native:
        return NATIVE, (f" (not measured: M={rows} over a weight {streamed}; dynvm's "
                        f"small-M kernel on the weight as stored)")
    return ONEDNN, (f" (not measured: M={rows} over a weight {streamed}; oneDNN's packed "
                    f"weight)")
