"""A chain of primitives in pieces with a helper thread (Note [A chain in halves, one
wake a call] in jit/backends/cpu/chain_halves.py): the rows each piece reads; kernels
whose arenas run in pieces (row halves at batch 1, an image a piece at 2-4 in NHWC)
agree with eager over random batches,
offset and strided inputs, odd heights (uneven halves), fp32 and bf16; every piece runs
once a call; one OpenMP thread runs the team's chain; "never" builds none; the choice
holds the team after a starved helper.

Tolerance: tests/jit/test_cpu_conv_bf16.py's for bf16 (against fp32 eager).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import chain_halves, chain_layout_choice, chain_pieces, onednn_chain
from dynvm.jit.backends.cpu.halves_choice import FIRST, RoundChoice
from tests.jit import _jit_helpers as h
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY, ChainBlocks, bound_native, native_chain

pytestmark = NEEDS_ONEDNN_LIBRARY
RELATIVE_BF16 = 0.03


@pytest.mark.parametrize("seed", range(4))
def test_the_rows_a_piece_reads_give_its_rows_of_the_convolution(seed):
    rng = random.Random(seed)
    for _ in range(25):
        k, s, d = rng.choice((1, 3, 5, 7)), rng.choice((1, 2, 3)), rng.choice((1, 2))
        p = rng.randrange(0, k)
        size = rng.randrange(d * (k - 1) + 1, 30)
        x = torch.randn(1, 2, size, 5, dtype=torch.float64)
        w = torch.randn(3, 2, k, 1, dtype=torch.float64)
        whole = F.conv2d(x, w, stride=(s, 1), padding=(p, 0), dilation=(d, 1))
        pieces = chain_pieces.row_pieces(whole.shape[2], rng.choice((2, 3)))
        assert pieces[0][0] == 0 and pieces[-1][1] == whole.shape[2]
        assert all(a < b for a, b in pieces)
        assert all(b == a2 for (_, b), (a2, _) in zip(pieces, pieces[1:]))
        for a, b in pieces:
            first, end, top, below = chain_pieces.input_rows(a, b, size, s, p, d * (k - 1) + 1)
            assert 0 <= first < end <= size and top >= 0 and below >= 0
            piece = F.conv2d(F.pad(x[:, :, first:end], (0, 0, top, below)), w,
                             stride=(s, 1), dilation=(d, 1))
            # the same products and sums; torch may order a float64 sum differently at
            # another output size (it did on an AMD EPYC), so equal to rounding: a wrong
            # input row would be off by whole terms
            torch.testing.assert_close(piece, whole[:, :, a:b], rtol=1e-12, atol=1e-12,
                                       msg=str((k, s, d, p, size, a, b)))


class _Net(ChainBlocks):
    """The chain's blocks, then ResNet's head (the global mean kept 1 x 1, a linear)."""

    def __init__(self, c: int = 16) -> None:
        super().__init__(c)
        self.head = nn.Linear(2 * c, 10)

    def forward(self, x):
        return self.head(self.trunk(x).mean((2, 3), keepdim=True).flatten(1))


def _chains_with_halves() -> list:
    return [o for o in gc.get_objects()
            if isinstance(o, onednn_chain.PrimitiveChain) and o.halves]


def _pieces_run(chains) -> int:
    return sum(c.halves.by_helper + c.halves.by_caller
               for chain in chains for c in chain.halves.values())


@pytest.fixture
def halves_always(monkeypatch):
    native_chain()
    bound_native(chain_halves)
    monkeypatch.setattr(chain_halves, "policy", "always")
    gc.collect()
    # pieces need two threads (one torch thread runs the team's chain), and a test
    # before this one in the same process may have left torch at one (bench.zoo's and
    # bench._timing's mains set it so)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("precision,blocked", [
    ("fp32", "always"), ("fp32", "never"), ("bf16", "measured")])
def test_arenas_in_pieces_agree_with_eager(precision, blocked, halves_always, monkeypatch):
    # fp32 at batch 2-4: nChw16c team chains, or NHWC ones in pieces by image (Note
    # [nChw16c or NHWC by measurement] in chain_layout_choice)
    monkeypatch.setattr(chain_layout_choice, "blocked_policy", blocked)
    model = _Net().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 17, 16),),
                            ({0: Dim("batch", min=1, max=4)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always",
                            precision=precision)
    gen = torch.Generator().manual_seed(5)
    limit = RELATIVE_BF16 if precision == "bf16" else 1e-4
    before_chains = {id(c) for c in _chains_with_halves()}
    batches = [1, 3, 1, 2, 1, 4, 1, 1, 2, 1]
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        kept = []
        for step, batch in enumerate(batches):
            x = torch.randn(batch + 1, 3, 17, 19, generator=gen)[1:, :, :, 3:]
            if step % 3 == 0:
                x = x.contiguous()           # else an offset and strided view
            got, want = rt(x), model(x)
            assert got.shape == want.shape and got.dtype == torch.float32
            error = float((got - want).abs().max() / want.abs().max())
            assert error < limit, (step, batch, error)
            kept.append((got, got.clone()))
        for got, copy in kept:               # no result aliases a later call's buffers
            assert torch.equal(got, copy)
        stats = rt.stats()
        assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"]
        sources = [a.source for a in rt.jit.artifacts.values()]
        chains = [c for c in _chains_with_halves() if id(c) not in before_chains]
        assert any("row halves with a helper" in s for s in sources), sources
        assert chains, "no chain has a batch-1 arena in halves"
        per_call = {id(c): c.halves.pieces for chain in chains for c in chain.halves.values()}
        assert all(n >= 2 * 5 for n in per_call.values())   # every step cut in two or more
        for chain in chains:                 # every piece once a call
            for call in chain.halves.values():
                ran = call.halves.by_helper + call.halves.by_caller
                assert ran % per_call[id(call)] == 0
        assert _pieces_run(chains) > 0
        ran_at = {shape[0] for chain in chains for shape, call in chain.halves.items()
                  if call.halves.by_helper + call.halves.by_caller}
        assert 1 in ran_at
        if precision == "bf16" or blocked == "never":   # NHWC at 2-4: an image a piece
            assert ran_at - {1}, ran_at
        if precision == "fp32":                               # 5 x 4 outputs: output-channel halves
            placed = [p for chain in chains for call in chain.halves.values()
                      for p in call.halves._pieces if getattr(p, "place", None) is not None]
            assert placed and all(p.place.sum in (0, 1) for p in placed)
            assert any(p.place.sum for p in placed)    # a residual's sum placed too


def test_one_openmp_thread_runs_the_teams_chain(halves_always):
    model = _Net().eval()
    program = dynvm.compile(model, (torch.randn(1, 3, 16, 16),))
    config = h.eager_config(cpu_fusion="always", cpu_channels_last="always")
    x = torch.randn(1, 3, 16, 16)
    threads = torch.get_num_threads()
    before_chains = {id(c) for c in _chains_with_halves()}
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        rt(x)
        chains = [c for c in _chains_with_halves() if id(c) not in before_chains]
        assert chains
        ran = _pieces_run(chains)
        torch.set_num_threads(1)
        try:
            got = rt(x)
        finally:
            torch.set_num_threads(threads)
        assert _pieces_run(chains) == ran     # the team's chain, not the halves
        assert torch.allclose(got, model(x), rtol=1e-4, atol=1e-4)
        rt(x)
        assert _pieces_run(chains) > ran


def test_never_builds_no_halves(monkeypatch):
    native_chain()
    monkeypatch.setattr(chain_halves, "policy", "never")
    model = _Net().eval()
    program = dynvm.compile(model, (torch.randn(1, 3, 16, 16),))
    config = h.eager_config(cpu_fusion="always", cpu_channels_last="always")
    x = torch.randn(1, 3, 16, 16)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        got = rt(x)
        assert torch.allclose(got, model(x), rtol=1e-4, atol=1e-4)
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert any("native call" in s for s in sources)
    assert not any("row halves" in s for s in sources)


def _calls(choice, n: int, halves_s: float, team_s: float) -> list[bool]:
    picks = []
    for _ in range(n):
        use = choice.next()
        choice.record(use, halves_s if use else team_s)
        picks.append(use)
    return picks


def test_an_arenas_choice_is_taken_in_rounds_with_the_chains_retry():
    # Note [Halves chosen in rounds] (tests/jit/test_halves_choice.py); a chain's
    # verdict for the team is retaken after `_RETRY` calls (Note [fp32 batch 4 in pieces
    # and the chooser's held verdict])
    call = chain_halves.HalvesCall(_Way(), _Way())
    assert isinstance(call.choice, RoundChoice)
    _calls(call.choice, 2 * FIRST, 2.0, 1.0)         # the halves slowed by a compile
    assert not call.choice.halves
    picks = _calls(call.choice, chain_halves._RETRY - 1 + 2 * FIRST, 1.0, 1.05)
    assert picks[:chain_halves._RETRY - 1] == [False] * (chain_halves._RETRY - 1)
    assert call.choice.halves


class _Way:
    """A stand-in for an arena or its pieces: `run` returns its input."""

    starved = False

    def __init__(self) -> None:
        self.calls = 0

    def run(self, x):
        self.calls += 1
        return [x]


def test_a_call_beside_a_compile_is_not_a_timing_and_its_round_goes_on(monkeypatch):
    # Note [fp32 batch 4 in pieces and the chooser's held verdict]
    from dynvm.jit import background
    monkeypatch.setattr(chain_halves, "policy", "measure")
    arena, pieces = _Way(), _Way()
    call = chain_halves.HalvesCall(arena, pieces)
    x = torch.zeros(1)
    with background.worker_task():
        for _ in range(4 * FIRST):
            assert call(x)[0] is x
    assert call.untimed == 4 * FIRST
    assert call.choice._asking and not any(call.choice._samples.values())
    for _ in range(2 * FIRST):
        call(x)
    assert not call.choice._asking and call.untimed == 4 * FIRST
    assert arena.calls >= FIRST and pieces.calls >= FIRST
