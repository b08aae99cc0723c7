"""The KernelStore contract, checked on both implementations (local directory, real Redis)."""

from __future__ import annotations

import hashlib

import pytest

from dynvm.cluster import InvalidKey, KernelStore
from dynvm.jit.artifact import cache_key


def key(n: int) -> str:
    return hashlib.sha256(f"key-{n}".encode()).hexdigest()


def test_is_a_kernel_store(store):
    assert isinstance(store, KernelStore)


def test_put_then_get_round_trips_bytes(store):
    value = bytes(range(256)) * 3 + b"\0\r\n"
    store.put(key(1), value)
    assert store.get([key(1)]) == {key(1): value}


def test_missing_keys_are_absent(store):
    store.put(key(1), b"one")
    assert store.get([key(2)]) == {}
    assert store.get([key(2), key(1), key(3)]) == {key(1): b"one"}
    assert store.get([]) == {}


def test_get_several_keys(store):
    values = {key(n): f"value {n}".encode() * (n + 1) for n in range(20)}
    for k, v in values.items():
        store.put(k, v)
    assert store.get(list(values)) == values


def test_put_replaces(store):
    store.put(key(1), b"old")
    store.put(key(1), b"new")
    assert store.get([key(1)]) == {key(1): b"new"}


def test_empty_and_large_values(store):
    big = hashlib.sha256(b"x").digest() * (1 << 15)  # 1 MiB
    store.put(key(1), b"")
    store.put(key(2), big)
    assert store.get([key(1), key(2)]) == {key(1): b"", key(2): big}


def test_bytearray_and_memoryview_values(store):
    store.put(key(1), bytearray(b"ba"))
    store.put(key(2), memoryview(b"mv"))
    assert store.get([key(1), key(2)]) == {key(1): b"ba", key(2): b"mv"}


def test_cache_key_output_is_a_valid_key(store):
    k = cache_key("prog", 3, "fam", "cpu", "cpu", toolchain={"torch": "x"})
    store.put(k, b"v")
    assert store.get([k]) == {k: b"v"}


@pytest.mark.parametrize("bad", [
    "", "abc", key(1).upper(), key(1)[:-1], key(1) + "0", "g" * 64, "../" + key(1)[3:],
    key(1)[:63] + "\n", " " + key(1)[1:], "x" * 100_000, None, 42, key(1).encode(),
])
def test_bad_keys_are_rejected(store, bad):
    with pytest.raises(InvalidKey) as get_error:
        store.get([key(2), bad])
    with pytest.raises(ValueError) as put_error:
        store.put(bad, b"v")
    for error in (get_error.value, put_error.value):
        message = str(error)
        assert "invalid kernel store key" in message
        assert len(message) < 300  # a huge key is not echoed whole
        if isinstance(bad, str) and bad and len(bad) < 70:
            assert repr(bad)[:30] in message
    assert store.get([key(2)]) == {}


def test_values_must_be_bytes(store):
    with pytest.raises(TypeError, match="must be bytes"):
        store.put(key(1), "text")
    assert store.get([key(1)]) == {}


def test_stats_count_hits_misses_puts(store):
    store.put(key(1), b"a")
    store.put(key(2), b"b")
    store.get([key(1), key(2), key(3)])
    store.get([key(4)])
    assert store.stats.snapshot() == {"hits": 2, "misses": 2, "puts": 2, "errors": 0,
                                     "oversized": 0, "evicted": 0, "expired": 0}
