"""The compile service sharded by program, and observations pre-aggregated on the
replica (Note [Compile service shards], Note [Pre-aggregated observations]).

The shard test runs the real service actors on a real local Ray with a real
redis-server; the aggregation tests use the in-process FleetCompiler (the same code the
actor wraps) and a real redis-server."""

from __future__ import annotations

import contextlib
import random
import threading
import uuid

import pytest

import dynvm
from dynvm.cluster import StoreConfig
from dynvm.cluster.fleet._compiler import FleetCompiler
from dynvm.cluster.fleet._link import FleetLink, FleetOptions
from dynvm.cluster.fleet._shards import shard_actor_name, shard_of
from dynvm.cluster.fleet.compile_service import LocalServiceClient, ReportLoad
from dynvm.jit.config import JitConfig
from tests.cluster._cluster_helpers import saved_recommender, wait_until
from tests.cluster._redis_server import redis_config
from tests.cluster._shared_serve import shared_serve

# The shard test's Ray is the one shared with other modules (Note [Shared Serve in tests]):
# the module runs among them; its other tests need no Ray and run beside it.
pytestmark = pytest.mark.shared_serve

FAST = {"flush_interval_s": 0.02, "poll_interval_s": 0.2}
# No families: new shapes after a shard restart are promoted as new exact kernels.
CONFIG = JitConfig(min_recurrence=2, max_recurrence=4, families=False, horizon_calls=10**7)
# K = 4 exactly, no families: the count at which a shape is promoted is known.
EXACT_K = JitConfig(min_recurrence=4, max_recurrence=4, families=False, horizon_calls=10**7)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    demo, program, path = saved_recommender(tmp_path_factory.mktemp("shards"))
    return demo, program, path.read_bytes()


@pytest.fixture
def redis_store(redis_server, secret):
    return StoreConfig(secret=secret, redis=redis_config(redis_server))


def _inputs(demo, seed: int) -> tuple:
    return demo.sample_inputs(random.Random(seed))


class RecordingClient(LocalServiceClient):
    """The in-process client, keeping every batch it carried (what went over the wire)."""

    def __init__(self, compiler: FleetCompiler) -> None:
        super().__init__(compiler)
        self.batches: list[list] = []

    def report(self, program_hash, batch):
        self.batches.append(list(batch))
        return super().report(program_hash, batch)


def _link(program, dvm_bytes, store, client, config=EXACT_K, **options) -> FleetLink:
    runtime = dynvm.Runtime(program, "cpu", jit=config)
    return FleetLink(runtime, dvm_bytes, FleetOptions(store, **{**FAST, **options}), client)


def test_identical_observations_travel_as_one_counted_record(model, redis_store):
    demo, program, dvm_bytes = model
    compiler = FleetCompiler(redis_store, EXACT_K)
    client = RecordingClient(compiler)
    link = _link(program, dvm_bytes, redis_store, client).start(threads=False)
    try:
        inputs = _inputs(demo, 3)
        for _ in range(3):
            link.runtime(*inputs)
        client.batches.clear()
        link.flush()
        (batch,) = client.batches
        regions = {record[0] for record in batch}
        # One record per region the call interprets, each standing for the 3 calls.
        assert len(batch) == len(regions) >= 1
        assert all(len(record) == 5 and record[4] == 3 for record in batch), batch
        assert link.stats()["reported"] == 3 * len(batch)
        assert compiler.stats()["programs"][program.content_hash[:12]]["observations"] \
            == 3 * len(batch)
    finally:
        link.close()
        compiler.close()


@pytest.mark.parametrize("aggregate", [True, False])
def test_promotion_happens_at_the_same_count_with_or_without_aggregation(
        model, redis_store, aggregate):
    """K = 4: three calls of a shape promote nothing, the fourth promotes it, whether
    the four arrive as records of one call each or counted in one record."""
    demo, program, dvm_bytes = model
    compiler = FleetCompiler(redis_store, EXACT_K)
    link = _link(program, dvm_bytes, redis_store, LocalServiceClient(compiler),
                 aggregate=aggregate).start(threads=False)
    try:
        inputs = _inputs(demo, 11)
        for _ in range(3):
            link.runtime(*inputs)
        link.flush()
        assert compiler.wait_idle()
        assert compiler.stats()["published"] == 0
        link.runtime(*inputs)
        link.flush()
        assert compiler.wait_idle()
        assert compiler.stats()["published"] >= 1
    finally:
        link.close()
        compiler.close()


