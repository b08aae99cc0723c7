"""Attention in bf16 between bf16 GEMMs (Note [bf16 attention between bf16 GEMMs] in
jit/backends/cpu/attention_bf16.py): under precision "bf16" a BERT-style layer's SDPA
reads its Q/K/V GEMM's bf16 result through the views (no cast to fp32) and its output
reaches the output projection with no cast back; the kernels stay within the bf16
chain's tolerance of eager over random shape sequences, offset and strided inputs, and
families; a float mask, or a Q/K/V value read outside attention, keeps the fp32 path.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu.attention_bf16 import bf16_attention
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.precision import precision_available
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.specialize import specialize
from tests.jit import _jit_helpers as h
from tests.jit._kernel_run import views

pytestmark = pytest.mark.skipif(precision_available("bf16") is not None,
                                reason=str(precision_available("bf16")))
BF16_RELATIVE = 3e-2        # tests/jit/test_cpu_precision.py's bf16 bound
NOTE = "attention in bf16"


class Layer(nn.Module):
    """A BERT layer's attention and FFN (one Q/K/V weight, heads 4 x 8, a key mask of
    booleans, or of floats with `float_mask`; with `leak` the Q/K/V result also leaves
    the region, so it is needed in fp32)."""

    def __init__(self, d: int = 32, heads: int = 4, float_mask: bool = False,
                 leak: bool = False) -> None:
        super().__init__()
        self.heads, self.float_mask, self.leak = heads, float_mask, leak
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x, keep, mask=None):         # x: [b, s, d], keep: [b, s] 0/1
        b, s, d = x.shape
        qkv = self.qkv(x)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).permute(0, 2, 1, 3)
                   for t in qkv.split(d, -1))
        mask = keep[:, None, None, :].bool() if mask is None else mask
        if self.float_mask:
            mask = torch.zeros(mask.shape).masked_fill(~mask, -1e4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=0.3)
        h1 = self.norm1(x + self.out(a.permute(0, 2, 1, 3).reshape(b, s, d)))
        y = self.norm2(h1 + self.down(nn.functional.gelu(self.up(h1))))
        return (y, qkv) if self.leak else y


def _program(**kwargs):
    torch.manual_seed(0)
    model = Layer(**kwargs).eval()
    batch, seq = Dim("batch", min=1, max=16), Dim("seq", min=2, max=64)
    keep = torch.ones(2, 5, dtype=torch.long)
    return model, dynvm.compile(model, (torch.randn(2, 5, 32), keep),
                                ({0: batch, 1: seq}, {0: batch, 1: seq}))


def _keep(batch, seq, gen):
    keep = torch.ones(batch, seq, dtype=torch.long)
    for row in range(batch):   # each row masks off a random tail (never all of it)
        keep[row, int(torch.randint(1, seq + 1, (1,), generator=gen)):] = 0
    return keep


def _relative(got, want) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


def serve_random_shapes(program, model, inputs, seed: int, seq_step: int = 5) -> list[str]:
    """bf16 runtimes of `program`, exact kernels and then families, each serving 8
    random (batch, seq) shapes twice, eager-equal within BF16_RELATIVE; `inputs(batch,
    seq, step, gen)` makes a call's inputs (views at odd steps). The family runtime's
    kernel sources."""
    gen = torch.Generator().manual_seed(seed)
    sources: list[str] = []
    for families in (False, True):
        config = h.eager_config(cpu_fusion="always", precision="bf16", families=families)
        with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
            for step in range(8):
                batch, seq = (int(v) for v in torch.randint(1, 5, (2,), generator=gen))
                seq += 2 + seq_step * (step % 3)
                args = inputs(batch, seq, step, gen)
                rt(*args)
                got = rt(*args)
                assert _relative(got, model(*args)) < BF16_RELATIVE, (families, step)
            assert rt.stats()["specialized_region_calls"] > 0
            sources = [a.source for a in rt.jit.artifacts.values()]
    return sources


def _spec(program, x, keep):
    region = program.regions[0]
    return region, specialize(program, region, {region.live_in[0].index: x,
                                                region.live_in[1].index: keep})


def _kernel(program, x, keep, options):
    region, spec = _spec(program, x, keep)
    constants = [t.detach() for t in program.constants]
    return region, compile_kernel(spec, program, constants, torch.device("cpu"),
                                  "test", "strong", options)


def run_kernel(region, fn, *inputs) -> torch.Tensor:
    """Kernel `fn` of `region` called on `inputs` (its live-ins in order): its first
    live-out."""
    regs = [None] * 1024
    for live_in, value in zip(region.live_in, inputs, strict=True):
        regs[live_in.index] = value
    fn(regs)
    return regs[region.live_out[0].index]


def test_the_casts_around_attention_go_and_the_kernel_stays_within_tolerance():
    model, program = _program()
    gen = torch.Generator().manual_seed(5)
    options = CpuOptions(fusion="always", precision="bf16", prepacked=PrepackCache())
    for batch, seq in ((1, 16), (2, 7), (3, 33)):
        keep = _keep(batch, seq, gen)
        for name, x in views(torch.randn(batch, seq, 32, generator=gen)).items():
            region, kernel = _kernel(program, x, keep, options)
            assert NOTE in kernel.source, kernel.source
            assert "1 SDPA(s) on their bf16 Q/K/V, 1 cast(s) to fp32 and 1 back" \
                in kernel.source, kernel.source
            got = run_kernel(region, kernel.fn, x, keep)
            with torch.no_grad():
                want = model(x, keep)
            assert got.dtype == torch.float32
            assert _relative(got, want) < BF16_RELATIVE, (batch, seq, name)
            off = CpuOptions(fusion="always", precision="bf16", prepacked=PrepackCache(),
                             bf16_attention="off")
            _, fp32_attention = _kernel(program, x, keep, off)
            assert NOTE not in fp32_attention.source
            assert fp32_attention.source.count("to_fp32") > kernel.source.count("to_fp32")


def test_runtimes_serve_random_shape_sequences_and_families():
    model, program = _program()
    gen = torch.Generator().manual_seed(11)
    for families in (False, True):
        config = h.eager_config(cpu_fusion="always", precision="bf16", families=families)
        with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
            for step in range(8):
                batch, seq = (int(v) for v in torch.randint(1, 5, (2,), generator=gen))
                seq += 2
                x, keep = torch.randn(batch, seq, 32, generator=gen), _keep(batch, seq, gen)
                if step % 2:       # an offset view of the input
                    x = torch.randn(batch + 1, seq, 32, generator=gen)[1:]
                rt(x, keep)
                got = rt(x, keep)
                assert _relative(got, model(x, keep)) < BF16_RELATIVE, (families, step)
            assert rt.stats()["specialized_region_calls"] > 0
            sources = [a.source for a in rt.jit.artifacts.values()]
        assert sources and all(NOTE in s for s in sources), sources


@pytest.mark.parametrize("kwargs", [{"float_mask": True}, {"leak": True}])
def test_a_float_mask_or_a_qkv_value_leaving_keeps_fp32_attention(kwargs):
    model, program = _program(**kwargs)
    gen = torch.Generator().manual_seed(7)
    x, keep = torch.randn(2, 9, 32, generator=gen), _keep(2, 9, gen)
    _, spec = _spec(program, x, keep)
    options = CpuOptions(fusion="always", precision="bf16", prepacked=PrepackCache())
    region, kernel = _kernel(program, x, keep, options)
    assert NOTE not in kernel.source, kernel.source
    regs = [None] * 1024
    regs[region.live_in[0].index], regs[region.live_in[1].index] = x, keep
    kernel.fn(regs)
    with torch.no_grad():
        want = model(x, keep)
    wants = [want] if isinstance(want, torch.Tensor) else list(want)
    gots = {tuple(regs[r.index].shape): regs[r.index] for r in region.live_out}
    for want in wants:
        assert _relative(gots[tuple(want.shape)], want) < BF16_RELATIVE
    assert bf16_attention(dataclasses.replace(spec))[1] == ""   # fp32 IR: nothing to do


class TwoLayers(nn.Module):
    """Two of those layers reading one boolean [b, 1, s, s] mask, made once (as BERT's
    layers share theirs)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Layer(), Layer()

    def forward(self, x, keep):
        b, s = keep.shape
        mask = keep[:, None, None, :].bool().expand(b, 1, s, s)
        return self.second(self.first(x, keep, mask), keep, mask)


