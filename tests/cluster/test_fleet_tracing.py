"""One trace across the fleet: a request on replica A whose observation tips a promotion
on the compile service, the compile there, the publish, and the install on replica B,
linked by one trace id (W3C trace context carried in the observation batch and in the
announcement). Real redis-server pub/sub; in-memory exporters, one per process role."""

from __future__ import annotations

import random
import time

import dynvm
from dynvm.cluster import StoreConfig
from dynvm.cluster.fleet._compiler import FleetCompiler
from dynvm.cluster.fleet._link import FleetLink, FleetOptions
from dynvm.cluster.fleet.compile_service import LocalServiceClient
from dynvm.jit.config import JitConfig
from dynvm.models import recommender
from dynvm.telemetry import Telemetry
from tests.cluster._redis_server import redis_config

CONFIG = JitConfig(min_recurrence=2, max_recurrence=2, horizon_calls=10**7,
                   families=False)


def test_request_promotion_compile_and_remote_install_share_one_trace(tmp_path, secret,
                                                                      redis_server):
    demo = recommender(max_batch=64)
    program = dynvm.compile(demo.module.eval(), demo.example_inputs, demo.dynamic_shapes,
                            name="recommender")
    dynvm.save(program, tmp_path / "r.dvm")
    dvm_bytes = (tmp_path / "r.dvm").read_bytes()
    program = dynvm.load(tmp_path / "r.dvm")
    store = StoreConfig(secret=secret, redis=redis_config(redis_server))
    service_telemetry, service_spans = Telemetry.in_memory()
    a_telemetry, a_spans = Telemetry.in_memory()
    b_telemetry, b_spans = Telemetry.in_memory()
    compiler = FleetCompiler(store, CONFIG, service_telemetry)
    options = FleetOptions(store, flush_interval_s=0.02, poll_interval_s=30)
    a = FleetLink(dynvm.Runtime(program, "cpu", jit=CONFIG, telemetry=a_telemetry),
                  dvm_bytes, options, LocalServiceClient(compiler)).start()
    b = FleetLink(dynvm.Runtime(program, "cpu", jit=CONFIG, telemetry=b_telemetry),
                  dvm_bytes, options, LocalServiceClient(compiler)).start()
    try:
        assert b._subscription.connected.wait(10)
        inputs = demo.sample_inputs(random.Random(3))
        for _ in range(3):
            a.runtime(*inputs)
            a.flush()
        assert compiler.wait_idle()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                s.name == "dynvm.fleet_install" for s in b_spans.get_finished_spans()):
            time.sleep(0.05)
        installs = [s for s in b_spans.get_finished_spans() if s.name == "dynvm.fleet_install"]
        assert installs, "B recorded no install span"
        service = {s.name: s for s in service_spans.get_finished_spans()}
        for name in ("dynvm.promote", "dynvm.compile", "dynvm.publish"):
            assert name in service, f"the service recorded no {name} span"
        trace_id = service["dynvm.compile"].context.trace_id
        calls = [s for s in a_spans.get_finished_spans() if s.name == "dynvm.call"]
        assert trace_id in {s.context.trace_id for s in calls}, \
            "the compile is not in the trace of a request on A"
        assert service["dynvm.promote"].context.trace_id == trace_id
        assert service["dynvm.publish"].context.trace_id == trace_id
        assert trace_id in {s.context.trace_id for s in installs}, \
            "B's install is not in the request's trace"
        reads = [s for s in b_spans.get_finished_spans() if s.name == "dynvm.store_read"]
        assert any(s.attributes["valid"] >= 1 for s in reads), "no traced store hit on B"
        assert service["dynvm.publish"].attributes["dynvm.store_written"] is True
        assert b.runtime.stats()["compiles"] == 0
    finally:
        a.close()
        b.close()
        compiler.close()
