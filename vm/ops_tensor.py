"""Tensor instructions: matrix products, reductions, views, copies and creation.

The other families live next door (`ops_elementwise`, `ops_nn`, `ops_index`); how an
entry is declared, and what its operands are, is in `dynvm.vm.ops_common`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynvm.vm.isa import ChannelsLast, Gemm, OpSpec, OutForm
from dynvm.vm.ops_common import factory, tensor_op

aten = torch.ops.aten
_nn = torch._C._nn


def _sdpa(q, k, v, mask, dropout_p, is_causal, scale):
    return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale)


def _sdpa_abstract(q, k, v, mask, dropout_p, is_causal, scale):
    # The output's strides depend on which kernel runs: the CPU flash kernel returns it in
    # the layout of its query (a [B, L, H, E] projection transposed to [B, H, L, E] comes
    # out that way), the math kernel contiguous. Views downstream rely on those strides
    # (Llama, Qwen2, T5: a masked SDPA, then transpose and view), so the shape function
    # asks torch's own kernel choice. It reads only metadata, but on meta tensors it
    # always answers "math", so it is asked about CPU stand-ins of the operands (never
    # written, never read). A CUDA runtime chooses among other kernels: not modelled.
    if q.device.type == "meta" and q.dim() == 4 and _cpu_sdp_choice(
            q, k, v, mask, dropout_p, is_causal, scale) == _FLASH:
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
    return _sdpa(q, k, v, mask, dropout_p, is_causal, scale)


_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def _cpu_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale) -> int:
    def cpu(t):
        return None if t is None else torch.empty_strided(t.shape, t.stride(),
                                                          dtype=t.dtype)
    return torch._fused_sdp_choice(cpu(q), cpu(k), cpu(v), cpu(mask), dropout_p, is_causal,
                                   scale=scale)


def _clone(x, memory_format):
    return torch.clone(x, memory_format=memory_format)


def _expand(x, size):
    return x.expand(size)


def _sum(x, dim, keepdim, dtype):
    return torch.sum(x, dim, keepdim, dtype=dtype)


def _sum_all(x, dtype):
    return torch.sum(x, dtype=dtype)


def _mean(x, dim, keepdim, dtype):
    return torch.mean(x, dim, keepdim, dtype=dtype)


def _mean_all(x, dtype):
    return torch.mean(x, dtype=dtype)


def _prod_all(x, dtype):
    return torch.prod(x, dtype=dtype)


def _prod(x, dim, keepdim, dtype):
    return torch.prod(x, dim, keepdim, dtype=dtype)


def _var(x, dim, correction, keepdim):
    return torch.var(x, dim, correction=correction, keepdim=keepdim)


def _vector_norm(x, order, dim, keepdim, dtype):
    return torch._C._linalg.linalg_vector_norm(x, order, dim, keepdim, dtype=dtype)


def _cumprod(x, dim, dtype):
    return torch.cumprod(x, dim, dtype=dtype)


_aten_to_copy = aten._to_copy.default


def _to_copy(x, dtype, layout, device):
    # Tensor.to with copy=True reaches the same _to_copy kernel for 4 us less than the
    # overload (measured: 3.0 vs 7.0 us); other layouts than strided take the overload.
    if layout is None or layout is torch.strided:
        return x.to(dtype=dtype, device=device, copy=True)
    return _aten_to_copy(x, dtype=dtype, layout=layout, device=device)


def _alias(x):
    return x.view_as(x)   # the same view as aten.alias, half its call cost


def _cumsum(x, dim, dtype):
    return torch.cumsum(x, dim, dtype=dtype)


_aten_slice = aten.slice.Tensor


def _slice(x, dim, start, end, step):
    # Tensor.narrow for unit steps: the same view, about 1 us faster than the overload.
    # The bounds are normalised as aten.slice does (None, negative, past the end).
    if step != 1:
        return _aten_slice(x, dim, start, end, step)
    size = x.shape[dim]
    if start is None:
        start = 0
    elif start < 0:
        start = max(start + size, 0)
    if end is None or end > size:
        end = size
    elif end < 0:
        end = max(end + size, 0)
    start = min(start, size)
    return x.narrow(dim, start, max(end - start, 0))


def _sum_out(x, dims, keepdim, dtype, out):
    return torch.sum(x, dims, keepdim, dtype=dtype, out=out)


def _mean_out(x, dims, keepdim, dtype, out):
    return torch.mean(x, dims, keepdim, dtype=dtype, out=out)


def _with_dims(x, dims, keepdim, dtype):
    return dims is not None


def _linear_out(x, w, b, out):
    return _nn.linear(x, w, b, out=out)


def _addmm_out(bias, a, b, out):
    return torch.addmm(bias, a, b, out=out)


def _matrix_out(fn):
    return OutForm(lambda a, b, out: fn(a, b, out=out))


def _cat_out(tensors, dim, out):
    return torch.cat(tensors, dim, out=out)


def _zeros_out(size, dtype, layout, device, out):
    return torch.zeros(size, out=out)


def _full_out(size, value, dtype, layout, device, out):
    return torch.full(size, value, out=out)


def _transpose_dims(rank: int, dim0, dim1) -> tuple[int, ...] | None:
    """TRANSPOSE's permutation of a rank-`rank` operand (None: dims not literal ints)."""
    if not (isinstance(dim0, int) and isinstance(dim1, int)):
        return None
    dims = list(range(rank))
    dims[dim0 % rank], dims[dim1 % rank] = dims[dim1 % rank], dims[dim0 % rank]
    return tuple(dims)


