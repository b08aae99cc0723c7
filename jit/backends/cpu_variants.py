"""Shape-specific kernel variants of the CPU backend.

Note [Packed weights]
~~~~~~~~~~~~~~~~~~~~~
MKL can pre-pack a GEMM operand for one row count, and a specialization knows its row
count exactly. Measured on this project's 2-core x86 machine, a 32 x 256 @ 256 x 1024
LINEAR took 103 us through torch's linear and 69 us with the weight packed for 32 rows;
at 128 rows 247 vs 231 us; from 512 rows on the gain is within a few percent. Narrow
weights lose: the demo GNN's 64x64 and 64x128 LINEARs at 100 rows made a whole call
545 us packed against 477 us unpacked (the unpacked ones write into the arena; packed
results cannot). Timing both forms at compile time did not predict that (isolated
GEMMs favoured packing), so the rule is static: a strong-guarded specialization packs a
LINEAR with at most `packed_linear_max_rows` rows and a weight of at least
`PACKED_MIN_WEIGHT` elements, and calls `mkl._mkl_linear` with the weight packed at
compile time. Packed weights are shared
between specializations of the same row count and freed with the last one that uses
them (a weak-valued cache).
"""

from __future__ import annotations

import threading
import weakref

import torch

from dynvm.jit.ir import ConstRef, Literal, SpecOp, Var

PACKED_MIN_WEIGHT = 256 * 256


def mkl_packing_available(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear"))


class PackedWeights:
    """(constant index, rows) -> MKL-packed weight, shared while someone holds it."""

    def __init__(self) -> None:
        self._cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def get(self, index: int, weight: torch.Tensor, rows: int) -> torch.Tensor:
        with self._lock:
            packed = self._cache.get((index, rows))
            if packed is None:
                with torch.inference_mode():
                    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
                self._cache[(index, rows)] = packed
            return packed


def packed_linear_rows(op: SpecOp, probes: tuple, constants, max_rows: int) -> int | None:
    """Row count if this LINEAR may use a packed weight (the same at every probe of the
    specialization, see Note [Probes]), else None."""
    if op.opcode != "LINEAR" or op.variant or max_rows <= 0:
        return None
    x, weight, bias = op.args
    if not isinstance(x, Var) or not isinstance(weight, ConstRef):
        return None
    if not (isinstance(bias, ConstRef) or bias == Literal(None)):
        return None
    w = constants[weight.index]
    if w.dtype != torch.float32 or w.dim() != 2 or w.numel() < PACKED_MIN_WEIGHT:
        return None
    counts = set()
    for probe in probes:
        value = probe.get(x.reg)
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            return None
        if value.dim() < 2:
            return None
        counts.add(value.numel() // max(1, value.shape[-1]))
    if len(counts) != 1:
        return None
    rows = counts.pop()
    return rows if 0 < rows <= max_rows else None


def mkl_linear(x, packed, weight, bias, rows):
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
