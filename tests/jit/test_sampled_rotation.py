"""Note [Sampling a rotation] in dynvm.jit.region_watch: a region sampled at one miss in
`sample_every` (Note [Sampled watching]) must still see every shape of a traffic that
cycles through its shapes in a fixed order, each at its share of the calls.

The zoo's gpt2 and albert (tests/zoo: four shapes in turn, a region of ~0.3 ms) were
sampled at one miss in 16 from their first checks; with a fixed gap of 16 misses, a
multiple of the rotation's 4, every profiled miss was the same shape, so the window held
that shape ~61 times in 64 and the three others not at all. Which shape it was depended
on the phase at which sampling began, and the policy promoted (or never promoted) by
that: 0, 1 or 3 compiles of the same model from run to run."""

from __future__ import annotations

import torch

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.jit.policy import EXACT
from dynvm.jit.region_watch import COLD_CHECK_EVERY
from dynvm.jit.settling import best_waiting
from tests.jit._jit_helpers import compile_module

# A transformer block's feed-forward half at the zoo's width, over [batch, seq, 32]
# with both dims dynamic: one region of a few dozen microseconds.
WIDTH = 32
POINTS = ((2, 8), (1, 5), (3, 13), (4, 32))   # the zoo's token points, in its order


class _FeedForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


def _program() -> dynvm.Program:
    torch.manual_seed(0)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=48)
    return compile_module(_FeedForward(), (torch.randn(2, 8, WIDTH),),
                          ({0: batch, 1: seq},))


def test_a_sampled_region_sees_every_shape_of_a_rotation():
    """Four shapes in turn, a sampled watch: every shape keeps about a quarter of the
    window (16 of 64), at every check, never one shape holding it. K = the window, so
    nothing is ever promoted (the window stays all misses); the compile cost and the
    horizon make every key pay, so the region is watched, not cold (Note [Cold
    regions]), and its sampling grows to SAMPLE_MAX (Note [Sampled watching])."""
    config = JitConfig(families=False, min_recurrence=64, max_recurrence=64, window=64,
                       horizon_calls=10**12, expected_speedup=1.0, sync=True)
    program = _program()
    runtime = dynvm.Runtime(program, "cpu", jit=config)
    reference = dynvm.Runtime(program, "cpu", jit=False)
    inputs = [(torch.randn(b, s, WIDTH, generator=torch.Generator().manual_seed(i)),)
              for i, (b, s) in enumerate(POINTS)]
    (region_jit,) = runtime.jit.regions.values()
    profile, watch = region_jit.profile, region_jit.watch
    checked = 0
    for call in range(6000):
        x = inputs[call % len(inputs)]
        out = runtime(*x)
        if call % 997 == 0:
            torch.testing.assert_close(out, reference(*x))
        # Judged once the window holds only misses profiled at one in 4 or sparser (the
        # 4-shape rotation's period divides the fixed gap): 64 profiled misses later.
        if watch.sample_every < len(POINTS):
            sampled_since = profile.calls
            continue
        if profile.calls - sampled_since < config.window or call % COLD_CHECK_EVERY:
            continue
        seen = sorted(profile.recurrence(key) for key in profile.table)
        assert len(seen) == len(POINTS) and seen[0] >= 4 and seen[-1] <= 32, (
            f"call {call}: window {seen} at one miss in {watch.sample_every}")
        checked += 1
    assert watch.sample_every >= 4 * len(POINTS) and checked >= 8
    stats = runtime.stats()
    assert stats["promotions"] == 0 and stats["cold_periods"] == 0
    # What `dynvm bench zoo` states of such a region: the key the policy waits for,
    # here one shape at its quarter of the window, short of K.
    waiting = best_waiting(region_jit)
    assert waiting["kind"] == EXACT and waiting["threshold"] == config.window
    assert 4 <= waiting["seen"] <= 32 and waiting["benefit_seconds"] > waiting["cost_seconds"]
