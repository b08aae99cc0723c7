"""dynvm's masked attention kernel (Note [Masked attention of our own] in
jit/backends/cpu/attention_native.py): equal to torch's SDPA over random shapes,
strided and offset operands, every mask kind, right padding and rows masked everywhere,
with torch's output strides; operands it does not read run torch's SDPA; the pass puts
an exact fp32 kernel's SDPA of MIN_KEYS+ keys on it (96 on Intel, 16 elsewhere), and
runtimes stay equal to eager over random shapes, exact kernels and families.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import attention_native
from dynvm.jit.backends.cpu.attention_native import (
    INTEL_MIN_KEYS,
    MAX_KEYS,
    MIN_KEYS,
    NOT_INTEL_MIN_KEYS,
    fp32_min_keys,
    masked_attention,
)
from tests.jit import _jit_helpers as h
from tests.jit.test_cpu_attention_primitives import BF16_RELATIVE, Layer, _keep, _relative

pytestmark = pytest.mark.skipif(not attention_native.available(),
                                reason="dynvm's attention library is not built or no AVX-512F")
F = torch.nn.functional
NOTE = "on dynvm's masked attention"
BELOW = MIN_KEYS // 2 + 1    # keys the pass leaves to torch's SDPA on every CPU


def _operands(gen, dtype, b, h, s, keys, d):
    """q, k, v as views of projections ([B, rows, H, 3D+pad] transposed: strided and
    offset), v sometimes a dense tensor of its own."""
    base = torch.randn(b, max(s, keys) + 2, h, 3 * d + 5, generator=gen).to(dtype)
    q = base[:, 1:s + 1, :, 3:3 + d].transpose(1, 2)
    k = base[:, :keys, :, d + 3:2 * d + 3].transpose(1, 2)
    v = base[:, 2:keys + 2, :, 2 * d + 3:3 * d + 3].transpose(1, 2)
    if int(torch.randint(0, 2, (1,), generator=gen)):
        v = torch.randn(b, h, keys, d, generator=gen).to(dtype)
    return q, k, v


def _mask(gen, kind, dtype, b, h, s, keys):
    if kind == "none":
        return None
    if kind == "bool":
        mask = torch.rand(b, 1, s, keys, generator=gen) > 0.3
        mask[0, 0, 0] = False                                   # a row masked everywhere
        return mask
    if kind == "padding":                                       # right padding, a key row
        keep = _keep(b, keys, gen).bool()
        return keep[:, None, None, :]
    bias = torch.randn(1, h, s, keys, generator=gen)
    bias = bias.masked_fill(torch.rand(1, h, s, keys, generator=gen) > 0.7, float("-inf"))
    return bias.to(dtype)


def _dense_bias(gen, b, s, keys):
    """A [B, 1, S, L] bf16 bias of 0 / -inf, as Note [One bf16 mask bias a call] makes,
    each batch row keeping a random prefix of the keys."""
    keep = _keep(b, keys, gen).bool()[:, None, None, :].expand(b, 1, s, keys)
    return torch.zeros(b, 1, s, keys, dtype=torch.bfloat16).masked_fill_(~keep, float("-inf"))


def bf16_cases(seed: int, count: int):
    """`count` random bf16 operand sets for the kernel's bf16 versions: (case, q, k, v,
    mask, scale, what) over batch, heads, 1-79 queries, 1-MAX_KEYS keys, D 32-128, every
    mask kind (a dense bf16 bias as the bf16 lowering makes it too) and three scales."""
    gen = torch.Generator().manual_seed(seed)
    for case in range(count):
        b, h = (int(v) for v in torch.randint(1, 4, (2,), generator=gen))
        s = int(torch.randint(1, 80, (1,), generator=gen))
        keys = int(torch.randint(1, MAX_KEYS + 1, (1,), generator=gen))
        d = (32, 64, 96, 128)[case % 4]
        q, k, v = _operands(gen, torch.bfloat16, b, h, s, keys, d)
        kind = ("none", "bool", "padding", "additive", "dense")[case % 5]
        mask = _dense_bias(gen, b, s, keys) if kind == "dense" else \
            _mask(gen, kind, torch.bfloat16, b, h, s, keys)
        yield case, q, k, v, mask, (None, 0.125, 0.3)[case % 3], (b, h, s, keys, d, kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_torchs_sdpa(dtype):
    gen = torch.Generator().manual_seed(7)
    for case in range(60):
        b, h = (int(v) for v in torch.randint(1, 4, (2,), generator=gen))
        s = int(torch.randint(1, 70, (1,), generator=gen))
        keys = int(torch.randint(1, MAX_KEYS + 1, (1,), generator=gen))
        d = (16, 32, 64, 80)[case % 4]
        q, k, v = _operands(gen, dtype, b, h, s, keys, d)
        mask = _mask(gen, ("none", "bool", "padding", "additive")[case % 4], dtype, b, h, s,
                     keys)
        scale = (None, 0.125, 0.3)[case % 3]
        got = masked_attention(q, k, v, mask, 0.0, False, scale)
        torch_out = F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=scale)
        assert got.dtype == dtype and got.stride() == torch_out.stride(), case
        float_mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), float_mask,
                                              0.0, False, scale=scale)
        tolerance = 2e-5 if dtype == torch.float32 else 2e-2
        assert (got.float() - want).abs().max() <= tolerance * max(1.0, want.abs().max()), \
            (case, b, h, s, keys, d)


def test_operands_the_kernel_does_not_read_run_torchs_sdpa():
    gen = torch.Generator().manual_seed(3)
    q, k, v = _operands(gen, torch.float32, 2, 2, 9, 20, 32)
    odd = _operands(gen, torch.float32, 2, 2, 9, 20, 24)              # D not a multiple of 16
    long = _operands(gen, torch.float32, 1, 1, 4, MAX_KEYS + 1, 16)   # too many keys
    cases = [((q, k, v, None, 0.0, True, None), {}),                   # causal
             ((*odd, None, 0.0, False, None), {}),
             ((*long, None, 0.0, False, None), {}),
             ((q, k, v, None, 0.5, False, None), {}),                   # dropout
             ((q.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2), k, v, None,
               0.0, False, None), {})]                                 # D not contiguous
    for args, _ in cases:
        assert not attention_native._reads(*args[:6])
        torch.manual_seed(5)
        want = F.scaled_dot_product_attention(*args[:6], scale=args[6])
        torch.manual_seed(5)
        assert torch.equal(masked_attention(*args), want)


def _program():
    torch.manual_seed(0)
    model = Layer(d=64, heads=2).eval()          # heads of 32
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=160)
    keep = torch.ones(2, 5, dtype=torch.long)
    return model, dynvm.compile(model, (torch.randn(2, 5, 64), keep),
                                ({0: batch, 1: seq}, {0: batch, 1: seq}))


def _layer_inputs(gen, steps: int, seqs: tuple):
    """(step, seq, x, keep) for a Layer's calls: random batches over `seqs` in turn,
    every other step an offset input and a strided mask."""
    for step in range(steps):
        batch = int(torch.randint(1, 4, (1,), generator=gen))
        seq = seqs[step % len(seqs)]
        x = torch.randn(batch, seq, 64, generator=gen)
        keep = _keep(batch, seq, gen)
        if step % 2:
            x = torch.randn(batch, seq + 1, 64, generator=gen)[:, 1:]
            keep = keep.t().contiguous().t()
        yield step, seq, x, keep


def _taken(sources: list[str]) -> list[str]:
    """The kernels whose SDPA the pass took: each calls the kernel, or calls it from the
    Q/K/V result (Note [Attention without its views]); at least one."""
    taken = [s for s in sources if NOTE in s]
    assert taken and all("masked_attention" in s or "qkv_attention" in s
                         for s in taken), sources
    return taken


def bf16_runtimes_take_it_from(min_keys: int) -> None:
    """Under precision "bf16" the pass puts a BERT-style layer's SDPA of `min_keys` keys
    or more on the kernel (its bf16 version: AMX tiles or AVX512-BF16 dot products), not
    fewer, and runtimes stay within bf16's distance of eager over random batches, offset
    inputs and strided masks, with families off and on."""
    model, program = _program()
    gen = torch.Generator().manual_seed(29)
    for families in (False, True):
        config = h.eager_config(cpu_fusion="always", precision="bf16", families=families)
        with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
            for step, seq, x, keep in _layer_inputs(gen, 8, (min_keys - 7, min_keys, 37, 64,
                                                              129)):
                rt(x, keep)
                got = rt(x, keep)
                assert _relative(got, model(x, keep)) < BF16_RELATIVE, (families, step, seq)
            assert rt.stats()["specialized_region_calls"] > 0
            sources = [a.source for a in rt.jit.artifacts.values()]
        if not families:
            _taken(sources)
            short = [s for s in sources
                     if re.search(rf"signature: \(\d+, {min_keys - 7},", s)]
            assert short and all(NOTE not in s for s in short), sources   # too few keys


def test_runtimes_run_it_from_min_keys_on_and_equal_eager():
    model, program = _program()
    gen = torch.Generator().manual_seed(17)
    for families in (False, True):
        config = h.eager_config(cpu_fusion="always", families=families)
        with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
            for _, _, x, keep in _layer_inputs(gen, 6, (BELOW, MIN_KEYS, MIN_KEYS + 31, 150)):
                rt(x, keep)
                torch.testing.assert_close(rt(x, keep), model(x, keep), rtol=1e-5, atol=1e-5)
            assert rt.stats()["specialized_region_calls"] > 0
            sources = [a.source for a in rt.jit.artifacts.values()]
        if not families:
            taken = _taken(sources)
            assert any(f"[{BELOW}, " in s and NOTE not in s for s in sources) or \
                len(taken) < len(sources), sources


def test_fp32_takes_fewer_keys_off_intel_only():
    # Note [fp32 attention where MKL runs its generic code]: the Intel figure holds
    # on Intel and where the vendor is unknown
    assert fp32_min_keys("GenuineIntel") == INTEL_MIN_KEYS == 96
    assert fp32_min_keys("") == INTEL_MIN_KEYS
    assert fp32_min_keys("AuthenticAMD") == NOT_INTEL_MIN_KEYS < INTEL_MIN_KEYS
    assert fp32_min_keys(attention_native._cpu_vendor()) == MIN_KEYS


def test_the_option_off_keeps_torchs_sdpa():
    model, program = _program()
    config = h.eager_config(cpu_fusion="always")
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        rt.jit._cpu_options = type(rt.jit._cpu_options)(
            **{**rt.jit._cpu_options.__dict__, "native_attention": "off"})
        x, keep = torch.randn(1, 128, 64), torch.ones(1, 128, dtype=torch.long)
        rt(x, keep)
        torch.testing.assert_close(rt(x, keep), model(x, keep), rtol=1e-5, atol=1e-5)
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources and not any(NOTE in s for s in sources)
