"""Hostile requests against a real Ray Serve server (docs/RELIABILITY.md, "Hostile
input"): a runaway program, JSON amplification, numbers, nesting and encodings that the
protocol must refuse, unbounded echoes, the protocol's error body on every route.

One module-scoped local Ray + Serve (start-up dominates) serving the recommender demo
(default 64 MiB body limit) and `spin`, a data-dependent loop (`while i < n`) whose
call budget is 1 s, so that a request with a huge `n` runs away. The proxy runs
dynvm's guard (Note [Limits at the proxy]) with a 2 s body timeout.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import dynvm
from dynvm.cluster import BatchingOptions, serve_models
from dynvm.cluster.protocol._v2_json import decode_header
from dynvm.cluster.protocol.proxy_guard import ProxyLimits
from dynvm.cluster.serving._limits import ServingLimits
from tests.cluster._cluster_helpers import local_serve, saved_recommender
from tests.vm._programs import DATA_LOOP, DATA_LOOP_INPUTS, build

pytestmark = pytest.mark.slow

PROXY = ProxyLimits(body_timeout_s=2.0)
REC = "/v2/models/recommender/infer"
SPIN = "/v2/models/spin/infer"


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
    dynvm.save(build(DATA_LOOP, regs=8, inputs=DATA_LOOP_INPUTS,
                     outputs=2, name="spin"), spin_path)
    with local_serve("dynvm-test-hostile", proxy_limits=PROXY) as port:
        serve_models({"recommender": str(rec_path), "spin": str(spin_path)}, device="cpu",
                     jit=False, num_cpus=0.5, limits=ServingLimits(call_seconds=1.0),
                     batching=BatchingOptions(max_batch_size=4, max_delay_s=0.005))
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
    print(f"\nrunaway request: {answer['reply'][0]} after {answer['seconds']:.2f} s "
          f"(budget 1 s); "
          f"other model meanwhile: max {max(s for _, s in during):.3f} s")


def test_a_slow_call_of_a_fast_signature_never_holds_the_event_loop(server):
    # The spin program's time is its data's (a loop of n iterations), not its shapes':
    # before the fix, calls of n=1 made its signature "fast", so the next call of the
    # same shapes ran on the replica's event loop, however long (Note [Inline fast
    # batches]); /ready and every other request to that replica waited for it.
    for _ in range(5):
        assert server.request("POST", SPIN, _spin_body(1))[0] == 200
    answer: dict = {}

    def runaway() -> None:
        answer["reply"] = server.request("POST", SPIN, _spin_body(2**62))

    thread = threading.Thread(target=runaway)
    thread.start()
    time.sleep(0.1)
    ready, others = [], []
    while thread.is_alive():
        start = time.perf_counter()
        status, _, _ = server.request("GET", "/v2/models/spin/ready")
        ready.append((status, time.perf_counter() - start))
        others.append(server.good())   # another model's request, meanwhile
        time.sleep(0.02)
    thread.join()
    assert answer["reply"][0] == 500   # it ran to its 1 s budget
    assert len(ready) >= 5 and all(status == 200 for status, _ in ready), ready
    worst = max(seconds for _, seconds in ready)
    print(f"\n/ready of the spinning model during its 1 s call: {len(ready)} polls, "
          f"median {sorted(s for _, s in ready)[len(ready) // 2] * 1000:.1f} ms, max "
          f"{worst * 1000:.1f} ms; another model meanwhile max "
          f"{max(s for _, s in others) * 1000:.1f} ms")
    assert worst < 0.4, ready   # the call holds the loop for ~1 s when it runs there
    assert all(status == 200 for status, _ in others), others


def _edited(server, index: int, **changes) -> bytes:
    doc = server.good_doc()
    doc["inputs"][index].update(changes)
    return json.dumps(doc).encode()


ERRORS = [
    # (case, method, path, body, status, a part of the error text)
    ("FP32 as an integer too big for a float", "POST", REC, "overflow", 400,
     "... is out of range for FP32 (largest magnitude 3.40282e+38)"),
    ("FP32 beyond its range", "POST", REC, "1e39", 400,
     "input 'dense': value 1e+39 is out of range for FP32"),
    ("number beyond a double", "POST", REC, "1e400", 400,
     "input 'dense': 'data': Number out of range"),
    ("ragged rows", "POST", REC, "ragged", 400,
     "input 'dense': 'data' is not nested as its shape [2, 13]: data[1] should be a "
     "list of 13, got a list of 12"),
    ("rows nested against the shape", "POST", REC, "transposed", 400,
     "input 'dense': 'data' is not nested as its shape [2, 13]: data should be a list "
     "of 2, got a list of 13"),
    ("bare NaN token", "POST", REC, "nan", 400, "malformed JSON in the request"),
    ("GET on infer", "GET", REC, None, 405,
     "method GET is not allowed on /v2/models/recommender/infer (allowed: POST)"),
    ("OPTIONS on infer", "OPTIONS", REC, None, 405, "method OPTIONS is not allowed"),
    ("double slash", "POST", "/v2/models/recommender//infer", "good", 404,
     "no route /v2/models/recommender//infer"),
    ("no such route in a model", "GET", "/v2/models/recommender/nope", None, 404,
     "no route /v2/models/recommender/nope"),
    ("no such route at all", "GET", "/nope", None, 404, "/nope"),
    ("unknown model, 5 KB name", "POST", "/v2/models/" + "m" * 5000 + "/infer", "good",
     404, "unknown model 'mmmm"),
    ("unknown version, 5 KB", "POST", "/v2/models/recommender/versions/" + "9" * 5000
     + "/infer", "good", 404, "model 'recommender' has no version '9999"),
    ("unknown input, 5 KB name", "POST", REC, "long name", 400, "unknown input 'xxxx"),
]


def _body(server, kind):
    if kind is None:
        return None
    if kind == "good":
        return json.dumps(server.good_doc()).encode()
    if kind == "overflow":
        return _edited(server, 0, data=[10**400] + [0.5] * 25)
    if kind in ("1e39", "1e400", "nan"):  # JSON text json.dumps would not write
        doc = server.good_doc()
        doc["inputs"][0]["data"][0] = 12345.5
        token = "NaN" if kind == "nan" else kind
        return json.dumps(doc).replace("12345.5", token, 1).encode()
    if kind == "ragged":
        return _edited(server, 0, data=[[0.5] * 13, [0.5] * 12])
    if kind == "transposed":
        return _edited(server, 0, data=[[0.5, 0.5]] * 13)
    if kind == "long name":
        return _edited(server, 0, name="x" * 5000)
    raise AssertionError(kind)


@pytest.mark.parametrize("case,method,path,kind,status,needle", ERRORS,
                         ids=[e[0] for e in ERRORS])
def test_every_error_is_the_protocols_body_and_echoes_little(server, case, method, path,
                                                             kind, status, needle):
    body = _body(server, kind)
    got, headers, raw = server.request(method, path, body)
    assert got == status, raw[:300]
    assert headers["content-type"] == "application/json"
    doc = json.loads(raw)
    assert set(doc) == {"error"} and needle in doc["error"], doc
    assert len(raw) < 400, raw  # nothing the client sent comes back whole
    print(f"\n{case}: {got} {doc['error']}")


def test_non_finite_values_travel_as_valid_json_and_tritonclient_reads_them(server):
    import tritonclient.http as httpclient

    doc = server.good_doc()
    doc["inputs"][0]["data"][0] = "NaN"
    doc["inputs"][0]["data"][1] = "Infinity"
    status, _, raw = server.request("POST", REC, json.dumps(doc).encode())
    assert status == 200, raw

    def no_bare_tokens(token):
        raise AssertionError(f"bare {token} in the response")

    out = json.loads(raw, parse_constant=no_bare_tokens)["outputs"][0]
    assert "NaN" in out["data"], out["data"][:20]  # row 0 saw the NaN
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    arrays = [np.array(i["data"], dtype=np.float32 if i["datatype"] == "FP32" else np.int64)
              .reshape(i["shape"]) for i in doc["inputs"]]
    inputs = []
    for entry, array in zip(doc["inputs"], arrays, strict=True):
        item = httpclient.InferInput(entry["name"], list(array.shape), entry["datatype"])
        item.set_data_from_numpy(array, binary_data=True)
        inputs.append(item)
    result = client.infer("recommender", inputs, outputs=[
        httpclient.InferRequestedOutput("output__0", binary_data=False)])
    got = result.as_numpy("output__0")
    tensors = [torch.from_numpy(a) for a in arrays]
    expected = server.runtime(*tensors).numpy()
    assert np.isnan(got[0]).any() and np.allclose(got, expected, atol=1e-5, equal_nan=True)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as statm:
        return int(statm.read().split()[1]) * 4096


def _proxy_pid() -> int:
    """Serve's HTTP proxy: Ray titles its worker process "ray::ProxyActor..."."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(b"ray::ProxyActor"):
                found.append(int(entry.name))
    assert len(found) == 1, found
    return found[0]


