"""Decode bombs (issue 28; Note [Bounded decoding] in dynvm.vm.bounded_decode): a few
bytes of msgpack header that promise millions of items, in a kernel store entry, a
program's index, a .dvm META section, an announcement, and a .dvm signature that nests
too deep. Each is refused at its header, in milliseconds, with little more memory than
its own size. Real redis-server, real stores, a real Runtime.

Timing bounds are generous (a loaded host); the figures are printed. Memory is Python's
allocations measured by tracemalloc around the refusal alone (the input already exists).
"""

from __future__ import annotations

import gc
import hashlib
import secrets
import struct
import time
import tracemalloc

import msgpack
import pytest

import dynvm
from dynvm.cluster import RedisStore, StoreConfig
from dynvm.cluster.fleet._announce import Announcement
from dynvm.cluster.fleet._link import FleetLink, FleetOptions
from dynvm.cluster.fleet._records import index_key, index_stamp_key
from dynvm.cluster.store._redis import PIECE_BYTES
from dynvm.cluster.store._signed import ArtifactCache, CorruptArtifact, open_sealed
from dynvm.jit.artifact import toolchain_versions
from dynvm.vm import dvm_file, dvm_signature
from dynvm.vm.bounded_decode import DecodeLimitError, DecodeLimits, unpack_msgpack
from dynvm.vm.errors import CorruptSectionError, DvmSignatureError
from tests.cluster._redis_server import redis_config
from tests.cluster.test_cluster_store_redis import command_calls
from tests.vm._programs import compiled

MIB = 1 << 20
SECRET = secrets.token_bytes(32)
EXPECT = {"target": "cpu", "toolchain": toolchain_versions()}
TIME_BOUND_S = 0.5
"""What a refusal may take here; the issue's goal is 50 ms (printed beside it). Before
the fix: 2.2 s for a 4 MiB store entry, 10.6 s for 16 MiB, 11.6 s for a 4.4 MB META."""


def array_bomb(size: int) -> bytes:
    """`size` bytes of msgpack: an array header for size - 5 empty maps, then the maps
    (one byte each, 64+ bytes each once decoded)."""
    n = size - 5
    return b"\xdd" + struct.pack(">I", n) + b"\x80" * n


