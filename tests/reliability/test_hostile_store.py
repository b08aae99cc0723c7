"""What the kernel store and the announcement channel can make a replica do, bounded
(Note [Entry size cap] in dynvm.cluster.store._base; the announcement rate in
dynvm.cluster.fleet._link): an oversized entry is never downloaded, and a flood of forged
announcements costs at most FleetOptions.max_announced_fetches_per_s store lookups a
second. Real redis-server, real stores, a real Runtime."""

from __future__ import annotations

import secrets
import time

import pytest

import dynvm
from dynvm.cluster import LocalDirStore, RedisStore, StoreConfig
from dynvm.cluster.fleet._announce import Announcement
from dynvm.cluster.fleet._link import FleetLink, FleetOptions
from dynvm.cluster.store._base import EntryTooLarge
from tests.cluster._redis_server import redis_config
from tests.vm._programs import compiled

CAP = 1 << 20
KEY_SMALL, KEY_BIG = "a" * 64, "b" * 64


def _output_bytes(admin) -> int:
    return int(admin.info("stats")["total_net_output_bytes"])


def test_an_oversized_redis_entry_is_not_downloaded(redis_server):
    with redis_server.client() as admin, RedisStore(redis_config(redis_server),
                                                    max_entry_bytes=CAP) as store:
        admin.set("dynvm:k:" + KEY_BIG, b"x" * (16 * CAP))  # written around the store
        store.put(KEY_SMALL, b"small")
        before = _output_bytes(admin)
        found = store.get([KEY_SMALL, KEY_BIG])
        sent = _output_bytes(admin) - before  # the INFO reply itself included
        assert found == {KEY_SMALL: b"small"}
        assert store.stats.snapshot()["oversized"] == 1
        assert sent < 64 * 1024, sent  # the 16 MiB value never left Redis
        with pytest.raises(EntryTooLarge, match=f"the cap is {CAP}"):
            store.put(KEY_BIG, b"x" * (CAP + 1))
        print(f"\nRedis sent {sent} bytes for a get of a 5-byte and a 16 MiB entry "
              f"(cap 1 MiB)")


def test_an_oversized_file_entry_is_not_read(tmp_path):
    store = LocalDirStore(tmp_path, max_entry_bytes=CAP)
    (tmp_path / KEY_BIG).write_bytes(b"x" * (CAP + 1))
    store.put(KEY_SMALL, b"small")
    assert store.get([KEY_SMALL, KEY_BIG]) == {KEY_SMALL: b"small"}
    assert store.stats.snapshot()["oversized"] == 1
    with pytest.raises(EntryTooLarge):
        store.put(KEY_BIG, b"x" * (CAP + 1))


def test_a_flood_of_forged_announcements_is_rate_bounded(tmp_path):
    program = compiled("looping")
    runtime = dynvm.Runtime(program, jit=dynvm.JitConfig(sync=True))
    options = FleetOptions(StoreConfig(secret=secrets.token_bytes(32),
                                       local_dir=str(tmp_path / "store")),
                           max_announced_fetches_per_s=20.0)
    link = FleetLink(runtime, b"", options, client=None)  # not started: no service
    store = link.cache.store
    start = time.monotonic()
    sent = 2000
    for _ in range(sent):  # each names a key nobody stored: a lookup if let through
        link._on_announcement(Announcement(program.content_hash, link.target,
                                           secrets.token_hex(32)))
    elapsed = time.monotonic() - start
    looked_up = link.cache.stats()["missing"]
    allowed = 20 + 20 * elapsed + 1
    print(f"\n{sent} forged announcements in {elapsed:.2f} s: {looked_up} store lookups "
          f"(bound {allowed:.0f}), {link.counters.announcements_dropped} dropped")
    assert looked_up <= allowed
    assert link.counters.announcements_dropped == sent - looked_up
    assert store.stats.snapshot()["misses"] == looked_up
    runtime.close()
