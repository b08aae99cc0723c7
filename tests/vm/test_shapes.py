"""Interned shapes (Note [Interned shapes] in dynvm.vm.shapes): equal dims are one
object, the object is immutable, and the table forgets shapes nobody holds."""

from __future__ import annotations

import gc
import pickle
import threading
import weakref

import pytest
import torch

from dynvm.vm.shapes import Shape, intern_shape, interned_count

# Dims no other test interns, so counts and identities here are this file's own.
BASE = 7_919_001


def test_equal_dims_give_the_identical_object():
    a = intern_shape((BASE, 3, 5))
    assert intern_shape([BASE, 3, 5]) is a
    assert intern_shape(torch.Size([BASE, 3, 5])) is a
    assert intern_shape(d for d in (BASE, 3, 5)) is a
    assert intern_shape((torch.tensor(BASE).item(), 3, 5)) is a
    assert intern_shape(torch.empty(0, 3, 5).shape) is not a
    assert intern_shape(torch.empty(0, 3, 5).shape) is intern_shape((0, 3, 5))


def test_different_dims_give_different_objects():
    shapes = [intern_shape(d) for d in [(BASE, 2), (2, BASE), (BASE,), (BASE, 2, 1), ()]]
    assert len({id(s) for s in shapes}) == len(shapes)
    assert len(set(shapes)) == len(shapes)


def test_equality_and_hash_are_identity():
    a = intern_shape((BASE, 4))
    assert a == intern_shape((BASE, 4))
    assert a != (BASE, 4)  # an uninterned tuple is not a Shape; compare a.dims instead
    assert a.dims == (BASE, 4)
    signature = (a, intern_shape((BASE, 5)))
    assert {signature: 1}[(intern_shape((BASE, 4)), intern_shape((BASE, 5)))] == 1


def test_dims_are_python_ints_and_a_tuple():
    shape = intern_shape(torch.Size([BASE, 2]))
    assert type(shape.dims) is tuple
    assert all(type(d) is int for d in shape.dims)


def test_rank_numel_and_sequence_protocol():
    shape = intern_shape((BASE, 3, 2))
    assert shape.rank == len(shape) == 3
    assert shape.numel == BASE * 6
    assert list(shape) == [BASE, 3, 2]
    assert shape[0] == BASE and shape[-1] == 2 and shape[1:] == (3, 2)
    scalar = intern_shape(())
    assert scalar.rank == 0 and scalar.numel == 1
    empty = intern_shape((BASE, 0))
    assert empty.numel == 0
    assert "7919001" in repr(shape)


def test_shape_is_immutable():
    shape = intern_shape((BASE, 6))
    with pytest.raises(AttributeError):
        shape.dims = (1, 2)
    with pytest.raises(AttributeError):
        shape.numel = 0
    with pytest.raises(AttributeError):
        shape.extra = 1
    with pytest.raises(AttributeError):
        del shape.dims
    with pytest.raises(TypeError):
        shape.dims[0] = 1  # type: ignore[index]
    assert shape.dims == (BASE, 6) and shape.numel == BASE * 6
    assert intern_shape((BASE, 6)) is shape


def test_pickle_round_trip_returns_the_interned_object():
    shape = intern_shape((BASE, 7))
    assert pickle.loads(pickle.dumps(shape)) is shape


def test_a_shape_nobody_holds_is_dropped():
    gc.collect()  # other tests' garbage shapes must not leave the table during the count
    shape = intern_shape((BASE, 8, 8))
    ref = weakref.ref(shape)
    count = interned_count()
    del shape
    gc.collect()
    assert ref() is None
    assert interned_count() == count - 1
    again = intern_shape((BASE, 8, 8))
    assert again.dims == (BASE, 8, 8)
    assert interned_count() == count


def test_a_held_shape_survives_collection():
    shape = intern_shape((BASE, 9, 9))
    gc.collect()
    assert intern_shape((BASE, 9, 9)) is shape


def test_a_stream_of_distinct_shapes_does_not_grow_the_table():
    gc.collect()
    before = interned_count()
    peak = before
    for i in range(10_000):
        shape = intern_shape((BASE + 1, i, 3))
        assert shape.dims == (BASE + 1, i, 3)
        if i % 1000 == 0:
            peak = max(peak, interned_count())
    del shape
    gc.collect()
    assert peak <= before + 2
    assert interned_count() <= before


def test_the_table_holds_as_many_shapes_as_are_alive():
    gc.collect()
    before = interned_count()
    held = [intern_shape((BASE + 2, i)) for i in range(500)]
    assert interned_count() == before + 500
    del held[:250]
    gc.collect()
    assert interned_count() == before + 250
    assert all(intern_shape((BASE + 2, 250 + i)) is s for i, s in enumerate(held))


def test_threads_interning_the_same_dims_get_the_same_object():
    n_threads, rounds = 8, 200
    barrier = threading.Barrier(n_threads)
    results: list[list[Shape]] = [[] for _ in range(n_threads)]
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        try:
            barrier.wait()
            for r in range(rounds):
                results[slot].append(intern_shape((BASE + 3, r, r % 7)))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for r in range(rounds):
        first = results[0][r]
        assert all(results[t][r] is first for t in range(n_threads)), r
        assert first.dims == (BASE + 3, r, r % 7)
