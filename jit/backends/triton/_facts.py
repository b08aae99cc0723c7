"""What the backend knows about each value of a specialized region: per probe its shape
(Note [Probes] in dynvm.jit.specialize), its dtype and whether it is contiguous.

A dim that takes the same value at every probe is static for the family (a constexpr of
its kernels); one that differs is a runtime argument. The probes make every varying
dim of the family vary (`Family.probe_dims`), and the launcher re-checks each static dim
on every call (`dynvm.jit.backends.triton.launch`), so a value that only happens to
agree at the probes is caught, never silently wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, Var

Shapes = tuple[tuple[int, ...], ...]   # one shape per probe


@dataclass(frozen=True)
class TensorFacts:
    """What the planner knows of a tensor operand across a family's probes: its
    shape at each probe, its dtype, and whether it was contiguous at all of them."""

    shapes: Shapes
    dtype: torch.dtype
    contiguous: bool        # at every probe

    @property
    def rank(self) -> int:
        return len(self.shapes[0])

    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)


def static_or_none(values: Sequence[int]) -> int | None:
    """The value when it is the same at every probe, else None (it varies)."""
    first = values[0]
    return first if all(v == first for v in values) else None


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= `n` (1 for n <= 1): a Triton block size."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class Facts:
    """Facts about the values of one specialized region, memoized."""

    def __init__(self, spec: SpecializedRegion, constants: Sequence[object]) -> None:
        self.spec = spec
        self.constants = constants
        self.probes = len(spec.abstract)
        self._memo: dict[object, TensorFacts | None] = {}

    def tensor(self, value) -> TensorFacts | None:
        """Facts of a tensor value; None for a scalar, a list, or a value unknown at some
        probe (data-dependent)."""
        if not isinstance(value, Var | ConstRef) or self.probes == 0:
            return None
        if value not in self._memo:
            self._memo[value] = self._compute(value)
        return self._memo[value]

    def _compute(self, value: Var | ConstRef) -> TensorFacts | None:
        if isinstance(value, ConstRef):
            if not 0 <= value.index < len(self.constants):
                return None
            tensors = [self.constants[value.index]] * self.probes
        else:
            tensors = [probe.get(value.reg) for probe in self.spec.abstract]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            return None
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            return None
        return TensorFacts(tuple(tuple(t.shape) for t in tensors), dtypes.pop(),
                           all(t.is_contiguous() for t in tensors))


def is_number(value) -> bool:
    """A Literal that a kernel can inline: a finite int or float (bools are not)."""
    return (isinstance(value, Literal) and isinstance(value.value, int | float)
            and not isinstance(value.value, bool) and math.isfinite(value.value))
