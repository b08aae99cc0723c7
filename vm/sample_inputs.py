"""Random inputs that fit a program's declared signature, by dynamic-dim name.

    declared_dims(program)            {"batch": (1, 64), "seq": (2, 512)}
    random_inputs(program, {"batch": 4, "seq": 32}, generator) -> flat input tensors

`dynvm run` draws its calls with these, and precompile (dynvm.cluster.fleet.precompile) the
calls that make a fleet's families.
"""

from __future__ import annotations

import torch

# Integer inputs of a .dvm file carry no hint of their valid range (an embedding table's
# row count lives in a constant, not in the signature), so they are drawn from a range
# small enough to be a valid index for any plausible table. `dynvm run --help` says so.
INT_HIGH = 8


def dim_key(spec, axis: int, dim) -> str:
    """The name a dynamic dim is addressed by: its own, else `<input>.<axis>` (a file
    may hold a dynamic dim without a name; it is still addressable)."""
    return dim.name or f"{spec.name}.{axis}"


def declared_dims(program) -> dict[str, tuple[int, int]]:
    """Each dynamic dim's key and the range every input using it accepts. A derived dim
    (`32*k`, Note [Derived dims]) is keyed by its root, and the range is the root's."""
    dims: dict[str, tuple[int, int]] = {}
    for spec in program.inputs:
        for axis, dim in enumerate(spec.dims):
            if not dim.is_static:
                key = dim_key(spec, axis, dim)
                root_low, root_high = dim.root_range()
                low, high = dims.get(key, (root_low, root_high))
                dims[key] = (max(low, root_low), min(high, root_high))
    return dims


def dim_values(program, flat) -> dict[str, int]:
    """The dynamic dims' values in a call's flat inputs (a derived dim's root's)."""
    values: dict[str, int] = {}
    for spec, tensor in zip(program.inputs, flat):
        for axis, dim in enumerate(spec.dims):
            if not dim.is_static and axis < tensor.dim():
                root = dim.root_of(int(tensor.shape[axis]))
                if root is not None:
                    values.setdefault(dim_key(spec, axis, dim), root)
    return values


def random_tensor(spec, values: dict[str, int], generator: torch.Generator) -> torch.Tensor:
    """One input of `spec`'s dtype, its dynamic dims sized by `values` (by dim key; a
    derived dim's size is its expression of the root's value)."""
    shape = [dim.low if dim.is_static
             else dim.scale * values[dim_key(spec, axis, dim)] + dim.offset
             for axis, dim in enumerate(spec.dims)]
    dtype = spec.dtype
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=generator)
    if dtype.is_floating_point:
        # randn in float32, then cast: not every low-precision dtype has a CPU randn.
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(0, INT_HIGH, shape, generator=generator, dtype=dtype)


def random_inputs(program, values: dict[str, int],
                  generator: torch.Generator) -> list[torch.Tensor]:
    """A call's flat inputs (on the CPU), every dynamic dim sized by `values`."""
    return [random_tensor(spec, values, generator) for spec in program.inputs]
