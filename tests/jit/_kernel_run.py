"""Running a generated CPU kernel by hand in a test: its region's register file with
one input, the first output back (tests/jit/test_cpu_conv.py, test_row_gate.py)."""

from __future__ import annotations


def run_kernel(kernel, region, x):
    """`kernel.fn` on a register file holding `x` in `region`'s first live-in; returns
    the region's first live-out."""
    regs: list = [None] * 1024          # more registers than any test program has
    regs[region.live_in[0].index] = x
    kernel.fn(regs)
    return regs[region.live_out[0].index]
