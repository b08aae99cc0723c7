"""bench.resnet_layers: the per-layer join of the JIT's, oneDNN's and ONNX Runtime's
convolution times (Note [ResNet layers side by side])."""

from __future__ import annotations

import pytest
import torch

from bench import resnet_layers

X, W = (1, 64, 56, 56), (256, 64, 1, 1)
OTHER = (1, 256, 56, 56)


def test_jit_key_per_fused_form():
    unary = [list(X), list(W), [256], [], [], [], [], [], [], []]
    binary = [list(X), list(OTHER), list(W), [256], [], [], [], [], [], [], [], [], []]
    in_place = [list(OTHER), list(X), list(W), [256], [], [], [], [], [], [], [], [], []]
    assert resnet_layers.jit_conv_key("mkldnn::_convolution_pointwise", unary) == (X, W)
    assert resnet_layers.jit_conv_key("mkldnn::_convolution_pointwise", binary) == (X, W)
    assert resnet_layers.jit_conv_key("mkldnn::_convolution_pointwise_", in_place) == (X, W)
    assert resnet_layers.jit_conv_key("aten::addmm", [[1000], [1, 2048], [2048, 1000]]) is None


def test_onednn_exec_reads_verbose_lines():
    line = ("onednn_verbose,v1,primitive,exec,cpu,convolution,brgconv_1x1:avx512_core,"
            "forward_inference,src:f32::blocked:acdb::f0 wei:f32:a:blocked:Acdb64a::f0 "
            "bia:f32:a:blocked:a::f0 dst:f32::blocked:acdb::f0,attr-scratchpad:user "
            "attr-post-ops:sum+eltwise_relu,alg:convolution_direct,"
            "mb1_ic64oc256_ih56oh56kh1sh1dh0ph0_iw56ow56kw1sw1dw0pw0,0.372")
    grouped = ("onednn_verbose,v1,primitive,exec,cpu,convolution,brg_conv_fwd:avx512_core,"
               "forward_inference,src:f32 wei:f32 dst:f32,,alg:convolution_direct,"
               "mb2_g32ic32oc32_ih8oh8kh3sh1dh0ph1_iw8ow8kw3sw1dw0pw1,0.05")
    creation = line.replace(",exec,", ",create:cache_hit,")
    found = resnet_layers.onednn_exec([line, line, creation, grouped, "not a line"])
    assert found[(X, W)] == ("brgconv_1x1:avx512_core", 0.744, 2)
    assert found[((2, 32, 8, 8), (32, 1, 3, 3))][2] == 1


def test_the_verbose_format_is_the_one_torch_prints(capfd):
    # the parser is held to what this torch's oneDNN prints, not to a format from memory
    x = torch.randn(1, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(4, 8, 3, 3)
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        torch.ops.mkldnn._convolution_pointwise(x, weight, None, [1, 1], [1, 1], [1, 1], 1,
                                                "relu", [], "")
    lines = capfd.readouterr().out.splitlines()
    found = resnet_layers.onednn_exec(lines)
    assert list(found) == [((1, 8, 6, 6), (4, 8, 3, 3))]


def test_ort_join_and_table():
    trace = [{"cat": "Session", "name": "model_run"}, {"cat": "Session", "name": "model_run"},
             *({"cat": "Node", "name": "conv_kernel_time", "dur": 300,
                "args": {"op_name": "Conv", "input_type_shape": [{"float": list(X)},
                                                                 {"float": list(W)}]}}
               for _ in range(2)),
             {"cat": "Node", "name": "pool_kernel_time", "dur": 100,
              "args": {"op_name": "MaxPool", "input_type_shape": [{"float": list(X)}]}}]
    ort, runs = resnet_layers.ort_conv_times(trace)
    assert runs == 2 and ort == {(X, W): (0.6, 2)}
    rows = resnet_layers.join({(X, W): (0.45, 1)}, {k: (ms / runs, n // runs)
                                                    for k, (ms, n) in ort.items()},
                              {(X, W): ("brgconv_1x1:avx512_core", 1.2, 3)}, onednn_calls=3)
    row = dict(rows[0])
    assert len(rows) == 1 and row.pop("exec_ms") == pytest.approx(0.4)
    assert row == {"input": X, "weight": W, "count": 1, "jit_ms": 0.45, "ort_ms": 0.3,
                   "impl": "brgconv_1x1:avx512_core"}
    table = resnet_layers.markdown(rows)
    assert "| [1, 64, 56, 56] | [256, 64, 1, 1] | 1 | 0.450 | 0.300 | 1.50 | 0.400 | 0.050 |" \
        in table
    assert table.splitlines()[-1].startswith("| all convolutions | | 1 | 0.450 | 0.300 | 1.50 |")
