"""Tensor instructions: one opcode per ATen operator the frontend keeps.

Operands follow the ATen schema's argument order (keyword-only arguments included), cut
after the last argument the opcode carries; the frontend checks that every argument past
the cut has its default value. `impl` is the fastest Python entry to the same kernel
(a method or `torch._C` binding, not the `torch.ops` overload, which costs about 1 us more
per call); where no such entry takes the arguments positionally, `_aten_call` adapts the
ATen overload itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynvm.vm.isa import OpClass, OpSpec, op

aten = torch.ops.aten


def _aten_call(overload, n_args: int):
    """Call `overload` with its first `n_args` schema arguments given positionally."""
    schema_args = overload._schema.arguments[:n_args]
    n_positional = sum(1 for a in schema_args if not a.kwarg_only)
    kw_names = tuple(a.name for a in schema_args[n_positional:])
    if not kw_names:
        return overload

    def call(*args):
        return overload(*args[:n_positional], **dict(zip(kw_names, args[n_positional:])))

    call.__name__ = f"aten_{overload.__name__.replace('.', '_')}"
    return call


def _factory(fn):
    """A factory op (`fn(*positional, dtype, layout, device)`) through torch's own binding:
    the same ATen op as the overload, a third of its call cost (the overload parses its
    keyword arguments against the schema in Python on every call)."""

    def call(*args):
        *positional, dtype, layout, device = args
        return fn(*positional, dtype=dtype, layout=layout, device=device)

    call.__name__ = fn.__name__
    return call


def _tensor(name: str, overloads: tuple, args: str, doc: str, impl=None, outs: str = "T",
            **fields) -> OpSpec:
    n_args = len(args.split(",")) if args else 0
    return op(name, OpClass.TENSOR, args, outs, doc,
              impl=impl if impl is not None else _aten_call(overloads[0], n_args),
              aten=overloads, **fields)


def _elementwise_binary(name: str, fn, *overloads) -> OpSpec:
    return _tensor(name, overloads, "A,A", f"elementwise {name.lower()} with broadcasting",
                   impl=fn)


def _elementwise_unary(name: str, fn, overload) -> OpSpec:
    return _tensor(name, (overload,), "T", f"elementwise {name.lower()}", impl=fn)


def _sdpa(q, k, v, mask, dropout_p, is_causal, scale):
    return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale)


def _sdpa_abstract(q, k, v, mask, dropout_p, is_causal, scale):
    # The output's strides depend on which kernel runs: the CPU flash kernel (no mask, no
    # dropout) returns it in the layout of its inputs, the math kernel contiguous. Views
    # downstream rely on those strides, so the shape function asks the same kernel.
    if mask is None and dropout_p == 0.0 and q.dim() == 4:
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, scale=scale)[0]
    return _sdpa(q, k, v, mask, dropout_p, is_causal, scale)


def _gelu(x, approximate):
    return torch._C._nn.gelu(x, approximate=approximate)


def _clone(x, memory_format):
    return torch.clone(x, memory_format=memory_format)


def _expand(x, size):
    return x.expand(size)


def _index_add(x, dim, index, source):
    return torch.index_add(x, dim, index, source)


def _embedding(weight, indices, padding_idx):
    return torch.embedding(weight, indices, padding_idx)


TENSOR_OPS: tuple[OpSpec, ...] = (
    # -- matrix products ------------------------------------------------------------
    _tensor("LINEAR", (aten.linear.default,), "T,T,T?", "x @ w.T + b",
            impl=torch._C._nn.linear),
    _tensor("MATMUL", (aten.matmul.default,), "T,T", "batched matrix product (broadcasting)",
            impl=torch.matmul),
    _tensor("MM", (aten.mm.default,), "T,T", "2-D matrix product", impl=torch.mm),
    _tensor("BMM", (aten.bmm.default,), "T,T", "3-D batched matrix product", impl=torch.bmm),
    _tensor("ADDMM", (aten.addmm.default,), "T,T,T", "bias + a @ b", impl=torch.addmm),
    _tensor("SDPA", (aten.scaled_dot_product_attention.default,), "T,T,T,T?,S,K,K",
            "softmax(q @ k.T * scale + mask) @ v", impl=_sdpa,
            custom_shape_fn=_sdpa_abstract),
    # -- normalisation and activations ---------------------------------------------------
    _tensor("LAYER_NORM", (aten.layer_norm.default,), "T,L,T?,T?,S,K",
            "layer norm over the trailing dims", impl=torch.layer_norm),
    _tensor("SOFTMAX", (aten.softmax.int,), "T,S,K", "softmax along a dim",
            impl=torch.softmax),
    _tensor("SOFTMAX_", (aten._softmax.default,), "T,S,K", "softmax (core ATen form)",
            impl=torch._softmax),
    _tensor("LOG_SOFTMAX", (aten.log_softmax.int,), "T,S,K", "log-softmax along a dim",
            impl=torch.log_softmax),
    _tensor("LOG_SOFTMAX_", (aten._log_softmax.default,), "T,S,K",
            "log-softmax (core ATen form)", impl=torch._log_softmax),
    _tensor("GELU", (aten.gelu.default,), "T,K", "GELU ('none' or 'tanh')", impl=_gelu),
    _elementwise_unary("RELU", torch.relu, aten.relu.default),
    _elementwise_unary("SILU", torch._C._nn.silu, aten.silu.default),
    _elementwise_unary("SIGMOID", torch.sigmoid, aten.sigmoid.default),
    _elementwise_unary("TANH", torch.tanh, aten.tanh.default),
    _elementwise_unary("EXP", torch.exp, aten.exp.default),
    _elementwise_unary("LOG", torch.log, aten.log.default),
    _elementwise_unary("SQRT", torch.sqrt, aten.sqrt.default),
    _elementwise_unary("RSQRT", torch.rsqrt, aten.rsqrt.default),
    _elementwise_unary("NEG", torch.neg, aten.neg.default),
    _elementwise_unary("ABS", torch.abs, aten.abs.default),
    _elementwise_unary("ERF", torch.erf, aten.erf.default),
    _elementwise_unary("RECIPROCAL", torch.reciprocal, aten.reciprocal.default),
    _elementwise_unary("SIN", torch.sin, aten.sin.default),
    _elementwise_unary("COS", torch.cos, aten.cos.default),
    _elementwise_unary("ROUND", torch.round, aten.round.default),
    _elementwise_unary("FLOOR", torch.floor, aten.floor.default),
    _elementwise_unary("CEIL", torch.ceil, aten.ceil.default),
    _elementwise_unary("LOGICAL_NOT", torch.logical_not, aten.logical_not.default),
    _tensor("CLAMP", (aten.clamp.default,), "T,S?,S?", "clamp to [min, max]",
            impl=torch.clamp),
    # -- elementwise binary (ALPHA != 1 is lowered to a MUL first) -----------------------
    _elementwise_binary("ADD", torch.add, aten.add.Tensor, aten.add.Scalar),
    _elementwise_binary("SUB", torch.sub, aten.sub.Tensor, aten.sub.Scalar),
    _elementwise_binary("MUL", torch.mul, aten.mul.Tensor, aten.mul.Scalar),
    _elementwise_binary("DIV", torch.div, aten.div.Tensor, aten.div.Scalar),
    _elementwise_binary("POW", torch.pow, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor),
    _elementwise_binary("MAXIMUM", torch.maximum, aten.maximum.default),
    _elementwise_binary("MINIMUM", torch.minimum, aten.minimum.default),
    _elementwise_binary("EQ", torch.eq, aten.eq.Tensor, aten.eq.Scalar),
    _elementwise_binary("NE", torch.ne, aten.ne.Tensor, aten.ne.Scalar),
    _elementwise_binary("LT", torch.lt, aten.lt.Tensor, aten.lt.Scalar),
    _elementwise_binary("LE", torch.le, aten.le.Tensor, aten.le.Scalar),
    _elementwise_binary("GT", torch.gt, aten.gt.Tensor, aten.gt.Scalar),
    _elementwise_binary("GE", torch.ge, aten.ge.Tensor, aten.ge.Scalar),
    _elementwise_binary("LOGICAL_AND", torch.logical_and, aten.logical_and.default),
    _elementwise_binary("LOGICAL_OR", torch.logical_or, aten.logical_or.default),
    _tensor("DIV_MODE", (aten.div.Tensor_mode, aten.div.Scalar_mode), "A,A,K",
            "division with rounding mode 'trunc' or 'floor'"),
    _tensor("WHERE", (aten.where.self,), "T,A,A", "cond ? a : b", impl=torch.where),
    _tensor("MASKED_FILL", (aten.masked_fill.Scalar,), "T,T,S", "fill where mask is true",
            impl=torch.masked_fill),
    # -- reductions --------------------------------------------------------------------
    _tensor("SUM", (aten.sum.dim_IntList,), "T,L?,K,K", "sum over dims",
            impl=lambda x, dim, keepdim, dtype: torch.sum(x, dim, keepdim, dtype=dtype)),
    _tensor("SUM_ALL", (aten.sum.default,), "T,K", "sum of all elements",
            impl=lambda x, dtype: torch.sum(x, dtype=dtype)),
    _tensor("MEAN", (aten.mean.dim,), "T,L?,K,K", "mean over dims",
            impl=lambda x, dim, keepdim, dtype: torch.mean(x, dim, keepdim, dtype=dtype)),
    _tensor("MEAN_ALL", (aten.mean.default,), "T,K", "mean of all elements",
            impl=lambda x, dtype: torch.mean(x, dtype=dtype)),
    _tensor("AMAX", (aten.amax.default,), "T,L,K", "max over dims", impl=torch.amax),
    _tensor("AMIN", (aten.amin.default,), "T,L,K", "min over dims", impl=torch.amin),
    _tensor("ARGMAX", (aten.argmax.default,), "T,S?,K", "index of the max",
            impl=torch.argmax),
    _tensor("CUMSUM", (aten.cumsum.default,), "T,S,K", "cumulative sum along a dim"),
    # -- views (no data movement) ----------------------------------------------------
    _tensor("VIEW", (aten.view.default, aten._unsafe_view.default), "T,L",
            "view with a new shape", impl=torch.Tensor.view, is_view=True),
    _tensor("PERMUTE", (aten.permute.default,), "T,L", "reorder dims", impl=torch.permute,
            is_view=True),
    _tensor("TRANSPOSE", (aten.transpose.int,), "T,S,S", "swap two dims",
            impl=torch.transpose, is_view=True),
    _tensor("T", (aten.t.default,), "T", "transpose a 2-D tensor", impl=torch.t,
            is_view=True),
    _tensor("UNSQUEEZE", (aten.unsqueeze.default,), "T,S", "insert a dim of size 1",
            impl=torch.unsqueeze, is_view=True),
    _tensor("SQUEEZE", (aten.squeeze.dim,), "T,S", "drop a dim of size 1",
            impl=torch.squeeze, is_view=True),
    _tensor("SQUEEZE_DIMS", (aten.squeeze.dims,), "T,L", "drop dims of size 1",
            impl=torch.squeeze, is_view=True),
    _tensor("EXPAND", (aten.expand.default,), "T,L", "broadcast to a size", impl=_expand,
            is_view=True),
    _tensor("SLICE", (aten.slice.Tensor,), "T,S,S?,S?,S", "x[start:end:step] along a dim",
            is_view=True),
    _tensor("SELECT", (aten.select.int,), "T,S,S", "x[index] along a dim",
            impl=torch.select, is_view=True),
    _tensor("ALIAS", (aten.alias.default,), "T", "a view of the whole tensor",
            is_view=True),
    _tensor("SPLIT", (aten.split.Tensor,), "T,S,S", "split into chunks of a size",
            impl=torch.split, outs="T*", is_view=True),
    _tensor("SPLIT_WITH_SIZES", (aten.split_with_sizes.default,), "T,L,S",
            "split into chunks of given sizes", impl=torch.split, outs="T*", is_view=True),
    _tensor("UNBIND", (aten.unbind.int,), "T,S", "split into slices along a dim",
            impl=torch.unbind, outs="T*", is_view=True),
    # -- copies, concatenation ---------------------------------------------------------
    _tensor("CLONE", (aten.clone.default,), "T,K", "copy (optionally to a memory format)",
            impl=_clone),
    _tensor("CAT", (aten.cat.default,), "TL,S", "concatenate along a dim", impl=torch.cat),
    _tensor("STACK", (aten.stack.default,), "TL,S", "stack along a new dim",
            impl=torch.stack),
    _tensor("TO_COPY", (aten._to_copy.default,), "T,K,K,K",
            "copy to a dtype/layout/device"),
    # -- indexing ---------------------------------------------------------------------
    _tensor("EMBEDDING", (aten.embedding.default,), "T,T,S", "rows of a table",
            impl=_embedding),
    _tensor("INDEX_SELECT", (aten.index_select.default,), "T,S,T", "gather slices by index",
            impl=torch.index_select),
    _tensor("INDEX_ADD", (aten.index_add.default,), "T,S,T,T",
            "out-of-place x.index_add(dim, index, source)", impl=_index_add),
    _tensor("SCATTER_ADD", (aten.scatter_add.default,), "T,S,T,T",
            "out-of-place scatter-add", impl=torch.scatter_add),
    _tensor("SCATTER_REDUCE", (aten.scatter_reduce.two,), "T,S,T,T,K,K",
            "out-of-place scatter with a reduction ('sum', 'mean', 'amax', ...)"),
    _tensor("GATHER", (aten.gather.default,), "T,S,T", "gather along a dim"),
    # -- creation (device operands are replaced by the runtime's device) ---------------
    _tensor("FULL", (aten.full.default,), "L,S,K,K,K", "a tensor filled with a value",
            impl=_factory(torch.full)),
    _tensor("ZEROS", (aten.zeros.default,), "L,K,K,K", "a tensor of zeros",
            impl=_factory(torch.zeros)),
    _tensor("ONES", (aten.ones.default,), "L,K,K,K", "a tensor of ones",
            impl=_factory(torch.ones)),
    _tensor("FULL_LIKE", (aten.full_like.default,), "T,S,K,K,K", "full, shaped like x",
            impl=_factory(torch.full_like)),
    _tensor("ZEROS_LIKE", (aten.zeros_like.default,), "T,K,K,K", "zeros, shaped like x",
            impl=_factory(torch.zeros_like)),
    _tensor("ONES_LIKE", (aten.ones_like.default,), "T,K,K,K", "ones, shaped like x",
            impl=_factory(torch.ones_like)),
    _tensor("ARANGE", (aten.arange.start_step,), "S,S,S,K,K,K", "start, start+step, ...",
            impl=_factory(torch.arange)),
    _tensor("SCALAR_TENSOR", (aten.scalar_tensor.default,), "S,K,K,K",
            "a 0-dim tensor holding a scalar", impl=_factory(torch.scalar_tensor)),
)
