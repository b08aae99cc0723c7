"""The zoo's checks can fail: a wrong output, a counted JIT failure and a malformed entry
are caught (cheap: no model is built)."""

from __future__ import annotations

import pytest
import torch

from tests.zoo import _zoo_harness as harness
from tests.zoo._zoo import ZooEntry

POINTS = ({"batch": 1}, {"batch": 3}, {"batch": 5})


def _entry(**changes) -> ZooEntry:
    fields = {"name": "m", "library": "torchvision", "build": lambda: None,
              "export_point": {"batch": 2}, "held_out": POINTS}
    return ZooEntry(**{**fields, **changes})


def test_outputs_off_by_more_than_the_tolerance_fail():
    entry = _entry()
    expected = (torch.ones(4, 8),)
    harness.assert_matches(entry, torch.ones(4, 8) + 1e-6, expected, "close")
    with pytest.raises(AssertionError, match=r"wrong, output 0"):
        harness.assert_matches(entry, torch.ones(4, 8) + 1e-3, expected, "wrong")
    with pytest.raises(AssertionError, match="2 outputs, eager gives 1"):
        harness.assert_matches(entry, (torch.ones(4, 8),) * 2, expected, "extra")


def test_counted_jit_failures_are_reported():
    clean = {"specialize_failures_total": 0, "specialize_failures": {}, "deopts": 0,
             "compile_timeouts": 0, "compile_failures": 2}  # rejections are not bugs
    assert harness.jit_failures(clean) == ""
    failing = {**clean, "specialize_failures_total": 1,
               "specialize_failures": {"RuntimeError: view size is not compatible": 1},
               "deopts": 3}
    assert harness.jit_failures(failing) == (
        "specialize failures {'RuntimeError: view size is not compatible': 1}; deopts 3")


def test_an_entry_needs_three_held_out_points_other_than_the_export_point():
    assert _entry().dims == ("batch",)
    with pytest.raises(ValueError, match=">= 3 held-out"):
        _entry(held_out=POINTS[:2])
    with pytest.raises(ValueError, match="not held out"):
        _entry(held_out=(*POINTS, {"batch": 2}))
    with pytest.raises(ValueError, match="same dims"):
        _entry(held_out=(*POINTS[:2], {"batch": 3, "seq": 4}))
