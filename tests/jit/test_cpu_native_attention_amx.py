"""bf16 masked attention on AMX tiles (Note [bf16 attention on AMX tiles] in
jit/backends/cpu/attention_native.py): equal to fp32 SDPA within bf16 tolerance over
random batch, heads, query and key counts (blocks of fewer than 16 queries, keys past a
tile), every mask kind (right padding, arbitrary, rows masked everywhere, a dense bf16
bias as the bf16 lowering makes), offset and strided operands, with torch's output
strides; heads not a multiple of 32 stay off the tiles; under precision "bf16" the pass
puts a BERT-style layer's SDPA of 16+ keys on it and runtimes stay eager-equal.
"""

from __future__ import annotations

import pytest
import torch

from dynvm.jit.backends.cpu import attention_native
from dynvm.jit.backends.cpu.attention_native import AMX_MIN_KEYS, masked_attention
from tests.jit.test_cpu_native_attention import (
    _dense_bias,
    _operands,
    bf16_cases,
    bf16_runtimes_take_it_from,
)

pytestmark = pytest.mark.skipif(not attention_native.amx_available(),
                                reason="no AMX (or dynvm's attention library is not built)")
F = torch.nn.functional
NOTE = "on dynvm's masked attention"


def test_the_tiles_equal_fp32_sdpa_within_bf16_tolerance():
    for case, q, k, v, mask, scale, what in bf16_cases(23, 60):
        assert attention_native._on_tiles(q)
        got = masked_attention(q, k, v, mask, 0.0, False, scale)
        torch_out = F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=scale)
        assert got.dtype == torch.bfloat16 and got.stride() == torch_out.stride(), case
        float_mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), float_mask,
                                              0.0, False, scale=scale)
        assert torch.isfinite(got.float()).all(), case
        assert (got.float() - want).abs().max() <= 2e-2 * max(1.0, want.abs().max()), \
            (case, what)


def test_a_row_masked_everywhere_gives_zeros_and_the_rest_are_untouched():
    gen = torch.Generator().manual_seed(4)
    q, k, v = _operands(gen, torch.bfloat16, 2, 3, 19, 40, 64)
    mask = torch.ones(2, 1, 19, 40, dtype=torch.bool)
    mask[1, 0, 17] = False                    # in the second block of 16 queries
    mask[0, 0, 3, 20:] = False                # a row that stops early
    got = masked_attention(q, k, v, mask)
    assert torch.equal(got[1, :, 17], torch.zeros_like(got[1, :, 17]))
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask)
    want[1, :, 17] = 0                        # torch's fp32 kernel: NaN or 0 there
    assert (got.float() - want).abs().max() <= 2e-2 * max(1.0, want.abs().max())


def test_heads_not_a_multiple_of_32_stay_off_the_tiles():
    gen = torch.Generator().manual_seed(8)
    q, k, v = _operands(gen, torch.bfloat16, 1, 2, 20, 30, 48)
    assert not attention_native._on_tiles(q)
    got = masked_attention(q, k, v)           # the AVX-512 kernel, bf16 widened to fp32
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert (got.float() - want).abs().max() <= 2e-2 * max(1.0, want.abs().max())


def test_bf16_runtimes_run_it_at_16_keys_and_more_and_equal_eager():
    bf16_runtimes_take_it_from(AMX_MIN_KEYS)



def test_small_calls_on_the_calling_thread_give_the_teams_bits(monkeypatch):
    # Note [bf16 attention on AMX tiles]: a (batch, head) is computed the same way on
    # whichever thread takes it, so one thread and the team give the same bits
    gen = torch.Generator().manual_seed(12)
    q, k, v = _operands(gen, torch.bfloat16, 2, 3, 21, 21, 64)
    mask = _dense_bias(gen, 2, 21, 21)
    assert attention_native.AMX_ONE_THREAD_SCORES >= 2 * 3 * 21 * 21
    alone = masked_attention(q, k, v, mask)
    monkeypatch.setattr(attention_native, "AMX_ONE_THREAD_SCORES", 0)
    assert torch.equal(masked_attention(q, k, v, mask), alone)
