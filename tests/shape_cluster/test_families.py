"""Code families on hand-built signatures (Note [Code families], Note [Family keys])."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dynvm.shape_cluster import (
    Family,
    bucket_of,
    cluster,
    family_for,
    layout_class,
    structure_key,
    varying_dims,
)
from tests.shape_cluster._cluster_sigs import (
    CPU,
    keys_by_signature,
    observed,
    row_major,
    ssig,
    tsig,
)

# ------------------------------------------------------------------ layout classes ----


def test_layout_class_of_hand_written_strides():
    assert layout_class((4, 32, 256), (8192, 256, 1), 0) == "contiguous"
    assert layout_class((4, 32, 256), (8192, 256, 1), 256) == "strided"
    assert layout_class((4, 32), (1, 4), 0) == "strided"
    assert layout_class((4, 1, 8), (8, 99, 1), 0) == "contiguous"   # size-1 stride unused
    assert layout_class((2, 0, 3), (3, 3, 1), 0) == "contiguous"
    assert layout_class((), (), 0) == "contiguous"
    assert layout_class((4, 8), (8,), 0) == "strided"


def test_layout_class_agrees_with_torch_on_real_tensors():
    base = torch.empty(6, 5, 4)
    views = [base, base.transpose(0, 1), base[1:], base[:, 1:], base[:, :, :1],
             base[:1], base.expand(2, 6, 5, 4), torch.empty(3, 1, 4)[:, :, :],
             torch.empty(1, 7).t(), torch.empty(5, 4)[::2], torch.empty(0, 3)]
    for view in views:
        expected = ("contiguous" if view.is_contiguous() and view.storage_offset() == 0
                    else "strided")
        assert layout_class(tuple(view.shape), view.stride(), view.storage_offset()) == \
            expected, (tuple(view.shape), view.stride(), view.storage_offset())


# ------------------------------------------------------------------ structures ---------


def test_structure_key_parts():
    assert structure_key((tsig(4, 8), ssig(7))) == (
        ("t", 2, torch.float32, CPU, "contiguous"), ("s", int, 7))
    assert structure_key((tsig(4, 8, strides=(1, 4)),))[0][4] == "strided"


def test_structure_separates_dtype_rank_device_layout_and_scalar_values():
    variants = [
        (tsig(4, 8), ssig(7)),
        (tsig(4, 8, dtype=torch.float16), ssig(7)),
        (tsig(4, 8, 1), ssig(7)),
        (tsig(4, 8, device=torch.device("meta")), ssig(7)),
        (tsig(4, 8, strides=(1, 4)), ssig(7)),
        (tsig(4, 8), ssig(8)),
        (tsig(4, 8), ssig(7.0)),
        (tsig(4, 8), ssig(True)),
    ]
    keys = [structure_key(signature) for signature in variants]
    assert len(set(keys)) == len(variants)
    assert structure_key((tsig(9, 3), ssig(7))) == keys[0]   # dims are not structure
    # Strides and offset only matter through the layout class.
    assert structure_key((tsig(4, 8, offset=8), ssig(7))) == keys[4]


# ------------------------------------------------------------------ cluster ------------


def test_batch_varying_1_to_64_gives_4_families():
    signatures = [(tsig(batch, 32, 256),) for batch in range(1, 65)]
    stats = cluster([(s, 2, 0.001 * s[0][0].dims[0]) for s in signatures])
    assert sorted(s.family.bounds[0][0] for s in stats) == [(1, 1), (2, 4), (5, 16), (17, 64)]
    assert [s.family.bounds[0][0] for s in stats] == [(17, 64), (5, 16), (2, 4), (1, 1)]
    for s in stats:
        low, high = s.family.bounds[0][0]
        assert s.family.bounds[0][1:] == ((32, 32), (256, 256))
        assert [m[0][0].dims[0] for m in s.members] == list(range(low, high + 1))
        assert s.count == 2 * (high - low + 1)
        assert s.seconds == pytest.approx(0.001 * sum(range(low, high + 1)))
        assert s.family.varying == (((0, 0),) if low != high else ())


def test_batch_and_seq_both_varying_give_the_product_of_buckets():
    batches, seqs = (1, 3, 10, 40), (8, 100)
    stats = cluster(observed(*[(tsig(b, s, 64),) for b in batches for s in seqs]))
    assert len(stats) == 8
    expected = {(bucket_of(b), bucket_of(s), (64, 64)) for b in batches for s in seqs}
    assert {s.family.bounds[0] for s in stats} == expected
    assert all(len(s.members) == 1 for s in stats)


def test_dims_vary_per_structure():
    # float32 varies in batch; the lone float16 signature stays exact.
    stats = cluster(observed((tsig(2, 8),), (tsig(3, 8),),
                             (tsig(3, 8, dtype=torch.float16),), (tsig(4, 8, 2),)))
    keys = sorted(s.family.key for s in stats)
    assert keys == ["t:float16:cpu:contiguous[3,8]", "t:float32:cpu:contiguous[2..4,8]",
                    "t:float32:cpu:contiguous[4,8,2]"]


def test_strided_and_offset_tensors_get_no_family():
    strided = (tsig(8, 4, strides=(1, 8)),)
    offset = (tsig(8, 4, offset=4),)
    assert family_for(strided, frozenset({(0, 0)})) is None
    assert family_for(offset, frozenset()) is None
    stats = cluster(observed((tsig(8, 4),), strided, offset, (tsig(9, 4, strides=(1, 9)),)))
    assert [s.family.key for s in stats] == ["t:float32:cpu:contiguous[8,4]"]


def test_scalars_are_part_of_the_structure_by_value():
    stats = cluster(observed((tsig(2, 8), ssig(7)), (tsig(3, 8), ssig(7)),
                             (tsig(3, 8), ssig(8)), (tsig(3, 8), ssig(True))))
    assert sorted(s.family.key for s in stats) == [
        "t:float32:cpu:contiguous[2..4,8]|s:int:7",
        "t:float32:cpu:contiguous[3,8]|s:bool:True",
        "t:float32:cpu:contiguous[3,8]|s:int:8",
    ]


def test_cluster_sums_repeats_and_orders_by_seconds_then_key():
    a, b, c = (tsig(1, 8),), (tsig(8, 5),), (tsig(8, 6),)
    stats = cluster([(a, 3, 1.0), (b, 1, 2.0), (a, 4, 1.5), (c, 1, 2.0)])
    assert [(s.members, s.count, s.seconds) for s in stats] == [
        ((a,), 7, 2.5), ((b, c), 2, 4.0)][::-1]
    tied = cluster([((tsig(2, 8),), 1, 1.0), ((tsig(3, 9),), 1, 1.0)])
    assert [s.family.key for s in tied] == sorted(s.family.key for s in tied)


def test_varying_dims():
    assert varying_dims([]) == frozenset()
    assert varying_dims([(tsig(4, 8), ssig(1), tsig(3))] * 3) == frozenset()
    assert varying_dims([(tsig(4, 8), ssig(1), tsig(3)),
                         (tsig(4, 9), ssig(1), tsig(5))]) == {(0, 1), (2, 0)}
    # Different structures do not vary against each other.
    assert varying_dims([(tsig(4, 8),), (tsig(5, 8, dtype=torch.int64),)]) == frozenset()


# ------------------------------------------------------------------ keys ---------------


def test_golden_key():
    family = family_for((tsig(20, 32, 256), ssig(7)), frozenset({(0, 0)}))
    assert family.key == "t:float32:cpu:contiguous[17..64,32,256]|s:int:7"


def test_keys_are_equal_for_equal_signatures_built_from_fresh_objects():
    first = (tsig(20, 32, 256), ssig(7), ssig(0.5), ssig("gelu"))
    fresh = ((tsig(*(int(d) for d in ("20", "32", "256")), device=torch.device("cpu"))),
             (int, int("7")), (float, float("0.5")), (str, "".join(["ge", "lu"])))
    varying = frozenset({(0, 0), (0, 1)})
    one, two = family_for(first, varying), family_for(fresh, set(varying))
    assert one == two and hash(one) == hash(two) and one.key == two.key
    assert one.key == ("t:float32:cpu:contiguous[17..64,17..64,256]|s:int:7|s:float:0.5"
                       "|s:str:'gelu'")


def test_a_family_survives_pickling():
    # The compile service receives families from replicas (Ray pickles them).
    family = family_for((tsig(20, 32), ssig(7)), frozenset({(0, 0)}))
    copy = pickle.loads(pickle.dumps(family))
    assert copy == family and copy.key == family.key and copy.contains((tsig(64, 32), ssig(7)))


def test_scalar_literals_in_keys():
    def key(value):
        family = family_for((ssig(value),), frozenset())
        return None if family is None else family.key

    assert key(None) == "s:None:None"
    assert key(torch.bfloat16) == "s:dtype:bfloat16"
    assert key(torch.device("cuda", 1)) == "s:device:cuda:1"
    assert key(torch.channels_last) == "s:memory_format:channels_last"
    assert key(-0.0) == key(0.0) == "s:float:0.0"      # equal values, one structure
    assert key(float("inf")) == "s:float:inf"
    assert key("a|s:int:1") == "s:str:'a|s:int:1'"       # repr keeps separators quoted
    # No stable, exact text: tuples ((1, 2) == (True, 2.0)), NaN, arbitrary objects.
    assert key((1, 2)) is None
    assert key(float("nan")) is None
    assert key(object()) is None


def test_a_family_cannot_be_built_with_bounds_that_do_not_fit_its_structure():
    structure = structure_key((tsig(4, 8),))
    assert Family(structure, (((4, 4), (8, 8)),)).key == "t:float32:cpu:contiguous[4,8]"
    for bounds in [(((4, 4),),), (None,), ()]:
        with pytest.raises(ValueError):
            Family(structure, bounds)


# ------------------------------------------------------------------ contains -----------


def test_contains_respects_bounds_and_structure():
    family = family_for((tsig(20, 32), ssig(7)), frozenset({(0, 0)}))
    assert family.bounds == (((17, 64), (32, 32)), None)
    for batch in (17, 40, 64):
        assert family.contains((tsig(batch, 32), ssig(7)))
    assert not family.contains((tsig(16, 32), ssig(7)))
    assert not family.contains((tsig(65, 32), ssig(7)))
    assert not family.contains((tsig(20, 33), ssig(7)))
    assert not family.contains((tsig(20, 32), ssig(8)))
    assert not family.contains((tsig(20, 32, dtype=torch.float64), ssig(7)))
    assert not family.contains((tsig(20, 32, strides=(1, 20)), ssig(7)))
    assert not family.contains((tsig(20, 32, 1), ssig(7)))
    assert not family.contains((tsig(20, 32),))
    assert not family.contains((tsig(20, 32), ssig(7), ssig(7)))


# ------------------------------------------------------------------ probes -------------

dims_strategy = st.lists(st.integers(min_value=0, max_value=5000), min_size=0, max_size=4)


@st.composite
def families(draw):
    signature = tuple(tsig(*draw(dims_strategy))
                      for _ in range(draw(st.integers(min_value=1, max_value=3))))
    positions = [(p, d) for p, entry in enumerate(signature) for d in range(entry[0].rank)]
    varying = draw(st.sets(st.sampled_from(positions))) if positions else set()
    return family_for(signature, frozenset(varying), draw(st.sampled_from([2, 4, 8])))


@given(families())
def test_probes_stay_in_bounds_and_reach_both_ends_of_every_varying_dim(family):
    probes = family.probe_dims()
    assert 1 <= len(probes) <= 6
    assert len(set(probes)) == len(probes)
    varying = family.varying
    assert probes[0] == tuple(tuple(high for _, high in dims) for dims in family.bounds)
    for probe in probes:
        for dims, bounds in zip(probe, family.bounds):
            assert len(dims) == len(bounds)
            assert all(low <= n <= high for n, (low, high) in zip(dims, bounds))
    for position, axis in varying:
        values = {probe[position][axis] for probe in probes}
        low, high = family.bounds[position][axis]
        assert {low, high} <= values
        if high - low >= 2:
            assert low + 1 in values
    if len(varying) <= 8:
        # Any two varying dims are apart in some probe: one at its low, the other at its high.
        def at_low(probe, position, axis):
            return probe[position][axis] == family.bounds[position][axis][0]

        for (p1, a1), (p2, a2) in itertools.combinations(varying, 2):
            assert any(at_low(probe, p1, a1) != at_low(probe, p2, a2) and
                       probe[p1][a1] in family.bounds[p1][a1] and
                       probe[p2][a2] in family.bounds[p2][a2] for probe in probes)


def test_probes_of_two_varying_dims():
    family = family_for((tsig(20, 100), ssig(3)), frozenset({(0, 0), (0, 1)}))
    assert family.probe_dims() == (
        ((64, 256), None), ((17, 65), None), ((18, 66), None),
        ((64, 65), None), ((17, 256), None))


def test_a_family_with_nothing_varying_has_one_probe():
    family = family_for((tsig(20, 100), ssig(3)), frozenset())
    assert family.probe_dims() == (((20, 100), None),)


def test_row_major_helper_matches_torch():
    for dims in [(4, 32, 256), (2, 0, 3), (1,), ()]:
        assert row_major(dims) == torch.empty(dims).stride()


def test_keys_by_signature_helper():
    a = (tsig(3, 3),)
    assert keys_by_signature(cluster(observed(a))) == {a: "t:float32:cpu:contiguous[3,3]"}
