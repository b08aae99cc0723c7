"""Declared input dims: from an ExportedProgram and the user's `dynamic_shapes` to
`InputSpec`s (each dim static, or a named range)."""

from __future__ import annotations

import inspect

import sympy
import torch
import torch.utils._pytree as pytree

from dynvm.vm.errors import UnsupportedOpError
from dynvm.vm.program import DimSpec, InputSpec
from dynvm.vm.verifier import MAX_DIM

# A dim declared without a bound (`Dim("batch")`, `Dim.AUTO`) gets the largest bound a
# program may declare (the verifier refuses more), not an unbounded one.
_UNBOUNDED = MAX_DIM


def user_dim_names(module, example_inputs: tuple, dynamic_shapes) -> list[dict[int, str]]:
    """Per input tensor, in the order torch.export flattens the inputs (a list or dict
    input is several), {dim index: the user's Dim name}."""
    leaves = pytree.tree_leaves(tuple(example_inputs))
    if dynamic_shapes is None:
        return [{} for _ in leaves]
    if isinstance(dynamic_shapes, dict):
        params = list(inspect.signature(module.forward).parameters)
        per_input = [dynamic_shapes.get(name) for name in params[: len(example_inputs)]]
    else:
        per_input = list(dynamic_shapes)
    specs: list = []
    for example, spec in zip(example_inputs, per_input):
        _tensor_specs(example, spec, specs)
    names: list[dict[int, str]] = []
    for spec in specs:
        found: dict[int, str] = {}
        items = spec.items() if isinstance(spec, dict) else enumerate(spec or ())
        for index, dim in items:
            # A derived dim (`32 * Dim("k")`) is addressed by its root's name.
            name = getattr(getattr(dim, "root", dim), "__name__", None)
            if name:
                found[int(index)] = name
        names.append(found)
    return names


def _tensor_specs(example, spec, out: list) -> None:
    """Append the dynamic-shape spec of each tensor in `example` (a tensor, or a list,
    tuple or dict of them, as torch.export takes them) in flattening order; None where
    the user gave none."""
    if isinstance(example, torch.Tensor):
        out.append(spec)
    elif isinstance(example, list | tuple):
        subs = spec if isinstance(spec, list | tuple) else [None] * len(example)
        for item, sub in zip(example, subs):
            _tensor_specs(item, sub, out)
    elif isinstance(example, dict):
        subs = spec if isinstance(spec, dict) else {}
        for key in pytree.tree_flatten(example)[1].context:
            _tensor_specs(example[key], subs.get(key), out)
    else:
        out.extend([None] * len(pytree.tree_leaves(example)))


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


def _linear(expr) -> tuple[sympy.Symbol, int, int] | None:
    """(root, scale, offset) when `expr` is `scale * root + offset` with int coefficients
    and scale >= 1, else None."""
    if isinstance(expr, sympy.Symbol):
        return expr, 1, 0
    symbols = expr.free_symbols
    if len(symbols) != 1:
        return None
    (root,) = symbols
    try:
        poly = sympy.Poly(expr, root)
    except sympy.PolynomialError:
        return None
    coeffs = poly.all_coeffs()
    if poly.degree() != 1 or not all(c.is_Integer for c in coeffs) or coeffs[0] < 1:
        return None
    return root, int(coeffs[0]), int(coeffs[1])


def _dim_spec(exported, where: str, expr, name: str) -> DimSpec:
    """The DimSpec of a dynamic input dim whose size is `expr` (Note [Derived dims])."""
    relation = _linear(expr)
    if relation is None:
        raise UnsupportedOpError(
            f"{where} is the size {expr}; declare each input dim as its own Dim, "
            "a * Dim(...) + b, or a static size")
    root, scale, offset = relation
    root_low, root_high = _bounds(exported, root)
    if scale == 1 and offset == 0:
        return DimSpec(name, root_low, root_high)
    size_low, size_high = _bounds(exported, expr)
    root_low = max(root_low, -(-(size_low - offset) // scale))
    root_high = min(root_high, (min(size_high, _UNBOUNDED) - offset) // scale)
    if root_low > root_high:
        raise UnsupportedOpError(f"{where} ({expr}) has no valid size: {root} in "
                                 f"{root_low}..{root_high}")
    return DimSpec(name, scale * root_low + offset, scale * root_high + offset, scale, offset)


def _root_names(placeholders, user_names: list[dict[int, str]]) -> dict:
    """The user's name of each root symbol, from the first dim that names it: a dim
    shared by several inputs (one Dim object given twice, or an input of a list) is one
    symbol to torch.export, and keeps the user's name wherever it appears."""
    names: dict = {}
    for index, node in enumerate(placeholders):
        fake = node.meta.get("val")
        given = user_names[index] if index < len(user_names) else {}
        if not isinstance(fake, torch.Tensor):
            continue
        for dim_index, size in enumerate(fake.shape):
            if isinstance(size, int) or dim_index not in given:
                continue
            relation = _linear(size.node.expr)
            root = relation[0] if relation is not None else size.node.expr
            names.setdefault(root, given[dim_index])
    return names


def input_specs(exported, placeholders, names: list[str],
                user_names: list[dict[int, str]]) -> tuple[tuple[InputSpec, ...], list]:
    """InputSpecs of the user inputs, and the repeats: pairs of (input index, dim) whose
    sizes share a root symbol, the first appearance and a later one, which the program
    checks agree (on the size, or on the root's value for derived dims)."""
    specs = []
    first_seen: dict[sympy.Symbol, tuple[int, int]] = {}
    repeats: list[tuple[tuple[int, int], tuple[int, int]]] = []
    root_names = _root_names(placeholders, user_names)
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
            relation = _linear(expr)
            root = relation[0] if relation is not None else expr
            name = root_names.get(root, str(root))
            dims.append(_dim_spec(exported, f"input {names[index]!r} dim {dim_index}", expr,
                                  name))
            if root in first_seen:
                repeats.append((first_seen[root], (index, dim_index)))
            else:
                first_seen[root] = (index, dim_index)
        specs.append(InputSpec(names[index], fake.dtype, tuple(dims)))
    return tuple(specs), repeats
