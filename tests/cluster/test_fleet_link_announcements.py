"""A link installs a burst of announcements with one store read (Note [Announcement
bursts] in dynvm.cluster.announce). Real redis-server, the real FleetCompiler."""

from __future__ import annotations

import random

import pytest

import dynvm
from dynvm.cluster import StoreConfig
from dynvm.cluster.announce import Announcement
from dynvm.cluster.compile_service import LocalServiceClient
from dynvm.cluster.fleet_compiler import FleetCompiler
from dynvm.cluster.fleet_link import FleetLink, FleetOptions
from dynvm.jit.config import JitConfig
from tests.cluster._cluster_helpers import saved_recommender
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
