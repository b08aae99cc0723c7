"""A freshly built exact specialization's first call, paid on the compile thread.

Note [Prewarmed installs]
~~~~~~~~~~~~~~~~~~~~~~~~~
A kernel's first call at a shape pays what later calls do not: oneDNN builds (and
caches, process-wide) a primitive for each fused GEMM or convolution at a row count it
has not run (Note [oneDNN at a new row count] in jit/backends/cpu/row_gate.py: 0.4-1.4 ms each at
small sizes, more at BERT-base width's FFN) and the arena pool allocates the kernel's
first buffer (later leases reuse it). Installed as it is,
that first call is a request's. So before an exact specialization (strong guard: every
shape, stride and offset known) is installed, the compile thread runs it once on
zero-filled inputs of its signature's layout, after a checkpoint (Note [Background work
yields to calls] in jit.background), under inference mode as a call runs. The results
are dropped. Zeros are valid indices for gathers; a kernel that raises on them (a data
dependent check) is installed unwarmed: warming is best effort and never fails a compile.

Family kernels are not warmed: a family meets many row counts, one warm run would
cover one of them at the cost of a whole call, and the row gate already keeps oneDNN's
builds off the row counts that have not recurred.
"""

from __future__ import annotations

import time

import torch

from dynvm.jit.background import checkpoint, run_paced
from dynvm.shape_cluster.signature import is_tensor_entry


def warm_registers(n_regs: int, constants: list, live_in: tuple[int, ...],
                   signature: tuple, device: torch.device) -> list:
    """A register file (registers, constants, the loop meter and return slots, as the
    interpreter lays it out) with zero-filled live-ins of `signature`'s layouts."""
    regs = [None] * n_regs + list(constants) + [None, None]
    for index, entry in zip(live_in, signature):
        if not is_tensor_entry(entry):
            regs[index] = entry[1]
            continue
        shape, dtype, strides, offset, _device = entry
        dims = tuple(shape.dims)
        extent = offset + 1 + sum((d - 1) * s for d, s in zip(dims, strides)) \
            if all(d > 0 for d in dims) else offset
        base = torch.zeros(max(1, extent), dtype=dtype, device=device)
        regs[index] = base.as_strided(dims, strides, offset)
    return regs


def prewarm(fn, regs: list) -> float:
    """Run a kernel once on `regs` after a checkpoint (Note [Prewarmed installs]);
    the seconds it ran, or 0.0 if it raised."""
    checkpoint()
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            _, paused = run_paced(fn, regs)   # Note [A kernel's run on the worker pauses
            #                                   for calls] in jit.background
    except Exception:  # noqa: BLE001 — best effort: the install goes ahead unwarmed
        return 0.0
    return time.perf_counter() - start - paused
