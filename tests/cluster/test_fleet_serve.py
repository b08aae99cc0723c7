"""The fleet over real parts: a local Ray cluster, Ray Serve replicas behind HTTP, a real
redis-server, the compile service actor; clients are tritonclient and plain HTTP.

Apps "ta" and "tb" serve the same Transformer program: two replicas of one program that
Serve cannot route between, so traffic can be aimed at one of them.
"""

from __future__ import annotations

import http.client
import json
import random
import threading

import numpy as np
import pytest
import torch

from tests.cluster._cluster_helpers import saved_recommender, serve_fleet, wait_until
from tests.cluster._redis_server import REDIS_SERVER

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpclient = pytest.importorskip("tritonclient.http")

import dynvm  # noqa: E402
from dynvm.cluster import Autoscaling, BatchingOptions, serve_models  # noqa: E402
from dynvm.cluster.fleet._link import FleetOptions  # noqa: E402
from dynvm.jit.config import JitConfig  # noqa: E402
from dynvm.models import recommender, transformer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.shared_serve]  # serve_fleet

SMALL = {"layers": 2, "hidden": 64, "heads": 4, "ffn": 128}
CONFIG = JitConfig(min_recurrence=2, max_recurrence=4, horizon_calls=10**7)
SEQ = 16




class Cluster:
    def __init__(self, port: int, fleet: FleetOptions, paths: dict, modules: dict) -> None:
        self.port = port
        self.fleet = fleet
        self.paths = paths
        self.modules = modules

    def request(self, method: str, path: str, body: bytes | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Type": "application/json"} if body else {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def stats(self, model: str) -> dict:
        status, body = self.request("GET", f"/v2/models/{model}/stats")
        assert status == 200, body
        return json.loads(body)

    def deploy(self, models: dict[str, str], **options) -> None:
        """Deploy `models` ({name: path}) at once (in parallel)."""
        serve_models(models, device="cpu", jit=CONFIG, num_cpus=0.1, fleet=self.fleet,
                     batching=BatchingOptions(max_batch_size=4, max_delay_s=0.005),
                     **options)


def _tokens(batch: int, seed: int) -> np.ndarray:
    """Inputs of the Transformer: float32 [batch, SEQ, hidden]."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, SEQ, SMALL["hidden"]), dtype=np.float32)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not installed (scripts/setup installs it)")
    tmp = tmp_path_factory.mktemp("fleet-serve")
    demo = transformer(**SMALL)
    program = dynvm.compile(demo.module.eval(), demo.example_inputs, demo.dynamic_shapes,
                            name="transformer_s")
    dynvm.save(program, tmp / "transformer.dvm")
    saved_recommender(tmp)
    with serve_fleet(tmp, "dynvm-test-fleet", CONFIG, flush_interval_s=0.02,
                     poll_interval_s=0.5) as (port, _, fleet):
        paths = {"transformer": str(tmp / "transformer.dvm"),
                 "recommender": str(tmp / "recommender.dvm")}
        c = Cluster(port, fleet, paths, {"transformer": demo.module.eval()})
        c.deploy({"ta": paths["transformer"], "tb": paths["transformer"]})
        yield c


def _infer(client, model: str, tokens: np.ndarray, binary: bool) -> np.ndarray:
    given = httpclient.InferInput("x", list(tokens.shape), "FP32")
    given.set_data_from_numpy(tokens, binary_data=binary)
    result = client.infer(model, [given])
    name = result.get_response()["outputs"][0]["name"]
    return result.as_numpy(name)


def test_tritonclient_gets_the_transformers_outputs(cluster):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{cluster.port}",
                                              network_timeout=120)
    module = cluster.modules["transformer"]
    for batch, binary in [(1, True), (4, False), (16, True), (3, False)]:
        tokens = _tokens(batch, seed=batch)
        got = _infer(client, "ta", tokens, binary)
        with torch.inference_mode():
            want = module(torch.from_numpy(tokens))
        want = want[0] if isinstance(want, tuple) else want
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)




def test_promotion_from_traffic_on_a_is_installed_on_b_without_compiling(cluster):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{cluster.port}",
                                              network_timeout=120)
    shapes = [_tokens(2, seed=1), _tokens(2, seed=2), _tokens(8, seed=3)]
    b_before = cluster.stats("tb")
    for _ in range(10):
        for tokens in shapes:
            _infer(client, "ta", tokens, binary=True)
    installed = wait_until(lambda: cluster.stats("tb")["installs"] > b_before["installs"], 60)
    assert installed is not None, \
        cluster.stats("tb")
    assert cluster.stats("ta")["compiles"] == 0, "the service compiles, not replica A"
    b = cluster.stats("tb")
    assert b["compiles"] == 0 and b["fleet"]["service_ok"]
    spec_before = b["specialized_region_calls"]
    for tokens in shapes:
        _infer(client, "tb", tokens, binary=False)
    b_after = cluster.stats("tb")
    assert b_after["specialized_region_calls"] > spec_before
    assert b_after["compiles"] == 0


def test_a_replica_started_after_promotion_serves_its_first_request_specialized(cluster):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{cluster.port}",
                                              network_timeout=120)
    tokens = _tokens(2, seed=11)
    for _ in range(8):
        _infer(client, "ta", tokens, binary=True)
    # Wait until the promoted shape is in the index (B, a running replica, has it).
    assert wait_until(lambda: cluster.stats("tb")["fleet"]["installed"] >= 1, 60) is not None
    cluster.deploy({"tc": cluster.paths["transformer"]})
    before = cluster.stats("tc")
    assert before["fleet"]["warm_start_installs"] >= 1 and before["compiles"] == 0
    _infer(client, "tc", tokens, binary=True)
    after = cluster.stats("tc")
    assert after["specialized_region_calls"] > before["specialized_region_calls"]
    assert after["interpreted_region_calls"] == before["interpreted_region_calls"], \
        "the first request of a promoted shape ran interpreted"
    assert after["compiles"] == 0


def _running_replicas(app: str) -> int:
    status = serve.status().applications[app]
    return sum(d.replica_states.get("RUNNING", 0) for d in status.deployments.values())


def test_deployment_scales_up_under_load_and_back(cluster):
    cluster.deploy({"auto": cluster.paths["recommender"]}, autoscaling=Autoscaling(
        min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0.5,
        downscale_delay_s=2.0))
    assert _running_replicas("dynvm-model-auto") == 1
    rec = recommender(max_batch=64)
    names = [spec.name for spec in dynvm.load(cluster.paths["recommender"]).inputs]
    stop = threading.Event()
    failures = []

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            tensors = rec.sample_inputs(rng)
            body = {"inputs": [{"name": n, "shape": list(t.shape),
                                "datatype": "FP32" if t.dtype == torch.float32 else "INT64",
                                "data": t.flatten().tolist()} for n, t in zip(names, tensors)]}
            status, text = cluster.request("POST", "/v2/models/auto/infer",
                                           json.dumps(body).encode())
            if status != 200:
                failures.append((status, text[:200]))

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    try:
        up = wait_until(lambda: _running_replicas("dynvm-model-auto") >= 2, timeout_s=90)
        assert up is not None, "no scale-up under 8 concurrent clients"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not failures, failures[:3]
    down = wait_until(lambda: _running_replicas("dynvm-model-auto") == 1, timeout_s=120)
    assert down is not None, "no scale-down after the load stopped"


def _complete(port: int, prompt: list[int], max_tokens: int) -> list[int]:
    """One greedy OpenAI completion from a generator replica; its token ids."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions",
                     json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                 "ignore_eos": True}).encode(),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == 200, body
        return body["choices"][0]["token_ids"]
    finally:
        conn.close()


