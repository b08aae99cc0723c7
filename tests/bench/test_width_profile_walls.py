"""bench/width_profile.py's --walls (Note [Walls inside the kernel]) at a tiny width: the
JIT's kernel calls are summed by piece of a BERT layer while inside `kernel_walls`, the
call's results are unchanged by the wrappers, and the kernels' own functions are back
afterwards. No timing is asserted (the host is shared)."""

from __future__ import annotations

import pytest
import torch

import dynvm
from bench import full_width, width_profile
from dynvm.jit.backends.cpu import norm_bf16
from dynvm.jit.backends.cpu.precision import precision_available
from tests.jit import _jit_helpers as h


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_walls_by_piece_and_kernels_restored(precision):
    if precision_available(precision) is not None:
        pytest.skip(str(precision_available(precision)))
    model = full_width.bert(hidden=32, layers=2, heads=2, ffn=64, vocab=128,
                            shapes=((2, 16), (3, 24)))
    program = dynvm.compile(model.module, model.export_inputs, model.dynamic_shapes)
    config = h.eager_config(cpu_fusion="always", precision=precision)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        x = model.inputs[0]
        rt(*x)
        want = rt(*x)
        assert rt.stats()["specialized_region_calls"] > 0
        kernels = [s for r in rt.jit.regions.values() for s in r.installed()]
        before = [dict(s.fn.__globals__) for s in kernels]
        with width_profile.kernel_walls(rt) as walls:
            width_profile.reset(walls)
            got = rt(*x)
            pieces = {k: v for k, v in walls.items() if k != "_gemms"}
            assert walls["_gemms"] == 4 * 2         # four GEMMs a layer, two layers
        assert torch.equal(got, want)
        assert [dict(s.fn.__globals__) for s in kernels] == before
    for piece in ("QKV GEMM", "output projection + residual", "FFN up + GELU",
                  "FFN down + residual", "attention (SDPA)", "layer norm"):
        assert pieces.get(piece, 0.0) > 0.0, (piece, pieces)
    if precision == "bf16":
        assert pieces.get("mask bias", 0.0) > 0.0
        # the layer norms' casts are in the norms where dynvm's kernel runs (Note [Layer
        # norm writing bf16 too]); the first GEMM's input cast stays
        assert (pieces.get("casts", 0.0) > 0.0) != norm_bf16.available(), pieces


def test_piece_of_names_the_generated_callees():
    assert width_profile.piece_of("onednn_linear_primitive29") is None
    assert width_profile.piece_of("SDPA33") == "attention (SDPA)"
    assert width_profile.piece_of("masked_attention") == "attention (SDPA)"
    assert width_profile.piece_of("qkv_attention") == "attention (SDPA)"
    assert width_profile.piece_of("to_bf1627") == "casts"
    assert width_profile.piece_of("layer_norm_bf1614") == "layer norm"
    assert width_profile.piece_of("ARANGE20") == "prologue / other ops"
