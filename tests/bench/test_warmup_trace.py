"""bench.warmup_trace's attribution of a slow JIT call to the background work that
overlapped it (the compile worker's lanes), on a made-up timeline: no model runs."""

from __future__ import annotations

from bench.warmup_trace import Timeline, classify


def _timeline(*spans) -> Timeline:
    timeline = Timeline()
    for span in spans:
        timeline.add(*span)
    return timeline


def test_a_slow_call_is_charged_to_the_shadow_sample_or_prewarm_beside_it():
    interp = {"8x16": [0.050] * 10}   # the interpreter's p90 there: 50 ms
    calls = [(0.0, 0.040, "8x16"),     # fast: not looked at
             (1.0, 1.100, "8x16"),     # slow, beside a shadow sample
             (2.0, 2.100, "8x16"),     # slow, beside a compile's prewarm
             (3.0, 3.100, "8x16")]     # slow, beside nothing
    timeline = _timeline((0.95, 1.08, "shadow sample", "shadow sample"),
                         (1.90, 2.20, "compile", "exact r0"),
                         (2.00, 2.07, "prewarm", "prewarm"))
    result = classify(calls, timeline, interp, bar=1.1)
    assert [r["cause"] for r in result["slow"]] == [
        "shadow sample", "prewarm", "nothing overlapped"]
    first, second = result["slow"][0], result["slow"][1]
    assert first["overlap_ms"] == {"shadow sample": 80.0}
    # The prewarm runs inside its compile: the compile is charged only the rest.
    assert second["overlap_ms"] == {"prewarm": 70.0, "compile outside calibration": 30.0}
    assert result["by_cause"] == {"shadow sample": 1, "prewarm": 1, "nothing overlapped": 1}