def _two_layers():
    torch.manual_seed(0)
    model = TwoLayers().eval()
    batch, seq = Dim("batch", min=1, max=16), Dim("seq", min=2, max=64)
    keep = torch.ones(2, 5, dtype=torch.long)
    return model, dynvm.compile(model, (torch.randn(2, 5, 32), keep),
                                ({0: batch, 1: seq}, {0: batch, 1: seq}))


def test_one_mask_bias_a_call_gives_the_same_bits(monkeypatch):
    # Note [One bf16 mask bias a call]: the shared boolean mask becomes one bf16 bias,
    # made once, and both SDPAs read it; the results are those of SDPA's own conversion.
    from dynvm.jit.backends.cpu import codegen

    model, program = _two_layers()
    gen = torch.Generator().manual_seed(3)
    options = CpuOptions(fusion="always", precision="bf16", prepacked=PrepackCache())
    for batch, seq in ((1, 16), (3, 9), (2, 40)):
        keep = _keep(batch, seq, gen)
        keep[-1, 1:] = 0        # a row that keeps one token only
        for name, x in views(torch.randn(batch, seq, 32, generator=gen)).items():
            monkeypatch.setattr(codegen, "bf16_attention", bf16_attention)
            region, kernel = _kernel(program, x, keep, options)
            assert "2 SDPA(s) on their bf16 Q/K/V" in kernel.source, kernel.source
            assert "1 boolean mask(s) made a bf16 bias once" in kernel.source
            bodies = [b for b in kernel.source.split("\ndef ") if "= SDPA" in b]
            assert bodies and all(b.count("bf16_mask_bias") == 1 for b in bodies), [
                line for line in kernel.source.splitlines() if "mask_bias" in line]
            monkeypatch.setattr(codegen, "bf16_attention",
                                functools.partial(bf16_attention, mask_bias=False))
            _, without = _kernel(program, x, keep, options)
            assert "bf16_mask_bias" not in without.source
            got = []
            for fn in (kernel.fn, without.fn):
                got.append(run_kernel(region, fn, x, keep))
            assert torch.equal(got[0], got[1]), (batch, seq, name)
            with torch.no_grad():
                want = model(x, keep)
            assert _relative(got[0], want) < BF16_RELATIVE, (batch, seq, name)