class StuckService:
    """A service that takes every report and answers only when released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def report(self, program_hash, batch):
        self.entered.set()
        self.release.wait(60)
        return {"known": True}

    def register(self, program_hash, dvm_bytes):
        return True


def test_overflow_is_dropped_and_counted_while_the_service_lags(model, redis_store):
    """The service hangs in a report; requests keep running, the table stays bounded
    (new signatures beyond it are dropped and counted, known ones still count)."""
    demo, program, dvm_bytes = model
    service = StuckService()
    service.release.set()   # start() reports once, synchronously
    link = _link(program, dvm_bytes, redis_store, service, max_buffered=2).start()
    try:
        service.release.clear()
        link.runtime(*_inputs(demo, 0))
        assert service.entered.wait(30), "the link thread never reported"
        service.entered.clear()
        # The link thread is now stuck in report: every call below runs regardless.
        shapes = [_inputs(demo, seed) for seed in range(40)]
        for inputs in shapes:
            link.runtime(*inputs)
        stats = link.stats()
        assert stats["buffered"] <= 2
        assert stats["dropped_observations"] >= 1
        assert link.runtime.stats()["calls"] == 41
    finally:
        service.release.set()
        link.close()


class BackingOffService(LocalServiceClient):
    def report(self, program_hash, batch):
        return {**super().report(program_hash, batch), "backoff_s": 60.0}


def test_a_busy_service_spaces_the_reports_out(model, redis_store):
    demo, program, dvm_bytes = model
    compiler = FleetCompiler(redis_store, EXACT_K)
    link = _link(program, dvm_bytes, redis_store, BackingOffService(compiler),
                 max_backoff_s=60.0).start(threads=False)
    try:
        reports = link.stats()["reports"]
        link.runtime(*_inputs(demo, 1))
        link.tick()   # asked for quiet for 60 s: the observation waits, counted on
        link.runtime(*_inputs(demo, 1))
        assert link.stats()["reports"] == reports
        assert link.stats()["buffered"] >= 1
        assert link.stats()["backoffs"] == 1
    finally:
        link.close()
        compiler.close()


def test_report_load_doubles_the_interval_when_busy_and_clears_it_when_idle():
    now = [0.0]
    load = ReportLoad(period_s=1.0, start_s=0.1, max_s=0.4, clock=lambda: now[0])
    for busy in (0.9, 0.9, 0.9, 0.9):
        now[0] += 1.0
        load.add(busy)
    assert load.backoff_s == 0.4   # 0.1, 0.2, 0.4, capped
    for _ in range(3):
        now[0] += 1.0
        load.add(0.0)
    assert load.backoff_s == 0.0   # 0.2, 0.1, then under start_s: none


def test_shard_names_are_a_function_of_the_program_hash():
    digest = "00000000000000ff" + "0" * 48
    assert shard_of(digest, 4) == 255 % 4
    assert shard_actor_name("svc", digest, 4) == f"svc-{255 % 4}"
    assert shard_actor_name("svc", digest, 1) == "svc"


# -- sharded service on a real Ray -----------------------------------------------------

def _two_programs(directory):
    """Two recommender programs (different batch ranges, so different hashes) and the
    smallest shard count that puts them on different shards."""
    a = saved_recommender(directory, "a.dvm", max_batch=64)
    b = saved_recommender(directory, "b.dvm", max_batch=32)
    ha, hb = a[1].content_hash, b[1].content_hash
    shards = next(n for n in range(2, 64) if shard_of(ha, n) != shard_of(hb, n))
    return a, b, shards


@pytest.mark.slow
def test_programs_land_on_their_shards_and_a_shard_restarts_alone(
        tmp_path, redis_store):
    ray = pytest.importorskip("ray")
    from dynvm.cluster.fleet.compile_service import (
        RayServiceClient,
        start_compile_service,
        stop_compile_service,
    )

    (demo_a, prog_a, path_a), (demo_b, prog_b, path_b), shards = _two_programs(tmp_path)
    name = f"shards-{uuid.uuid4().hex[:8]}"
    namespace = "dynvm-test-shards"  # the service's: its actors are looked up by it
    links = []
    # The Ray shared with other modules (Note [Shared Serve in tests]); Serve is unused.
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(shared_serve())
        cleanup.callback(stop_compile_service, name, namespace, shards=shards)
        cleanup.callback(lambda: [link.close() for link in links])
        start_compile_service(redis_store, CONFIG, name=name, namespace=namespace,
                              shards=shards)
        options = FleetOptions(redis_store, service_name=name, service_namespace=namespace,
                               service_shards=shards, service_timeout_s=10.0, **FAST)

        def shard(program):
            return ray.get_actor(options.service_actor(program.content_hash),
                                 namespace=namespace)

        def programs_of(program):
            return ray.get(shard(program).stats.remote())["programs"]

        for program, path in ((prog_a, path_a), (prog_b, path_b)):
            runtime = dynvm.Runtime(program, "cpu", jit=CONFIG)
            links.append(FleetLink(runtime, path.read_bytes(), options,
                                   RayServiceClient.for_fleet(options)).start())
        link_a, link_b = links
        assert link_a.stats()["service_ok"] and link_b.stats()["service_ok"]
        # Each program is known to its own shard only.
        assert set(programs_of(prog_a)) == {prog_a.content_hash[:12]}
        assert set(programs_of(prog_b)) == {prog_b.content_hash[:12]}

        def promoted_on(link, demo, seeds):
            draws = [_inputs(demo, s) for s in seeds]
            for _ in range(6):
                for inputs in draws:
                    link.runtime(*inputs)
            return wait_until(lambda: link.runtime.stats()["installs"] >= 1, 60)

        assert promoted_on(link_a, demo_a, range(3)) is not None
        assert promoted_on(link_b, demo_b, range(3)) is not None
        installs_a = link_a.runtime.stats()["installs"]
        registrations_b = link_b.stats()["registrations"]
        indexed_a = ray.get(shard(prog_a).stats.remote())["programs"][
            prog_a.content_hash[:12]]["indexed"]

        # A's shard dies; Ray restarts it (max_restarts=-1) with nothing in memory.
        ray.kill(shard(prog_a), no_restart=False)

        def known_again() -> bool:
            try:
                programs = ray.get(shard(prog_a).stats.remote(), timeout=5)["programs"]
            except (ray.exceptions.RayError, TimeoutError):   # restarting
                return False
            # The link counts its registration after the call returns: wait for both.
            return (prog_a.content_hash[:12] in programs and link_a.stats()["service_ok"]
                    and link_a.stats()["registrations"] >= 2)

        assert wait_until(known_again, 120) is not None, link_a.stats()
        restarted = ray.get(shard(prog_a).stats.remote())["programs"]
        # Re-registered, and resumed from the store's index: nothing compiled again.
        assert restarted[prog_a.content_hash[:12]]["indexed"] >= indexed_a
        # New shapes on A (traffic going on) are promoted by the restarted shard.
        draws = [_inputs(demo_a, s) for s in range(100, 103)]

        def new_shapes_installed() -> bool:
            for inputs in draws:
                link_a.runtime(*inputs)
            return link_a.runtime.stats()["installs"] > installs_a

        assert wait_until(new_shapes_installed, 60, interval_s=0.2) is not None, (
            link_a.stats(), ray.get(shard(prog_a).stats.remote()))
        assert link_a.runtime.stats()["compiles"] == 0
        # B's shard was not touched: B never registered again and kept reporting.
        assert link_b.stats()["registrations"] == registrations_b
        assert link_b.stats()["service_ok"]