def test_a_generator_replica_started_during_a_trace_serves_first_request_specialized(
        cluster, tmp_path):
    """Issue 33: a generator replica started while another serves a trace installs the
    step's families from the store before it answers, so its first request runs them
    and compiles nothing. One client, prompts of one length: every step signature of
    the new replica's request (a prompt chunk and single-row decode steps) is one the
    trace ran."""
    from dynvm.cluster.serving._generate_replica import GeneratorServer
    from dynvm.cluster.serving._generate_scheduler import SchedulerConfig
    from dynvm.cluster.serving.serving_config import ServingConfig
    from tests.cluster._generate_helpers import HttpServer, reference, saved_generator

    bundle = str(saved_generator(tmp_path / "gen"))
    config = ServingConfig(device="cpu", jit=CONFIG, fleet=cluster.fleet)
    scheduler = SchedulerConfig(max_sequences=2)
    first = GeneratorServer("gen", bundle, config, scheduler, metrics_to_ray=False)
    first_http = HttpServer(first)
    second = second_http = None
    stop, failures = threading.Event(), []

    def trace() -> None:
        rng = random.Random(5)
        while not stop.is_set():
            try:
                _complete(first_http.port, [rng.randrange(3, 100) for _ in range(6)], 12)
            except Exception as error:  # noqa: BLE001 - reported by the test below
                failures.append(repr(error))
                return

    client = threading.Thread(target=trace, daemon=True)
    client.start()
    try:
        try:
            # The compile service promoted the trace's step signatures (a prompt chunk,
            # single-row decode), and the first replica runs none of its regions
            # interpreted any more.
            window = [first.generator.step.stats()]

            def trace_specialized() -> bool:
                now = first.generator.step.stats()
                last, window[0] = window[0], now
                return (now["calls"] > last["calls"] and now["interpreted_region_calls"]
                        == last["interpreted_region_calls"])

            assert wait_until(trace_specialized, 60, interval_s=0.5) is not None, \
                (first.stats()["fleet"], window[0])
            second = GeneratorServer("gen", bundle, config, scheduler, metrics_to_ray=False)
            link = second.stats()["fleet"][0]
            assert link["warm_start_installs"] >= 1, link
            second_http = HttpServer(second)
            before = second.generator.step.stats()
            prompt = [7, 8, 9, 10, 11, 12]
            tokens = _complete(second_http.port, prompt, 12)
            after = second.generator.step.stats()
        finally:
            stop.set()
            client.join(60)
        assert not failures, failures
        assert tokens == reference(prompt, 12)
        assert after["compiles"] == 0, after
        assert after["specialized_region_calls"] > before["specialized_region_calls"]
        assert after["interpreted_region_calls"] == before["interpreted_region_calls"], \
            ("the new replica's first request ran interpreted", before, after)
    finally:
        for server, http_server in ((second, second_http), (first, first_http)):
            if http_server is not None:
                http_server.close()
            if server is not None:
                server.close()
