"""Ops over constants and literals run at compile time in fp32 kernels too (Note [Shape
constants in kernels] in jit/backends/cpu/shape_constants.py; `CpuOptions.shape_constants`):
a BERT-style prologue's index arithmetic, mask ops and embeddings of constant ids leave
exact fp32 kernels, with the same bits as the kernel without the pass and eager's
results within float tolerance, over random shapes, offset and strided inputs, exact
kernels and families.
"""

from __future__ import annotations

import torch

import dynvm
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.specialize import specialize
from tests.jit import _jit_helpers as h
from tests.jit.test_cpu_attention_primitives import _keep, run_kernel
from tests.jit.test_cpu_shape_constants import NOTE, _program

VIEWS_NOTE = "embedding(s) of constant ids as views of their table"


def _fp32_kernel(program, ids, keep, fold: bool):
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: ids,
                                        region.live_in[1].index: keep})
    constants = [t.detach() for t in program.constants]
    options = CpuOptions(fusion="always", prepacked=PrepackCache(),
                         shape_constants="on" if fold else "off")
    return region, compile_kernel(spec, program, constants, torch.device("cpu"), "test",
                                  "strong", options)


def test_fp32_kernels_fold_the_prologue_with_the_same_bits():
    gen = torch.Generator().manual_seed(11)
    for shifted, width in ((False, 32), (True, 32), (False, 512)):
        model, program = _program(shifted=shifted, width=width)
        for batch, seq in ((1, 16), (3, 9), (2, 40)):
            ids = torch.randint(0, 50, (batch + 1, seq), generator=gen)[1:]   # offset
            keep = _keep(batch, seq, gen).t().contiguous().t()              # strided
            region, kernel = _fp32_kernel(program, ids, keep, fold=True)
            _, plain = _fp32_kernel(program, ids, keep, fold=False)
            assert NOTE in kernel.source and NOTE not in plain.source, kernel.source
            assert kernel.source.count("ARANGE") < plain.source.count("ARANGE")
            if width == 512:     # the position table's rows as a view (over MAX_BYTES)
                assert VIEWS_NOTE in kernel.source, kernel.source
            with torch.no_grad():
                want = model(ids, keep)
            for _ in range(2):   # a kept constant is not changed by the first call
                got = run_kernel(region, kernel.fn, ids, keep)
                assert got.dtype == torch.float32
                assert torch.equal(got, run_kernel(region, plain.fn, ids, keep))
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            other = _keep(batch, seq, gen)
            assert torch.equal(run_kernel(region, kernel.fn, ids, other),
                               run_kernel(region, plain.fn, ids, other))


def test_fp32_runtimes_serve_random_shape_sequences_and_families():
    model, program = _program(shifted=True)
    gen = torch.Generator().manual_seed(23)
    for families in (False, True):
        config = h.eager_config(cpu_fusion="always", families=families)
        with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
            for step in range(8):
                batch, seq = (int(v) for v in torch.randint(1, 5, (2,), generator=gen))
                seq += 2 + 5 * (step % 3)
                ids, keep = torch.randint(0, 50, (batch, seq), generator=gen), \
                    _keep(batch, seq, gen)
                if step % 2:
                    ids = torch.randint(0, 50, (batch + 1, seq), generator=gen)[1:]
                    keep = keep.t().contiguous().t()
                rt(ids, keep)
                torch.testing.assert_close(rt(ids, keep), model(ids, keep),
                                           rtol=1e-5, atol=1e-5)
            assert rt.stats()["specialized_region_calls"] > 0
            sources = [a.source for a in rt.jit.artifacts.values()]
        assert sources and all(NOTE in s for s in sources), sources
