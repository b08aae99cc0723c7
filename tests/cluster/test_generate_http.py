"""A generator replica over real HTTP (uvicorn in this process, no Ray): the `openai`
package and `curl -N` stream completions whose tokens equal `Generator.generate`'s for
the same seed; the v2 generate extension; each protocol's error shape; 503 + Retry-After
when the waiting room is full; a client that disconnects frees its sequence; the
Prometheus series."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import time

import pytest

import dynvm
from dynvm.cluster.serving._generate_replica import GeneratorServer
from dynvm.cluster.serving._generate_scheduler import SchedulerConfig
from dynvm.cluster.serving.serving_config import ServingConfig
from tests.cluster._generate_helpers import HttpServer, reference, saved_generator, words

openai = pytest.importorskip("openai")

MODEL = "tiny"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return saved_generator(tmp_path_factory.mktemp("generator") / "tiny")


@pytest.fixture(scope="module")
def served(bundle):
    server = GeneratorServer(MODEL, str(bundle), ServingConfig(device="cpu", jit=False),
                             SchedulerConfig(max_sequences=4), metrics_to_ray=False)
    http_server = HttpServer(server)
    yield server, http_server
    http_server.close()
    server.close()


def _client(http_server):
    return openai.OpenAI(base_url=f"{http_server.url}/v1", api_key="unused", max_retries=0)


def _curl(url: str, doc: dict) -> list:
    """POST `doc` with `curl -N`; the server-sent events' data, decoded."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    done = subprocess.run([curl, "-sS", "-N", "-X", "POST", url, "-H",
                           "Content-Type: application/json", "-d", json.dumps(doc)],
                          capture_output=True, text=True, timeout=60, check=True)
    events = [line[len("data: "):] for line in done.stdout.splitlines()
              if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_openai_client_streams_generate_tokens(served):
    server, http_server = served
    client = _client(http_server)
    prompt = [5, 17, 42, 9]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                      temperature=0)
    expected = reference(prompt, 10)
    choice = whole.choices[0]
    assert choice.token_ids == expected and choice.text == words(expected)
    assert whole.usage.prompt_tokens == 4 and whole.usage.completion_tokens == len(expected)
    sampling = dynvm.Sampling(temperature=0.9, top_k=30, top_p=0.95, seed=7)
    chunks = list(client.completions.create(
        model=MODEL, prompt=words(prompt), max_tokens=12, temperature=0.9, top_p=0.95,
        seed=7, stream=True, extra_body={"top_k": 30}))
    tokens = [t for chunk in chunks for t in chunk.choices[0].token_ids]
    assert tokens == reference(prompt, 12, sampling)
    assert "".join(c.choices[0].text for c in chunks) == words(tokens)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert len(chunks) == len(tokens) + 1  # a chunk per token, then the finish reason


def test_curl_streams_both_protocols(served):
    _, http_server = served
    prompt = [7, 8, 9]
    expected = reference(prompt, 6)
    events = _curl(f"{http_server.url}/v1/completions",
                   {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "stream": True})
    assert events[-1] == "[DONE]"
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == expected
    events = _curl(f"{http_server.url}/v2/models/{MODEL}/generate_stream",
                   {"text_input": words(prompt), "parameters": {"max_tokens": 6}})
    assert [t for e in events for t in e["output_ids"]] == expected
    assert "".join(e["text_output"] for e in events) == words(expected)
    assert events[-1]["finish_reason"] == "length"


def _post(http_server, path: str, doc) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", http_server.port, timeout=30)
    try:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        conn.close()


def test_v2_generate_and_stop_strings(served):
    _, http_server = served
    prompt = [11, 12, 13]
    expected = reference(prompt, 8)
    status, _, body = _post(http_server, f"/v2/models/{MODEL}/generate",
                            {"input_ids": prompt, "parameters": {"max_tokens": 8}})
    assert status == 200 and body["output_ids"] == expected, body
    assert body["text_output"] == words(expected) and body["model_name"] == MODEL
    stop = f" w{expected[3]}"  # text stops at the fourth token's word, or before
    status, _, body = _post(http_server, "/v1/completions",
                            {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                             "stop": [stop]})
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop", body
    text = words(expected)
    assert choice["text"] == text[:text.index(stop)], (choice, text)


