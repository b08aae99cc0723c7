"""An HTTP request's W3C trace context (traceparent) parents the VM call it causes: the
replica's batch path runs the call inside the extracted context. The replica class runs
here without Serve (its HTTP layer is covered by test_replica_http.py)."""

from __future__ import annotations

import json

import pytest

import dynvm
from dynvm.cluster import ModelReplica, ServingConfig
from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.serving._replica import ReplicaServer
from dynvm.telemetry import Telemetry
from tests.cluster._cluster_helpers import saved_recommender

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    demo, _, path = saved_recommender(tmp_path_factory.mktemp("trace"), "r.dvm")
    # The deployment's class itself (no Serve) builds synchronously.
    cls = ReplicaServer
    assert ModelReplica.func_or_class is cls
    return cls("rec", str(path), ServingConfig(device="cpu", jit=False), probe_outputs=False), demo


def _request(replica, demo, batch: int) -> v2.InferRequest:
    tensors = demo.example_inputs
    body = {"inputs": [{"name": spec.name, "shape": [batch, *t.shape[1:]],
                        "datatype": "FP32" if t.is_floating_point() else "INT64",
                        "data": t[:1].repeat(batch, *[1] * (t.dim() - 1)).flatten().tolist()}
                       for spec, t in zip(replica.program.inputs, tensors)]}
    return v2.parse_infer_request(json.dumps(body).encode(), replica.program.inputs)


def test_the_vm_call_joins_the_http_requests_trace(replica):
    replica, demo = replica
    telemetry, spans = Telemetry.in_memory()
    replica.executor.runtime = dynvm.Runtime(replica.program, "cpu", jit=False, telemetry=telemetry)
    requests = [_request(replica, demo, 2), _request(replica, demo, 3)]
    outcomes, counts = replica.executor.run_batch(requests, [{"traceparent": PARENT}, None])
    assert all(o.error is None for o in outcomes)
    calls = [s for s in spans.get_finished_spans() if s.name == "dynvm.call"]
    assert calls and all(format(s.context.trace_id, "032x") == TRACE_ID for s in calls)
    assert format(calls[0].parent.span_id, "016x") == "00f067aa0ba902b7"


def test_without_a_traceparent_the_call_starts_its_own_trace(replica):
    replica, demo = replica
    telemetry, spans = Telemetry.in_memory()
    replica.executor.runtime = dynvm.Runtime(replica.program, "cpu", jit=False, telemetry=telemetry)
    replica.executor.run_batch([_request(replica, demo, 2)], [None])
    calls = [s for s in spans.get_finished_spans() if s.name == "dynvm.call"]
    assert calls and format(calls[0].context.trace_id, "032x") != TRACE_ID
    assert calls[0].parent is None
