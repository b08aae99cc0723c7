"""Ray Serve replicas over real HTTP: tritonclient (binary) and plain JSON requests.

The local Ray cluster and Serve instance shared with other modules (start-up dominates
the run time; Note [Shared Serve in tests]); this module's applications are deleted at
its end, and the shared Ray is shut down after the last test that uses it.
"""

from __future__ import annotations

import http.client
import json
import random
import threading

import numpy as np
import pytest
import torch

from tests.cluster._cluster_helpers import assert_overloaded
from tests.cluster._shared_serve import shared_serve

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpclient = pytest.importorskip("tritonclient.http")

import dynvm  # noqa: E402
from dynvm.cluster import BatchingOptions, ServingConfig, serve_models  # noqa: E402
from dynvm.models import branchy, recommender  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.shared_serve]

MAX_BODY = 256 * 1024




class Server:
    def __init__(self, port: int, programs: dict, modules: dict) -> None:
        self.port = port
        self.url = f"127.0.0.1:{port}"
        self.programs = programs
        self.modules = modules
        self.runtimes = {name: dynvm.Runtime(p, "cpu", jit=False) for name, p in programs.items()}

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def get_json(self, path: str) -> tuple[int, dict]:
        status, _, body = self.request("GET", path)
        return status, json.loads(body)

    def post_json(self, path: str, doc) -> tuple[int, dict]:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        status, _, raw = self.request("POST", path, body,
                                      {"Content-Type": "application/json"})
        return status, json.loads(raw)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replica")
    programs, modules, paths = {}, {}, {}
    for build in (recommender, branchy):
        model = build()
        program = dynvm.compile(model.module, model.example_inputs, model.dynamic_shapes,
                                name=model.name)
        paths[model.name] = str(tmp / f"{model.name}.dvm")
        dynvm.save(program, paths[model.name])
        programs[model.name] = dynvm.load(paths[model.name])
        modules[model.name] = model.module

    with shared_serve() as stack:
        config = ServingConfig(device="cpu", jit=False, max_body_bytes=MAX_BODY,
                               num_cpus=0.5,
                               batching=BatchingOptions(max_batch_size=8, max_delay_s=0.05))
        serve_models(paths, config, per_model={"branchy": config.replace(
            batching=BatchingOptions(enabled=False))})
        yield Server(stack.port, programs, modules)


def _rec_inputs(batch: int, seed: int) -> list[np.ndarray]:
    model = recommender()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    dense = torch.randn(batch, 13, generator=gen)
    sparse = [torch.randint(0, rows, (batch, bag), generator=gen)
              for rows, bag in ((1000, 3), (800, 5), (1200, 1), (500, 4))]
    assert len(model.example_inputs) == 1 + len(sparse)
    return [t.numpy() for t in (dense, *sparse)]


REC_NAMES = ["dense", "sparse0", "sparse1", "sparse2", "sparse3"]


def _triton_infer(client, arrays: list[np.ndarray], binary: bool = True) -> np.ndarray:
    inputs = []
    for name, arr in zip(REC_NAMES, arrays, strict=True):
        inp = httpclient.InferInput(name, list(arr.shape),
                                    "FP32" if arr.dtype == np.float32 else "INT64")
        inp.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(inp)
    result = client.infer("recommender", inputs)
    return result.as_numpy("output__0")


def _reference(server: Server, name: str, arrays: list[np.ndarray]) -> np.ndarray:
    out = server.runtimes[name](*[torch.from_numpy(a) for a in arrays])
    return out.numpy()


# ------------------------------------------------------------------ server & metadata


def test_server_routes(server):
    status, doc = server.get_json("/v2")
    assert status == 200 and doc["name"] == "dynvm" and "binary_tensor_data" in doc["extensions"]
    assert server.get_json("/v2/health/live")[0] == 200
    assert server.get_json("/v2/health/ready") == (200, {"ready": True})
    client = httpclient.InferenceServerClient(server.url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("recommender") and client.is_model_ready("branchy")
    assert not client.is_model_ready("nope")


def test_model_metadata_reports_dynamic_dims(server):
    status, meta = server.get_json("/v2/models/recommender")
    assert status == 200
    assert meta["name"] == "recommender" and meta["versions"] == ["1"]
    assert meta["inputs"][0] == {"name": "dense", "datatype": "FP32", "shape": [-1, 13]}
    assert meta["inputs"][1] == {"name": "sparse0", "datatype": "INT64", "shape": [-1, 3]}
    assert meta["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": [-1, 1]}]
    assert server.get_json("/v2/models/recommender/versions/1")[1] == meta
    assert server.get_json("/v2/models/recommender/versions/1/ready")[0] == 200
    status, doc = server.get_json("/v2/models/recommender/versions/7")
    assert status == 404 and "version '7'" in doc["error"]
    client = httpclient.InferenceServerClient(server.url)
    assert client.get_model_metadata("branchy")["inputs"] == [
        {"name": "x", "datatype": "FP32", "shape": [-1, 32]}]