def test_an_oversize_body_is_refused_at_the_proxy_before_it_is_buffered(server):
    # Declared: refused before a byte of the body is read.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", REC)
    conn.putheader("Content-Length", str(200 * 2**20))
    conn.endheaders()
    resp = conn.getresponse()
    doc = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and doc == {
        "error": f"request body is {200 * 2**20} bytes, the limit is {64 * 2**20}"}
    # Chunked, 200 MB: refused as soon as 64 MiB have arrived; the proxy never holds more.
    pid = _proxy_pid()
    before = _rss_bytes(pid)
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes(pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    piece = b" " * 2**20

    def chunks():
        for _ in range(200):
            yield piece

    try:
        # No Content-Length: http.client sends an iterable with chunked encoding.
        status, _, raw = server.request("POST", REC, chunks())
    except (ConnectionError, http.client.HTTPException) as exc:  # closed while sending
        status, raw = None, repr(exc).encode()
    stop.set()
    sampler.join()
    growth = peak[0] - before
    print(f"\nchunked 200 MB body: {status} {raw[:80]!r}; proxy RSS growth "
          f"{growth / 1e6:.1f} MB")
    if status is not None:
        assert status == 413 and "the limit is" in json.loads(raw)["error"], raw
    # The proxy holds what it received (at most the limit) and its copy in flight to
    # the replica: about twice the limit, never the 200 MB sent.
    assert growth < 3 * 64 * 2**20
    assert server.good()[0] == 200


def _slow_client(port: int, declared: int, sent: bytes, every_s: float, out: list) -> None:
    start = time.perf_counter()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        sock.sendall(f"POST {REC} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {declared}\r\n\r\n".encode())
        reply = b""
        for byte in sent:
            sock.sendall(bytes([byte]))
            sock.settimeout(every_s)
            try:
                reply = sock.recv(65536)
            except TimeoutError:
                continue
            break
        sock.settimeout(30)
        while b"\r\n\r\n" not in reply:
            more = sock.recv(65536)
            if not more:
                break
            reply += more
        out.append((reply.split(b" ", 2)[1:2], time.perf_counter() - start, reply))
    except OSError as exc:
        out.append(([repr(exc).encode()], time.perf_counter() - start, b""))
    finally:
        sock.close()


def test_slow_clients_time_out_and_others_are_served(server):
    body = json.dumps(server.good_doc()).encode()
    results: list = []
    threads = [threading.Thread(target=_slow_client, args=(server.port, len(body), body,
                                                             0.1, results))
               for _ in range(40)]
    # Declares more than it sends: waits for bytes that never come.
    threads += [threading.Thread(target=_slow_client, args=(server.port, len(body) + 100,
                                                              body, 0.0005, results))
                for _ in range(10)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    meanwhile = [server.good() for _ in range(5)]
    for thread in threads:
        thread.join(30)
    statuses = sorted({r[0][0] for r in results})
    slowest = max(r[1] for r in results)
    print(f"\n50 slow clients: statuses {statuses}, all answered within {slowest:.2f} s "
          f"(body timeout 2 s); good requests meanwhile: max "
          f"{max(s for _, s in meanwhile):.3f} s")
    assert len(results) == 50 and statuses == [b"408"], results[:3]
    assert slowest < 2 + 3 and all(status == 200 for status, _ in meanwhile)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_json_amplification_is_bounded_and_others_are_served_meanwhile(server):
    """A valid request plus an ignored field of 21 million empty lists (63 MB, under the
    64 MiB limit): accepted without building the junk (Note [Bounded JSON]); the
    replica's memory grows by less than 4x the body, and requests sent meanwhile to the
    same replica keep a p99 under 1 s (or 7x the junk's decode on this host at the
    time, where that is more)."""
    status, _, raw = server.request("GET", "/v2/models/recommender/stats")
    pid = json.loads(raw)["process"]["pid"]
    doc = server.good_doc(batch=3, seed=5)
    body = (json.dumps(doc).encode()[:-1] + b', "junk": [' + b"[]," * (21_000_000 - 1)
            + b"[]]}")
    assert 60e6 < len(body) < 64 * 2**20
    # The replica holds the GIL while msgspec skips the junk, so a request meanwhile may
    # wait about that long whatever else is right: the p99 bound is 1 s or 7x that
    # decode timed here, whichever is more (quiet: ~0.14 s; at load 6 a fixed 1 s bound
    # failed a rehearsal at 1.41 s). It is timed before and after the junk requests, and
    # the slower of the two is the host's speed: a load that rose between a decode
    # timed before and the requests failed a rehearsal at 1.14 s against 1.0 s.
    def decode_seconds() -> float:
        return min(_seconds(lambda: decode_header(body, "request")) for _ in range(2))

    decode_before = decode_seconds()
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

    threads = [threading.Thread(target=sample)] + [threading.Thread(target=others)
                                                    for _ in range(3)]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    growth = 0
    for _ in range(2):  # twice, so that enough requests overlap it
        time.sleep(0.2)
        baseline, first = _rss_bytes(pid), len(samples)
        status, _, raw = server.request("POST", REC, body)
        assert status == 200, raw[:300]
        growth = max(growth, max(samples[first:] or [baseline]) - baseline)
    seconds = (time.perf_counter() - start - 0.4) / 2
    stop.set()
    for thread in threads:
        thread.join(30)
    out = json.loads(raw)["outputs"][0]
    tensors = [torch.tensor(i["data"]).reshape(i["shape"]) for i in doc["inputs"]]
    assert np.allclose(np.array(out["data"], np.float32).reshape(out["shape"]),
                       server.runtime(*tensors).numpy(), atol=1e-5)
    latencies = sorted(s for _, s in meanwhile)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    p99_bound = max(1.0, 7 * max(decode_before, decode_seconds()))
    print(f"\n63 MB amplification body (x2): 200 in {seconds:.2f} s; replica RSS growth "
          f"{growth / 1e6:.1f} MB ({growth / len(body):.2f}x the body, {len(samples)} "
          f"samples); {len(latencies)} requests meanwhile, p99 {p99:.3f} s, "
          f"max {latencies[-1]:.3f} s (bound {p99_bound:.2f} s)")
    assert all(s == 200 for s, _ in meanwhile)
    assert growth < 4 * len(body)
    assert len(latencies) >= 5 and p99 < p99_bound


def test_past_its_concurrency_limit_a_replica_answers_503_with_retry_after(server, tmp_path):
    from ray import serve

    from dynvm.cluster import model_application

    path = tmp_path / "spin2.dvm"
    dynvm.save(build(DATA_LOOP, regs=8, inputs=DATA_LOOP_INPUTS,
                     outputs=2, name="spin"), path)
    serve.run(model_application("spin2", path, device="cpu", jit=False, num_cpus=0.25,
                                limits=ServingLimits(call_seconds=1.0,
                                                     max_concurrent_requests=2)),
              name="dynvm-model-spin2", route_prefix="/v2/models/spin2")
    replies: list = []

    def runaway() -> None:
        start = time.perf_counter()
        status, headers, raw = server.request("POST", "/v2/models/spin2/infer",
                                              _spin_body(2**62))
        replies.append((status, headers, json.loads(raw), time.perf_counter() - start))

    threads = [threading.Thread(target=runaway) for _ in range(5)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(30)
    busy = [r for r in replies if r[0] == 503]
    print(f"\n5 runaway requests, limit 2: statuses {sorted(r[0] for r in replies)}; 503s "
          f"answered in <= {max(r[3] for r in busy):.3f} s")
    assert sorted(r[0] for r in replies) == [500, 500, 503, 503, 503]
    for _, headers, doc, seconds in busy:
        assert headers["retry-after"] == "1" and "is busy" in doc["error"] and seconds < 1.0
    status, _, raw = server.request("POST", "/v2/models/spin2/infer", _spin_body(3))
    assert status == 200, raw
    serve.delete("dynvm-model-spin2")
