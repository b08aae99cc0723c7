"""The one check of an input's shape against its declared dims.

The interpreter's SHAPE_ASSERT runs it on every call, and the HTTP protocol
(dynvm.cluster.v2_protocol) runs it on a request's declared shape before any data is
decoded, so a client sees the same message whether the shape was refused at the door or
by the program.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynvm.vm.errors import ShapeError

# One (low, high, name) per dim, as SHAPE_ASSERT carries it (InputSpec.as_assert_operand):
# a static dim has low == high and an empty name.
Dims = Sequence[tuple[int, int, str]]


def check_shape(name: str, shape: Sequence[int], dims: Dims,
                bound: dict[str, tuple[int, str]] | None = None) -> None:
    """Raise ShapeError unless `shape` (input `name`'s) has the rank of `dims` and every
    dim in its declared range. With `bound` (dim name -> (size, input that set it)),
    a named dim must also agree with the inputs checked before; it records its size
    there for the ones after."""
    if len(shape) != len(dims):
        declared = ", ".join(str(low) if low == high and not dim_name
                             else f"{dim_name}:{low}..{high}" for low, high, dim_name in dims)
        raise ShapeError(f"input {name!r}: shape {list(shape)} has rank {len(shape)}, "
                         f"expected rank {len(dims)} [{declared}]")
    for axis, (size, (low, high, dim_name)) in enumerate(zip(shape, dims)):
        if not low <= size <= high:
            if low == high and not dim_name:
                raise ShapeError(f"input {name!r}: dim {axis} is {size}, expected {low}")
            raise ShapeError(f"input {name!r}: dim {axis} ({dim_name}) is {size}, outside "
                             f"its declared range [{low}, {high}]")
    if bound is not None:
        _agree(name, shape, dims, bound)


def _agree(name: str, shape: Sequence[int], dims: Dims,
           bound: dict[str, tuple[int, str]]) -> None:
    for axis, (size, (_, _, dim_name)) in enumerate(zip(shape, dims)):
        if not dim_name:
            continue
        other_size, other = bound.setdefault(dim_name, (size, name))
        if other_size != size:
            raise ShapeError(f"input {name!r}: dim {axis} ({dim_name}) is {size} but input "
                             f"{other!r} has {dim_name}={other_size}")