@pytest.mark.parametrize("path, doc, status, param", [
    ("/v1/completions", {"prompt": [5], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5], "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": list(range(3, 60)), "max_tokens": 16}, 400, "max_tokens"),
    ("/v1/completions", {"model": "other", "prompt": [5]}, 404, "model"),
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": [5], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v2/models/tiny/generate", {"input_ids": [5], "parameters": {"top_p": 0}}, 400, None),
    ("/v2/models/tiny/generate", {"parameters": {}}, 400, None),
    ("/v2/models/other/generate", {"input_ids": [5]}, 404, None),
])
def test_errors_in_each_protocols_shape(served, path, doc, status, param):
    _, http_server = served
    code, _, body = _post(http_server, path, doc)
    assert code == status, body
    if path.startswith("/v1/"):
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["param"] == param
    else:
        assert isinstance(body["error"], str) and body["error"], body


def test_openai_client_raises_its_own_errors(served):
    _, http_server = served
    client = _client(http_server)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=[5], max_tokens=1000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=[5])


def test_full_waiting_room_is_503_with_retry_after(bundle):
    server = GeneratorServer(MODEL, str(bundle), ServingConfig(device="cpu", jit=False),
                             SchedulerConfig(max_sequences=2, max_waiting=1, cache_tokens=64),
                             metrics_to_ray=False)
    http_server = HttpServer(server)
    try:
        long = {"prompt": [5], "max_tokens": 62, "ignore_eos": True, "stream": True,
                "temperature": 0}
        # One runs (a cache of 64 holds one reservation of 63), one waits, one is refused.
        streams = [_open_stream(http_server, long), _open_stream(http_server, long, False)]
        deadline = time.monotonic() + 10
        while server.scheduler.occupancy()["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        status, headers, body = _post(http_server, "/v1/completions",
                                      {"prompt": [5], "max_tokens": 2})
        assert status == 503 and headers.get("retry-after") == "1", (status, body)
        assert body["error"]["type"] == "server_overloaded"
        # Counted by the gate every replica shares (serving._infer_seam.RequestGate).
        assert server.stats()["rejected_busy"] == 1
        for sock in streams:
            sock.close()
        assert server.scheduler.wait_idle(20)
        assert not server.scheduler.held
    finally:
        http_server.close()
        server.close()


