"""bf16 masked attention on AVX512-BF16 dot products, for CPUs without AMX (Note [bf16
attention with AVX512-BF16 dot products] in jit/backends/cpu/attention_native.py): equal
to fp32 SDPA within bf16 tolerance and as close as torch's bf16 SDPA over random batch,
heads, query and key counts (blocks of fewer than 8 queries, odd key counts), every mask
kind (right padding, arbitrary, rows masked everywhere, a dense bf16 bias as the bf16
lowering makes), offset and strided operands, with torch's output strides; the calling
thread alone and the team give the same bits; heads not a multiple of 32 stay on the
widening kernel; under precision "bf16" the pass puts a BERT-style layer's SDPA of 16+
keys on it and runtimes stay eager-equal.
"""

from __future__ import annotations

import pytest
import torch

from dynvm.jit.backends.cpu import attention_native
from dynvm.jit.backends.cpu.attention_native import DOT_MIN_KEYS, masked_attention
from tests.jit.test_cpu_native_attention import (
    _dense_bias,
    _operands,
    bf16_cases,
    bf16_runtimes_take_it_from,
)

pytestmark = pytest.mark.skipif(not attention_native.bf16_dot_available(),
                                reason="AMX present, no AVX512-BF16, or dynvm's attention "
                                       "library is not built")
F = torch.nn.functional
NOTE = "on dynvm's masked attention"


def _fp32_sdpa(q, k, v, mask, scale=None):
    float_mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), float_mask,
                                          0.0, False, scale=scale)


def test_the_dot_products_equal_fp32_sdpa_within_bf16_tolerance():
    for case, q, k, v, mask, scale, what in bf16_cases(31, 80):
        assert attention_native._on_dots(q)
        got = masked_attention(q, k, v, mask, 0.0, False, scale)
        torch_out = F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=scale)
        assert got.dtype == torch.bfloat16 and got.stride() == torch_out.stride(), case
        want = _fp32_sdpa(q, k, v, mask, scale)
        live = torch.isfinite(want)           # torch's fp32 kernel: NaN on a masked row
        assert torch.isfinite(got.float()).all(), case
        err = (got.float() - want)[live].abs().max()
        torch_err = (torch_out.float() - want)[live].abs().max()
        assert err <= 2e-2 * max(1.0, want[live].abs().max()), (case, what)
        # no worse than torch's own bf16 kernel by more than a bf16 step of the result
        assert err <= torch_err + 8e-3 * max(1.0, want[live].abs().max()), \
            (case, float(err), float(torch_err))


def test_a_row_masked_everywhere_gives_zeros_and_the_rest_are_untouched():
    gen = torch.Generator().manual_seed(4)
    q, k, v = _operands(gen, torch.bfloat16, 2, 3, 19, 41, 64)
    mask = torch.ones(2, 1, 19, 41, dtype=torch.bool)
    mask[1, 0, 17] = False                    # in the third block of 8 queries
    mask[0, 0, 3, 20:] = False                # a row that stops early
    got = masked_attention(q, k, v, mask)
    assert torch.equal(got[1, :, 17], torch.zeros_like(got[1, :, 17]))
    want = _fp32_sdpa(q, k, v, mask)
    want[1, :, 17] = 0                        # torch's fp32 kernel: NaN or 0 there
    assert (got.float() - want).abs().max() <= 2e-2 * max(1.0, want.abs().max())


def test_heads_not_a_multiple_of_32_stay_on_the_widening_kernel():
    gen = torch.Generator().manual_seed(8)
    q, k, v = _operands(gen, torch.bfloat16, 1, 2, 20, 30, 48)
    assert not attention_native._on_dots(q)
    got = masked_attention(q, k, v)           # the AVX-512 kernel, bf16 widened to fp32
    want = _fp32_sdpa(q, k, v, None)
    assert (got.float() - want).abs().max() <= 2e-2 * max(1.0, want.abs().max())


def test_small_calls_on_the_calling_thread_give_the_teams_bits(monkeypatch):
    # a (batch, head) is computed the same way on whichever thread takes it
    gen = torch.Generator().manual_seed(12)
    q, k, v = _operands(gen, torch.bfloat16, 2, 3, 21, 21, 64)
    mask = _dense_bias(gen, 2, 21, 21)
    assert attention_native.DOT_ONE_THREAD_SCORES >= 2 * 3 * 21 * 21
    alone = masked_attention(q, k, v, mask)
    monkeypatch.setattr(attention_native, "DOT_ONE_THREAD_SCORES", 0)
    assert torch.equal(masked_attention(q, k, v, mask), alone)


def test_bf16_runtimes_run_it_at_16_keys_and_more_and_equal_eager():
    bf16_runtimes_take_it_from(DOT_MIN_KEYS)
