"""Attention from the Q/K/V result in one call (Note [Attention without its views] in
jit/backends/cpu/attention_qkv.py): the kernel equals the views + SDPA + views it
replaces (the same bits) and SDPA in fp32 over random shapes, masks and offset /
strided Q/K/V values, operands it does not read take the views' path, the pass takes
BERT's chain in fp32 and bf16 runtimes that stay equal to eager, and leaves a chain
whose views are read elsewhere as it is.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import attention_native
from dynvm.jit.backends.cpu.attention_native import MIN_KEYS, _qkv_attention_views, qkv_attention
from tests.jit import _jit_helpers as h
from tests.jit.test_cpu_attention_primitives import Layer, _keep

pytestmark = pytest.mark.skipif(not attention_native.available(),
                                reason="dynvm's attention library is not built or no AVX-512F")
F = torch.nn.functional
CALL = "in one call (Note [Attention without its views])"
NATIVE = "on dynvm's masked attention"


def _qkv(gen, dtype, b, s, width, strided):
    """A [b, s, width] Q/K/V value: offset inside a wider tensor, its rows strided."""
    if not strided:
        return torch.randn(b, s, width, generator=gen).to(dtype)
    base = torch.randn(b, 2 * s + 1, width + 7, generator=gen).to(dtype)
    return base[:, 1::2, 3:3 + width]


def _mask(gen, kind, dtype, b, heads, s):
    if kind == "none":
        return None
    if kind == "padding":
        return _keep(b, s, gen).bool()[:, None, None, :]
    if kind == "bool":
        return torch.rand(b, 1, s, s, generator=gen) > 0.3
    return torch.randn(1, heads, s, s, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_equals_the_views_and_sdpa(dtype):
    gen = torch.Generator().manual_seed(11)
    for case in range(40):
        b = int(torch.randint(1, 4, (1,), generator=gen))
        s = int(torch.randint(1, 140, (1,), generator=gen))
        heads, d = ((2, 32), (3, 64), (4, 16), (1, 80))[case % 4]
        qkv = _qkv(gen, dtype, b, s, 3 * heads * d, strided=bool(case % 2))
        mask = _mask(gen, ("none", "padding", "bool", "additive")[case % 4], dtype, b, heads, s)
        scale = (None, 0.125, 0.3)[case % 3]
        got = qkv_attention(qkv, mask, heads, scale)
        views = _qkv_attention_views(qkv, mask, heads, scale)
        assert got.shape == (b, s, heads * d) and got.is_contiguous() and got.dtype == dtype
        assert torch.equal(got, views), (case, b, s, heads, d)
        q, k, v = (t.float().view(b, s, heads, d).transpose(1, 2)
                   for t in qkv.split(heads * d, -1))
        float_mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
        want = F.scaled_dot_product_attention(q, k, v, float_mask, scale=scale)
        want = want.transpose(1, 2).reshape(b, s, heads * d)
        finite = want.isfinite()     # rows masked everywhere: 0 here, NaN in torch's maths
        tolerance = 2e-5 if dtype == torch.float32 else 2e-2
        assert (got.float() - want)[finite].abs().max() <= tolerance * max(
            1.0, want[finite].abs().max()), (case, b, s, heads, d)


def test_operands_it_does_not_read_take_the_views_path():
    gen = torch.Generator().manual_seed(4)
    cases = [torch.randn(2, 9, 3 * 2 * 24, generator=gen),              # D not a multiple of 16
             torch.randn(2, 9, 3 * 64 * 2, generator=gen).transpose(0, 1)
             .contiguous().transpose(0, 1),                             # strided, fits
             torch.randn(1, 300, 3 * 2 * 16, generator=gen)]            # too many keys
    for qkv in cases:
        heads = 2 if qkv.shape[-1] != 384 else 4
        assert torch.equal(qkv_attention(qkv, None, heads, None),
                           _qkv_attention_views(qkv, None, heads, None))


def _program(model, seq_max=160):
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=seq_max)
    keep = torch.ones(2, 5, dtype=torch.long)
    return dynvm.compile(model, (torch.randn(2, 5, 64), keep),
                         ({0: batch, 1: seq}, {0: batch, 1: seq}))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_runtimes_take_the_chain_and_equal_eager(precision):
    torch.manual_seed(0)
    model = Layer(d=64, heads=2).eval()          # heads of 32
    program = _program(model)
    gen = torch.Generator().manual_seed(23)
    relative = 1e-5 if precision == "fp32" else 3e-2   # test_cpu_precision's bf16 bound
    for families in (False, True):
        config = h.eager_config(cpu_fusion="always", families=families, precision=precision)
        with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
            for step in range(6):
                batch = int(torch.randint(1, 4, (1,), generator=gen))
                seq = (MIN_KEYS, MIN_KEYS + 31, 150)[step % 3]
                x = torch.randn(batch, seq, 64, generator=gen)
                keep = _keep(batch, seq, gen)
                if step % 2:     # an offset input and a strided mask
                    x = torch.randn(batch, seq + 1, 64, generator=gen)[:, 1:]
                    keep = keep.t().contiguous().t()
                rt(x, keep)
                got, want = rt(x, keep), model(x, keep)
                assert (got - want).abs().max() <= relative * want.abs().max(), (step, seq)
            assert rt.stats()["specialized_region_calls"] > 0
            sources = [a.source for a in rt.jit.artifacts.values()]
        if not families:
            taken = [s for s in sources if CALL in s]
            if precision == "bf16" and not (attention_native.amx_available()
                                            or attention_native.bf16_dot_available()):
                # Notes [bf16 attention on AMX tiles], [bf16 attention with AVX512-BF16
                # dot products]: without either a bf16 SDPA stays torch's
                assert not taken, sources
                continue
            assert taken and all("qkv_attention" in s and not re.search(
                r"= SPLIT_WITH_SIZES\d+\(", s) for s in taken), sources


class _KeysReadTwice(Layer):
    """Layer whose keys are also read outside the attention: its views stay."""

    def forward(self, x, keep, mask=None):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).permute(0, 2, 1, 3)
                   for t in self.qkv(x).split(d, -1))
        a = F.scaled_dot_product_attention(q, k, v, keep[:, None, None, :].bool(), scale=0.3)
        h1 = self.norm1(x + self.out(a.permute(0, 2, 1, 3).reshape(b, s, d)))
        return h1 + k.mean()


def test_a_chain_read_elsewhere_stays_and_the_option_off_keeps_it():
    torch.manual_seed(0)
    for model, option in ((_KeysReadTwice(d=64, heads=2).eval(), "on"),
                          (Layer(d=64, heads=2).eval(), "off")):
        program = _program(model)
        with dynvm.Runtime(program, jit=h.eager_config(cpu_fusion="always")) as rt, \
                torch.no_grad():
            rt.jit._cpu_options = dataclasses.replace(rt.jit._cpu_options,
                                                      qkv_attention=option)
            x, keep = torch.randn(1, 128, 64), torch.ones(1, 128, dtype=torch.long)
            rt(x, keep)
            torch.testing.assert_close(rt(x, keep), model(x, keep), rtol=1e-5, atol=1e-5)
            sources = [a.source for a in rt.jit.artifacts.values()]
        assert any(NATIVE in s for s in sources), sources
        assert not any(CALL in s for s in sources), sources
