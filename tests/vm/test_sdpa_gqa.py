"""SDPA with grouped heads (`enable_gqa=True`) lowers to SDPA_GQA and agrees with eager:
the decode fold (one query, no copy of K/V), prompts with masks, causal calls, strided
and offset views of the cache, abstract strides, and the JIT's specialized region (Note
[Grouped heads without copies] in dynvm.vm.ops_attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import dynvm
from dynvm.vm.ops_attention import _fold, sdpa_gqa, sdpa_gqa_abstract
from tests.jit._jit_helpers import eager_config

B, H, HKV, D = 2, 6, 2, 8


def _meta(t):
    if t is None:
        return None
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _cases():
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    cache = rand(B + 1, HKV, 40, D)           # a bigger cache: k/v are offset views
    k, v = cache[1:, :, 3:20], cache[:-1, :, 5:22]
    decode_q = rand(B, 1, H, D).transpose(1, 2)   # HF's layout: [B, T, H, D] transposed
    prompt_q = rand(B, 5, H, D).transpose(1, 2)
    pad = torch.ones(B, 1, 1, 17, dtype=torch.bool)
    pad[0, ..., :4] = False
    float_mask = rand(B, H, 5, 17)
    return {
        "decode": (decode_q, k, v, None, False),
        "decode_bool_mask": (decode_q, k, v, pad, False),
        "decode_contiguous_q": (decode_q.contiguous(), k.contiguous(), v, pad, False),
        "prompt_mask_per_head": (prompt_q, k, v, float_mask, False),
        "prompt_mask_broadcast": (prompt_q, k, v, pad.expand(B, 1, 5, 17), False),
        "prompt_2d_mask": (prompt_q, k, v, rand(5, 17), False),
        "causal": (prompt_q, k[:, :, :5], v[:, :, :5], None, True),
    }


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager_and_abstract(case):
    q, k, v, mask, causal = CASES[case]
    want = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=True)
    got = sdpa_gqa(q, k, v, mask, 0.0, causal, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    abstract = sdpa_gqa_abstract(*map(_meta, (q, k, v, mask)), 0.0, causal, None)
    assert abstract.shape == got.shape and abstract.stride() == got.stride(), case


def test_decode_fold_copies_nothing():
    """One query per row: the folded query and mask are views of the operands."""
    q, k, _, mask, _ = CASES["decode_bool_mask"]
    folded_q, folded_mask = _fold(q, k, mask, False)
    assert folded_q.shape == (B, HKV, H // HKV, D)
    assert folded_q.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    assert folded_mask.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()
    assert _fold(q, k, mask, True) is None     # causal: torch's own kernel


class _Attention(torch.nn.Module):
    # Scaled inputs and a residual: enough tensor ops for the JIT to watch the region.
    def forward(self, q, k, v, mask):
        out = F.scaled_dot_product_attention(q * 0.5, k + 1.0, v, mask, enable_gqa=True)
        return out + q


@pytest.fixture(scope="module")
def program():
    q, k, v, mask, _ = CASES["prompt_mask_broadcast"]
    batch, length, keys = Dim("batch", max=8), Dim("T", max=32), Dim("L", max=64)
    examples = tuple(t.contiguous() for t in (q, k, v, mask))
    return dynvm.compile(_Attention(), examples, (
        {0: batch, 2: length}, {0: batch, 2: keys}, {0: batch, 2: keys},
        {0: batch, 2: length, 3: keys}))


@pytest.mark.parametrize("jit", [False, True], ids=["interpreter", "jit"])
def test_program_lowers_to_sdpa_gqa(program, jit):
    assert [i.op for i in program.code].count("SDPA_GQA") == 1
    config = eager_config() if jit else False
    with dynvm.Runtime(program, jit=config) as runtime:
        for case in ("decode_bool_mask", "prompt_mask_broadcast", "decode"):
            q, k, v, mask, _ = CASES[case]
            if mask is None:
                mask = torch.ones(B, 1, q.shape[2], k.shape[2], dtype=torch.bool)
            mask = mask.expand(B, 1, q.shape[2], k.shape[2])
            want = _Attention()(q, k, v, mask)
            for _ in range(2):   # the JIT's promotion, then its specialized code
                torch.testing.assert_close(runtime(q, k, v, mask), want, rtol=1e-5,
                                           atol=1e-5)
        if jit:
            stats = runtime.stats()
            assert stats["compile_failures"] == 0 and stats["deopts"] == 0, stats
            assert stats["specialized_region_calls"] >= 3, stats
