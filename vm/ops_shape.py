"""Shape instructions: read dims, do scalar arithmetic on them, check them.

Symbolic sizes in an exported graph (`sym_size`, `s0 * 8`, `s1 // 2`) become these
instructions, operating on scalar registers. They cost next to nothing in the
interpreter, and a specialization folds them to constants (its shapes are known).
"""

from __future__ import annotations

import operator

import torch

from dynvm.vm.errors import ShapeError
from dynvm.vm.input_check import check_shape
from dynvm.vm.isa import OpClass, OpSpec, op
from dynvm.vm.shapes import intern_shape

aten = torch.ops.aten


def _shape(name: str, args: str, outs: str, doc: str, impl, **fields) -> OpSpec:
    return op(name, OpClass.SHAPE, args, outs, doc, impl=impl, **fields)


def _scalar_binary(name: str, fn, *sources) -> OpSpec:
    return _shape(name, "S,S", "S", f"scalar {fn.__name__} of two dims or numbers", fn,
                  aten=sources)


def _logical_and(a, b):
    return bool(a) and bool(b)


def _logical_or(a, b):
    return bool(a) or bool(b)


def _dim(x, index):
    return x.shape[index]


def _stride(x, index):
    return x.stride(index)


def _shape_of(x):
    return intern_shape(x.shape)


def check_input(x, name: str, dtype, device, dims: tuple) -> None:
    """Validate one program input against its declared signature.

    `dims` holds one `(low, high, dim_name)` per dim: a static dim has low == high and an
    empty name. Raises ShapeError naming the input, the dim, expected and actual; the
    shape's messages are dynvm.vm.input_check's, which the HTTP protocol also uses.
    """
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"input {name!r}: expected a tensor, got {type(x).__name__}")
    check_shape(name, x.shape, dims)
    if x.dtype != dtype:
        raise ShapeError(f"input {name!r}: expected dtype {dtype}, got {x.dtype}")
    if device is not None and x.device != device:
        raise ShapeError(f"input {name!r}: expected device {device}, got {x.device}")


def _check_input_abstract(x, name, dtype, device, dims):
    # Abstract tensors live on the meta device: check all but the device.
    check_input(x, name, dtype, None, dims)
    return ()


def _assert_scalar(condition, message: str) -> None:
    if not condition:
        raise ShapeError(f"shape check failed: {message}")


def _shape_guard(x, pattern: tuple) -> bool:
    shape = x.shape
    if len(shape) != len(pattern):
        return False
    return all(want < 0 or want == got for want, got in zip(pattern, shape))


def _reshape_if(x, size):
    # Skip the call when the shape already matches: a reshape to the same shape is the
    # most common no-op in exported graphs (flatten of an already-flat tensor, ...).
    if list(x.shape) == size:
        return x
    return x.reshape(size)


def _item(x):
    return x.item()


SHAPE_OPS: tuple[OpSpec, ...] = (
    _shape("SHAPE_OF", "T", "S", "the interned Shape of a tensor", _shape_of),
    _shape("DIM", "T,K", "S", "one dim of a tensor's shape", _dim,
           aten=(aten.sym_size.int,)),
    _shape("NUMEL", "T", "S", "element count of a tensor", torch.Tensor.numel,
           aten=(aten.sym_numel.default,)),
    _shape("STRIDE", "T,K", "S", "one dim's stride", _stride, aten=(aten.sym_stride.int,)),
    _shape("STORAGE_OFFSET", "T", "S", "a tensor's offset in its storage, in elements",
           torch.Tensor.storage_offset, aten=(aten.sym_storage_offset.default,)),
    _scalar_binary("SADD", operator.add, operator.add),
    _scalar_binary("SSUB", operator.sub, operator.sub),
    _scalar_binary("SMUL", operator.mul, operator.mul),
    _scalar_binary("SFLOORDIV", operator.floordiv, operator.floordiv),
    _scalar_binary("STRUEDIV", operator.truediv, operator.truediv),
    _scalar_binary("SMOD", operator.mod, operator.mod),
    _scalar_binary("SPOW", operator.pow, operator.pow),
    _scalar_binary("SMIN", min, torch.sym_min),
    _scalar_binary("SMAX", max, torch.sym_max),
    _scalar_binary("SEQ", operator.eq, operator.eq),
    _scalar_binary("SNE", operator.ne, operator.ne),
    _scalar_binary("SLT", operator.lt, operator.lt),
    _scalar_binary("SLE", operator.le, operator.le),
    _scalar_binary("SGT", operator.gt, operator.gt),
    _scalar_binary("SGE", operator.ge, operator.ge),
    _scalar_binary("SAND", _logical_and, operator.and_),
    _scalar_binary("SOR", _logical_or, operator.or_),
    _shape("SNEG", "S", "S", "scalar negation", operator.neg, aten=(operator.neg,)),
    _shape("SNOT", "S", "S", "scalar logical not", operator.not_,
           aten=(torch.sym_not, operator.not_)),
    _shape("SHAPE_ASSERT", "T,K,K,K,K", "",
           "validate a program input: name, dtype, device, (low, high, name) per dim",
           check_input, custom_shape_fn=_check_input_abstract, is_check=True, is_input_check=True),
    _shape("ASSERT_SCALAR", "S,K", "", "raise ShapeError unless the scalar is true",
           _assert_scalar, aten=(aten._assert_scalar.default,), is_check=True),
    _shape("SHAPE_GUARD", "T,K", "S",
           "true if the shape matches a pattern (-1 matches any dim)", _shape_guard),
    _shape("RESHAPE_IF", "T,L", "T", "reshape, or the tensor itself if already that shape",
           _reshape_if, aten=(aten.reshape.default,), returns_operand=True, view_form="VIEW"),
    _shape("ITEM", "T", "S", "the value of a one-element tensor (data-dependent)", _item,
           aten=(aten._local_scalar_dense.default, aten.item.default), data_dependent=True),
)


def _dims_equal(a: int, b: int, what: str) -> None:
    if a != b:
        raise ShapeError(f"{what}: got {b}, expected {a} (the same dim appears in both)")


SHAPE_OPS = SHAPE_OPS + (
    _shape("DIMS_EQUAL", "S,S,K", "",
           "raise ShapeError naming both places unless two dims are equal", _dims_equal,
           is_check=True),
)
