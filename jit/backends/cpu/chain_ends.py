"""What a chain of primitives (onednn_chain) takes in at its ends: the conversion of its
input into the chain's layout, and a global mean of its last value.

Note [A chain's input conversion and global mean]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Around ResNet-50's one chain (Note [A chain of primitives in one call]) a call still ran
in Python, each op a torch dispatch and an OpenMP parallel region of its own: the
input's conversion into the chain (`TO_CHANNELS_LAST_BF16` in a bf16 chain: a cast, then
a layout pass) before it, the global average pooling (`MEAN` over height and width,
kept 1 x 1) after it. In a bf16 chain both become steps of its one native call:
- the conversion, when the chain's input is read by nothing else and its source is
  dense fp32 NCHW at every probe: the arena binds the source and a reorder primitive
  writes the chain's bf16 NHWC value into an arena buffer, cast and layout in one pass
  (oneDNN's jit:uni reorder); a kernel for an offset or strided view keeps the op;
- the mean, when it is the op right after the run and reads a value of the run that
  nothing after it reads: an average pooling over the whole plane (onednn_pool's
  `PrimitiveMean`), its [N, C, 1, 1] result a new tensor with torch's mean's strides.
A shape without an arena runs the conversion's own function and torch's mean, as before.

Measured first (one process, the kernel's head and tail as emitted against a reorder, an
average pooling and the same linear primitive in one native call, interleaved with an
A/A, ResNet-50 batch 1, 2026-12-05 22:59, load 6): fp32 0.93 -> 0.52 ms, bf16 0.61 ->
0.30 ms, results equal. Then the whole model, in one process, ends taken in against not
(three Runtimes, 40 calls interleaved, an A/A beside, 23:08, load 2.3-2.6, keep-awake on):
bf16 10.36 against 10.71 ms, 0.972 (A/A 1.006); fp32 34.88 against 35.17, 0.997 (A/A
1.005), no different; bf16 again at 23:52 (load 1.9, 30 calls): batch 1 / 2 / 4 0.970 /
0.966 / 0.905 (A/A 1.011 / 1.002 / 1.009). So fp32 chains keep both ops (`ENDS_DTYPES`),
and their tests keep reading the conversion as the mark of a chain. The fp32 mean alone,
taken in, measured no different too (2026-12-06 02:01, load 3.5, 25 calls: batch 1 / 2 /
4 1.009 / 1.005 / 0.998, A/A 0.994 / 0.995 / 1.005; alone torch's mean 0.096 ms against
the pooling's 0.041). The linear after the mean stays the linear pass's op
(onednn_linear): at M=1 its primitive, dynvm's small-M GEMM, torch's and an inner
product on the mean's value take 0.38-0.46 ms with the weight in cache.

At batch 2 / 4 the fp32 chain is nChw16c (Note [A chain of primitives in one call]) and
its ends in Python were ~0.5 ms of a ~60 ms call (bench.resnet_profile, 2026-12-06
14:09), so both were taken in again, in NHWC and nChw16c arenas (the mean's nChw16c
result leaving by the arena's reorder out), as an option (H35R, f99a5af, reverted).
Whole model, one process, Runtimes on and off interleaved call by call with an A/A,
40-50 calls, seasoned and huge_pages.drain()ed (/tmp/h35r/ab.py, 14:12-14:21 UTC, load
1.2-2.2): batch 1 / 2 / 4 on built last 0.950 / 0.980 / 0.998 (A/A 0.996 / 0.991 /
0.996); built first 1.039 / 1.004 / 0.984 and built last 0.979 / 0.987 / 0.988 (A/A
1.002 / 0.994 / 0.995); built between two off ones 0.997 / 1.005 at batch 2 / 4. The
order of building moves it more than the ends do: no gain, so fp32 keeps its ends in
Python and the option was taken out.
"""

from __future__ import annotations

import dataclasses

import torch

from dynvm.jit.backends.cpu.channels_last import (
    LAYOUT_KERNELS,
    TO_CHANNELS_LAST,
    TO_CHANNELS_LAST_BF16,
)
from dynvm.jit.backends.cpu.ir_match import probe_tensors
from dynvm.jit.ir import Literal, Var

_CL = torch.channels_last
_INTO_CHAIN = {TO_CHANNELS_LAST: torch.float32, TO_CHANNELS_LAST_BF16: torch.bfloat16}
ENDS_DTYPES = (torch.bfloat16,)
"""The chains whose ends are taken in (Note [A chain's input conversion and global
mean]): bf16, where it measured faster; in fp32 it measured no different."""


@dataclasses.dataclass(frozen=True)
class Head:
    """The conversion into a chain, taken into it: the op's position, its source
    register, its function (a shape without an arena runs it) and the source's dtype."""

    position: int
    source: int
    convert: object
    source_dtype: torch.dtype


def head(ops, start: int, end: int, x: int, reads, probes) -> Head | None:
    """The conversion op right before the run [start, end) that makes its input `x`,
    when the run alone reads `x` and the source is dense fp32 NCHW at every probe."""
    if start == 0:
        return None
    op = ops[start - 1]
    chain_dtype = _INTO_CHAIN.get(op.opcode)
    if chain_dtype not in ENDS_DTYPES or op.dsts != (x,) or len(op.args) != 1 \
            or not isinstance(op.args[0], Var):
        return None
    if any(r == x and not start <= position < end for r, position in reads):
        return None     # read outside the run
    source = op.args[0].reg
    values = probe_tensors(probes, source)
    converted = probe_tensors(probes, x)
    if not values or not converted or any(
            v.dim() != 4 or v.dtype != torch.float32 or not v.is_contiguous()
            or c.dtype != chain_dtype for v, c in zip(values, converted)):
        return None
    return Head(start - 1, source, LAYOUT_KERNELS[op.opcode], torch.float32)


def mean_after(ops, end: int, defined: set[int], reads, probes) -> tuple[int, int] | None:
    """(the value it reads, its result) of a MEAN over height and width kept 1 x 1 at
    position `end`, reading a value of the run that nothing else reads."""
    if end >= len(ops):
        return None
    op = ops[end]
    if op.opcode != "MEAN" or op.variant != "" or len(op.dsts) != 1 or len(op.args) != 4:
        return None
    x, dims, keepdim, dtype = op.args
    if not isinstance(x, Var) or x.reg not in defined or not all(
            isinstance(a, Literal) for a in (dims, keepdim, dtype)):
        return None
    if keepdim.value is not True or dtype.value is not None \
            or not isinstance(dims.value, (list, tuple)) \
            or sorted(int(d) % 4 for d in dims.value) != [2, 3]:
        return None
    if any(r == x.reg and position > end for r, position in reads):
        return None     # read after the mean too
    values = probe_tensors(probes, x.reg)
    if not values or any(v.dim() != 4 or not v.is_contiguous(memory_format=_CL)
                         or v.dtype not in ENDS_DTYPES for v in values):
        return None
    return x.reg, op.dsts[0]
