"""Neural-network layer instructions: softmax, normalisation, convolution, pooling,
padding and resampling."""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

from dynvm.vm.isa import ChannelsLast, OutForm, RowKind, RowOp
from dynvm.vm.ops_common import tensor_op

aten = torch.ops.aten
_nn = torch._C._nn


def _layer_norm_out(x, shape, weight, bias, eps, _cudnn, out, mean, rstd):
    return aten.native_layer_norm.out(x, shape, weight, bias, eps, out0=out, out1=mean,
                                      out2=rstd)[0]


def _layer_norm_scratch(x, shape, weight, bias, eps, _cudnn):
    # mean and rstd keep the leading dims and a 1 per normalized dim, contiguous, in the
    # input's dtype: what the CPU kernel returns and its out= form demands for every
    # dtype (the meta kernel says fp32 for fp16/bf16 inputs, and its Python
    # decomposition costs 5 ms a call; planning asks once per layer norm).
    stats = (*x.shape[:x.dim() - len(shape)], *(1,) * len(shape))
    return (torch.empty(stats, dtype=x.dtype, device=x.device),
            torch.empty(stats, dtype=x.dtype, device=x.device))


def _stats_in_input_dtype(kernel):
    """A norm's shape function whose saved statistics (results 1 and 2) have the input's
    dtype, as the CPU kernels give them; their meta kernels say fp32 for fp16/bf16
    inputs (the CUDA kernels' accumulation type; abstract values follow the CPU)."""

    def abstract(x, *args):
        y, *stats = kernel(x, *args)
        return (y, *(s.to(x.dtype) if s.is_floating_point() else s for s in stats))

    return abstract


def _convolution_abstract(x, w, b, stride, padding, dilation, transposed, output_padding,
                          groups):
    # The meta kernel answers contiguous; the CPU kernels (oneDNN) answer channels-last
    # (3d) when the input or the weight is laid out so, except the 3-d path that batch 1
    # with groups 1 takes, whose result is contiguous. Views after a convolution depend
    # on it (ConvNeXt's blocks permute to [N, C, H, W] views of NHWC data).
    # test_isa_table sweeps the rule against the real kernels.
    y = torch.convolution(x, w, b, stride, padding, dilation, transposed, output_padding,
                          groups)
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(y.dim())
    if layout is None or (y.dim() == 5 and x.shape[0] == 1 and groups == 1):
        return y
    if suggest_memory_format(x) == layout or suggest_memory_format(w) == layout:
        return y.contiguous(memory_format=layout)
    return y


def _softmax_out(x, dim, dtype, out):
    return aten._softmax.out(x, dim, False, out=out)


def _log_softmax_out(x, dim, dtype, out):
    return aten._log_softmax.out(x, dim, False, out=out)


def _no_dtype(x, dim, dtype):
    return dtype is None


def _batch_norm_abstract(x, weight, bias, mean, var, momentum, eps):
    # In inference the kernel saves no statistics: it returns empty tensors where the
    # meta kernel says [C]. Graphs read only the output; the shapes follow the kernel.
    y = torch._native_batch_norm_legit_no_training(x, weight, bias, mean, var, momentum,
                                                   eps)[0]
    return y, x.new_empty((0,)), x.new_empty((0,))


