"""bf16 primitives' weights in buffers wholly on 2 MiB pages (Note [bf16 weights wholly
on huge pages] in jit/backends/cpu/huge_pages.py): the buffer's bounds, the copy's
place, and results equal to eager's bf16 linear at random rows, offset and strided
inputs included, with torch's packed copy offered and not read in place."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dynvm.jit.backends.cpu import huge_pages, onednn_api
from dynvm.jit.backends.cpu.huge_pages import HUGE_PAGE, aligned_buffer, aligned_span
from dynvm.jit.backends.cpu.onednn_matmul import (
    ANY_ROWS,
    LinearSpec,
    LinearWeights,
    PrimitiveLinear,
)
from dynvm.jit.backends.cpu.precision import precision_available
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY

BF16_RELATIVE = 3e-2        # tests/jit/test_cpu_precision.py's bf16 bound
NO_BF16 = precision_available("bf16")


@pytest.mark.parametrize("nbytes", [1, 64, HUGE_PAGE - 1, HUGE_PAGE, HUGE_PAGE + 1,
                                    3 * HUGE_PAGE + 12345])
def test_an_aligned_buffer_is_whole_huge_pages_and_its_span_is_itself(nbytes):
    buffer = aligned_buffer(nbytes)
    assert buffer.dtype == torch.uint8 and buffer.numel() >= nbytes
    assert buffer.data_ptr() % HUGE_PAGE == 0 and buffer.numel() % HUGE_PAGE == 0
    assert buffer.numel() - nbytes < HUGE_PAGE
    storage = buffer.untyped_storage()
    # what the collapser asks for is exactly the buffer: no page before or after it
    assert aligned_span(storage.data_ptr(), storage.nbytes()) == \
        (buffer.data_ptr(), buffer.numel())


def _strided(x: torch.Tensor) -> torch.Tensor:
    """`x`'s values in a view with a storage offset and a row stride past its width."""
    rows, width = x.shape
    wide = torch.zeros(rows + 1, width + 7, dtype=x.dtype)
    view = wide[1:, 3:3 + width]
    view.copy_(x)
    assert view.storage_offset() > 0 and (rows == 1 or not view.is_contiguous())
    return view


@pytest.mark.parametrize("binary", [None, "add"])
@pytest.mark.skipif(NO_BF16 is not None, reason=str(NO_BF16))
@NEEDS_ONEDNN_LIBRARY[0]
@NEEDS_ONEDNN_LIBRARY[1]
def test_bf16_weights_are_reordered_onto_huge_pages_and_equal_eager(binary):
    gen = torch.Generator().manual_seed(23)
    n, k = 96, 80
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    library = onednn_api.library()
    plain = weight.to(torch.bfloat16)
    weights = LinearWeights(library, plain)
    # torch's packed copy, offered as the bf16 lowering does: a bf16 weight is not read
    # in place (its place is wherever torch's allocator put it)
    packed = torch.ops.mkldnn._reorder_linear_weight(plain, 1)
    weights.offer(packed)
    spec = LinearSpec(k, n, torch.bfloat16, True, None, binary,
                      torch.float32 if binary else None)
    linear = PrimitiveLinear(library, spec, weights, bias, [11, ANY_ROWS], None)
    weights.offer(packed)                 # a second kernel's offer, after the build
    assert weights.shared() == 0 and weights.copies() >= 1
    torch_copy = weakref.ref(packed)
    del packed
    gc.collect()
    assert torch_copy() is None           # one copy of the weight: ours, not torch's
    for buffer in weights.buffers():
        assert not buffer.is_mkldnn and buffer.data_ptr() % HUGE_PAGE == 0
        assert buffer.numel() % HUGE_PAGE == 0
        assert huge_pages.to_huge_pages(buffer) is False     # already queued once
    for m in (11, 11, 3, 1, 17):          # the built rows, and others on any rows
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        residual = torch.randn(m, n, generator=gen) if binary else None
        want = torch.nn.functional.linear(x.float(), plain.float(), bias)
        if binary:
            want = want + residual
        for given in (x, _strided(x)):
            got = linear(given, None if residual is None else _strided(residual))
            assert got.dtype == (torch.float32 if binary else torch.bfloat16)
            error = float((got.float() - want).abs().max() / want.abs().max())
            assert error < BF16_RELATIVE, (m, error)


@NEEDS_ONEDNN_LIBRARY[0]
@NEEDS_ONEDNN_LIBRARY[1]
def test_fp32_weights_still_read_torchs_packed_copy_in_place():
    gen = torch.Generator().manual_seed(29)
    weight = torch.randn(64, 48, generator=gen)
    library = onednn_api.library()
    weights = LinearWeights(library, weight)
    weights.offer(torch.ops.mkldnn._reorder_linear_weight(weight, 16))
    linear = PrimitiveLinear(library, LinearSpec(48, 64, torch.float32, False), weights,
                             None, [16], None)
    x = torch.randn(16, 48, generator=gen)
    torch.testing.assert_close(linear(x, None), x @ weight.t(), rtol=1e-4, atol=1e-4)
    assert weights.copies() == 1 and weights.shared() == 1 and weights.nbytes() == 0
