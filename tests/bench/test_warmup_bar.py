"""bench/warmup_bar.py (Note [Warm-up bar by repetition]): each shape's calls pooled over
runs, the verdicts against the bar and the pooled A/A, and a whole run of fresh child
processes at a tiny width. No timing is asserted (the host is shared)."""

from __future__ import annotations

import json

import pytest

from bench import warmup_bar


def _run(jit, interp, interp_b):
    """A run's times (ms) at one shape, as bench.full_width's warm-up returns them."""
    return {"times_ms": {"eager": {"1x16": [1.0] * len(interp)}, "interp": {"1x16": interp},
                         "interp_b": {"1x16": interp_b}, "jit": {"1x16": jit}}}


def test_pooled_p90_over_runs_and_verdicts():
    ten = [1.0] * 9
    # One slow JIT call in each of two runs: pooled over 20 calls the p90 still meets it.
    runs = [_run(ten + [5.0], ten + [1.0], ten + [1.0]), _run(ten + [5.0], ten + [1.0],
                                                              ten + [1.0])]
    shape = warmup_bar.pooled(runs)["1x16"]
    assert shape["calls"] == 20 and len(shape["per_run"]) == 2
    assert shape["jit_over_interp_p90"] == pytest.approx(
        warmup_bar.percentile([1.0] * 18 + [5.0] * 2, 90))
    # A JIT slower at every call is over, unless the A/A moved as far.
    slow = [_run([1.3] * 10, [1.0] * 10, [1.0] * 10)]
    assert warmup_bar.pooled(slow)["1x16"]["verdict"] == "over"
    noisy = [_run([1.15] * 10, [1.0] * 10, [1.2] * 10)]
    assert warmup_bar.pooled(noisy)["1x16"]["verdict"] == "within the noise"
    fine = [_run([0.5] * 10, [1.0] * 10, [1.0] * 10)]
    assert warmup_bar.pooled(fine)["1x16"]["verdict"] == "met"


def test_fresh_processes_pooled(tmp_path):
    out = tmp_path / "out"
    assert warmup_bar.main(["--bert-hidden", "32", "--bert-layers", "1", "--repeats", "2",
                            "--calls", "16", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads((out / "bert.json").read_text())
    assert len(result["runs"]) == 2 and result["calls"] == 16
    # Every call of both runs is in some shape's pool, and each run is its own process.
    assert sum(s["calls"] for s in result["per_shape"].values()) == 2 * 16
    for shape in result["per_shape"].values():
        assert shape["interp_p90_ms"] > 0 and shape["jit_over_interp_p90"] > 0
        assert shape["verdict"] in ("met", "within the noise", "over")
    text = (out / "bert.md").read_text()
    assert all(f"| {label} |" in text for label in result["per_shape"])
