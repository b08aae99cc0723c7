"""A run of oneDNN primitives as one native call over an arena of the chain's values
(Note [A chain of primitives in one call] in jit/backends/cpu/onednn_chain.py): kernels
whose chains hold convolutions, residuals written in place and a max pooling make one
call of the chain library and agree with eager over random batches, offset and strided
inputs, fp32 and bf16; a shape without an arena runs the steps one by one; a returned
tensor is not changed by the next call; two threads calling one chain at once each get
their own results; where the library is absent nothing changes.

Tolerance as tests/jit/test_cpu_conv_primitives.py's.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import chain_layout_choice, onednn_api, onednn_chain
from dynvm.jit.backends.cpu.onednn_chain import PrimitiveChain, Step, chain_primitives
from dynvm.jit.backends.cpu.onednn_conv import (
    _STEP_KINDS,
    CONV_PRIMITIVE,
    CONV_PRIMITIVE_INTO,
    ConvSpec,
    PrimitiveConv,
    _run_step,
    eltwise_of,
)
from dynvm.jit.backends.cpu.onednn_pool import POOL_PRIMITIVE, PoolSpec, PrimitivePool
from dynvm.jit.ir import Literal, SpecializedRegion, SpecOp, Var
from tests.jit import _jit_helpers as h
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY, ChainBlocks, native_chain

pytestmark = NEEDS_ONEDNN_LIBRARY
TOL = {"rtol": 1e-4, "atol": 1e-4}
_CL = torch.channels_last


def _chained(rt, layout: str) -> list[str]:
    sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources
    for source in sources:
        assert source.count("= onednn_chain_primitives") == 1, source
        assert "= onednn_conv_primitive" not in source, source
        assert "8 primitive(s) in 1 native call(s) (" in source, source
    # batch 1 stays NHWC inside (BLOCKED_MIN_BATCH): the layout is some kernel's
    assert any(f"{layout} inside" in s or f"/{layout} inside" in s for s in sources), sources
    return sources


@pytest.mark.parametrize("precision,width,layout", [
    ("fp32", 32, "nChw16c"),     # every convolution but the stem's on 16-channel blocks
    ("fp32", 16, "NHWC"),        # 8-channel convolutions: NHWC throughout
    ("bf16", 32, "NHWC")])       # bf16 stays NHWC (BLOCKED_DTYPES)
def test_a_chain_is_one_native_call_and_agrees_with_eager(precision, width, layout,
                                                          monkeypatch):
    monkeypatch.setattr(chain_layout_choice, "blocked_policy", "always")   # blocked on any CPU
    native_chain()
    model = ChainBlocks(width).eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 16, 16),),
                            ({0: Dim("batch", min=1, max=8)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always",
                            precision=precision)
    gen = torch.Generator().manual_seed(5)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for step, batch in enumerate((4, 2, 3, 1, 4, 3, 2, 1, 3, 8)):
            x = torch.randn(batch + 1, 3, 16, 19, generator=gen)[1:, :, :, 3:]
            if step < 5:
                x = x.contiguous()          # then offset and strided views
            before = x.clone()
            got, want = rt(x), model(x)
            if precision == "fp32":
                torch.testing.assert_close(got, want, **TOL, msg=f"step {step}")
            else:   # tolerance: tests/jit/test_cpu_conv_bf16.py
                assert got.dtype == torch.float32
                assert float((got - want).abs().max() / want.abs().max()) < 0.03, step
            assert torch.equal(x, before)   # the caller's tensor is never written
        stats = rt.stats()
        assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"]
        _chained(rt, layout)


def test_shapes_without_an_arena_run_the_steps_one_by_one():
    # A family whose height varies: arenas for the probes' shapes; the others run each
    # step on its own (a primitive where built, else the op's torch call).
    native_chain()
    model = ChainBlocks().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 16, 16),),
                            ({0: Dim("batch", min=1, max=4), 2: 8 * Dim("h", min=2, max=4)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always")
    gen = torch.Generator().manual_seed(19)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for batch, height in ((2, 16), (3, 24), (1, 32), (4, 16), (2, 24), (3, 32)):
            x = torch.randn(batch, 3, height, 16, generator=gen)
            torch.testing.assert_close(rt(x), model(x), **TOL, msg=f"{batch}x{height}")
        assert not rt.stats()["compile_failures"]
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert any("= onednn_chain_primitives" in s for s in sources), sources


def _conv(library, c_in, c_out, kernel, stride, shapes, residual=False, gen=None):
    weight = torch.randn(c_out, c_in, kernel, kernel, generator=gen) * 0.2
    bias = torch.randn(c_out, generator=gen)
    pad = kernel // 2
    spec = ConvSpec((stride, stride), (pad, pad), (1, 1), residual, eltwise_of("relu", [], ""))
    conv = PrimitiveConv(library, weight, bias, spec, shapes)

    def reference(x, other=None):
        y = nn.functional.conv2d(x, weight, bias, stride, pad)
        return torch.relu(y if other is None else y + other)
    return conv, reference


def _hand_chain(shapes=((2, 4, 12, 12),), width: int = 8):
    """x -> conv a -> pool -> conv b, and conv c of the pool written into b's result:
    registers 0 (x), 1 (a), 2 (pool), 3 (b), 4 (c + b, in b's storage); with each
    step's frees."""
    library, gen = onednn_api.library(), torch.Generator().manual_seed(31)
    c_in = shapes[0][1]
    a, ref_a = _conv(library, c_in, width, 3, 1, list(shapes), gen=gen)
    pooled = [(n, width, h, w) for n, _, h, w in shapes]
    pool_spec = PoolSpec.of([3, 3], [2, 2], [1], [1], False, torch.float32)
    pool = PrimitivePool(library, pool_spec, pooled)
    after = [(n, width, pool_spec.out_size(h, 0), pool_spec.out_size(w, 1))
             for n, _, h, w in shapes]
    b, ref_b = _conv(library, width, width, 1, 1, after, gen=gen)
    c, ref_c = _conv(library, width, width, 3, 1, after, residual=True, gen=gen)
    steps = [Step(a, 0, None, 1), Step(pool, 1, None, 2), Step(b, 2, None, 3),
             Step(c, 2, 3, 4)]

    def reference(x):
        pooled = nn.functional.max_pool2d(ref_a(x), 3, 2, 1)
        return ref_c(pooled, ref_b(pooled))
    frees = [(0,), (1,), (), (2, 3)]
    return library, steps, frees, reference


@pytest.mark.parametrize("batch,c_in,width,policy,layout", [
    (2, 4, 8, "always", "NHWC"), (2, 16, 32, "always", "nChw16c"),
    (2, 16, 32, "never", "NHWC"),
    (1, 16, 32, "always", "NHWC")])     # batch 1 stays NHWC inside (BLOCKED_MIN_BATCH)
def test_a_returned_tensor_is_not_changed_by_the_next_call(batch, c_in, width, policy,
                                                           layout, monkeypatch):
    # nChw16c: the input reordered in, the result reordered out into a new NHWC tensor
    monkeypatch.setattr(chain_layout_choice, "blocked_policy", policy)
    bound = native_chain()
    library, steps, frees, reference = _hand_chain(((batch, c_in, 12, 12),), width)
    chain = PrimitiveChain(library, bound, steps, (4,), frees, _run_step)
    assert set(chain.by_shape) == {(batch, c_in, 12, 12)}
    assert chain.layouts() == {layout}
    assert chain.reorders() == (2 if layout == "nChw16c" else 0)
    gen = torch.Generator().manual_seed(3)
    first_x = torch.randn(batch, c_in, 12, 12, generator=gen)
    first = chain(first_x)
    kept = first.clone()
    torch.testing.assert_close(first, reference(first_x), **TOL)
    buffers = {b.untyped_storage().data_ptr() for a in chain.by_shape.values()
               for b in a.buffers}
    assert first.untyped_storage().data_ptr() not in buffers
    for _ in range(3):
        x = torch.randn(batch, c_in, 12, 12, generator=gen)
        torch.testing.assert_close(chain(x), reference(x), **TOL)
    assert torch.equal(first, kept)
    # a shape without an arena (and without primitives: `covered` ones raise) fails
    # loudly rather than computing something else
    with pytest.raises(RuntimeError, match="no oneDNN"):
        chain(torch.randn(3 + batch, c_in, 12, 12))


@pytest.mark.parametrize("c_in,width", [(4, 8), (16, 32)])
def test_two_threads_calling_one_chain_get_their_own_results(c_in, width):
    bound = native_chain()
    library, steps, frees, reference = _hand_chain(((2, c_in, 12, 12), (3, c_in, 12, 12)),
                                                   width)
    chain = PrimitiveChain(library, bound, steps, (4,), frees, _run_step)
    errors: list = []

    def calls(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        try:
            for i in range(30):
                x = torch.randn(2 + (i + seed) % 2, c_in, 12, 12, generator=gen)
                x = x.contiguous(memory_format=_CL) if i % 3 else x
                torch.testing.assert_close(chain(x), reference(x), **TOL)
        except Exception as exc:   # noqa: BLE001  (reported by the main thread)
            errors.append(exc)
    threads = [threading.Thread(target=calls, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def _hand_spec(steps, frees) -> SpecializedRegion:
    opcodes = {"conv": CONV_PRIMITIVE, "into": CONV_PRIMITIVE_INTO, "pool": POOL_PRIMITIVE}
    ops = []
    for position, step in enumerate(steps):
        kind = "into" if step.into is not None else (
            "pool" if isinstance(step.runner, PrimitivePool) else "conv")
        args = (Var(step.x),) + ((Var(step.into),) if step.into is not None else ()) \
            + (Literal(step.runner),)
        ops.append(SpecOp(opcodes[kind], (step.dst,), args, position, frees[position],
                          "onednn"))
    return SpecializedRegion(0, (0,), tuple(ops), ((9, Var(4)),), (0,), True, (), 4)


def test_the_pass_makes_one_op_and_where_the_library_is_absent_changes_nothing():
    native_chain()
    library, steps, frees, reference = _hand_chain()
    spec = _hand_spec(steps, frees)
    chained, note = chain_primitives(spec, library, _STEP_KINDS, _run_step, "onednn")
    assert [op.opcode for op in chained.ops] == [onednn_chain.CHAIN_PRIMITIVES]
    op = chained.ops[0]
    assert op.dsts == (4,) and op.frees == (0,) and op.args[0] == Var(0)
    assert "4 primitive(s) in 1 native call(s)" in note
    x = torch.randn(2, 4, 12, 12)
    torch.testing.assert_close(op.args[1].value(x), reference(x), **TOL)
    missing = Path("/nonexistent/_onednn_chain.so")
    same, note = chain_primitives(spec, library, _STEP_KINDS, _run_step, "onednn",
                                  native_path=missing)
    assert same is spec and "was not built" in note
    assert onednn_chain.native(None)[0] is None      # no libdnnl: no chain either