def refusal(call, expected: type[BaseException], repeats: int = 3):
    """(best seconds, peak extra bytes) of `call`, which must raise `expected`: the time
    of the fastest of `repeats` runs, the memory of one more under tracemalloc."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        with pytest.raises(expected):
            call()
        best = min(best, time.perf_counter() - start)
    gc.collect()
    tracemalloc.start()
    try:
        with pytest.raises(expected):
            call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return best, peak


def report(what: str, size: int, seconds: float, peak: int) -> None:
    print(f"\n{what}: {size / MIB:.1f} MiB refused in {seconds * 1e3:.2f} ms (goal 50 ms), "
          f"+{peak / MIB:.3f} MiB peak ({peak / size:.3f}x the input)")


# -------------------------------------------------------------- the helper itself ---


def test_a_header_over_its_limit_is_refused_before_its_items():
    bomb = array_bomb(4 * MIB)
    limits = DecodeLimits(max_bytes=len(bomb), max_map=4, max_containers=1)
    seconds, peak = refusal(lambda: unpack_msgpack(bomb, limits, "doc"), DecodeLimitError)
    report("array header", len(bomb), seconds, peak)
    assert peak < len(bomb) // 100


def test_many_small_containers_are_counted():
    # No header is large, but maps of maps add up: the container count stops them.
    inner = msgpack.packb({"a": {}, "b": {}, "c": {}, "d": {}})
    doc = b"\x84" + b"".join(msgpack.packb(k) + inner for k in "abcd")
    limits = DecodeLimits(max_bytes=len(doc), max_str=8, max_map=4, max_containers=1,
                          max_depth=8)
    with pytest.raises(DecodeLimitError, match="more than 1 maps and arrays"):
        unpack_msgpack(doc, limits, "doc")


# -------------------------------------------------------------- the kernel store ----


def test_a_16_mib_store_entry_bomb_is_refused_at_its_header(redis_server):
    key = "c" * 64
    bomb = array_bomb(16 * MIB)   # exactly the store's default cap: it is downloaded
    with redis_server.client() as admin, RedisStore(redis_config(redis_server)) as store:
        admin.set(store.config.namespace + key, bomb)  # written around the store
        cache = ArtifactCache(store, SECRET, EXPECT)
        seconds, peak = refusal(lambda: open_sealed(key, bomb, SECRET, EXPECT),
                                CorruptArtifact)
        report("store entry (open_sealed)", len(bomb), seconds, peak)
        start = time.perf_counter()
        assert cache.fetch([key]) == {}
        fetched = time.perf_counter() - start
        assert cache.stats()["corrupt"] == 1
        tracemalloc.start()
        try:
            assert cache.fetch([key]) == {}
            _, fetch_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        print(f"the fetch, download included: {fetched * 1e3:.1f} ms, "
              f"+{fetch_peak / MIB:.1f} MiB peak ({fetch_peak / len(bomb):.2f}x)")
    assert seconds < TIME_BOUND_S
    assert peak < 2 * len(bomb)
    assert fetched < 4 * TIME_BOUND_S
    # The download (Note [Reading in pieces]): the value itself and at most 1.5x more
    # (one MGET held it three times: +50 MiB for 16).
    assert fetch_peak - len(bomb) < 1.5 * len(bomb)


def test_an_entry_longer_than_a_piece_is_read_whole(redis_server):
    value = secrets.token_bytes(2 * PIECE_BYTES + 12345)
    key = "d" * 64
    with RedisStore(redis_config(redis_server)) as store:
        store.put(key, value)
        before = command_calls(redis_server, "getrange")
        assert store.get([key]) == {key: value}
        # The head, then three pieces.
        assert command_calls(redis_server, "getrange") - before == 4
        with redis_server.client() as admin:   # shrunk after it was measured: a miss
            admin.set(store.config.namespace + key, value[:PIECE_BYTES + 1])
        assert store._read_pieces(store.config.namespace + key, len(value)) is None


@pytest.fixture(scope="module")
def program():
    return compiled("looping")


def test_an_index_bomb_is_refused_and_not_reread_every_poll(redis_server, program):
    runtime = dynvm.Runtime(program, jit=dynvm.JitConfig(sync=True))
    options = FleetOptions(StoreConfig(secret=SECRET, redis=redis_config(redis_server)))
    link = FleetLink(runtime, b"", options, client=None)   # not started: no service
    try:
        bomb = array_bomb(16 * MIB)
        with redis_server.client() as admin:
            namespace = link.cache.store.config.namespace
            admin.set(namespace + index_key(link.program_hash, link.target), bomb)
            admin.set(namespace + index_stamp_key(link.program_hash, link.target), b"s1")
        start = time.perf_counter()
        assert link.install_indexed() == 0
        first = time.perf_counter() - start
        assert link.cache.stats()["corrupt"] == 1
        start = time.perf_counter()
        assert link.install_indexed() == 0   # the same stamp: the bomb is not read again
        second = time.perf_counter() - start
        print(f"\nindex bomb, 16 MiB: first poll {first * 1e3:.1f} ms (download included), "
              f"next poll {second * 1e3:.2f} ms")
        assert link.cache.stats()["corrupt"] == 1
        assert link.counters.index_rejected == 1
        assert link.counters.index_reads_skipped == 1
        assert first < 4 * TIME_BOUND_S
        with redis_server.client() as admin:   # a new index write: read at the next poll
            admin.set(namespace + index_stamp_key(link.program_hash, link.target), b"s2")
        assert link.install_indexed() == 0
        assert link.cache.stats()["corrupt"] == 2
    finally:
        link.cache.store.close()
        runtime.close()


def test_an_announcement_bomb_is_ignored_within_its_size():
    bomb = array_bomb(4096)
    gc.collect()
    tracemalloc.start()
    try:
        assert Announcement.decode(bomb) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"\nannouncement bomb, 4 KiB: +{peak} bytes peak")
    assert peak < 2 * len(bomb)
    good = Announcement("a" * 64, "cpu", "b" * 64, {"traceparent": "00-" + "1" * 32 + "-"
                                                    + "2" * 16 + "-01"}, b"s2", b"s1")
    assert Announcement.decode(good.encode()) == good


# -------------------------------------------------------------- the .dvm loader -----

_HEADER = struct.Struct("<8sII")
_ENTRY = struct.Struct("<8sIQQ")


def with_section(data: bytes, name: str, payload: bytes) -> bytes:
    """`data` (a writer's .dvm file) with section `name`'s bytes replaced, the table and
    the file's checksum rewritten: what anyone who can write the file can produce."""
    magic, version, count = _HEADER.unpack_from(data)
    sections = []
    for i in range(count):
        raw, section_version, offset, length = _ENTRY.unpack_from(
            data, _HEADER.size + i * _ENTRY.size)
        own = raw.rstrip(b"\0").decode()
        sections.append((raw, section_version,
                         payload if own == name else data[offset:offset + length]))
    parts = [_HEADER.pack(magic, version, count)]
    offset = _HEADER.size + _ENTRY.size * count
    for raw, section_version, body in sections:
        parts.append(_ENTRY.pack(raw, section_version, offset, len(body)))
        offset += len(body)
    parts += [body for _, _, body in sections]
    body = b"".join(parts)
    return body + hashlib.sha256(body).digest()


def test_a_4_mib_meta_bomb_is_refused_at_once(tmp_path, program):
    bomb = array_bomb(4 * MIB)
    path = tmp_path / "bomb.dvm"
    path.write_bytes(with_section(dvm_file.dumps(program), "META", bomb))
    seconds, peak = refusal(lambda: dvm_file.load(path), CorruptSectionError)
    report(".dvm META", len(bomb), seconds, peak)
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.load(path)
    assert info.value.section == "META"
    assert seconds < TIME_BOUND_S
    assert peak < 2 * len(bomb)   # the file's own bytes, read by load, included


def test_a_stale_content_hash_is_refused_before_the_sections_are_decoded(tmp_path, program):
    # The code changed after the file was written (its stored content hash is stale), and
    # META is a bomb: the hash check comes first and refuses it in milliseconds.
    data = dvm_file.dumps(program)
    magic, version, count = _HEADER.unpack_from(data)
    code = next(data[offset:offset + length] for raw, _, offset, length in (
        _ENTRY.unpack_from(data, _HEADER.size + i * _ENTRY.size) for i in range(count))
        if raw.rstrip(b"\0") == b"CODE")
    header = msgpack.unpackb(code, raw=False)
    header["name"] = "renamed"
    changed = with_section(data, "CODE", msgpack.packb(header, use_bin_type=True))
    path = tmp_path / "stale.dvm"
    path.write_bytes(with_section(changed, "META", array_bomb(4 * MIB)))
    seconds, peak = refusal(lambda: dvm_file.load(path), CorruptSectionError)
    with pytest.raises(CorruptSectionError, match="content hash") as info:
        dvm_file.load(path)
    assert info.value.section == "CODE"
    print(f"\nstale content hash with a 4 MiB META bomb: {seconds * 1e3:.2f} ms, "
          f"+{peak / MIB:.3f} MiB")
    assert seconds < TIME_BOUND_S and peak < 2 * 4 * MIB


def test_a_signature_that_nests_too_deep_is_a_signature_error(tmp_path, program):
    path = tmp_path / "m.dvm"
    dvm_file.save(program, path)
    dvm_signature.signature_path(path).write_bytes(b"[" * dvm_signature.MAX_SIGNATURE_BYTES)
    with pytest.raises(DvmSignatureError, match="nested more than"):
        dvm_file.load(path, signing_secret=SECRET)