# ------------------------------------------------------------------ inference


def test_tritonclient_binary_and_json_infer(server):
    client = httpclient.InferenceServerClient(server.url)
    arrays = _rec_inputs(5, seed=1)
    expected = _reference(server, "recommender", arrays)
    assert np.allclose(_triton_infer(client, arrays, binary=True), expected, atol=1e-6)
    assert np.allclose(_triton_infer(client, arrays, binary=False), expected, atol=1e-6)


def test_plain_json_infer_matches_eager(server):
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    for sign in (1.0, -1.0):  # both branches of torch.cond
        xs = (x.abs() * sign)
        status, doc = server.post_json("/v2/models/branchy/infer", {
            "id": "q1",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 32],
                        "data": xs.tolist()}]})
        assert status == 200, doc
        assert doc["id"] == "q1" and doc["model_name"] == "branchy"
        out = doc["outputs"][0]
        assert out["name"] == "output__0" and out["datatype"] == "FP32"
        assert out["shape"] == [3, 32]
        got = torch.tensor(out["data"]).reshape(3, 32)
        with torch.no_grad():
            eager = server.modules["branchy"](xs)
        assert torch.allclose(got, eager, atol=1e-5)


def test_binary_response_on_request(server):
    arrays = _rec_inputs(2, seed=2)
    header = {"inputs": [{"name": n, "datatype": "FP32" if a.dtype == np.float32 else "INT64",
                          "shape": list(a.shape), "data": a.flatten().tolist()}
                         for n, a in zip(REC_NAMES, arrays, strict=True)],
              "outputs": [{"name": "output__0", "parameters": {"binary_data": True}}]}
    status, headers, body = server.request("POST", "/v2/models/recommender/versions/1/infer",
                                           json.dumps(header).encode())
    assert status == 200
    n = int(headers["inference-header-content-length"])
    doc = json.loads(body[:n])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 8
    got = np.frombuffer(body[n:], dtype=np.float32).reshape(2, 1)
    assert np.allclose(got, _reference(server, "recommender", arrays), atol=1e-6)


def test_concurrent_requests_are_batched(server):
    before = server.get_json("/v2/models/recommender/stats")[1]
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            client = httpclient.InferenceServerClient(server.url)
            for k in range(4):
                arrays = _rec_inputs(1 + (t + k) % 4, seed=100 * t + k)
                if k == 0:
                    barrier.wait(timeout=30)
                got = _triton_infer(client, arrays, binary=(t % 2 == 0))
                expected = _reference(server, "recommender", arrays)
                assert got.shape == expected.shape
                assert np.allclose(got, expected, atol=1e-5), (t, k)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    status, stats = server.get_json("/v2/models/recommender/stats")
    assert status == 200
    assert stats["requests"] - before["requests"] == 32
    assert stats["batched_vm_calls"] > before["batched_vm_calls"]
    assert stats["max_requests_per_vm_call"] >= 2
    assert stats["vm_calls"] - before["vm_calls"] < 32  # fewer VM calls than requests
    assert stats["calls"] >= stats["vm_calls"] and stats["jit"] is False


def test_lone_requests_run_at_once_and_batches_are_reported(server):
    """Sequential requests each find the model idle: none is held for the batch delay
    (0.05 s here), each is its own batch; stats report the batcher's counters."""
    before = server.get_json("/v2/models/recommender/stats")[1]["batching"]
    client = httpclient.InferenceServerClient(server.url)
    for k in range(5):
        arrays = _rec_inputs(1 + k % 3, seed=500 + k)
        got = _triton_infer(client, arrays, binary=False)
        assert np.allclose(got, _reference(server, "recommender", arrays), atol=1e-5)
    after = server.get_json("/v2/models/recommender/stats")[1]["batching"]
    assert after["held_batches"] == before["held_batches"]
    assert after["batches"] - before["batches"] == 5
    assert after["batched_requests"] - before["batched_requests"] == 5
    assert after["recorded_batches"] - before["recorded_batches"] == 5
    assert after["specialized_batch_ratio"] == 0.0  # jit=False: nothing specialized
    assert after["queued"] == 0


