"""dynvm's replicas behind Serve's direct ingress (Note [Direct ingress]): a real local
Ray started with RAY_SERVE_ENABLE_DIRECT_INGRESS=1, real HTTP straight to each
replica's own port, no proxy in the path. Everything is shut down at the end.
"""

from __future__ import annotations

import http.client
import json
import threading

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import dynvm  # noqa: E402
from dynvm.cluster import BatchingOptions, ServingConfig, ServingLimits  # noqa: E402
from dynvm.cluster.protocol._http_front import SERVER_APP, model_app_name  # noqa: E402
from dynvm.cluster.protocol.ingress import direct_addresses, ingress_environment  # noqa: E402
from dynvm.cluster.protocol.proxy_guard import ProxyLimits  # noqa: E402
from dynvm.vm.errors import ConfigError  # noqa: E402
from tests.cluster._cluster_helpers import (  # noqa: E402
    assert_overloaded,
    local_serve,
    saved_recommender,
)
from tests.vm._programs import DATA_LOOP, DATA_LOOP_INPUTS, build  # noqa: E402

pytestmark = pytest.mark.slow


class Direct:
    """The running applications: each one's replica port, and the reference Runtime."""

    def __init__(self, proxy_port: int, ports: dict[str, int], demo, program) -> None:
        self.proxy_port, self.ports, self.demo = proxy_port, ports, demo
        self.names = [spec.name for spec in program.inputs]
        self.runtime = dynvm.Runtime(program, "cpu", jit=False)

    def body(self, batch: int, seed: int) -> tuple[bytes, list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(batch, 13, generator=gen)] + [
            torch.randint(0, rows, (batch, bag), generator=gen)
            for rows, bag in ((1000, 3), (800, 5), (1200, 1), (500, 4))]
        doc = {"inputs": [{"name": n, "shape": list(t.shape),
                           "datatype": "FP32" if t.is_floating_point() else "INT64",
                           "data": t.flatten().tolist()}
                          for n, t in zip(self.names, tensors, strict=True)]}
        return json.dumps(doc).encode(), tensors


def _request(port: int, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None, conn: http.client.HTTPConnection | None = None):
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return (response.status, {k.lower(): v for k, v in response.getheaders()},
                response.read())
    finally:
        if own:
            conn.close()


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("direct")
    demo, program, path = saved_recommender(tmp)
    spin = tmp / "spin.dvm"
    dynvm.save(build(DATA_LOOP, regs=8, inputs=DATA_LOOP_INPUTS, outputs=2, name="spin"),
               spin)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ingress_environment("direct").items():
            patch.setenv(name, value)  # Serve's controller and replicas inherit them
        with local_serve("dynvm-test-direct",
                         proxy_limits=ProxyLimits(keep_alive_timeout_s=1)) as proxy_port:
            from dynvm.cluster import serve_models

            config = ServingConfig(device="cpu", jit=False, num_cpus=0.25, ingress="direct")
            spin_config = config.replace(
                batching=BatchingOptions(max_queued=1),
                limits=ServingLimits(call_seconds=0.5, retry_after_s=2))
            handles = serve_models({"recommender": str(path), "spin": str(spin)}, config,
                                   per_model={"spin": spin_config})
            ports = {app: found[0][1] for app, found in direct_addresses(handles).items()}
            yield Direct(proxy_port, ports, demo, program)


def test_each_application_has_its_own_replica_port(direct):
    ports = direct.ports
    assert set(ports) == {model_app_name("recommender"), model_app_name("spin"), SERVER_APP}
    assert len(set(ports.values())) == 3 and direct.proxy_port not in ports.values()
    status, _, raw = _request(ports[SERVER_APP], "GET", "/v2/health/ready")
    assert status == 200 and json.loads(raw) == {"ready": True}


def test_v2_json_straight_to_the_replica_is_answered_correctly(direct):
    port = direct.ports[model_app_name("recommender")]
    body, tensors = direct.body(3, seed=1)
    status, headers, raw = _request(port, "POST", "/v2/models/recommender/infer", body,
                                    {"Content-Type": "application/json"})
    assert status == 200 and headers["content-type"] == "application/json"
    out = json.loads(raw)["outputs"][0]
    expected = direct.runtime(*tensors).numpy()
    assert out["shape"] == list(expected.shape)
    np.testing.assert_allclose(np.asarray(out["data"], np.float32).reshape(expected.shape),
                               expected, rtol=1e-5, atol=1e-6)


