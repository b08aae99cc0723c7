"""Layer norm writing its bf16 copy in the same pass (Note [Layer norm writing bf16 too]
in jit/backends/cpu/norm_bf16.py): the C kernel against torch's layer norm and cast, its
fallback for operands it does not read and where the library is absent, and the pass in
BERT-style kernels: the casts of layer norms' results gone, results within bf16's
tolerance of eager over random shapes, offset and strided inputs and families.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dynvm.jit.backends.cpu import norm_bf16, precision
from dynvm.jit.backends.cpu.codegen import CpuOptions
from dynvm.jit.backends.cpu.norm_bf16 import LAYER_NORM_BF16, layer_norm_bf16, torch_pair
from dynvm.jit.backends.cpu.precision import (
    PRECISION_VARIANT,
    TO_BF16,
    precision_available,
)
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.ir import Literal, SpecOp, Var
from tests.jit._kernel_run import views
from tests.jit.test_cpu_attention_primitives import (
    BF16_RELATIVE,
    _keep,
    _kernel,
    _program,
    _relative,
    _spec,
    lowered_bf16,
    run_kernel,
    serve_random_shapes,
)

NOTE = "layer norm(s) writing their bf16 copy in the same pass"
needs_library = pytest.mark.skipif(not norm_bf16.available(),
                                   reason="dynvm's layer norm library is not built here")
needs_bf16 = pytest.mark.skipif(precision_available("bf16") is not None,
                                reason=str(precision_available("bf16")))


@needs_library
@pytest.mark.parametrize("rows", [1, 3, 128, 1024])
@pytest.mark.parametrize("affine", [True, False])
def test_the_kernel_is_torchs_layer_norm_and_its_rounding(rows, affine):
    gen = torch.Generator().manual_seed(rows)
    n = 768 if rows > 3 else 48
    x = torch.randn(rows, n, generator=gen) * 4 + 1.5
    weight = torch.randn(n, generator=gen) if affine else None
    bias = torch.randn(n, generator=gen) if affine else None
    y, y16 = layer_norm_bf16(x.view(1, rows, n), [n], weight, bias, 1e-12)
    want, _ = torch_pair(x.view(1, rows, n), [n], weight, bias, 1e-12)
    assert y.shape == y16.shape == (1, rows, n) and y16.dtype == torch.bfloat16
    assert y.is_contiguous() and y16.is_contiguous()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    # the bf16 copy is the fp32 result rounded to nearest even, as torch rounds
    assert torch.equal(y16, y.to(torch.bfloat16))


@needs_library
def test_a_nan_row_stays_nan_and_other_rows_are_unaffected():
    x = torch.randn(4, 64)
    x[1, 5] = float("nan")
    y, y16 = layer_norm_bf16(x, [64], None, None, 1e-5)
    assert torch.isnan(y[1]).all() and torch.isnan(y16[1].float()).all()
    torch.testing.assert_close(y[[0, 2, 3]], torch.layer_norm(x[[0, 2, 3]], [64]),
                               rtol=1e-5, atol=1e-5)


def test_operands_it_does_not_read_run_torchs_pair_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 64, generator=gen)
    cases = {name: (v, [64], None, None, 1e-5) for name, v in views(x).items()
             if not v.is_contiguous()}
    cases["double"] = (x.double(), [64], None, None, 1e-5)
    cases["n not a multiple of 16"] = (torch.randn(3, 40, generator=gen), [40], None, None,
                                       1e-5)
    cases["two trailing dims"] = (x, [9, 64], None, None, 1e-5)
    cases["strided weight"] = (x, [64], torch.randn(128, generator=gen)[::2], None, 1e-5)
    for name, args in cases.items():
        got, want = layer_norm_bf16(*args), torch_pair(*args)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name


def test_without_the_library_the_pair_runs_and_the_pass_rewrites_nothing(monkeypatch):
    monkeypatch.setattr(norm_bf16, "_LIBRARY", None)
    x = torch.randn(2, 16, 64)
    got, want = layer_norm_bf16(x, [64], None, None, 1e-5), torch_pair(x, [64], None, None,
                                                                       1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    _, program = _program()
    _, spec = _spec(program, torch.randn(2, 9, 32), torch.ones(2, 9, dtype=torch.long))
    assert norm_bf16.fuse_norm_casts(spec, list(program.constants), cast=TO_BF16,
                                     variant=PRECISION_VARIANT) == (spec, "")


@needs_library
@needs_bf16
def test_the_casts_of_layer_norms_go_and_kernels_stay_within_tolerance(monkeypatch):
    model, program = _program()
    gen = torch.Generator().manual_seed(4)
    options = CpuOptions(fusion="always", precision="bf16", prepacked=PrepackCache())
    for batch, seq in ((1, 16), (2, 7), (3, 33)):
        keep = _keep(batch, seq, gen)
        for name, x in views(torch.randn(batch, seq, 32, generator=gen)).items():
            region, kernel = _kernel(program, x, keep, options)
            assert "1 layer norm(s) writing their bf16 copy in the same pass, 1 cast(s) gone" \
                in kernel.source, kernel.source
            monkeypatch.setattr(precision, "fuse_norm_casts", lambda spec, *a, **k: (spec, ""))
            _, unfused = _kernel(program, x, keep, options)
            monkeypatch.undo()
            assert NOTE not in unfused.source
            assert unfused.source.count("= to_bf16") > kernel.source.count("= to_bf16")
            got = []
            for fn in (kernel.fn, unfused.fn):
                got.append(run_kernel(region, fn, x, keep))
            with torch.no_grad():
                want = model(x, keep)
            assert _relative(got[0], want) < BF16_RELATIVE, (batch, seq, name)
            # the same ops up to float32 rounding in the norm (and a bf16 step from it)
            assert _relative(got[0], got[1]) < BF16_RELATIVE / 3, (batch, seq, name)


@needs_library
@needs_bf16
def test_a_write_into_the_norms_result_before_its_cast_keeps_the_pair():
    _, program = _program()
    lowered, constants = lowered_bf16(program)
    ops = list(lowered.ops)
    fused_at = next(i for i, op in enumerate(ops) if op.opcode == LAYER_NORM_BF16)
    # undo the fusion by hand, then write into the norm's result between it and the cast
    norm = ops[fused_at]
    result, copy = norm.dsts
    plain = SpecOp("LAYER_NORM", (result,), (*norm.args, Literal(False)), norm.source_pc)
    fresh = max(r for op in ops for r in op.dsts) + 1
    write = SpecOp("MUL", (fresh,), (Var(result), Literal(1.0)),
                   norm.source_pc, variant="inplace")
    cast = SpecOp(TO_BF16, (copy,), (Var(fresh),), norm.source_pc,
                  variant=PRECISION_VARIANT)
    probes = [{**p, fresh: p[result]} for p in lowered.abstract]
    written = dataclasses.replace(
        lowered, ops=(*ops[:fused_at], plain, write, cast, *ops[fused_at + 1:]),
        abstract=tuple(probes))
    rewritten, note = norm_bf16.fuse_norm_casts(written, constants, cast=TO_BF16,
                                                variant=PRECISION_VARIANT)
    assert rewritten.ops[fused_at].opcode == "LAYER_NORM", note
    # the same cast straight after the norm is fused
    direct = dataclasses.replace(
        lowered, ops=(*ops[:fused_at], plain,
                      SpecOp(TO_BF16, (copy,), (Var(result),),
                             norm.source_pc, variant=PRECISION_VARIANT),
                      *ops[fused_at + 1:]))
    fused, _ = norm_bf16.fuse_norm_casts(direct, constants, cast=TO_BF16,
                                         variant=PRECISION_VARIANT)
    assert fused.ops[fused_at].opcode == LAYER_NORM_BF16


@needs_library
@needs_bf16
def test_runtimes_serve_random_shape_sequences_and_families():
    model, program = _program()

    def inputs(batch, seq, step, gen):
        x, keep = torch.randn(batch, seq, 32, generator=gen), _keep(batch, seq, gen)
        if step % 2:       # an offset view of the input
            x = torch.randn(batch + 1, seq, 32, generator=gen)[1:]
        return x, keep

    sources = serve_random_shapes(program, model, inputs, seed=21)
    assert sources and all(NOTE in s for s in sources), sources
