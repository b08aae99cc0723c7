"""Running a generated CPU kernel by hand in a test: its region's register file with
one input, the first output back (tests/jit/test_cpu_conv.py, test_row_gate.py) or all
of them (test_cpu_fusion.py, test_cpu_precision.py); and the views a [b, s, d] input is
checked through."""

from __future__ import annotations

import torch


def run_kernel(kernel, region, x):
    """`kernel.fn` on a register file holding `x` in `region`'s first live-in; returns
    the region's first live-out."""
    regs: list = [None] * 1024          # more registers than any test program has
    regs[region.live_in[0].index] = x
    kernel.fn(regs)
    return regs[region.live_out[0].index]


def run_kernel_outputs(kernel, region, x) -> list[torch.Tensor]:
    """`kernel.fn` on a register file holding `x` in `region`'s first live-in; returns
    every live-out of the region."""
    regs: list = [None] * 1024
    regs[region.live_in[0].index] = x
    kernel.fn(regs)
    return [regs[r.index] for r in region.live_out]


def views(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """`x` ([b, s, d]) as it is, as an offset view into a larger tensor, and as a view
    with a stride over s. (Not a batch/seq transpose: a model's reshape lowers to VIEW,
    which the interpreter cannot run on one either.)"""
    b, s, d = x.shape
    big = torch.zeros(b + 1, s + 2, d + 3)
    big[1:, 2:, 3:] = x
    strided = torch.zeros(b, 2 * s, d)
    strided[:, ::2] = x
    return {"contiguous": x, "offset": big[1:, 2:, 3:], "strided": strided[:, ::2]}
