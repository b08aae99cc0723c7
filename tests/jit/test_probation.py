"""Note [Probation]: a specialization that measures slower than the interpreter on its
own calls is re-planned without the arena, then dropped, with counters and events."""

from __future__ import annotations

import time

import pytest
import torch

import dynvm
from dynvm.jit import shadow
from dynvm.jit.config import JitConfig
from dynvm.jit.engine import Jit
from dynvm.jit.probation import Probation
from dynvm.telemetry import Telemetry
from tests.jit._jit_helpers import SMALL_TRANSFORMER, compiled, demo, eager_config, torch_threads


def _x(batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randn(batch, seq, SMALL_TRANSFORMER["hidden"],
                       generator=torch.Generator().manual_seed(batch))


@pytest.fixture
def slow_kernels(monkeypatch):
    """Every specialization built from now on sleeps 20 ms in its code. Its samples
    meet the next calls on the worker; unspaced (SHADOW_SPACING 0), as these tests count
    them (the spacing: tests/jit/test_shadow_pacing.py)."""
    monkeypatch.setattr(shadow, "SHADOW_SPACING", 0)
    shadow.shadow_pacing().next_at = 0
    build = Jit._finish_build

    def slowed(self, *args, **kwargs):
        spec = build(self, *args, **kwargs)
        fast = spec.fn

        def fn(regs):
            time.sleep(0.02)
            fast(regs)

        spec.fn = fn
        return spec

    monkeypatch.setattr(Jit, "_finish_build", slowed)


PROBATION = {"probation": True, "probation_shadow_every": 1, "probation_samples": 3,
             "failed_compile_backoff_calls": 1000}


def test_a_slow_specialization_is_demoted_then_dropped(slow_kernels):
    telemetry, exporter = Telemetry.in_memory()
    program = compiled("transformer")
    runtime = dynvm.Runtime(program, jit=eager_config(**PROBATION), telemetry=telemetry)
    x = _x()
    module = demo("transformer").module
    with torch_threads(1), torch.inference_mode():
        expected = module(x)
        for _ in range(12):
            torch.testing.assert_close(runtime(x), expected, rtol=1e-4, atol=1e-4)
    stats = runtime.stats()
    jit = runtime.jit
    (region,) = [r for r in jit.regions.values() if r.counters.specialized]
    assert stats["compiles"] == 1                       # one specialization, with an arena
    assert stats["probation"]["demotions"] == 1         # re-planned without it
    assert stats["probation"]["drops"] == 1             # still slow: dropped
    assert stats["probation"]["confirmed"] == 0
    assert stats["probation"]["shadow_calls"] == 6      # 3 per probation
    assert not (region.strong or region.weak or region.family_kernels)
    # its key backs off: the calls after the drop were interpreted, nothing re-promoted
    assert stats["promotions"] == 1 and region.counters.failed
    log = "\n".join(jit.event_log)
    assert "demoted: re-planned without the arena" in log and "dropped" in log
    ratios = [float(line.split(": ")[1].split("x ")[0]) for line in jit.event_log
              if "x the interpreter" in line]
    assert len(ratios) == 2 and all(r > 1.0 for r in ratios)
    events = [e for span in exporter.get_finished_spans() for e in span.events
              if e.name == "dynvm.probation"]
    assert [e.attributes["dynvm.verdict"] for e in events] == ["demote", "drop"]
    assert all(e.attributes["dynvm.ratio"] > 1.0 for e in events)
    runtime.close()


def test_without_an_arena_a_slow_specialization_is_dropped_at_once(slow_kernels):
    runtime = dynvm.Runtime(compiled("transformer"),
                            jit=eager_config(arena_budget_bytes=0, **PROBATION))
    with torch_threads(1), torch.inference_mode():
        for _ in range(8):
            runtime(_x())
    assert runtime.stats()["probation"] == {"shadow_calls": 3, "confirmed": 0,
                                            "demotions": 0, "drops": 1}
    runtime.close()


def test_probation_off_keeps_what_is_installed(slow_kernels):
    runtime = dynvm.Runtime(compiled("transformer"),
                            jit=eager_config(**{**PROBATION, "probation": False}))
    with torch_threads(1), torch.inference_mode():
        for _ in range(6):
            runtime(_x())
    stats = runtime.stats()
    assert stats["probation"]["shadow_calls"] == 0 and stats["specialized_region_calls"] == 5
    runtime.close()


def test_verdict_is_the_median_of_paired_ratios():
    probation = Probation(every=2, samples=3, margin=0.1)
    assert [probation.due() for _ in range(4)] == [False, True, True, True]
    assert probation.add(1.0, 2.0) is None          # 0.5
    assert probation.add(9.0, 1.0) is None          # 9.0: one outlier
    ratio = probation.add(0.8, 1.0)                 # 0.8
    assert ratio == pytest.approx(0.8)
    assert probation.passes(ratio) and not probation.passes(0.95)


def test_explain_shows_each_specializations_measured_ratio(capsys):
    from dynvm.cli import main

    assert main(["explain", "branchy", "--shape", "batch=2"]) == 0
    out = capsys.readouterr().out
    measured = [line for line in out.splitlines() if line.startswith("; measured: ")]
    assert measured and len(measured) == out.count("; kernel_region")
    for line in measured:  # a verdict for each, or why there is none
        assert "x the interpreter on its calls" in line or "not installed" in line


def test_the_early_samples_come_from_consecutive_hits():
    """Note [Probation]: after one warm-up hit, every hit is a shadow call until there
    are EARLY_SAMPLES ratios (a clear loser is decided after EARLY_SAMPLES + 1 hits, not
    after EARLY_SAMPLES x every); then one hit in `every`."""
    from dynvm.jit.probation import EARLY_SAMPLES

    probation = Probation(every=4, samples=12, margin=0.02)
    shadows = []
    for hit in range(1, 40):
        if probation.due():
            shadows.append(hit)
            probation.add(0.5, 1.0)
    assert shadows[:EARLY_SAMPLES] == list(range(2, EARLY_SAMPLES + 2))
    assert shadows[EARLY_SAMPLES] == EARLY_SAMPLES + 1 + 4
    assert all(b - a == 4 for a, b in zip(shadows[EARLY_SAMPLES:], shadows[EARLY_SAMPLES + 1:]))


def test_clear_losers_and_clear_winners_are_decided_early():
    from dynvm.jit.probation import EARLY_LOSS, EARLY_SAMPLES, EARLY_WIN

    losing = Probation(every=1, samples=12, margin=0.02)
    for _ in range(EARLY_SAMPLES - 1):
        assert losing.add(2.0 * EARLY_LOSS, 1.0) is None
    ratio = losing.add(3.0 * EARLY_LOSS, 1.0)
    assert ratio == 2.0 * EARLY_LOSS and not losing.passes(ratio)
    # One sample below the bar: no early verdict, the full count decides.
    mixed = Probation(every=1, samples=12, margin=0.02)
    assert [mixed.add(s, 1.0) for s in [2.0, 2.0, 2.0, 1.0, 2.0, 2.0]] == [None] * 6
    # Every early sample at or under EARLY_WIN: kept after EARLY_SAMPLES.
    winning = Probation(every=1, samples=12, margin=0.02)
    assert [winning.add(0.1, 1.0) for _ in range(EARLY_SAMPLES - 1)] == [None] * 3
    ratio = winning.add(EARLY_WIN, 1.0)
    assert ratio == 0.1 and winning.passes(ratio)
    # A likely winner with one sample above the bar waits for every sample.
    close = Probation(every=1, samples=12, margin=0.02)
    samples = [0.5, 0.5, 0.5, EARLY_WIN + 0.05] + [0.5] * 7
    assert [close.add(s, 1.0) for s in samples] == [None] * 11
    assert close.add(0.5, 1.0) == 0.5


def test_a_kernel_within_the_noise_floor_is_not_kept():
    """The default margin is outside the measured A/A noise of a median of paired ratios
    (JitConfig.probation_margin): 0.97x is not kept (9% of A/A medians reach 0.98)."""
    config = JitConfig()
    probation = Probation(config.probation_shadow_every, config.probation_samples,
                          config.probation_margin)
    assert not probation.passes(0.97) and probation.passes(0.94)


def test_a_shadow_call_charges_the_regions_layout_resolution():
    """Note [Probation]: the specialized side carries the region's mean cost per call of
    resolving new layouts; here a kernel that does nothing, with a resolution cost of
    a second per call, is a clear loser (without the charge it measured ~0.01x)."""
    import random
    import types

    from bench.profile_overhead import captured_entry
    from dynvm.jit.guards import GuardStrength
    from dynvm.jit.probation import EARLY_LOSS, EARLY_SAMPLES
    from dynvm.jit.region_jit import Specialization

    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=JitConfig(families=False,
                                                          compile_seconds_base=1e9))
    index, region_jit = next(iter(runtime.jit.regions.items()))
    regs = captured_entry(runtime, index, demo("recommender").sample_inputs(random.Random(0)))
    runtime.interpreter.install_slot(index, region_jit)
    spec = Specialization(signature=region_jit._sign(regs), strength=GuardStrength.STRONG,
                          fn=lambda regs: None,
                          artifact=types.SimpleNamespace(kernel_name="k", key="k"))
    region_jit.install(spec)
    region_jit.resolve_seconds = 1.0 + region_jit.region_calls()
    for _ in range(EARLY_SAMPLES + 1):
        region_jit.enter(regs.copy())
    # The shadow samples run on the compile worker; a hit acts on their verdict
    # (Note [Probation]).
    deadline = time.monotonic() + 60
    while spec.probation is not None and time.monotonic() < deadline:
        time.sleep(0.01)
        region_jit.enter(regs.copy())
    assert spec.probation is None and spec.ratio >= EARLY_LOSS
    assert runtime.stats()["probation"]["drops"] == 1