def _permute_dims(rank: int, dims) -> tuple[int, ...] | None:
    """PERMUTE's permutation of a rank-`rank` operand (None: dims not a literal list)."""
    if not isinstance(dims, list | tuple):
        return None
    return tuple(d % rank for d in dims)


TENSOR_OPS: tuple[OpSpec, ...] = (
    # -- matrix products ------------------------------------------------------------
    tensor_op("LINEAR", aten.linear.default, "x @ w.T + b", impl=_nn.linear,
              out=OutForm(_linear_out),
              gemm=Gemm(0, 1, 2, b_is_nk=True, a_min_rank=1, bias_is_vector=True)),
    tensor_op("MATMUL", aten.matmul.default, "batched matrix product (broadcasting)",
              impl=torch.matmul, out=_matrix_out(torch.matmul), gemm=Gemm(0, 1, b_batched=True)),
    tensor_op("MM", aten.mm.default, "2-D matrix product", impl=torch.mm,
              out=_matrix_out(torch.mm), gemm=Gemm(0, 1, a_2d=True)),
    tensor_op("BMM", aten.bmm.default, "3-D batched matrix product", impl=torch.bmm,
              out=_matrix_out(torch.bmm)),
    tensor_op("ADDMV", aten.addmv.default, "beta * bias + alpha * (a @ v)"),
    tensor_op("ADDMM", aten.addmm.default, "bias + a @ b", args="T,T,T", impl=torch.addmm,
              out=OutForm(_addmm_out), gemm=Gemm(1, 2, bias=0, a_2d=True)),
    tensor_op("SDPA", aten.scaled_dot_product_attention.default,
              "softmax(q @ k.T * scale + mask) @ v", args="T,T,T,T?,S,K,K", impl=_sdpa,
              custom_shape_fn=_sdpa_abstract),
    # -- reductions --------------------------------------------------------------------
    tensor_op("SUM", aten.sum.dim_IntList, "sum over dims", impl=_sum,
              out=OutForm(_sum_out, accepts=_with_dims)),
    tensor_op("SUM_ALL", aten.sum.default, "sum of all elements", impl=_sum_all),
    tensor_op("MEAN", aten.mean.dim, "mean over dims", impl=_mean,
              out=OutForm(_mean_out, accepts=_with_dims), channels_last=ChannelsLast.STRUCTURED),
    tensor_op("MEAN_ALL", aten.mean.default, "mean of all elements", impl=_mean_all),
    tensor_op("AMAX", aten.amax.default, "max over dims", impl=torch.amax),
    tensor_op("AMIN", aten.amin.default, "min over dims", impl=torch.amin),
    tensor_op("ARGMAX", aten.argmax.default, "index of the max", impl=torch.argmax),
    tensor_op("ARGMIN", aten.argmin.default, "index of the min", impl=torch.argmin),
    tensor_op("MAX_DIM", aten.max.dim, "max along a dim, with its index", impl=torch.max),
    tensor_op("MIN_DIM", aten.min.dim, "min along a dim, with its index", impl=torch.min),
    tensor_op("ANY", aten.any.default, "whether any element is true", impl=torch.any),
    tensor_op("ANY_DIM", aten.any.dim, "whether any is true along a dim", impl=torch.any),
    tensor_op("ANY_DIMS", aten.any.dims, "whether any is true over dims", impl=torch.any),
    tensor_op("PROD_ALL", aten.prod.default, "product of all elements", impl=_prod_all),
    tensor_op("PROD", aten.prod.dim_int, "product along a dim", impl=_prod),
    tensor_op("VAR", aten.var.correction, "variance over dims with a correction",
              impl=_var),
    tensor_op("VECTOR_NORM", aten.linalg_vector_norm.default, "vector p-norm over dims",
              impl=_vector_norm),
    tensor_op("MAX_ALL", aten.max.default, "the largest element", impl=torch.max),
    tensor_op("MIN_ALL", aten.min.default, "the smallest element", impl=torch.min),
    tensor_op("MEDIAN_ALL", aten.median.default, "the median element", impl=torch.median),
    tensor_op("MEDIAN_DIM", aten.median.dim, "median along a dim, with its index",
              impl=torch.median),
    tensor_op("MODE", aten.mode.default, "most frequent value along a dim, with its index",
              impl=torch.mode),
    tensor_op("KTHVALUE", aten.kthvalue.default, "k-th smallest along a dim, with its index",
              impl=torch.kthvalue),
    tensor_op("HISTC", aten.histc.default, "histogram with equal bins", impl=torch.histc),
    tensor_op("CUMMAX", aten.cummax.default, "running max along a dim, with indices",
              impl=torch.cummax),
    tensor_op("CUMMIN", aten.cummin.default, "running min along a dim, with indices",
              impl=torch.cummin),
    tensor_op("LOGCUMSUMEXP", aten.logcumsumexp.default, "log of the running sum of exp",
              impl=torch.logcumsumexp),
    tensor_op("CUMSUM", aten.cumsum.default, "cumulative sum along a dim", impl=_cumsum),
    tensor_op("CUMPROD", aten.cumprod.default, "cumulative product along a dim",
              impl=_cumprod),
    # -- views (no data movement) ----------------------------------------------------
    # torch.export resolves `reshape` and `flatten` to
    # `view` for the example's layout; a channels-last input (which eager's reshape
    # copies) would then fail here. reshape is a view wherever view succeeds, else a
    # copy with the same values; aliasing analysis still treats the result as a view,
    # which only costs reuse it could have had.
    tensor_op("VIEW", (aten.view.default, aten._unsafe_view.default),
              "view with a new shape (a copy where the layout allows no view)",
              impl=torch.Tensor.reshape),
    tensor_op("PERMUTE", aten.permute.default, "reorder dims", impl=torch.permute,
              permutation=_permute_dims),
    tensor_op("TRANSPOSE", aten.transpose.int, "swap two dims", impl=torch.transpose,
              permutation=_transpose_dims),
    tensor_op("T", aten.t.default, "transpose a 2-D tensor", impl=torch.t),
    tensor_op("UNSQUEEZE", aten.unsqueeze.default, "insert a dim of size 1",
              impl=torch.unsqueeze),
    tensor_op("SQUEEZE", aten.squeeze.dim, "drop a dim of size 1", impl=torch.squeeze),
    tensor_op("SQUEEZE_DIMS", aten.squeeze.dims, "drop dims of size 1", impl=torch.squeeze),
    tensor_op("EXPAND", aten.expand.default, "broadcast to a size", args="T,L",
              impl=_expand),
    tensor_op("SLICE", aten.slice.Tensor, "x[start:end:step] along a dim", impl=_slice),
    tensor_op("SELECT", aten.select.int, "x[index] along a dim", impl=torch.select),
    tensor_op("ALIAS", aten.alias.default, "a view of the whole tensor", impl=_alias),
    tensor_op("AS_STRIDED", aten.as_strided.default, "a view with given sizes and strides",
              impl=torch.as_strided),
    tensor_op("DIAGONAL", aten.diagonal.default, "a diagonal of two dims, as a view",
              impl=torch.diagonal),
    tensor_op("UNFOLD", aten.unfold.default, "sliding windows along a dim, as a view",
              impl=torch.Tensor.unfold),
    tensor_op("VIEW_AS_REAL", aten.view_as_real.default,
              "a complex tensor as real pairs (a trailing dim of 2)", impl=torch.view_as_real),
    tensor_op("VIEW_AS_COMPLEX", aten.view_as_complex.default,
              "real pairs as a complex tensor", impl=torch.view_as_complex),
    tensor_op("SPLIT", aten.split.Tensor, "split into chunks of a size", impl=torch.split),
    tensor_op("SPLIT_WITH_SIZES", aten.split_with_sizes.default,
              "split into chunks of given sizes", impl=torch.split),
    tensor_op("UNBIND", aten.unbind.int, "split into slices along a dim", impl=torch.unbind),
    # -- copies, concatenation ---------------------------------------------------------
    tensor_op("CLONE", aten.clone.default, "copy (optionally to a memory format)",
              impl=_clone, is_copy=True),
    tensor_op("CAT", aten.cat.default, "concatenate along a dim", impl=torch.cat,
              out=OutForm(_cat_out), channels_last=ChannelsLast.STRUCTURED),
    tensor_op("STACK", aten.stack.default, "stack along a new dim", impl=torch.stack),
    tensor_op("COPY", aten.copy.default, "src's values in self's shape, dtype and device",
              n_args=2),
    tensor_op("FLIP", aten.flip.default, "reverse the order along dims", impl=torch.flip),
    tensor_op("REPEAT", aten.repeat.default, "tile the tensor", impl=torch.Tensor.repeat),
    tensor_op("SLICE_SCATTER", aten.slice_scatter.default,
              "a copy of x with a slice replaced by src", impl=torch.slice_scatter),
    tensor_op("TO_COPY", aten._to_copy.default, "copy to a dtype/layout/device", n_args=4,
              impl=_to_copy, is_copy=True),
    # -- spectral (complex results stay inside the program) ---------------------------
    tensor_op("FFT_R2C", aten._fft_r2c.default, "real-to-complex FFT over dims",
              impl=torch._fft_r2c),
    tensor_op("FFT_C2R", aten._fft_c2r.default, "complex-to-real inverse FFT over dims",
              impl=torch._fft_c2r),
    tensor_op("POLAR", aten.polar.default, "abs * exp(i * angle)", impl=torch.polar),
    tensor_op("COMPLEX", aten.complex.default, "real + i * imag", impl=torch.complex),
    # -- creation (device operands are replaced by the runtime's device) ---------------
    tensor_op("FULL", aten.full.default, "a tensor filled with a value", n_args=5,
              impl=factory(torch.full), out=OutForm(_full_out)),
    tensor_op("ZEROS", aten.zeros.default, "a tensor of zeros", n_args=4,
              impl=factory(torch.zeros), out=OutForm(_zeros_out)),
    tensor_op("ONES", aten.ones.default, "a tensor of ones", n_args=4,
              impl=factory(torch.ones)),
    tensor_op("FULL_LIKE", aten.full_like.default, "full, shaped like x", n_args=5,
              impl=factory(torch.full_like)),
    tensor_op("ZEROS_LIKE", aten.zeros_like.default, "zeros, shaped like x", n_args=4,
              impl=factory(torch.zeros_like)),
    tensor_op("ONES_LIKE", aten.ones_like.default, "ones, shaped like x", n_args=4,
              impl=factory(torch.ones_like)),
    tensor_op("ARANGE", aten.arange.start_step, "start, start+step, ...", n_args=6,
              impl=factory(torch.arange)),
    tensor_op("SCALAR_TENSOR", aten.scalar_tensor.default, "a 0-dim tensor holding a scalar",
              n_args=4, impl=factory(torch.scalar_tensor)),
    tensor_op("EMPTY", aten.empty.memory_format, "an uninitialized tensor", n_args=4,
              impl=factory(torch.empty)),
    tensor_op("EMPTY_STRIDED", aten.empty_strided.default,
              "an uninitialized tensor with given strides", n_args=5,
              impl=factory(torch.empty_strided)),
    tensor_op("EMPTY_PERMUTED", aten.empty_permuted.default,
              "an uninitialized tensor laid out in a given dim order", n_args=5,
              impl=factory(torch.empty_permuted)),
    # Random tensors: a program may draw noise (sampling, diffusion); never folded.
    tensor_op("RAND", aten.rand.default, "uniform random numbers in [0, 1)", n_args=4,
              impl=factory(torch.rand)),
    tensor_op("RANDN", aten.randn.default, "standard normal random numbers", n_args=4,
              impl=factory(torch.randn)),
    tensor_op("RAND_LIKE", aten.rand_like.default, "uniform random numbers shaped like x",
              n_args=4, impl=factory(torch.rand_like)),
    tensor_op("RANDN_LIKE", aten.randn_like.default, "normal random numbers shaped like x",
              n_args=4, impl=factory(torch.randn_like)),
    tensor_op("MULTINOMIAL", aten.multinomial.default,
              "draw indices from rows of probabilities", args="T,S,K", impl=torch.multinomial),
    tensor_op("TRIU_INDICES", aten.triu_indices.default,
              "the indices of a matrix's upper triangle", n_args=6,
              impl=factory(torch.triu_indices)),
    tensor_op("TRIL_INDICES", aten.tril_indices.default,
              "the indices of a matrix's lower triangle", n_args=6,
              impl=factory(torch.tril_indices)),
    tensor_op("RANDPERM", aten.randperm.default, "a random permutation of 0..n-1",
              n_args=4, impl=factory(torch.randperm)),
)