def _open_stream(http_server, doc, first_event: bool = True) -> socket.socket:
    """A streaming request on a raw socket, read up to its first event if asked."""
    body = json.dumps(doc).encode()
    sock = socket.create_connection(("127.0.0.1", http_server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    received = b""
    while first_event and b"data: " not in received:
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    return sock


def test_client_disconnect_frees_its_sequence(served):
    server, http_server = served
    scheduler = server.scheduler
    before = dict(scheduler.counters)
    sock = _open_stream(http_server, {"prompt": [5, 6], "max_tokens": 62, "stream": True,
                                      "ignore_eos": True, "temperature": 0})
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    assert scheduler.wait_idle(20)
    counters = scheduler.counters
    assert counters["cancelled"] == before["cancelled"] + 1, counters
    assert counters["tokens"] - before["tokens"] < 62
    assert counters["admitted"] == counters["freed"] and not scheduler.held
    assert scheduler.occupancy()["cache_rows"] == 0


def test_client_disconnect_frees_its_slot_on_the_rows_step(tmp_path):
    """Over a generator saved in the step's rows form (packed=False, or saved before the
    packed step was the default; a decode call and a prompt call a step, Note [One
    packed call per step]) a client that disconnects mid-stream has its sequence
    cancelled and its slot freed, and the next request streams `Generator.generate`'s
    tokens. (The module's `served` generator is the default packed form.)"""
    from dynvm._serve_generate_bundle import save_generator
    from tests.generation._tiny import tiny_rows_programs

    bundle = save_generator(tiny_rows_programs(), tmp_path / "rows")
    server = GeneratorServer(MODEL, str(bundle), ServingConfig(device="cpu", jit=False),
                             SchedulerConfig(max_sequences=4), metrics_to_ray=False)
    http_server = HttpServer(server)
    try:
        assert not server.generator.packed
        scheduler = server.scheduler
        sock = _open_stream(http_server, {"prompt": [5, 6], "max_tokens": 62,
                                          "stream": True, "ignore_eos": True,
                                          "temperature": 0})
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        assert scheduler.wait_idle(20)
        events = _curl(f"{http_server.url}/v1/completions",
                       {"prompt": [7, 8, 9], "max_tokens": 9, "temperature": 0,
                        "ignore_eos": True, "stream": True})
        assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == \
            reference([7, 8, 9], 9, None, ())
        assert scheduler.wait_idle(20)
        counters = scheduler.counters
        assert counters["cancelled"] == 1 and counters["tokens"] < 62 + 9, counters
        assert counters["admitted"] == counters["freed"] == 2 and not scheduler.held
        assert scheduler.occupancy()["cache_rows"] == 0
        assert scheduler._slots.used_tokens() == 0
    finally:
        http_server.close()
        server.close()


def test_prometheus_series_and_stats(served):
    server, http_server = served
    _post(http_server, "/v1/completions", {"prompt": [5], "max_tokens": 4})
    conn = http.client.HTTPConnection("127.0.0.1", http_server.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for series in ("dynvm_generate_ttft_seconds_count", "dynvm_generate_itl_seconds_bucket",
                   "dynvm_generate_tokens_total", "dynvm_generate_running",
                   "dynvm_generate_cache_occupancy", 'reason="length"'):
        assert series in text, series
    stats = server.stats()
    assert stats["tokens"] >= 4 and stats["ttft_p50_s"] > 0 and stats["itl_p99_s"] > 0


def test_the_step_threads_run_on_the_configured_slice(served):
    """Note [Short slices for the step's threads]: the scheduler's thread and the thread
    of the loop that serves the requests each got SchedulerConfig.thread_slice_s from
    the kernel (where it reports per-thread slices), and /stats says so."""
    from dynvm.cluster.serving._generate_slice import thread_slice

    if thread_slice() is None:
        pytest.skip("this kernel reports no per-thread slice (Linux 6.12+ EEVDF)")
    server, http_server = served
    _post(http_server, "/v1/completions", {"prompt": [5], "max_tokens": 2})
    wanted = server.scheduler.config.thread_slice_s
    assert wanted > 0
    assert server.stats()["thread_slice_s"] == {"scheduler": pytest.approx(wanted),
                                                "loop": pytest.approx(wanted)}


def test_dynvm_top_shows_generation(served):
    from dynvm._top_cmd import Row
    from dynvm._top_generate import generation_lines

    server, http_server = served
    _post(http_server, "/v1/completions", {"prompt": [5], "max_tokens": 3})
    conn = http.client.HTTPConnection("127.0.0.1", http_server.port, timeout=30)
    conn.request("GET", f"/v2/models/{MODEL}/stats")
    stats = json.loads(conn.getresponse().read())
    conn.close()
    lines = generation_lines([Row(MODEL, "sample", stats), Row("other", "-", error="down")])
    assert lines[1] == "generation" and "TTFT p50/p99 ms" in lines[2]
    assert len(lines) == 4 and lines[3].startswith(MODEL) and "slots" in lines[3]


def test_a_span_per_generation_joins_the_requests_trace(served):
    from dynvm.telemetry import Telemetry

    server, http_server = served
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    saved, (server.telemetry, spans) = server.telemetry, Telemetry.in_memory()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", http_server.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": [5, 6], "max_tokens": 5, "temperature": 0, "ignore_eos": True}),
            {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        server.telemetry = saved
    [span] = [s for s in spans.get_finished_spans() if s.name == "dynvm.generate"]
    assert format(span.context.trace_id, "032x") == trace_id
    attributes = span.attributes
    assert attributes["dynvm.generate.completion_tokens"] == 5
    assert attributes["dynvm.generate.prompt_tokens"] == 2
    assert attributes["dynvm.generate.finish_reason"] == "length"
    assert 0 < attributes["dynvm.generate.ttft_s"] < span.end_time / 1e9


def test_a_draining_generator_refuses_through_the_shared_gate(served):
    # The generator's admission is the inference replica's RequestGate (one seam):
    # draining, a new request of either protocol is a 503 + Retry-After in its shape.
    server, http_server = served
    before = server.stats()
    assert server.begin_drain() == 0 and server.draining
    try:
        status, headers, body = _post(http_server, "/v1/completions",
                                      {"prompt": [5], "max_tokens": 2})
        assert status == 503 and headers.get("retry-after") == "1", (status, body)
        assert "shutting down" in body["error"]["message"]
        status, _, body = _post(http_server, f"/v2/models/{MODEL}/generate",
                                {"input_ids": [5], "parameters": {"max_tokens": 2}})
        assert status == 503 and "shutting down" in body["error"]
    finally:
        server.gate.draining = False
    after = server.stats()
    assert after["requests"] == before["requests"] and after["in_flight"] == 0
    status, _, body = _post(http_server, "/v1/completions", {"prompt": [5], "max_tokens": 2})
    assert status == 200 and server.stats()["requests"] == before["requests"] + 1