NN_OPS = (
    # -- softmax ---------------------------------------------------------------------
    tensor_op("SOFTMAX", aten.softmax.int, "softmax along a dim", impl=torch.softmax,
              out=OutForm(_softmax_out, accepts=_no_dtype), row=RowOp(RowKind.SOFTMAX, None)),
    tensor_op("SOFTMAX_", aten._softmax.default, "softmax (core ATen form)",
              impl=torch._softmax, row=RowOp(RowKind.SOFTMAX, False)),
    tensor_op("LOG_SOFTMAX", aten.log_softmax.int, "log-softmax along a dim",
              impl=torch.log_softmax, out=OutForm(_log_softmax_out, accepts=_no_dtype)),
    tensor_op("LOG_SOFTMAX_", aten._log_softmax.default, "log-softmax (core ATen form)",
              impl=torch._log_softmax),
    # -- normalisation -----------------------------------------------------------------
    tensor_op("LAYER_NORM", aten.layer_norm.default, "layer norm over the trailing dims",
              impl=torch.layer_norm,
              out=OutForm(_layer_norm_out, scratch=_layer_norm_scratch),
              row=RowOp(RowKind.LAYER_NORM)),
    # Note [RMS norm as one op] in dynvm.vm.frontend.rms_norm: what Llama-style norms
    # of float32 values lower to (the same chain of operations, bit for bit).
    tensor_op("RMS_NORM", aten.rms_norm.default,
              "RMS norm over the trailing dims: x * rsqrt(mean(x^2) + eps) * weight",
              impl=torch.rms_norm),
    tensor_op("NATIVE_LAYER_NORM", aten.native_layer_norm.default,
              "layer norm with its mean and rstd", impl=torch.native_layer_norm,
              custom_shape_fn=_stats_in_input_dtype(torch.native_layer_norm)),
    tensor_op("BATCH_NORM", aten._native_batch_norm_legit_no_training.default,
              "batch norm with running statistics (inference)",
              impl=torch._native_batch_norm_legit_no_training,
              custom_shape_fn=_batch_norm_abstract, channels_last=ChannelsLast.STRUCTURED,
              folds_into_conv=True),
    tensor_op("BATCH_NORM_NO_STATS", aten._native_batch_norm_legit.no_stats,
              "batch norm over the batch's own statistics (instance norm)",
              impl=torch._native_batch_norm_legit,
              custom_shape_fn=_stats_in_input_dtype(torch._native_batch_norm_legit)),
    tensor_op("GROUP_NORM", aten.native_group_norm.default,
              "group norm with its mean and rstd", impl=torch.native_group_norm),
    # -- convolution -----------------------------------------------------------------
    tensor_op("CONVOLUTION", aten.convolution.default,
              "N-d convolution: grouped, dilated, strided, or transposed",
              impl=torch.convolution, custom_shape_fn=_convolution_abstract,
              channels_last=ChannelsLast.CONVOLUTION),
    # -- pooling ---------------------------------------------------------------------
    tensor_op("MAX_POOL2D", aten.max_pool2d_with_indices.default,
              "2-d max pooling with the argmax indices", impl=_nn.max_pool2d_with_indices,
              channels_last=ChannelsLast.STRUCTURED),
    tensor_op("MAX_POOL3D", aten.max_pool3d_with_indices.default,
              "3-d max pooling with the argmax indices", impl=_nn.max_pool3d_with_indices),
    tensor_op("AVG_POOL2D", aten.avg_pool2d.default, "2-d average pooling",
              impl=_nn.avg_pool2d, channels_last=ChannelsLast.STRUCTURED),
    tensor_op("AVG_POOL3D", aten.avg_pool3d.default, "3-d average pooling",
              impl=_nn.avg_pool3d),
    tensor_op("ADAPTIVE_AVG_POOL2D", aten._adaptive_avg_pool2d.default,
              "2-d average pooling to an output size", impl=torch._adaptive_avg_pool2d,
              channels_last=ChannelsLast.STRUCTURED),
    tensor_op("ADAPTIVE_AVG_POOL3D", aten._adaptive_avg_pool3d.default,
              "3-d average pooling to an output size", impl=torch._adaptive_avg_pool3d),
    tensor_op("ADAPTIVE_MAX_POOL2D", aten.adaptive_max_pool2d.default,
              "2-d max pooling to an output size, with indices",
              impl=_nn.adaptive_max_pool2d),
    tensor_op("ADAPTIVE_MAX_POOL3D", aten.adaptive_max_pool3d.default,
              "3-d max pooling to an output size, with indices",
              impl=torch._C._nn.adaptive_max_pool3d),
    # -- padding and resampling ------------------------------------------------------
    tensor_op("CONSTANT_PAD", aten.constant_pad_nd.default,
              "pad the trailing dims with a value", impl=torch.constant_pad_nd),
    tensor_op("UPSAMPLE_NEAREST2D", aten.upsample_nearest2d.vec,
              "nearest-neighbour resize to a size or by scale factors",
              impl=_nn.upsample_nearest2d),
    tensor_op("UPSAMPLE_BILINEAR2D", aten.upsample_bilinear2d.vec,
              "bilinear resize to a size or by scale factors",
              impl=_nn.upsample_bilinear2d),
    tensor_op("GRID_SAMPLER_2D", aten.grid_sampler_2d.default,
              "sample an image at grid points", impl=torch.grid_sampler_2d),
    tensor_op("GRID_SAMPLER_3D", aten.grid_sampler_3d.default,
              "sample a volume at grid points", impl=torch.grid_sampler_3d),
    # -- distances -------------------------------------------------------------------
    tensor_op("CDIST", aten._cdist_forward.default, "p-norm distance of all row pairs"),
    tensor_op("PDIST", aten._pdist_forward.default,
              "p-norm distance of all row pairs of one matrix (upper triangle)"),
)
