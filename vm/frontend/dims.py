"""Declared input dims: from an ExportedProgram and the user's `dynamic_shapes` to
`InputSpec`s (each dim static, or a named range)."""

from __future__ import annotations

import inspect

import sympy
import torch

from dynvm.vm.errors import UnsupportedOpError
from dynvm.vm.program import DimSpec, InputSpec
from dynvm.vm.verifier import MAX_DIM

# A dim declared without a bound (`Dim("batch")`, `Dim.AUTO`) gets the largest bound a
# program may declare (the verifier refuses more), not an unbounded one.
_UNBOUNDED = MAX_DIM


def user_dim_names(module, example_inputs: tuple, dynamic_shapes) -> list[dict[int, str]]:
    """Per positional input, {dim index: the user's Dim name}."""
    if dynamic_shapes is None:
        return [{} for _ in example_inputs]
    if isinstance(dynamic_shapes, dict):
        params = list(inspect.signature(module.forward).parameters)
        per_input = [dynamic_shapes.get(name) for name in params[: len(example_inputs)]]
    else:
        per_input = list(dynamic_shapes)
    names: list[dict[int, str]] = []
    for spec in per_input:
        found: dict[int, str] = {}
        items = spec.items() if isinstance(spec, dict) else enumerate(spec or ())
        for index, dim in items:
            name = getattr(dim, "__name__", None)
            if name:
                found[int(index)] = name
        names.append(found)
    return names


def _bounds(exported, expr) -> tuple[int, int]:
    ranges = exported.range_constraints.get(expr)
    if ranges is None:
        return 0, _UNBOUNDED
    return max(0, _finite_int(ranges.lower, 0)), min(_finite_int(ranges.upper, _UNBOUNDED),
                                                     _UNBOUNDED)


def _finite_int(bound, default: int) -> int:
    """A range bound as an int, `default` when unbounded. torch's own infinity for sizes
    (`int_oo`) says `is_finite` is True, so the test is for an integer, not for finiteness."""
    if isinstance(bound, int | sympy.Integer):
        return int(bound)
    return default


def input_specs(exported, placeholders, names: list[str],
                user_names: list[dict[int, str]]) -> tuple[tuple[InputSpec, ...], dict]:
    """InputSpecs of the user inputs, and {symbol: (input index, dim)} of each dynamic
    symbol's first appearance (later appearances must equal it)."""
    specs = []
    first_seen: dict[sympy.Symbol, tuple[int, int]] = {}
    repeats: list[tuple[tuple[int, int], tuple[int, int]]] = []
    for index, node in enumerate(placeholders):
        fake = node.meta.get("val")
        if not isinstance(fake, torch.Tensor):
            raise UnsupportedOpError(f"input {names[index]!r} is not a tensor "
                                     f"({type(fake).__name__}); dynvm programs take tensors")
        dims = []
        for dim_index, size in enumerate(fake.shape):
            if isinstance(size, int):
                dims.append(DimSpec("", size, size))
                continue
            expr = size.node.expr
            if not isinstance(expr, sympy.Symbol):
                raise UnsupportedOpError(
                    f"input {names[index]!r} dim {dim_index} is the derived size {expr}; "
                    "declare each input dim as its own Dim or a static size")
            low, high = _bounds(exported, expr)
            name = user_names[index].get(dim_index, str(expr)) if index < len(user_names) \
                else str(expr)
            dims.append(DimSpec(name, low, high))
            if expr in first_seen:
                repeats.append((first_seen[expr], (index, dim_index)))
            else:
                first_seen[expr] = (index, dim_index)
        specs.append(InputSpec(names[index], fake.dtype, tuple(dims)))
    return tuple(specs), repeats
