"""Sharing specializations across a fleet, in one process: a real redis-server (started
by the fixtures), the real FleetCompiler, real pub/sub; replicas are Runtimes with
FleetLinks. (tests/cluster/test_fleet_serve.py runs the same over Ray Serve and HTTP.)"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

import dynvm
from dynvm.cluster import StoreConfig
from dynvm.cluster.fleet._compiler import DEFAULT_FORGET_AFTER_S, FleetCompiler
from dynvm.cluster.fleet._link import FleetLink, FleetOptions
from dynvm.cluster.fleet._records import MAX_STAMP_SKIPS, write_index
from dynvm.cluster.fleet.compile_service import LocalServiceClient
from dynvm.cluster.store._signed import seal
from dynvm.jit.config import JitConfig
from tests.cluster._cluster_helpers import saved_recommender, wait_until
from tests.cluster._redis_server import redis_config

FAST = {"flush_interval_s": 0.02, "poll_interval_s": 0.2}
# The recommender's regions take microseconds: with the default horizon a compile would
# not pay for itself and the policy (rightly) refuses; a long horizon makes it promote.
CONFIG = JitConfig(min_recurrence=2, max_recurrence=4, horizon_calls=10**7)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    demo, program, path = saved_recommender(tmp_path_factory.mktemp("fleet"))
    return demo, program, path.read_bytes()


def _draws(demo, n: int, seed: int = 0) -> list[tuple]:
    return [demo.sample_inputs(random.Random(seed + i)) for i in range(n)]


def _replica(program, dvm_bytes, store: StoreConfig, compiler: FleetCompiler,
             config: JitConfig | None = None) -> FleetLink:
    runtime = dynvm.Runtime(program, "cpu", jit=config or CONFIG)
    return FleetLink(runtime, dvm_bytes, FleetOptions(store, **FAST),
                     LocalServiceClient(compiler)).start()




@pytest.fixture(params=["redis", "local"])
def store_config(request, tmp_path, secret):
    if request.param == "local":
        return StoreConfig(secret=secret, local_dir=str(tmp_path / "kernels"))
    server = request.getfixturevalue("redis_server")
    return StoreConfig(secret=secret, redis=redis_config(server))


def test_traffic_on_one_replica_is_installed_on_the_others(model, store_config):
    demo, program, dvm_bytes = model
    compiler = FleetCompiler(store_config, CONFIG)
    a = _replica(program, dvm_bytes, store_config, compiler)
    b = _replica(program, dvm_bytes, store_config, compiler)
    try:
        assert a.stats()["service_ok"] and not a.runtime.jit.compiles_locally()
        draws = _draws(demo, 3)
        for _ in range(12):
            for inputs in draws:
                a.runtime(*inputs)
        assert compiler.wait_idle()
        assert compiler.stats()["published"] >= 1
        # B never saw traffic: it installs what A's traffic promoted, compiling nothing.
        assert wait_until(lambda: b.runtime.stats()["installs"] >= 1) is not None
        assert wait_until(lambda: a.runtime.stats()["installs"] >= 1) is not None
        assert b.runtime.stats()["compiles"] == 0
        assert a.runtime.stats()["compiles"] == 0  # the service compiled, not A
        before = b.runtime.stats()["specialized_region_calls"]
        reference = dynvm.Runtime(program, "cpu", jit=False)
        for inputs in draws:
            torch.testing.assert_close(b.runtime(*inputs), reference(*inputs))
        assert b.runtime.stats()["specialized_region_calls"] > before
        # A replica that starts now serves its first call specialized (warm start).
        c = _replica(program, dvm_bytes, store_config, compiler)
        try:
            assert c.stats()["warm_start_installs"] >= 1
            c.runtime(*draws[0])
            stats = c.runtime.stats()
            assert stats["specialized_region_calls"] >= 1
            assert stats["interpreted_region_calls"] == 0
            assert stats["compiles"] == 0
        finally:
            c.close()
    finally:
        a.close()
        b.close()
        compiler.close()


def test_fleet_wide_recurrence_promotes_what_no_replica_would(model, store_config):
    """K=4 on every JIT: each of two replicas sees the shape twice (below K alone), the
    service sees it four times and promotes it."""
    demo, program, dvm_bytes = model
    config = JitConfig(min_recurrence=4, max_recurrence=4, families=False,
                       horizon_calls=10**7)
    compiler = FleetCompiler(store_config, config)
    a = _replica(program, dvm_bytes, store_config, compiler, config)
    b = _replica(program, dvm_bytes, store_config, compiler, config)
    try:
        inputs = _draws(demo, 1, seed=7)[0]
        for link in (a, b, a, b):
            link.runtime(*inputs)
            link.flush()
        assert compiler.wait_idle()
        assert compiler.stats()["published"] >= 1
        assert wait_until(lambda: a.runtime.stats()["installs"] >= 1
                          and b.runtime.stats()["installs"] >= 1) is not None
    finally:
        a.close()
        b.close()
        compiler.close()


def test_without_a_service_replicas_compile_locally(model, store_config):
    demo, program, dvm_bytes = model

    class Unreachable:
        def report(self, program_hash, batch):
            return None

        def register(self, program_hash, dvm_bytes):
            return False

    runtime = dynvm.Runtime(program, "cpu", jit=CONFIG)
    link = FleetLink(runtime, dvm_bytes, FleetOptions(store_config, **FAST),
                     Unreachable()).start()
    try:
        assert not link.stats()["service_ok"]
        inputs = _draws(demo, 1)[0]
        for _ in range(20):
            runtime(*inputs)
        assert wait_until(lambda: runtime.stats()["compiles"] >= 1) is not None
    finally:
        link.close()


def test_forged_store_entry_is_rejected_and_requests_still_succeed(model, store_config):
    demo, program, dvm_bytes = model
    compiler = FleetCompiler(store_config, CONFIG)
    a = _replica(program, dvm_bytes, store_config, compiler)
    try:
        draws = _draws(demo, 3)
        for _ in range(12):
            for inputs in draws:
                a.runtime(*inputs)
        assert compiler.wait_idle()
        keys = compiler.index(program.content_hash)
        assert keys
        # An attacker with store access overwrites every entry, with another secret.
        store = store_config.open_store()
        for key in store.get(keys):
            store.put(key, seal(key, {"backend": "cpu", "target": "cpu", "toolchain": {},
                                      "kernel_name": "x", "source": "import os", "guard": ""},
                                b"not-the-secret"))
        fresh = _replica(program, dvm_bytes, store_config, compiler)
        try:
            stats = fresh.stats()
            assert stats["store"]["forged"] >= 1
            assert stats["warm_start_installs"] == 0
            reference = dynvm.Runtime(program, "cpu", jit=False)
            for inputs in draws:
                torch.testing.assert_close(fresh.runtime(*inputs), reference(*inputs))
        finally:
            fresh.close()
    finally:
        a.close()
        compiler.close()


def test_the_service_also_builds_triton_binaries_for_gpu_targets(model, tmp_path, secret):
    """With GPU targets configured, each promotion also yields a signed Triton artifact
    with sm_90 binaries (built here, without a GPU) in the store."""
    from dynvm.cluster.store._signed import open_sealed
    from dynvm.jit.artifact import toolchain_versions
    from dynvm.jit.backends.triton import TritonArtifact

    demo, program, dvm_bytes = model
    store_config = StoreConfig(secret=secret, local_dir=str(tmp_path / "kernels"))
    compiler = FleetCompiler(store_config, JitConfig(min_recurrence=2, max_recurrence=2,
                                                     horizon_calls=10**7, families=False),
                             gpu_targets=(("cuda", 90, 32),))
    a = _replica(program, dvm_bytes, store_config, compiler)
    try:
        inputs = _draws(demo, 1, seed=5)[0]
        for _ in range(3):
            a.runtime(*inputs)
            a.flush()
        assert compiler.wait_idle(120)
        stats = compiler.stats()
        assert stats["published"] >= 1
        assert stats["gpu_published"] + stats["gpu_skipped"] >= stats["published"]
        assert stats["gpu_published"] >= 1, stats
        store = store_config.open_store()
        entries = [p.name for p in (tmp_path / "kernels").rglob("*") if p.is_file()]
        opened = []
        # Every file not starting with "." is an entry named by its key.
        for key in {e for e in entries if not e.startswith(".")}:
            data = store.get([key]).get(key)
            try:
                opened.append(open_sealed(key, data, secret, {
                    "target": "cuda:90", "toolchain": toolchain_versions(),
                    "backend": "triton"}))
            except Exception:  # CPU artifacts and the index: other backend or target
                continue
        assert opened, "no Triton artifact for cuda:90 in the store"
        artifact = TritonArtifact.from_bytes(opened[0]["triton_artifact"])
        assert "cuda:90" in artifact.binaries
    finally:
        a.close()
        compiler.close()


def test_a_program_no_replica_reports_is_forgotten_and_not_republished(model, tmp_path,
                                                                       secret):
    """A retired program (no registration, no report for forget_after_s) leaves the
    service, so the store check no longer rewrites its expired index; a program whose
    replicas keep reporting stays known, and a forgotten one that reports again is told
    to register."""
    _, program, dvm_bytes = model
    store = StoreConfig(secret=secret, local_dir=str(tmp_path / "kernels"))
    compiler = FleetCompiler(store, CONFIG, store_check_s=3600.0, forget_after_s=0.5)
    try:
        digest = program.content_hash
        compiler.register(digest, dvm_bytes)
        for _ in range(8):   # reports (heartbeats included) keep it known
            assert compiler.report(digest, []) == {"known": True}
            compiler.repair_store()
            time.sleep(0.1)
        assert compiler.knows(digest) and compiler.stats()["forgotten"] == 0
        time.sleep(0.6)      # retired: nothing reports any more
        compiler.repair_store()
        assert not compiler.knows(digest)
        assert compiler.stats()["forgotten"] == 1
        assert compiler.report(digest, []) == {"known": False}
        # The store's dropped entries sit next to its fetch counters (none here).
        assert {"evicted", "oversized", "expired", "valid"} <= set(compiler.stats()["store"])
    finally:
        compiler.close()


def test_the_store_ttl_else_an_hour_is_the_default_forget_period(tmp_path, secret, redis_server):
    with_ttl = StoreConfig(secret=secret, redis=dataclasses.replace(
        redis_config(redis_server), ttl_seconds=3600))
    local = StoreConfig(secret=secret, local_dir=str(tmp_path / "kernels"))
    for store, expected in ((with_ttl, 3600), (local, DEFAULT_FORGET_AFTER_S)):
        compiler = FleetCompiler(store, CONFIG)
        try:
            assert compiler.forget_after_s == expected
        finally:
            compiler.close()


def test_a_poll_reads_the_index_only_when_its_stamp_changed(model, store_config):
    """Note [Index stamps]: a link that installed everything the index lists skips the
    index read while the stamp is unchanged (up to MAX_STAMP_SKIPS polls in a row), and
    reads it at once after the service wrote it again."""
    demo, program, dvm_bytes = model
    compiler = FleetCompiler(store_config, CONFIG)
    a = _replica(program, dvm_bytes, store_config, compiler)
    runtime = dynvm.Runtime(program, "cpu", jit=CONFIG)
    b = FleetLink(runtime, dvm_bytes, FleetOptions(store_config, **FAST),
                  LocalServiceClient(compiler)).start(threads=False)   # polls when told
    try:
        draws = _draws(demo, 3)
        for _ in range(12):
            for inputs in draws:
                a.runtime(*inputs)
        assert compiler.wait_idle() and compiler.index(program.content_hash)
        assert b.install_indexed() >= 1   # a new stamp: the index is read and installed

        def index_reads() -> int:
            return b.cache.stats()["valid"] - b.stats()["installed"]

        reads = index_reads()
        for n in range(MAX_STAMP_SKIPS):
            assert b.install_indexed() == 0
            assert b.stats()["index_reads_skipped"] == n + 1
        assert index_reads() == reads                 # stamp read only, no index read
        assert b.install_indexed() == 0               # skipped enough: read anyway
        assert index_reads() == reads + 1
        write_index(compiler.cache, program.content_hash, "cpu",
                    compiler.index(program.content_hash))   # rewritten: a new stamp
        b.install_indexed()
        assert index_reads() == reads + 2
        assert b.stats()["index_reads_skipped"] == MAX_STAMP_SKIPS
    finally:
        a.close()
        b.close()
        compiler.close()
