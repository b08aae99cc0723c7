"""A link installs a burst of announcements with one store read (Note [Announcement
bursts] in dynvm.cluster.fleet._announce) and follows the index stamps they carry (Note [Index
stamps] in dynvm.cluster.fleet._records). Real redis-server, the real FleetCompiler."""

from __future__ import annotations

import random

import pytest

import dynvm
from dynvm.cluster import StoreConfig
from dynvm.cluster.fleet._announce import Announcement, Subscription
from dynvm.cluster.fleet._compiler import FleetCompiler
from dynvm.cluster.fleet._link import FleetLink, FleetOptions
from dynvm.cluster.fleet._records import index_key
from dynvm.cluster.fleet.compile_service import LocalServiceClient
from dynvm.jit.config import JitConfig
from tests.cluster._cluster_helpers import saved_recommender, wait_until
from tests.cluster._redis_server import redis_config

CONFIG = JitConfig(min_recurrence=2, max_recurrence=4, horizon_calls=10**7)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    demo, program, path = saved_recommender(tmp_path_factory.mktemp("burst"))
    return demo, program, path.read_bytes()


def _link(program, dvm_bytes, store: StoreConfig, compiler: FleetCompiler) -> FleetLink:
    runtime = dynvm.Runtime(program, "cpu", jit=CONFIG)
    return FleetLink(runtime, dvm_bytes, FleetOptions(store, flush_interval_s=0.02),
                     LocalServiceClient(compiler)).start(threads=False)


def test_a_burst_of_announcements_is_fetched_in_one_store_read(model, redis_server, secret):
    demo, program, dvm_bytes = model
    store = StoreConfig(secret=secret, redis=redis_config(redis_server))
    compiler = FleetCompiler(store, CONFIG)
    busy = _link(program, dvm_bytes, store, compiler)
    late = _link(program, dvm_bytes, store, compiler)   # started before anything compiled
    try:
        draws = [demo.sample_inputs(random.Random(i)) for i in range(6)]
        for _ in range(12):
            for inputs in draws:
                busy.runtime(*inputs)
            busy.flush()
        assert compiler.wait_idle()
        keys = list(compiler.index(program.content_hash))
        assert len(keys) >= 2
        reads = []
        get = late.cache.store.get

        def counted_get(asked):
            reads.append(list(asked))
            return get(asked)

        late.cache.store.get = counted_get
        burst = [Announcement(program.content_hash, late.target, key) for key in keys]
        burst.append(burst[0])                                    # heard twice
        burst.append(Announcement("f" * 64, late.target, keys[0]))   # not its program
        late.on_announcements(burst)
        assert reads == [keys]          # one store read for the burst, each key once
        assert late.stats()["installed"] == len(keys)
        assert late.stats()["announcements"] == len(keys) + 1
        assert late.runtime.stats()["installs"] == len(keys)
        late.on_announcements(burst)    # all installed: nothing is read again
        assert reads == [keys]
        for inputs in draws:            # and they serve
            late.runtime(*inputs)
        assert late.runtime.stats()["specialized_region_calls"] >= 1
        assert late.runtime.stats()["compiles"] == 0
    finally:
        busy.close()
        late.close()
        compiler.close()


def test_a_link_follows_the_index_stamps_its_announcements_carry(model, redis_server,
                                                                  secret):
    """Note [Index stamps]: a link that holds the index and installs the one key an
    index write added takes that write's stamp, so its next poll reads the stamp alone
    (not the index it already holds); a link that does not hold the index before it
    reads the index as before."""
    demo, program, dvm_bytes = model
    store = StoreConfig(secret=secret, redis=redis_config(redis_server))
    compiler = FleetCompiler(store, CONFIG)
    busy = _link(program, dvm_bytes, store, compiler)
    late = _link(program, dvm_bytes, store, compiler)
    behind = _link(program, dvm_bytes, store, compiler)   # never polls the first index
    heard: list[Announcement] = []
    subscription = Subscription(store.redis, program.content_hash, heard.append).start()

    def drive(seeds) -> list[str]:
        draws = [demo.sample_inputs(random.Random(i)) for i in seeds]
        for _ in range(12):
            for inputs in draws:
                busy.runtime(*inputs)
            busy.flush()
        assert compiler.wait_idle()
        return list(compiler.index(program.content_hash))

    try:
        assert subscription.connected.wait(10)
        first = drive(range(2))
        assert late.install_indexed() == len(first)   # holds the index and its stamp
        second = drive(range(2, 40))
        new = [k for k in second if k not in first]
        assert new and second[:len(first)] == first
        assert wait_until(lambda: len(heard) == len(second), 10) is not None
        # The first write had none before it; each later one added its key alone.
        assert heard[0].stamp is None and heard[0].after is None
        assert all(a.stamp is not None and a.after is not None for a in heard[1:])
        reads = []
        get = late.cache.store.get
        late.cache.store.get = lambda asked: reads.append(list(asked)) or get(asked)
        late.on_announcements(heard)
        assert late.stats()["installed"] == len(second)
        assert late.stats()["index_stamps_followed"] == len(new)
        assert reads == [new]
        assert late.install_indexed() == 0 and late.stats()["index_reads_skipped"] == 1
        assert len(reads) == 2 and reads[1] != [index_key(program.content_hash, "cpu")]
        # Without the index before them, the same announcements install but leave the
        # stamp alone: the next poll reads the index.
        behind.on_announcements(heard[len(first):])
        assert behind.stats()["index_stamps_followed"] == 0
        assert behind.install_indexed() == len(first)
        assert behind.stats()["index_reads_skipped"] == 0
    finally:
        subscription.close()
        for link in (busy, late, behind):
            link.close()
        compiler.close()
