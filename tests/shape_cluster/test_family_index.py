"""FamilyIndex: the incremental, memoized form of cluster() (Note [Family memo])."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynvm.shape_cluster import FamilyIndex, cluster, family_for
from tests.shape_cluster._cluster_sigs import keys_by_signature, observed, ssig, tsig

# A small world, so that drawn signatures often share a structure and dims vary.
tensor_entries = st.builds(
    lambda dims, dtype, strided: tsig(*dims, dtype=dtype,
                                      strides=tuple(range(len(dims))) if strided else None),
    st.lists(st.sampled_from([0, 1, 2, 3, 5, 16, 17, 64, 65, 300]), min_size=0, max_size=3),
    st.sampled_from([torch.float32, torch.int64]),
    st.sampled_from([False, False, False, True]),    # strided a quarter of the time
)
scalar_entries = st.sampled_from([0, 1, True, 0.0, -0.0, 2.5, "x", None, (1, 2)]).map(ssig)
signatures = st.lists(tensor_entries | scalar_entries, min_size=1, max_size=3).map(tuple)


@settings(max_examples=300, deadline=None)
@given(st.lists(signatures, min_size=1, max_size=30), st.sampled_from([1, 3, 4096]),
       st.sampled_from([2, 4]), st.data())
def test_index_agrees_with_cluster(sequence, memo_limit, ratio, data):
    index = FamilyIndex(ratio=ratio, memo_limit=memo_limit)
    for step, signature in enumerate(sequence):
        index.observe(signature)
        # Lookups between observations fill the memo with families that later
        # observations must invalidate.
        earlier = sequence[data.draw(st.integers(min_value=0, max_value=step))]
        index.family_of(earlier)
        assert index.memo_size <= memo_limit
    expected = keys_by_signature(cluster(observed(*sequence), ratio=ratio))
    for signature in sequence:
        family = index.family_of(signature)
        assert (family and family.key) == expected.get(signature), signature
        assert index.observe(signature) == family   # observing again changes nothing


def test_memo_returns_the_identical_family():
    index = FamilyIndex()
    a, b = (tsig(3, 8), ssig(1)), (tsig(4, 8), ssig(1))
    index.observe(a)
    index.observe(b)
    family = index.family_of(a)
    assert family.key == "t:float32:cpu:contiguous[2..4,8]|s:int:1"
    assert index.family_of(a) is family
    assert index.observe(a) is family
    # An equal signature built from fresh objects hits the same entry.
    assert index.family_of((tsig(3, 8), (int, 1))) is family


def test_a_growing_varying_set_invalidates_memoized_families():
    index = FamilyIndex()
    a = (tsig(4, 8),)
    assert index.observe(a).key == "t:float32:cpu:contiguous[4,8]"
    assert index.family_of(a).key == "t:float32:cpu:contiguous[4,8]"
    assert index.observe((tsig(3, 8),)).key == "t:float32:cpu:contiguous[2..4,8]"
    assert index.family_of(a).key == "t:float32:cpu:contiguous[2..4,8]"
    assert index.observe((tsig(3, 9),)).key == "t:float32:cpu:contiguous[2..4,5..16]"
    assert index.family_of(a).key == "t:float32:cpu:contiguous[2..4,5..16]"
    # Other structures keep their memoized family.
    other = (tsig(4, 8, dtype=torch.float16),)
    kept = index.observe(other)
    index.observe((tsig(5, 8),))
    assert index.family_of(other) is kept


def test_family_of_does_not_record():
    index = FamilyIndex()
    assert index.family_of((tsig(5, 8),)).key == "t:float32:cpu:contiguous[5,8]"
    index.observe((tsig(4, 8),))
    assert index.family_of((tsig(4, 8),)).key == "t:float32:cpu:contiguous[4,8]"
    # An unobserved signature gets its family under the observed varying set.
    assert index.family_of((tsig(5, 8),)).key == "t:float32:cpu:contiguous[5,8]"


def test_signatures_without_a_family():
    index = FamilyIndex()
    strided = (tsig(4, 8, strides=(1, 4)),)
    assert index.observe(strided) is None
    assert index.family_of(strided) is None
    assert index.observe((tsig(4, 8), ssig((1, 2)))) is None


def test_memo_stays_bounded_under_100000_distinct_signatures():
    index = FamilyIndex(memo_limit=4096)
    largest = 0
    for batch in range(1, 100_001):
        index.observe((tsig(batch, 8),))
        largest = max(largest, index.memo_size)
    assert largest <= 4096
    assert index.family_of((tsig(70_000, 8),)).bounds == (((65_537, 262_144), (8, 8)),)
    assert index.family_of((tsig(1, 8),)).bounds == (((1, 1), (8, 8)),)


def test_concurrent_observers_agree_with_cluster():
    sequence = [(tsig(b, s), ssig(k)) for b in (1, 2, 7, 30) for s in (8, 9, 100)
                for k in (0, 1)]
    index = FamilyIndex(memo_limit=16)

    def work(offset):
        for i in range(200):
            signature = sequence[(i * 7 + offset) % len(sequence)]
            index.observe(signature)
            index.family_of(sequence[(i + offset) % len(sequence)])

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = keys_by_signature(cluster(observed(*sequence)))
    assert {s: index.family_of(s).key for s in sequence} == expected


def test_invalid_settings_are_rejected():
    with pytest.raises(ValueError, match="ratio"):
        FamilyIndex(ratio=1)
    with pytest.raises(ValueError, match="memo_limit"):
        FamilyIndex(memo_limit=0)


def test_the_index_and_family_for_give_equal_families():
    index = FamilyIndex()
    a, b = (tsig(20, 8),), (tsig(40, 8),)
    index.observe(a)
    index.observe(b)
    assert index.family_of(a) == family_for(a, frozenset({(0, 0)}))