def test_past_its_queue_bound_a_replica_answers_503_with_retry_after(server, tmp_path):
    """BatchingOptions.max_queued bounds the requests waiting for the model: with one
    running (a loop that runs to its 0.5 s budget) and one waiting, the next ones are
    answered 503 + Retry-After at once instead of queued."""
    from dynvm.cluster import ServingLimits, model_application
    from tests.vm._programs import DATA_LOOP, DATA_LOOP_INPUTS, build

    path = tmp_path / "spin.dvm"
    dynvm.save(build(DATA_LOOP, regs=8, inputs=DATA_LOOP_INPUTS, outputs=2, name="spin"),
               path)
    config = ServingConfig(device="cpu", jit=False, num_cpus=0.25,
                           batching=BatchingOptions(max_queued=1),
                           limits=ServingLimits(call_seconds=0.5, retry_after_s=2))
    serve.run(model_application("spin", path, config), name="dynvm-model-spin",
              route_prefix="/v2/models/spin")
    try:
        assert_overloaded(lambda body: server.request("POST", "/v2/models/spin/infer", body))
        stats = server.get_json("/v2/models/spin/stats")[1]
        assert stats["rejected_busy"] == 3 and stats["batching"]["rejected_overload"] == 3
    finally:
        serve.delete("dynvm-model-spin")


# ------------------------------------------------------------------ bad input


def _rec_json(batch: int = 2) -> dict:
    arrays = _rec_inputs(batch, seed=7)
    return {"inputs": [{"name": n, "datatype": "FP32" if a.dtype == np.float32 else "INT64",
                        "shape": list(a.shape), "data": a.flatten().tolist()}
                       for n, a in zip(REC_NAMES, arrays, strict=True)]}


def _edit(index: int, **changes) -> dict:
    doc = _rec_json()
    doc["inputs"][index].update(changes)
    return doc


def _rec_binary(wrong_length: int) -> tuple[bytes, dict]:
    arrays = _rec_inputs(2, seed=8)
    header = {"inputs": [{"name": n, "datatype": "FP32" if a.dtype == np.float32 else "INT64",
                          "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}}
                         for n, a in zip(REC_NAMES, arrays, strict=True)]}
    raw = json.dumps(header).encode()
    body = raw + b"".join(a.tobytes() for a in arrays)
    return body, {"Inference-Header-Content-Length": str(len(raw) + wrong_length)}


BAD = [
    ("malformed json", "/v2/models/recommender/infer", b"{oops", {}, 400, "malformed JSON"),
    ("unknown model", "/v2/models/nope/infer", _rec_json(), {}, 404, "unknown model 'nope'"),
    ("unknown input", "/v2/models/recommender/infer", _edit(0, name="densee"), {}, 400,
     "unknown input 'densee'"),
    ("missing input", "/v2/models/recommender/infer",
     {"inputs": _rec_json()["inputs"][:4]}, {}, 400, "missing input 'sparse3'"),
    ("wrong datatype", "/v2/models/recommender/infer", _edit(1, datatype="FP32"), {}, 400,
     "input 'sparse0': datatype 'FP32'"),
    ("data length", "/v2/models/recommender/infer", _edit(0, data=[1.0] * 5), {}, 400,
     "input 'dense': 'data' has 5 elements"),
    ("rank mismatch", "/v2/models/recommender/infer", _edit(0, shape=[26]), {}, 400,
     "input 'dense': shape [26] has rank 1"),
    ("dim out of range", "/v2/models/recommender/infer", _edit(0, shape=[2000, 13]), {}, 400,
     "input 'dense': dim 0 (batch) is 2000, outside its declared range [1, 1024]"),
    ("static dim", "/v2/models/recommender/infer", _edit(0, shape=[1, 26]), {}, 400,
     "input 'dense': dim 1 is 26, expected 13"),
    ("wrong binary header length", "/v2/models/recommender/infer", *_rec_binary(+3), 400,
     "Inference-Header-Content-Length"),
    ("binary header length past end", "/v2/models/recommender/infer", *_rec_binary(+10**6),
     400, "the body has only"),
    ("oversize body", "/v2/models/recommender/infer", b" " * (MAX_BODY + 1), {}, 413,
     f"the limit is {MAX_BODY}"),
    ("index out of range", "/v2/models/recommender/infer",
     _edit(1, data=[10**6] * 6), {}, 400, "model 'recommender'"),
]


@pytest.mark.parametrize("label,path,body,headers,status,needle", BAD,
                         ids=[case[0] for case in BAD])
def test_bad_input_is_4xx_naming_the_problem(server, label, path, body, headers, status,
                                             needle):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got_status, _, got_body = server.request("POST", path, raw, headers)
    assert got_status == status, got_body
    doc = json.loads(got_body)
    assert set(doc) == {"error"} and needle in doc["error"], doc
    assert server.get_json("/v2/health/ready")[0] == 200
    assert server.get_json("/v2/models/recommender/ready")[0] == 200


def test_tritonclient_sees_errors(server):
    client = httpclient.InferenceServerClient(server.url)
    inp = httpclient.InferInput("x", [2, 31], "FP32")
    inp.set_data_from_numpy(np.zeros((2, 31), np.float32))
    with pytest.raises(Exception, match="input 'x': dim 1 is 31, expected 32"):
        client.infer("branchy", [inp])
    assert client.is_server_ready()
