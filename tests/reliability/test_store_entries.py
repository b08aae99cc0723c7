"""Kernel store entries that must not be used: rejected, counted, never returned, never run.

tests/cluster/test_cluster_signed.py already has, by name, each case of the issue:
unsigned ("unsigned: no mac / mac nil / mac empty"), signed with the wrong key
("forged: other secret"), truncated ("corrupt: truncated", and every prefix of an
entry in test_every_prefix_is_corrupt), bit-flipped ("forged: bit-flipped body / mac"),
another target ("incompatible: other target") and another toolchain ("incompatible:
other toolchain / toolchain lacks an entry"); test_artifact_cache_returns_only_valid_-
entries_and_counts puts every case in a local directory and in a real Redis and checks
that `ArtifactCache.fetch` returns only the valid entries and that `stats()` counts each
rejection under its reason. Its fuzz tests sample random mutations.

What this file adds, through a real redis-server:
- every single-bit flip of a sealed entry (all of them, not a sample) is rejected and
  counted, none is returned;
- entries that would act if they were ever deserialized unsafely or executed (a pickle
  whose load creates a file, a forged artifact whose source creates a file) leave no
  trace: nothing in dynvm runs them;
- verification is per fetch: a key once valid and then overwritten by a forgery is
  rejected, and a key once forged and then published properly is accepted.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import msgpack
import pytest
import torch

from dynvm.cluster import ArtifactCache, RedisStore
from dynvm.cluster.store._signed import (
    FORMAT_VERSION,
    REJECTIONS,
    RejectedArtifact,
    open_sealed,
    seal,
)
from tests.cluster._redis_server import redis_config

TOOLCHAIN = {"torch": torch.__version__}
EXPECT = {"target": "cpu", "toolchain": TOOLCHAIN}
SECRET = b"reliability-secret"


def key(n: int) -> str:
    return f"{n:064x}"


def fields(k: str, **changes) -> dict:
    base = {"key": k, "backend": "cpu", "target": "cpu", "toolchain": TOOLCHAIN,
            "kernel_name": "k", "source": "def k(regs):\n    pass\n", "guard": "strong"}
    return {**base, **changes}


def flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_every_single_bit_flip_is_rejected_and_counted(redis_server):
    probe = seal(key(0), fields(key(0)), SECRET)
    bits = len(probe) * 8
    with RedisStore(redis_config(redis_server, socket_timeout_s=5.0)) as store:
        keys = []
        for bit in range(bits):
            k = key(bit + 1)  # every entry sealed for its own key, then damaged
            store.put(k, flip(seal(k, fields(k), SECRET), bit))
            keys.append(k)
        cache = ArtifactCache(store, SECRET, EXPECT)
        assert cache.fetch(keys) == {}
        stats = cache.stats()
    assert stats["rejected"] == bits and stats["valid"] == 0 and stats["missing"] == 0
    reasons = {cls.reason: stats[cls.reason] for cls in REJECTIONS}
    assert sum(reasons.values()) == bits
    # A flip can land in the MAC or body (forged), break the msgpack framing (corrupt),
    # or hit the format version (incompatible): all three must have happened.
    assert reasons["forged"] and reasons["corrupt"] and reasons["incompatible"], reasons
    print(f"\n{bits} single-bit flips of a {len(probe)}-byte entry: all rejected {reasons}")


class _TouchOnLoad:
    """Unpickling this creates a file: proof that something unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_entries_that_would_act_if_run_leave_no_trace(redis_server, tmp_path):
    pickled_marker = tmp_path / "unpickled"
    run_marker = tmp_path / "executed"
    payload = pickle.dumps(_TouchOnLoad(pickled_marker))
    pickle.loads(payload)  # the payload does what it says...
    assert pickled_marker.exists()
    pickled_marker.unlink()  # ...and the test starts from no marker
    source = f"import pathlib\npathlib.Path({str(run_marker)!r}).touch()\n"
    entries = {
        key(1): payload,                                               # a pickle
        key(2): seal(key(2), fields(key(2), source=source), b"forger's key"),
        key(3): seal(key(3), fields(key(3), source=source, target="cuda:90"), SECRET),
        key(4): pickle.dumps(fields(key(4), source=source)),          # pickled fields
    }
    with RedisStore(redis_config(redis_server)) as store:
        for k, data in entries.items():
            store.put(k, data)
        cache = ArtifactCache(store, SECRET, EXPECT)
        assert cache.fetch(list(entries)) == {}
        stats = cache.stats()
    assert (stats["corrupt"], stats["forged"], stats["incompatible"]) == (2, 1, 1), stats
    assert not pickled_marker.exists() and not run_marker.exists()
    assert sorted(os.listdir(tmp_path)) == ["redis"]


def test_verification_is_per_fetch(redis_server):
    k = key(7)
    good = seal(k, fields(k), SECRET)
    forged = seal(k, fields(k, source="def k(regs):\n    regs.clear()\n"), b"forger's key")
    with RedisStore(redis_config(redis_server)) as store:
        cache = ArtifactCache(store, SECRET, EXPECT)
        store.put(k, good)
        assert cache.fetch([k]) == {k: fields(k)}
        store.put(k, forged)            # a writer without the secret replaces it
        assert cache.fetch([k]) == {}   # no memory of "this key was fine"
        assert cache.publish(k, fields(k))
        assert cache.fetch([k]) == {k: fields(k)}  # no memory of "this key was bad"
        stats = cache.stats()
    assert (stats["valid"], stats["forged"], stats["published"]) == (2, 1, 1), stats


def test_a_rejection_names_the_key_and_reason_only(redis_server):
    # What the operator sees for each class, as ArtifactCache logs it.
    k = key(9)
    cases = {
        "unsigned": msgpack.packb({"v": FORMAT_VERSION, "key": k, "body": b"", "mac": None}),
        "forged": seal(k, fields(k), b"other"),
        "corrupt": seal(k, fields(k), SECRET)[:-3],
        "incompatible": seal(k, fields(k, toolchain={"torch": "1.0"}), SECRET),
    }
    for reason, data in cases.items():
        with pytest.raises(RejectedArtifact) as caught:
            open_sealed(k, data, SECRET, EXPECT)
        assert caught.value.reason == reason, (reason, str(caught.value))
        assert str(caught.value).startswith(f"kernel store entry {k} rejected ({reason}): ")