def test_the_next_family_waits_for_the_early_verdict_of_the_last():
    """A family kernel compiling, or installed without EARLY_SAMPLES ratios yet, holds
    the region's next family promotion (gnn compiled four losing family kernels before
    the first verdict); exact promotions are not held."""
    import types

    from dynvm.jit.guards import GuardStrength
    from dynvm.jit.probation import EARLY_SAMPLES
    from dynvm.jit.region_jit import Specialization
    from dynvm.shape_cluster import TENSOR, Family, TensorPart

    runtime = dynvm.Runtime(compiled("recommender"), "cpu", jit=JitConfig())
    region_jit = next(iter(runtime.jit.regions.values()))
    assert not region_jit._family_bet_open()
    region_jit.pending.add((("exact", 1),))
    assert not region_jit._family_bet_open()
    region_jit.pending.add("t:float32:cpu:contiguous[1..4]")
    assert region_jit._family_bet_open()
    region_jit.pending.clear()
    family = Family((TensorPart(TENSOR, 1, torch.float32, torch.device("cpu"), "contiguous"),),
                    (((1, 4),),))
    spec = Specialization(signature=(), strength=GuardStrength.FAMILY, fn=lambda regs: None,
                          artifact=types.SimpleNamespace(kernel_name="k", key="k"),
                          family=family)
    region_jit.install(spec)
    assert region_jit._family_bet_open()
    spec.probation.ratios.extend([0.5] * EARLY_SAMPLES)
    assert not region_jit._family_bet_open()


def test_without_probation_no_family_waits_for_a_verdict():
    """Probation off (a fleet's compile service, which never runs a kernel): no verdict
    will come, so a pending family does not hold the next one."""
    runtime = dynvm.Runtime(compiled("recommender"), "cpu", jit=JitConfig(probation=False))
    region_jit = next(iter(runtime.jit.regions.values()))
    region_jit.pending.add("t:float32:cpu:contiguous[1..4]")
    assert not region_jit._family_bet_open()
