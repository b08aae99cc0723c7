"""bench.fusion_share's op groups: GEMM/conv/attention are the vendor's, whatever contains
an add (addmm) is not mistaken for an elementwise op, views are neither."""

from bench.fusion_share import group_of


def test_profiler_ops_fall_in_the_right_group():
    vendor = ["mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm",
              "mkldnn::_convolution_pointwise", "aten::mkldnn_convolution",
              "aten::_scaled_dot_product_flash_attention_for_cpu"]
    fusable = ["aten::add", "aten::add_", "aten::mul", "aten::gelu", "aten::_softmax",
               "aten::native_layer_norm", "aten::_native_batch_norm_legit_no_training",
               "aten::copy_", "aten::max_pool2d_with_indices", "aten::mean"]
    other = ["aten::view", "aten::permute", "aten::empty", "aten::select"]
    assert [group_of(op) for op in vendor] == ["vendor"] * len(vendor)
    assert [group_of(op) for op in fusable] == ["fusable"] * len(fusable)
    assert [group_of(op) for op in other] == ["other"] * len(other)
