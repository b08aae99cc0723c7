"""The one check of an input's shape against its declared dims.

The interpreter's SHAPE_ASSERT runs it on every call, and the HTTP protocol
(dynvm.cluster.protocol._v2) runs it on a request's declared shape before any data is
decoded, so a client sees the same message whether the shape was refused at the door or
by the program.

Note [Derived dims]
~~~~~~~~~~~~~~~~~~~
torch.export lets a user declare a dim as `a * Dim("k", min=.., max=..) + b` (a CNN at a
dynamic resolution exports only so: `32 * Dim("k")`, so every stride-2 stage divides it).
The program keeps that relation in the input's `DimSpec` (`scale`, `offset`, the root's
name) and SHAPE_ASSERT carries it as `(low, high, name, scale, offset)`; a plain dim keeps
its three-item form, so programs without derived dims are byte for byte as before. A
size is accepted when it lies in [low, high] and `size - offset` is a multiple of
`scale`; the message names the expression ("dim 2 must be 32*k for k in 1..5, got 100").
Dims that share a root agree on the root's value, not on their sizes (`32*k` and `16*k`
in two inputs). Everything downstream (regions, signatures, guards, family buckets)
sees sizes. A code family probes its buckets at sizes its root gives, and keeps this
check in its kernel, since its guard checks bounds, not the grid (Note [Probes] in
dynvm.jit.specialize); an exact specialization's guard is its one valid shape.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynvm.vm.errors import ShapeError

# One (low, high, name) per dim, as SHAPE_ASSERT carries it (InputSpec.as_assert_operand):
# a static dim has low == high and an empty name; a derived dim adds (scale, offset).
Dims = Sequence[tuple]


def derived_text(name: str, scale: int, offset: int) -> str:
    """`scale * name + offset` as listings and errors write it (`32*k`, `2*n+1`)."""
    text = name if scale == 1 else f"{scale}*{name}"
    return text if offset == 0 else f"{text}{offset:+d}"


def _text(dim: tuple) -> str:
    low, high, dim_name = dim[:3]
    if low == high and not dim_name:
        return str(low)
    return f"{_expression(dim)}:{low}..{high}"


def _expression(dim: tuple) -> str:
    return derived_text(dim[2], *_relation(dim))


def _relation(dim: tuple) -> tuple[int, int]:
    return (dim[3], dim[4]) if len(dim) == 5 else (1, 0)


def _root(dim: tuple, size: int) -> int | None:
    scale, offset = _relation(dim)
    root, rest = divmod(size - offset, scale)
    return None if rest else root


def check_shape(name: str, shape: Sequence[int], dims: Dims,
                bound: dict[str, tuple[int, str]] | None = None) -> None:
    """Raise ShapeError unless `shape` (input `name`'s) has the rank of `dims` and every
    dim in its declared range (a derived dim: one its expression gives). With `bound`
    (dim name -> (root value, input that set it)), a named dim must also agree with the
    inputs checked before; it records its root value there for the ones after."""
    if len(shape) != len(dims):
        declared = ", ".join(_text(dim) for dim in dims)
        raise ShapeError(f"input {name!r}: shape {list(shape)} has rank {len(shape)}, "
                         f"expected rank {len(dims)} [{declared}]")
    for axis, (size, dim) in enumerate(zip(shape, dims)):
        low, high, dim_name = dim[:3]
        if len(dim) == 5 and (not low <= size <= high or _root(dim, size) is None):
            scale, offset = _relation(dim)
            raise ShapeError(
                f"input {name!r}: dim {axis} must be {_expression(dim)} for {dim_name} in "
                f"{(low - offset) // scale}..{(high - offset) // scale}, got {size}")
        if not low <= size <= high:
            if low == high and not dim_name:
                raise ShapeError(f"input {name!r}: dim {axis} is {size}, expected {low}")
            raise ShapeError(f"input {name!r}: dim {axis} ({dim_name}) is {size}, outside "
                             f"its declared range [{low}, {high}]")
    if bound is not None:
        _agree(name, shape, dims, bound)


def _agree(name: str, shape: Sequence[int], dims: Dims,
           bound: dict[str, tuple[int, str]]) -> None:
    for axis, (size, dim) in enumerate(zip(shape, dims)):
        dim_name = dim[2]
        if not dim_name:
            continue
        root = _root(dim, size)
        other_root, other = bound.setdefault(dim_name, (root, name))
        if other_root != root:
            got = f"{size}" if len(dim) == 3 else f"{size} ({dim_name}={root})"
            raise ShapeError(f"input {name!r}: dim {axis} ({_expression(dim)}) is {got} but "
                             f"input {other!r} has {dim_name}={other_root}")
