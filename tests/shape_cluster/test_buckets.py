"""Geometric buckets (Note [Geometric buckets] in dynvm.shape_cluster.buckets)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynvm.shape_cluster import bucket_of


@pytest.mark.parametrize("ratio", [2, 3, 4, 10])
def test_buckets_cover_every_dim_exactly_once_without_gaps(ratio):
    buckets = {}
    for n in range(10_001):
        low, high = bucket_of(n, ratio)
        assert low <= n <= high
        buckets[(low, high)] = None
    ordered = sorted(buckets)
    assert ordered[0] == (0, 0)
    for (_, high), (low, _) in zip(ordered, ordered[1:]):
        assert low == high + 1       # contiguous and disjoint, so each n is in exactly one
    for low, high in ordered:
        assert bucket_of(low, ratio) == bucket_of(high, ratio) == (low, high)


def test_ratio_4_buckets():
    assert [bucket_of(n) for n in (0, 1, 2, 4, 5, 16, 17, 64, 65, 256, 257)] == [
        (0, 0), (1, 1), (2, 4), (2, 4), (5, 16), (5, 16), (17, 64), (17, 64),
        (65, 256), (65, 256), (257, 1024)]


def test_a_batch_range_of_1_to_64_gives_4_buckets():
    assert sorted({bucket_of(n) for n in range(1, 65)}) == [(1, 1), (2, 4), (5, 16), (17, 64)]


@given(st.integers(min_value=2, max_value=10**30), st.integers(min_value=2, max_value=50))
def test_a_bucket_spans_less_than_its_ratio(n, ratio):
    low, high = bucket_of(n, ratio)
    assert low <= n <= high
    assert high < ratio * low


def test_negative_dims_and_small_ratios_are_rejected():
    with pytest.raises(ValueError, match="-1"):
        bucket_of(-1)
    for ratio in (1, 0, -4):
        with pytest.raises(ValueError, match="ratio"):
            bucket_of(5, ratio)
