"""Elementwise tensor instructions: unary and binary math, comparisons, logic, select.

Besides the interpreter's entry, each op declares what the backends may do with it
(see dynvm.vm.isa): its in-place form (Note [In-place reuse]), its `out=` form (Note
[Arena layout]) and the formula a generated Triton kernel computes in registers. The
formulas are torch's: GELU in its erf form ('none') and its tanh form, SiLU as
x * sigmoid(x), ReLU that keeps NaN (torch.relu(nan) is nan, so it is
`where(x < 0, 0, x)`, not a maximum). tanh is written through exp (1 - 2 / (exp(2x) + 1):
exact at both ends, about 1e-7 absolute error near 0) because `tl` has no tanh that both
the CUDA backend and the interpreter provide.
"""

from __future__ import annotations

import torch

from dynvm.vm.isa import ChannelsLast, OutForm, Pointwise, PostOp
from dynvm.vm.ops_common import tensor_op

aten = torch.ops.aten
_nn = torch._C._nn
_T = torch.Tensor
def _reciprocal(factor) -> float:
    """DIV by `factor` as a multiplication (OpSpec.scale_of)."""
    return 1.0 / factor


_EW = ChannelsLast.ELEMENTWISE   # Note [Channels-last chains] in dynvm.jit.backends.cpu

SQRT_HALF = 0.7071067811865476          # 1 / sqrt(2)
SQRT_TWO_OVER_PI = 0.7978845608028654   # sqrt(2 / pi)


def _tanh_formula(x: str) -> str:
    return f"1.0 - 2.0 / (tl.exp(2.0 * {x}) + 1.0)"


def _gelu_formula(dst: str, ops: list[str], approximate: str) -> list[str]:
    (x,) = ops
    if approximate == "tanh":
        return [f"{dst}_inner = {SQRT_TWO_OVER_PI} * ({x} + 0.044715 * {x} * {x} * {x})",
                f"{dst} = 0.5 * {x} * (1.0 + ({_tanh_formula(dst + '_inner')}))"]
    return [f"{dst} = 0.5 * {x} * (1.0 + tl.erf({x} * {SQRT_HALF}))"]


def _out1(fn):
    return OutForm(lambda x, out: fn(x, out=out))


def _out2(fn):
    return OutForm(lambda a, b, out: fn(a, b, out=out))


def _unary(name: str, fn, overload, inplace=None, out=True, formula: str | None = None,
           **fields):
    return tensor_op(name, overload, f"elementwise {name.lower()}", args="T", impl=fn,
                     inplace=inplace, out=_out1(fn) if out is True else out,
                     pointwise=Pointwise(1, formula) if formula else None, **fields)


def _binary(name: str, fn, *overloads, inplace=None, out=True, formula: str | None = None,
            **fields):
    return tensor_op(name, overloads, f"elementwise {name.lower()} with broadcasting",
                     args="A,A", impl=fn, inplace=inplace,
                     out=_out2(fn) if out is True else out,
                     pointwise=Pointwise(2, formula) if formula else None, **fields)


def _gelu(x, approximate):
    return _nn.gelu(x, approximate=approximate)


def _gelu_inplace(x, approximate):
    return _nn.gelu_(x, approximate=approximate)


def _gelu_out(x, approximate, out):
    return _nn.gelu(x, approximate=approximate, out=out)


def _relu_out(x, out):
    return torch.clamp_min(x, 0, out=out)


def _elu_out(x, alpha, scale, input_scale, out):
    return _nn.elu(x, alpha, scale, input_scale, out=out)


def _leaky_relu_out(x, slope, out):
    return _nn.leaky_relu(x, slope, out=out)


def _hardtanh_out(x, low, high, out):
    return _nn.hardtanh(x, low, high, out=out)


def _div_mode(a, b, rounding_mode):
    return torch.div(a, b, rounding_mode=rounding_mode)


