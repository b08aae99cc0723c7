"""Store keys by program and artifact garbage (Note [Program hash tags], Note [Artifact
lifetime]): one program's keys share a Redis Cluster slot; a program that nobody reads
any more expires while a read one does not; a program's entries stay within its bound.
Real redis-server (short TTLs, Redis's own expiry) and the local directory store."""

from __future__ import annotations

import hashlib
import time

import pytest
from redis.crc import key_slot

from dynvm.cluster import LocalDirStore, RedisConfig, RedisStore
from dynvm.cluster.fleet._records import index_key, store_counters
from dynvm.cluster.store._base import check_key
from dynvm.cluster.store._signed import ArtifactCache
from dynvm.jit.artifact import cache_key
from dynvm.jit.artifact_keys import program_tag, program_tag_of
from tests.cluster._redis_server import redis_config

OLD = hashlib.sha256(b"model, first weights").hexdigest()
NEW = hashlib.sha256(b"model, new weights").hexdigest()


def artifact(program: str, n: int) -> str:
    return cache_key(program, n, f"family-{n}", "cpu", "cpu", toolchain={"torch": "x"})


def wait_until(condition, timeout_s: float, what: str, while_waiting=lambda: None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        while_waiting()
        time.sleep(0.05)


@pytest.fixture(params=["local", "redis"])
def make_store(request, tmp_path):
    """A factory of one store implementation with the given lifetime settings."""
    opened = []

    def make(**options):
        if request.param == "local":
            return LocalDirStore(tmp_path / "kernels", **options)
        server = request.getfixturevalue("redis_server")
        store = RedisStore(redis_config(server, **options))
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def test_keys_carry_the_program_tag_and_stay_valid():
    key = artifact(OLD, 0)
    assert key[64:] == "{" + OLD[:16] + "}" and check_key(key) == key
    assert program_tag_of(key) == OLD[:16] == program_tag(OLD)
    assert program_tag_of("a" * 64) is None  # a bare digest is still a key, of no program
    assert check_key("a" * 64) == "a" * 64
    # A test's program name is hashed into a well-formed tag.
    assert check_key(artifact("prog", 1)) and program_tag_of(artifact("prog", 1)) \
        == program_tag("prog")


def test_one_programs_keys_share_a_redis_cluster_slot(redis_server):
    from dynvm.jit.backends.triton import TritonOptions, artifact_key

    keys = [artifact(OLD, n) for n in range(8)] + [
        index_key(OLD, "cpu"), index_key(OLD, "cuda:80,cuda:90"),
        artifact_key(OLD, 2, "fam", ["cuda:90"], TritonOptions())]
    with RedisStore(redis_config(redis_server)) as store:
        for n, key in enumerate(keys):
            store.put(key, f"v{n}".encode())
        assert store.get(keys) == {key: f"v{n}".encode() for n, key in enumerate(keys)}
    with redis_server.client() as client:
        stored = [name.decode() for name in client.keys("*")]
    assert len(stored) == len(keys) + 1  # the entries and the program's use record
    assert {key_slot(name.encode()) for name in stored} == {key_slot(OLD[:16].encode())}
    assert key_slot(artifact(NEW, 0).encode()) == key_slot(NEW[:16].encode()) \
        != key_slot(OLD[:16].encode())


def test_namespace_with_braces_is_refused():
    with pytest.raises(ValueError, match="braces"):
        RedisConfig(namespace="dynvm:{k}:")


def test_a_retired_program_expires_while_a_read_one_lives(make_store):
    """The old weights' program is no longer read (no replica runs it): its artifacts and
    index expire. The new one's index is read, as replicas poll it, and every entry of it
    lives on, the never-read artifact included. Presence checks keep nothing alive."""
    store = make_store(ttl_seconds=1, refresh_interval_s=0.1)
    old = [artifact(OLD, n) for n in range(3)] + [index_key(OLD, "cpu")]
    new = [artifact(NEW, n) for n in range(3)] + [index_key(NEW, "cpu")]
    for key in old + new:
        store.put(key, b"entry")

    def poll_new_index() -> None:
        assert index_key(NEW, "cpu") in store.get([index_key(NEW, "cpu")])
        store.contains(old)  # the compile service checking on the old program

    started = time.monotonic()
    wait_until(lambda: not store.contains(old), 10, "the old program expired",
               poll_new_index)
    # Past the TTL since the writes: without the marks the new program would be gone too.
    wait_until(lambda: time.monotonic() - started > 1.5, 5, "a TTL and a half",
               poll_new_index)
    assert store.get(new) == dict.fromkeys(new, b"entry")
    assert store.get(old) == {}


def test_a_program_is_bounded_least_recently_used_first(make_store):
    store = make_store(max_entries_per_program=3, refresh_interval_s=0.001)
    keys = [artifact(OLD, n) for n in range(6)]
    other = [artifact(NEW, n) for n in range(3)]
    for key in other:
        store.put(key, b"other program")
    for n, key in enumerate(keys[:3]):
        store.put(key, f"v{n}".encode())
        time.sleep(0.01)  # distinct use times, also on coarse file system clocks
    assert store.get([keys[0]]) == {keys[0]: b"v0"}  # the oldest, used again
    time.sleep(0.01)
    store.put(keys[3], b"v3")
    assert store.contains(keys[:4]) == {keys[0], keys[2], keys[3]}  # keys[1]: least used
    store.put(keys[4], b"v4")
    store.put(keys[5], b"v5")
    assert store.contains(keys) == {keys[3], keys[4], keys[5]}
    assert store.stats.snapshot()["evicted"] == 3
    assert store.contains(other) == set(other)  # another program's bound is its own


def test_bare_keys_belong_to_no_program_bound(make_store):
    store = make_store(max_entries_per_program=1)
    bare = [hashlib.sha256(f"bare-{n}".encode()).hexdigest() for n in range(3)]
    for key in bare:
        store.put(key, b"v")
    assert store.contains(bare) == set(bare)
    assert store.stats.snapshot()["evicted"] == 0


def test_redis_use_record_lives_with_the_program(redis_server):
    with RedisStore(redis_config(redis_server, ttl_seconds=60)) as store:
        store.put(artifact(OLD, 0), b"v")
    with redis_server.client() as client:
        used = f"dynvm:k:{{{OLD[:16]}}}:used"
        assert [m.decode() for m in client.zrange(used, 0, -1)] == [artifact(OLD, 0)]
        assert 0 < client.ttl(used) <= 60


def test_local_sweep_removes_expired_programs(tmp_path):
    store = LocalDirStore(tmp_path / "kernels", ttl_seconds=0.5)
    store.put(artifact(OLD, 0), b"v")
    wait_until(lambda: store.sweep() == 1, 10, "the entry expired and was swept")
    assert not (tmp_path / "kernels" / artifact(OLD, 0)).exists()
    assert store.stats.snapshot()["expired"] == 1


def test_one_reader_of_the_fleet_renews_a_programs_ttls(redis_server):
    """Every replica marks its program in use; the renewal of every entry's TTL is done
    once per half TTL, by whichever marks first, not by each replica."""
    keys = [artifact(OLD, n) for n in range(5)]
    replicas = [RedisStore(redis_config(redis_server, ttl_seconds=60,
                                        refresh_interval_s=0.001)) for _ in range(4)]
    try:
        for key in keys:
            replicas[0].put(key, b"v")

        def expires() -> int:
            with redis_server.client() as client:
                return client.info("commandstats").get("cmdstat_expire", {}).get("calls", 0)

        before = expires()
        for replica in replicas:
            assert replica.get(keys[:1]) == {keys[0]: b"v"}
        assert expires() - before == len(keys) + 1  # the entries and the use record, once
    finally:
        for replica in replicas:
            replica.close()


def test_dropped_entries_show_in_the_fleets_store_counters(make_store):
    """What the store left out or deleted is in the counters /stats and the compile
    service's stats show (dynvm.cluster.fleet._records.store_counters), next to the
    fetch counts, where an oversized entry only reads as missing."""
    store = make_store(max_entries_per_program=2, refresh_interval_s=0.001)
    cache = ArtifactCache(store, b"gc-test-secret-0123456789abcdef",
                          {"target": "cpu", "toolchain": {"torch": "x"}})
    for n in range(3):
        store.put(artifact(OLD, n), b"small")   # the third write evicts the oldest
    store.put(artifact(NEW, 0), b"x" * 100)
    store.max_entry_bytes = 64                  # a reader with a smaller cap
    assert cache.fetch([artifact(NEW, 0)]) == {}
    counters = store_counters(cache)
    assert (counters["evicted"], counters["oversized"], counters["expired"]) == (1, 1, 0)
    assert counters["missing"] == 1
