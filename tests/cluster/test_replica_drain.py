"""A replica's drain (Note [Replica drain], Note [Drain before Serve stops]): the class
itself, without Serve, its routes called with real Starlette requests; plus the
drain's Serve options and the flags that set it."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from starlette.requests import Request
from torch.export import Dim

import dynvm
from dynvm.cluster.serving._deployment import DRAIN_POLL_S, drain_options
from dynvm.cluster.serving._replica import ReplicaServer
from dynvm.cluster.serving.serving_config import ServingConfig
from dynvm.vm.errors import ConfigError


class Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    path = tmp_path_factory.mktemp("drain") / "double.dvm"
    program = dynvm.compile(Double(), (torch.randn(4, 3),),
                            ({0: Dim("batch", min=1, max=16)},), name="double")
    dynvm.save(program, path)
    return ReplicaServer("double", str(path), ServingConfig(device="cpu", jit=False))


def _call(replica, method: str, route: str, body: bytes = b""):
    """(status, headers, decoded body) of one request through the replica's __call__."""
    prefix = "/v2/models/double"
    scope = {"type": "http", "method": method, "path": prefix + route,
             "root_path": prefix, "query_string": b"", "http_version": "1.1",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    sent = [False]

    async def receive():
        if sent[0]:
            return {"type": "http.disconnect"}
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def run():
        return await replica(Request(scope, receive))

    response = asyncio.run(run())
    return response.status_code, response.headers, json.loads(response.body)


def _infer_body(replica) -> bytes:
    return json.dumps({"inputs": [{"name": replica.program.inputs[0].name,
                                   "datatype": "FP32", "shape": [2, 3],
                                   "data": [1, 2, 3, 4, 5, 6]}]}).encode()


def test_a_draining_replica_is_not_ready_and_refuses_new_requests(replica):
    body = _infer_body(replica)
    assert replica.is_ready()
    assert _call(replica, "GET", "/ready")[0] == 200
    status, _, answer = _call(replica, "POST", "/infer", body)
    assert status == 200 and answer["outputs"][0]["data"] == [2, 4, 6, 8, 10, 12]

    assert replica.begin_drain() == 0  # nothing in flight
    assert not replica.is_ready()
    status, _, answer = _call(replica, "GET", "/ready")
    assert status == 503 and answer["ready"] is False
    status, headers, answer = _call(replica, "POST", "/infer", body)
    assert status == 503 and "shutting down" in answer["error"]
    assert headers["retry-after"] == str(replica.limits.retry_after_s)
    assert headers["connection"] == "close"
    # Metadata still answers (a client may look while the replica drains).
    assert _call(replica, "GET", "")[0] == 200
    # gRPC as HTTP: UNAVAILABLE, the code clients retry elsewhere.
    grpc = pytest.importorskip("grpc")
    from dynvm.cluster.protocol.grpc_v2 import protos

    message = protos().ModelInferRequest(model_name="double")
    message.inputs.add(name=replica.program.inputs[0].name, datatype="FP32", shape=[1, 3])
    message.raw_input_contents.append(torch.ones(1, 3).numpy().tobytes())
    context = _GrpcStatus()
    asyncio.run(replica.ModelInfer(message, grpc_context=context))
    assert context.code == grpc.StatusCode.UNAVAILABLE, context.details
    assert "shutting down on this replica" in context.details


class _GrpcStatus:
    """What a gRPC servicer context records of a call's status (the part of Serve's
    grpc_context an RPC of dynvm.cluster.protocol.grpc_v2 uses)."""

    code = details = None

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def invocation_metadata(self):
        return ()


def test_drain_options_follow_the_serving_config():
    assert drain_options(ServingConfig(drain_s=7.5)) == {
        "graceful_shutdown_timeout_s": 7.5, "graceful_shutdown_wait_loop_s": DRAIN_POLL_S}
    assert drain_options(ServingConfig(drain_s=0.1))["graceful_shutdown_wait_loop_s"] == 0.1
    for bad in (0, -1, float("inf"), float("nan"), 601, "5"):
        with pytest.raises(ConfigError, match="drain_s"):
            ServingConfig(drain_s=bad)
    assert ServingConfig.from_mapping({"drain_s": 12}).drain_s == 12


def test_the_model_deployment_carries_its_drain(tmp_path):
    from dynvm.cluster.serving._deployment import model_application

    app = model_application("m", tmp_path / "m.dvm", ServingConfig(drain_s=7, num_gpus=0.0))
    # What Serve will stop the replica with (its deployment config; no public getter).
    deployment_config = app._bound_deployment._deployment_config
    assert deployment_config.graceful_shutdown_timeout_s == 7
    assert deployment_config.graceful_shutdown_wait_loop_s == DRAIN_POLL_S


def _serve_args(*flags: str):
    import argparse

    from dynvm._serve_cmd import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_host_and_drain_flags(tmp_path):
    from dynvm._run_cmd import CliError
    from dynvm._serve_cmd import options_from_args

    path = tmp_path / "m.dvm"
    path.write_bytes(b"x")
    options = options_from_args(_serve_args(str(path)))
    assert options.host == "127.0.0.1" and options.serving.drain_s == ServingConfig().drain_s
    options = options_from_args(_serve_args(str(path), "--host", "0.0.0.0",
                                            "--drain-seconds", "2.5"))
    assert options.host == "0.0.0.0" and options.serving.drain_s == 2.5
    with pytest.raises(CliError, match="--host takes an IP address"):
        options_from_args(_serve_args(str(path), "--host", "example.org"))
    with pytest.raises(CliError, match="drain_s"):
        options_from_args(_serve_args(str(path), "--drain-seconds", "0"))
