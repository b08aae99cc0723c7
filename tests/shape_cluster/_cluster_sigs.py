"""Hand-built signatures for the shape_cluster tests.

Not a conftest on purpose (as tests/vm/_programs.py): import what you need.
"""

from __future__ import annotations

import torch

from dynvm.vm.shapes import intern_shape

CPU = torch.device("cpu")


def row_major(dims: tuple[int, ...]) -> tuple[int, ...]:
    """torch's contiguous strides for `dims` (a dim of size 0 counts as 1)."""
    strides, step = [], 1
    for dim in reversed(dims):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def tsig(*dims: int, dtype: torch.dtype = torch.float32, strides: tuple[int, ...] | None = None,
         offset: int = 0, device: torch.device = CPU) -> tuple:
    """A tensor signature entry; row-major strides unless `strides` is given."""
    return (intern_shape(dims), dtype, row_major(dims) if strides is None else strides,
            offset, device)


def ssig(value: object) -> tuple:
    """A scalar signature entry."""
    return (type(value), value)


def observed(*signatures: tuple, calls: int = 1, seconds: float = 1.0) -> list[tuple]:
    """(signature, calls, seconds) triples as `cluster` takes them."""
    return [(signature, calls, seconds) for signature in signatures]


def keys_by_signature(stats) -> dict[tuple, str]:
    """Signature -> the key of the family `cluster` put it in."""
    return {member: s.family.key for s in stats for member in s.members}