def test_the_mask_bias_serves_random_shape_sequences():
    model, program = _two_layers()

    def inputs(batch, seq, step, gen):
        x, keep = torch.randn(batch, seq, 32, generator=gen), _keep(batch, seq, gen)
        if step % 2:       # offset input and a strided (transposed) mask
            x = torch.randn(batch + 1, seq, 32, generator=gen)[1:]
            keep = keep.t().contiguous().t()
        return x, keep

    sources = serve_random_shapes(program, model, inputs, seed=13, seq_step=7)
    assert sources and all("bf16_mask_bias" in s for s in sources), sources


def lowered_bf16(program):
    """(the bf16 lowering of `program`'s region specialized at batch 2 x seq 9, the
    program's constants): what a test rewrites by hand."""
    from dynvm.jit.backends.cpu.precision import lower_precision

    gen = torch.Generator().manual_seed(2)
    keep = _keep(2, 9, gen)
    _, spec = _spec(program, torch.randn(2, 9, 32, generator=gen), keep)
    constants = [t.detach() for t in program.constants]
    return lower_precision(spec, constants, torch.device("cpu"), precision="bf16",
                           prepacked=PrepackCache()).spec, constants


def test_a_mask_written_in_place_between_gets_a_fresh_bias():
    # Note [One bf16 mask bias a call]: a bias made before an in-place write into the
    # mask is not read after it; the later SDPA reads a bias made after the write.
    from dynvm.jit.ir import Literal, SpecOp, Var

    _, program = _two_layers()
    lowered, _ = lowered_bf16(program)
    assert "made a bf16 bias once" in bf16_attention(lowered)[1]
    ops = list(lowered.ops)
    first, second = [i for i, op in enumerate(ops) if op.opcode == "SDPA"]
    mask = ops[first].args[3]
    fresh = max(r for op in ops for r in op.dsts) + 1
    write = SpecOp("BITWISE_AND", (fresh,), (mask, Literal(True)), ops[first].source_pc,
                   variant="inplace")
    probes = [{**p, fresh: p[mask.reg]} for p in lowered.abstract]
    written = dataclasses.replace(lowered, ops=(*ops[:first + 1], write, *ops[first + 1:]),
                                  abstract=tuple(probes))
    rewritten, note = bf16_attention(written)
    assert "1 boolean mask(s) made bf16 biases 2 times" in note, note
    sdpas = [op for op in rewritten.ops if op.opcode == "SDPA"]
    biases = [op for op in rewritten.ops if op.opcode == "BF16_MASK_BIAS"]
    assert [op.args[3] for op in sdpas] == [Var(b.dsts[0]) for b in biases]
    positions = {id(op): i for i, op in enumerate(rewritten.ops)}
    at_write = next(i for i, op in enumerate(rewritten.ops) if op.variant == "inplace")
    assert positions[id(biases[0])] < at_write < positions[id(biases[1])]
