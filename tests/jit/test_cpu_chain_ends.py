"""A bf16 chain of primitives takes in its input's conversion and the global mean after
it (Note [A chain's input conversion and global mean] in jit/backends/cpu/chain_ends.py):
kernels agree with eager over random batches, offset and strided inputs; the mean's
result has torch's strides and is not changed by the next call; a shape without an
arena runs the conversion and torch's mean; fp32 chains keep both as they were; where
the chain library is absent nothing is taken in.

Tolerance: tests/jit/test_cpu_conv_bf16.py's (bf16 against fp32 eager).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import chain_ends, chain_library, onednn_api
from dynvm.jit.backends.cpu.channels_last import to_channels_last_bf16
from dynvm.jit.backends.cpu.onednn_chain import PrimitiveChain, Step
from dynvm.jit.backends.cpu.onednn_conv import ConvSpec, PrimitiveConv, _run_step, eltwise_of
from dynvm.jit.backends.cpu.onednn_pool import PrimitiveMean
from tests.jit import _jit_helpers as h
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY, ChainBlocks, native_chain

pytestmark = NEEDS_ONEDNN_LIBRARY
RELATIVE = 0.03


class _Net(ChainBlocks):
    """The chain's blocks (tests/jit/_onednn.py), then ResNet's head: the global mean
    kept 1 x 1, flattened, a linear."""

    def __init__(self, c: int = 16) -> None:
        super().__init__(c)
        self.head = nn.Linear(2 * c, 10)

    def forward(self, x):
        return self.head(self.trunk(x).mean((2, 3), keepdim=True).flatten(1))


def _relative(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _sources(precision: str, dims, shapes, seed: int, views: bool = True):
    model = _Net().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 16, 16),), (dims,))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always",
                            precision=precision)
    gen = torch.Generator().manual_seed(seed)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for step, (batch, height) in enumerate(shapes):
            x = torch.randn(batch + 1, 3, height, 19, generator=gen)[1:, :, :, 3:]
            if step % 3 == 0 or not views:
                x = x.contiguous()           # else an offset and strided view
            before = x.clone()
            got, want = rt(x), model(x)
            assert got.dtype == torch.float32 and got.shape == want.shape
            limit = RELATIVE if precision == "bf16" else 1e-4
            assert _relative(got, want) < limit, (step, batch, height)
            assert torch.equal(x, before)    # the caller's tensor is never written
        stats = rt.stats()
        assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"]
        return [a.source for a in rt.jit.artifacts.values()]


def _code(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))


def test_a_bf16_chain_takes_in_its_conversion_and_mean_and_agrees_with_eager():
    native_chain()
    shapes = [(b, 16) for b in (4, 1, 3, 2, 4, 3, 1, 2, 8, 5)]
    sources = _sources("bf16", {0: Dim("batch", min=1, max=8)}, shapes, seed=11)
    converted_in = 0
    for source in sources:
        code = _code(source)
        assert "= onednn_chain_primitives" in code and "= MEAN" not in code, source
        assert "= exact_nchw_fp32" in code       # the 1 x 1 mean back to fp32
        # the conversion is taken in where the source is dense NCHW at every probe (a
        # kernel for an offset or strided view keeps it)
        if "into them 1 input conversion(s) and 1 global mean(s)" in source:
            assert "= to_channels_last_bf16" not in code, source
            converted_in += 1
        else:
            assert "into them 0 input conversion(s) and 1 global mean(s)" in source, source
            assert "contiguous" not in source.splitlines()[1], source   # its signature
    assert converted_in, sources


def test_fp32_chains_keep_their_conversion_and_mean():
    native_chain()
    shapes = [(b, 16) for b in (4, 1, 3, 2, 4, 3, 1, 2)]
    sources = _sources("fp32", {0: Dim("batch", min=1, max=4)}, shapes, seed=12)
    for source in sources:
        code = _code(source)
        assert "= to_channels_last" in code and "= MEAN" in code, source
        assert "input conversion(s)" not in source


def test_shapes_without_an_arena_convert_and_take_torchs_mean():
    # a family whose height varies: arenas for the probes' shapes only; dense sources,
    # so that the conversion is taken in
    native_chain()
    dims = {0: Dim("batch", min=1, max=4), 2: 8 * Dim("h", min=2, max=4)}
    shapes = [(2, 16), (3, 24), (1, 32), (4, 16), (2, 24), (3, 32)] * 2
    calls: list[tuple[bool, bool]] = []
    run = PrimitiveChain.__call__

    def counted(chain, x):
        calls.append((tuple(x.shape) in chain.by_shape, chain.head is not None))
        return run(chain, x)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PrimitiveChain, "__call__", counted)
        sources = _sources("bf16", dims, shapes, seed=13, views=False)
    assert any("1 input conversion(s)" in s for s in sources), sources
    assert (False, True) in calls and (True, True) in calls, calls   # both paths ran


def _hand_chain(shapes):
    """x (fp32 NCHW) -> bf16 NHWC -> conv + relu -> global mean, registers 0 (the
    source), 1 (converted), 2 (conv), 3 (mean)."""
    library, gen = onednn_api.library(), torch.Generator().manual_seed(41)
    c_in, width = shapes[0][1], 32
    weight = torch.randn(width, c_in, 3, 3, generator=gen) * 0.2
    bias = torch.randn(width, generator=gen)
    spec = ConvSpec((1, 1), (1, 1), (1, 1), False, eltwise_of("relu", [], ""),
                    torch.bfloat16)
    conv = PrimitiveConv(library, weight, bias, spec, list(shapes))
    steps = [Step(conv, 1, None, 2), Step(PrimitiveMean(library, torch.bfloat16), 2, None, 3)]
    head = chain_ends.Head(0, 0, to_channels_last_bf16, torch.float32)

    def reference(x):
        y = nn.functional.conv2d(x.to(torch.bfloat16), weight.to(torch.bfloat16),
                                 bias.to(torch.bfloat16), 1, 1)
        return torch.relu(y.float()).mean((2, 3), keepdim=True)
    return library, PrimitiveChain(library, native_chain(), steps, (3,), [(1,), (2,)], _run_step,
                                   head), reference


def test_the_mean_is_a_new_tensor_with_torchs_strides_unchanged_by_the_next_call():
    library, chain, reference = _hand_chain([(2, 16, 12, 12)])
    assert chain.reorders() == 1                         # the conversion in
    gen = torch.Generator().manual_seed(5)
    first_x = torch.randn(2, 16, 12, 12, generator=gen)
    first = chain(first_x)
    assert first.shape == (2, 32, 1, 1) and first.dtype == torch.bfloat16
    assert first.stride() == torch.randn(2, 32, 1, 1).mean((2, 3), keepdim=True).stride()
    assert _relative(first.float(), reference(first_x)) < RELATIVE
    kept = first.clone()
    for step in range(3):
        x = torch.randn(2, 16, 14, 15, generator=gen)[:, :, 1:13, 3:]   # offset, strided
        before = x.clone()
        assert _relative(chain(x).float(), reference(x)) < RELATIVE, step
        assert torch.equal(x, before)
    assert torch.equal(first, kept)


def test_where_the_library_is_absent_nothing_is_taken_in(monkeypatch):
    native_chain()
    monkeypatch.setattr(chain_library, "_find_library", lambda: None)
    shapes = [(b, 16) for b in (2, 1, 2, 1, 2, 1)]
    sources = _sources("bf16", {0: Dim("batch", min=1, max=2)}, shapes, seed=14)
    for source in sources:
        code = _code(source)
        assert "= to_channels_last_bf16" in code and "= MEAN" in code, source
        assert "= onednn_chain_primitives" not in code