def test_each_client_gets_its_own_answers_in_order(direct):
    """Four clients, each on its own keep-alive connection, send 12 requests of varied
    batch sizes at once (the replica batches across clients): every answer a client
    reads is the answer to the request it sent, in the order sent."""
    port = direct.ports[model_app_name("recommender")]
    failures: list = []

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            for i in range(12):
                body, tensors = direct.body(1 + (k + i) % 4, seed=100 * k + i)
                status, _, raw = _request(port, "POST", "/v2/models/recommender/infer",
                                          body, {"Content-Type": "application/json"}, conn)
                expected = direct.runtime(*tensors).numpy()
                out = json.loads(raw)["outputs"][0] if status == 200 else None
                if out is None or out["shape"] != list(expected.shape) or not np.allclose(
                        np.asarray(out["data"], np.float32).reshape(expected.shape),
                        expected, rtol=1e-5, atol=1e-6):
                    failures.append((k, i, status, raw[:200]))
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == []


def test_past_its_queue_bound_the_replica_answers_503_with_retry_after(direct):
    """BatchingOptions.max_queued=1 with no proxy in front: one request runs (a loop to
    its 0.5 s budget), one waits, the rest are answered 503 + Retry-After at once."""
    port = direct.ports[model_app_name("spin")]
    assert_overloaded(lambda body: _request(port, "POST", "/v2/models/spin/infer", body))


def test_the_proxy_guard_runs_in_the_replica(direct):
    """Serve builds each replica's HTTP server with the proxy's middlewares (Note [Direct
    ingress]): a declared body over the limit is refused before it is read, and Serve's
    own errors come back in the protocol's body."""
    port = direct.ports[model_app_name("recommender")]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", "/v2/models/recommender/infer")
        conn.putheader("Content-Length", str(ProxyLimits().max_body_bytes + 1))
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 413 and response.getheader("connection") == "close"
        assert "the limit is" in json.loads(response.read())["error"]
    finally:
        conn.close()
    status, headers, raw = _request(port, "GET", "/elsewhere")
    assert status == 404 and headers["content-type"] == "application/json"
    assert "/elsewhere" in json.loads(raw)["error"]


def test_the_replica_closes_an_idle_keep_alive_connection(direct):
    """ProxyLimits.keep_alive_timeout_s (1 s here) bounds idle connections to the
    replica's own server as it does the proxy's."""
    port = direct.ports[SERVER_APP]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        assert _request(port, "GET", "/v2/health/live", conn=conn)[0] == 200
        threading.Event().wait(2.0)
        conn.sock.settimeout(0.5)  # an open connection would time out here instead
        assert conn.sock.recv(1) == b""  # the server closed it
    finally:
        conn.close()


def test_a_model_request_at_the_server_apps_port_says_where_to_send_it(direct):
    """In direct ingress the server application's own port sees a served model's routes
    too (through the proxy they reach the model's application): it answers 404 saying
    so, not "unknown model"."""
    status, _, raw = _request(direct.ports[SERVER_APP], "GET", "/v2/models/recommender")
    assert status == 404
    error = json.loads(raw)["error"]
    assert "'recommender' is served by its own application" in error
    assert "unknown" not in error
    status, _, raw = _request(direct.ports[SERVER_APP], "GET", "/v2/models/nope")
    assert status == 404 and "unknown model 'nope'" in json.loads(raw)["error"]


def test_models_of_one_serve_must_name_the_same_ingress(tmp_path):
    from dynvm.cluster import serve_models

    with pytest.raises(ConfigError, match="same ingress"):
        serve_models({"a": str(tmp_path / "a.dvm")}, ServingConfig(ingress="direct"),
                     per_model={"a": ServingConfig(ingress="proxy")})
    with pytest.raises(ConfigError, match="ingress must be one of"):
        ServingConfig(ingress="haproxy")


def test_dynvm_serve_ingress_flag_maps_to_the_serving_config(tmp_path):
    import argparse

    from dynvm._serve_cmd import add_parser, options_from_args

    path = tmp_path / "m.dvm"
    path.write_bytes(b"x")  # options_from_args only checks that the file exists
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    for flags, ingress in (((), "direct"), (("--ingress", "proxy"), "proxy")):
        args = parser.parse_args(["serve", str(path), *flags])
        assert options_from_args(args).serving == ServingConfig(ingress=ingress)
    assert ingress_environment("proxy") == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