ELEMENTWISE_OPS = (
    # -- activations -----------------------------------------------------------------
    tensor_op("GELU", aten.gelu.default, "GELU ('none' or 'tanh')", args="T,K", impl=_gelu,
              inplace=_gelu_inplace, out=OutForm(_gelu_out),
              pointwise=Pointwise(1, _gelu_formula, modes=("none", "tanh")),
              onednn_unary=PostOp("gelu", algorithm=True), channels_last=_EW),
    _unary("RELU", torch.relu, aten.relu.default, inplace=_T.relu_,
           out=OutForm(_relu_out), formula="tl.where({x} < 0.0, 0.0, {x})",
           onednn_unary=PostOp("relu"), channels_last=_EW),
    _unary("SILU", _nn.silu, aten.silu.default, inplace=_nn.silu_,
           formula="{x} * tl.sigmoid({x})", onednn_unary=PostOp("swish"), channels_last=_EW),
    _unary("SIGMOID", torch.sigmoid, aten.sigmoid.default, inplace=_T.sigmoid_,
           formula="tl.sigmoid({x})", onednn_unary=PostOp("sigmoid"), channels_last=_EW),
    _unary("TANH", torch.tanh, aten.tanh.default, inplace=_T.tanh_,
           formula=_tanh_formula("{x}"), onednn_unary=PostOp("tanh"), channels_last=_EW),
    # -- unary math ------------------------------------------------------------------
    _unary("EXP", torch.exp, aten.exp.default, inplace=_T.exp_, formula="tl.exp({x})",
           channels_last=_EW),
    _unary("LOG", torch.log, aten.log.default, inplace=_T.log_, formula="tl.log({x})"),
    _unary("SQRT", torch.sqrt, aten.sqrt.default, inplace=_T.sqrt_, formula="tl.sqrt({x})",
           channels_last=_EW),
    _unary("RSQRT", torch.rsqrt, aten.rsqrt.default, inplace=_T.rsqrt_,
           formula="tl.rsqrt({x})", channels_last=_EW),
    _unary("NEG", torch.neg, aten.neg.default, inplace=_T.neg_, formula="-{x}",
           channels_last=_EW),
    _unary("ABS", torch.abs, aten.abs.default, inplace=_T.abs_, formula="tl.abs({x})",
           channels_last=_EW),
    _unary("ERF", torch.erf, aten.erf.default, inplace=_T.erf_, formula="tl.erf({x})",
           channels_last=_EW),
    _unary("RECIPROCAL", torch.reciprocal, aten.reciprocal.default,
           inplace=_T.reciprocal_, formula="1.0 / {x}", channels_last=_EW),
    _unary("SIN", torch.sin, aten.sin.default, inplace=_T.sin_),
    _unary("COS", torch.cos, aten.cos.default, inplace=_T.cos_),
    _unary("ROUND", torch.round, aten.round.default, inplace=_T.round_, out=None),
    _unary("FLOOR", torch.floor, aten.floor.default, inplace=_T.floor_, out=None),
    _unary("CEIL", torch.ceil, aten.ceil.default, inplace=_T.ceil_, out=None),
    _unary("LOGICAL_NOT", torch.logical_not, aten.logical_not.default, out=None),
    _unary("ACOS", torch.acos, aten.acos.default, inplace=_T.acos_),
    _unary("ACOSH", torch.acosh, aten.acosh.default, inplace=_T.acosh_),
    _unary("ASIN", torch.asin, aten.asin.default, inplace=_T.asin_),
    _unary("ASINH", torch.asinh, aten.asinh.default, inplace=_T.asinh_),
    _unary("ATAN", torch.atan, aten.atan.default, inplace=_T.atan_),
    _unary("ATANH", torch.atanh, aten.atanh.default, inplace=_T.atanh_),
    _unary("TAN", torch.tan, aten.tan.default, inplace=_T.tan_),
    _unary("SINH", torch.sinh, aten.sinh.default, inplace=_T.sinh_),
    _unary("COSH", torch.cosh, aten.cosh.default, inplace=_T.cosh_),
    _unary("EXPM1", torch.expm1, aten.expm1.default, inplace=_T.expm1_),
    _unary("LOG1P", torch.log1p, aten.log1p.default, inplace=_T.log1p_),
    _unary("LOG2", torch.log2, aten.log2.default, inplace=_T.log2_),
    _unary("LOG10", torch.log10, aten.log10.default, inplace=_T.log10_),
    _unary("SIGN", torch.sign, aten.sign.default, inplace=_T.sign_),
    _unary("TRUNC", torch.trunc, aten.trunc.default, inplace=_T.trunc_, out=None),
    _unary("ERFC", torch.erfc, aten.erfc.default, inplace=_T.erfc_),
    _unary("ERFINV", torch.erfinv, aten.erfinv.default, inplace=_T.erfinv_),
    _unary("EXP2", torch.exp2, aten.exp2.default, inplace=_T.exp2_),
    _unary("LGAMMA", torch.lgamma, aten.lgamma.default, inplace=_T.lgamma_),
    _unary("DIGAMMA", torch.digamma, aten.digamma.default, inplace=_T.digamma_),
    _unary("I0", torch.i0, aten.i0.default, inplace=_T.i0_),
    _unary("ISNAN", torch.isnan, aten.isnan.default, out=None),
    _unary("ISINF", torch.isinf, aten.isinf.default, out=None),
    _unary("BITWISE_NOT", torch.bitwise_not, aten.bitwise_not.default,
           inplace=_T.bitwise_not_),
    tensor_op("CLAMP", aten.clamp.default, "clamp to [min, max]", impl=torch.clamp,
              inplace=_T.clamp_, channels_last=_EW),
    tensor_op("CLAMP_TENSOR", aten.clamp.Tensor, "clamp to tensor bounds [min, max]",
              impl=torch.clamp),
    # -- activations with parameters ----------------------------------------------------
    tensor_op("ELU", aten.elu.default, "ELU(x) with alpha, scale, input scale",
              impl=_nn.elu, inplace=_nn.elu_, out=OutForm(_elu_out), channels_last=_EW),
    tensor_op("LEAKY_RELU", aten.leaky_relu.default, "x if x > 0 else slope * x",
              impl=_nn.leaky_relu, inplace=_nn.leaky_relu_, out=OutForm(_leaky_relu_out),
              onednn_unary=PostOp("leaky_relu", scalars=1), channels_last=_EW),
    tensor_op("HARDTANH", aten.hardtanh.default, "clamp to [min_val, max_val]",
              impl=_nn.hardtanh, inplace=_nn.hardtanh_, out=OutForm(_hardtanh_out),
              onednn_unary=PostOp("hardtanh", scalars=2), channels_last=_EW),
    # -- binary (ALPHA != 1 is lowered to a MUL first) ---------------------------------
    _binary("ADD", torch.add, aten.add.Tensor, aten.add.Scalar, inplace=_T.add_,
            commutative=True, formula="{a} + {b}", onednn_binary="add", channels_last=_EW),
    _binary("SUB", torch.sub, aten.sub.Tensor, aten.sub.Scalar, inplace=_T.sub_,
            formula="{a} - {b}", onednn_binary="sub", channels_last=_EW),
    _binary("MUL", torch.mul, aten.mul.Tensor, aten.mul.Scalar, inplace=_T.mul_,
            commutative=True, formula="{a} * {b}", onednn_binary="mul", channels_last=_EW,
            scale_of=float),
    _binary("DIV", torch.div, aten.div.Tensor, aten.div.Scalar, inplace=_T.div_,
            formula="{a} / {b}", channels_last=_EW, scale_of=_reciprocal),
    _binary("POW", torch.pow, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
            aten.pow.Scalar, inplace=_T.pow_),
    _binary("MAXIMUM", torch.maximum, aten.maximum.default, channels_last=_EW),
    _binary("MINIMUM", torch.minimum, aten.minimum.default, channels_last=_EW),
    _binary("EQ", torch.eq, aten.eq.Tensor, aten.eq.Scalar, out=None),
    _binary("NE", torch.ne, aten.ne.Tensor, aten.ne.Scalar, out=None),
    _binary("LT", torch.lt, aten.lt.Tensor, aten.lt.Scalar, out=None),
    _binary("LE", torch.le, aten.le.Tensor, aten.le.Scalar, out=None),
    _binary("GT", torch.gt, aten.gt.Tensor, aten.gt.Scalar, out=None),
    _binary("GE", torch.ge, aten.ge.Tensor, aten.ge.Scalar, out=None),
    _binary("LOGICAL_AND", torch.logical_and, aten.logical_and.default, out=None),
    _binary("LOGICAL_OR", torch.logical_or, aten.logical_or.default, out=None),
    _binary("ATAN2", torch.atan2, aten.atan2.default, inplace=_T.atan2_),
    _binary("FMOD", torch.fmod, aten.fmod.Tensor, aten.fmod.Scalar, inplace=_T.fmod_),
    _binary("REMAINDER", torch.remainder, aten.remainder.Tensor, aten.remainder.Scalar,
            inplace=_T.remainder_),
    _binary("BITWISE_AND", torch.bitwise_and, aten.bitwise_and.Tensor,
            aten.bitwise_and.Scalar, inplace=_T.bitwise_and_, commutative=True),
    _binary("BITWISE_OR", torch.bitwise_or, aten.bitwise_or.Tensor, aten.bitwise_or.Scalar,
            inplace=_T.bitwise_or_, commutative=True),
    _binary("BITWISE_XOR", torch.bitwise_xor, aten.bitwise_xor.Tensor,
            aten.bitwise_xor.Scalar, inplace=_T.bitwise_xor_, commutative=True),
    _binary("LOGICAL_XOR", torch.logical_xor, aten.logical_xor.default, out=None),
    _binary("SHIFT_LEFT", torch.bitwise_left_shift, aten.bitwise_left_shift.Tensor,
            aten.bitwise_left_shift.Tensor_Scalar, aten.__lshift__.Tensor,
            aten.__lshift__.Scalar),
    _binary("SHIFT_RIGHT", torch.bitwise_right_shift, aten.bitwise_right_shift.Tensor,
            aten.bitwise_right_shift.Tensor_Scalar, aten.__rshift__.Tensor,
            aten.__rshift__.Scalar),
    _binary("COPYSIGN", torch.copysign, aten.copysign.Tensor, aten.copysign.Scalar),
    _binary("HYPOT", torch.hypot, aten.hypot.default),
    _binary("XLOGY", torch.xlogy, aten.xlogy.Tensor),
    tensor_op("LERP", (aten.lerp.Scalar, aten.lerp.Tensor), "a + weight * (b - a)",
              args="T,T,A", impl=torch.lerp),
    tensor_op("DIV_MODE", (aten.div.Tensor_mode, aten.div.Scalar_mode),
              "division with rounding mode 'trunc' or 'floor'", args="A,A,K",
              impl=_div_mode),
    # -- selection -------------------------------------------------------------------
    tensor_op("WHERE", aten.where.self, "cond ? a : b", args="T,A,A", impl=torch.where),
    tensor_op("MASKED_FILL", aten.masked_fill.Scalar, "fill where mask is true",
              impl=torch.masked_fill, inplace=_T.masked_fill_),
)
