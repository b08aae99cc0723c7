"""Hostile requests against a real Ray Serve server (docs/RELIABILITY.md, "Hostile
input"): a runaway program, JSON amplification, numbers, nesting and encodings that the
protocol must refuse, unbounded echoes, the protocol's error body on every route.

One module-scoped local Ray + Serve (start-up dominates) serving the recommender demo
(default 64 MiB body limit) and `spin`, a data-dependent loop (`while i < n`) whose
call budget is 1 s, so that a request with a huge `n` runs away.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import numpy as np
import pytest
import torch

import dynvm
from dynvm.cluster.limits import ServingLimits
from dynvm.cluster.replica import serve_models
from tests.cluster._cluster_helpers import local_serve, saved_recommender
from tests.vm._programs import build

pytestmark = pytest.mark.slow

REC = "/v2/models/recommender/infer"
SPIN = "/v2/models/spin/infer"
SPIN_LOOP = """
    0  %2 = ITEM %0
    1  %3 = MOVE 0
    2  %4 = MOVE %1
    3  %5 = SLT %3, %2
    4  JUMP_IF_FALSE %5, @9
    5  %6 = MUL %4, 2.0
    6  %4 = MOVE %6
    7  %3 = SADD %3, 1
    8  JUMP @3
    9  %7 = SCALAR_TENSOR %3, torch.int64, None, None
    10  RETURN {%4, %7}
"""


class Server:
    def __init__(self, port: int, demo, runtime: dynvm.Runtime) -> None:
        self.port, self.demo, self.runtime = port, demo, runtime

    def request(self, method: str, path: str, body=None, headers: dict | None = None,
                timeout: float = 60) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def good_doc(self, batch: int = 2, seed: int = 7) -> dict:
        gen = torch.Generator().manual_seed(seed)
        inputs = []
        for spec, example in zip(self.runtime.program.inputs, self.demo.example_inputs,
                                 strict=True):
            if example.is_floating_point():
                t = torch.randn(batch, *example.shape[1:], generator=gen)
            else:
                t = torch.randint(0, 100, (batch, *example.shape[1:]), generator=gen)
            inputs.append({"name": spec.name, "shape": list(t.shape),
                           "datatype": "FP32" if t.is_floating_point() else "INT64",
                           "data": t.flatten().tolist()})
        return {"inputs": inputs}

    def good(self) -> tuple[int, float]:
        """(status, seconds) of one good recommender request, checked against the VM."""
        doc = self.good_doc()
        start = time.perf_counter()
        status, _, raw = self.request("POST", REC, json.dumps(doc).encode())
        seconds = time.perf_counter() - start
        if status == 200:
            out = json.loads(raw)["outputs"][0]
            got = np.array(out["data"], dtype=np.float32).reshape(out["shape"])
            tensors = [torch.tensor(i["data"]).reshape(i["shape"]) for i in doc["inputs"]]
            assert np.allclose(got, self.runtime(*tensors).numpy(), atol=1e-5)
        return status, seconds


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    demo, program, rec_path = saved_recommender(folder, max_batch=1024)
    spin_path = folder / "spin.dvm"
    dynvm.save(build(SPIN_LOOP, regs=8, inputs=('"n" int64 []', '"x" float32 [m:1..64]'),
                     outputs=2, name="spin"), spin_path)
    with local_serve("dynvm-test-hostile") as port:
        serve_models({"recommender": str(rec_path), "spin": str(spin_path)}, device="cpu",
                     jit=False, max_batch_size=4, batch_wait_timeout_s=0.005, num_cpus=0.5,
                     limits=ServingLimits(call_seconds=1.0))
        yield Server(port, demo, dynvm.Runtime(program, "cpu", jit=False))


def _spin_body(n: int) -> bytes:
    return json.dumps({"inputs": [
        {"name": "n", "datatype": "INT64", "shape": [], "data": [n]},
        {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, -1.0]}]}).encode()


def test_a_runaway_request_stops_at_its_budget_and_the_server_serves_on(server):
    answer: dict = {}

    def runaway() -> None:
        start = time.perf_counter()
        answer["reply"] = server.request("POST", SPIN, _spin_body(2**62))
        answer["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=runaway)
    thread.start()
    time.sleep(0.2)
    during = [server.good() for _ in range(5)]  # another model, while the loop runs
    thread.join(30)
    assert not thread.is_alive()
    status, headers, raw = answer["reply"]
    doc = json.loads(raw)
    assert status == 500 and set(doc) == {"error"}, doc
    error_id = headers["dynvm-error-id"]
    assert f"(error id {error_id})" in doc["error"]
    assert "CallBudgetError" in doc["error"] and "instruction 8 (JUMP @3)" in doc["error"]
    assert 1.0 <= answer["seconds"] < 10, answer["seconds"]
    assert all(status == 200 for status, _ in during), during
    # The spinning worker is free again: the same model answers a loop that ends.
    status, _, raw = server.request("POST", SPIN, _spin_body(5))
    assert status == 200, raw
    outputs = json.loads(raw)["outputs"]
    assert outputs[0]["data"] == [32.0, -32.0] and outputs[1]["data"] == [5]
    print(f"\nrunaway request: {status} after {answer['seconds']:.2f} s (budget 1 s); "
          f"other model meanwhile: max {max(s for _, s in during):.3f} s")


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as statm:
        return int(statm.read().split()[1]) * 4096


def test_json_amplification_is_bounded_and_others_are_served_meanwhile(server):
    """A valid request plus an ignored field of 21 million empty lists (63 MB, under the
    64 MiB limit): accepted without building the junk (Note [Bounded JSON]); the
    replica's memory grows by less than 4x the body, and requests sent meanwhile to the
    same replica keep a p99 under 1 s."""
    status, _, raw = server.request("GET", "/v2/models/recommender/stats")
    pid = json.loads(raw)["process"]["pid"]
    doc = server.good_doc(batch=3, seed=5)
    body = (json.dumps(doc).encode()[:-1] + b', "junk": [' + b"[]," * (21_000_000 - 1)
            + b"[]]}")
    assert 60e6 < len(body) < 64 * 2**20
    baseline = max(_rss_bytes(pid) for _ in range(5))
    stop = threading.Event()
    samples: list[int] = []
    meanwhile: list[tuple[int, float]] = []

    def sample() -> None:
        while not stop.is_set():
            samples.append(_rss_bytes(pid))
            time.sleep(0.005)

    def others() -> None:
        while not stop.is_set():
            meanwhile.append(server.good())

    threads = [threading.Thread(target=sample), threading.Thread(target=others)]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    status, _, raw = server.request("POST", REC, body)
    seconds = time.perf_counter() - start
    stop.set()
    for thread in threads:
        thread.join(30)
    assert status == 200, raw[:300]
    out = json.loads(raw)["outputs"][0]
    tensors = [torch.tensor(i["data"]).reshape(i["shape"]) for i in doc["inputs"]]
    assert np.allclose(np.array(out["data"], np.float32).reshape(out["shape"]),
                       server.runtime(*tensors).numpy(), atol=1e-5)
    growth = max(samples) - baseline
    latencies = sorted(s for _, s in meanwhile)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    print(f"\n63 MB amplification body: 200 in {seconds:.2f} s; replica RSS growth "
          f"{growth / 1e6:.1f} MB ({growth / len(body):.2f}x the body, {len(samples)} "
          f"samples); {len(latencies)} requests meanwhile, p99 {p99:.3f} s, "
          f"max {latencies[-1]:.3f} s")
    assert all(s == 200 for s, _ in meanwhile)
    assert growth < 4 * len(body)
    assert len(latencies) >= 3 and p99 < 1.0
