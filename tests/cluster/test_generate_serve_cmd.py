"""`dynvm serve GENERATOR_DIR` as a real subprocess (local Ray, Serve's proxy, the
generator replica): the `openai` client and `curl -N` stream completions equal to
`Generator.generate`'s tokens, a client that disconnects through Serve's proxy has its
sequence freed, every sequence is freed at the end, the replica's Runtimes are linked
to the compile service, and SIGINT stops the command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import dynvm
from tests.cluster._generate_helpers import reference, saved_generator, words
from tests.cluster._redis_server import REDIS_SERVER, free_port

openai = pytest.importorskip("openai")


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, json.loads(response.read())


def _stats(base: str) -> dict:
    return _get(f"{base}/v2/models/tiny/stats")[1]


def _wait_ready(process, base: str, out) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, out.read_text()[-3000:]
        try:
            if _get(f"{base}/v2/health/ready")[1].get("ready") and \
                    "Ctrl-C" in out.read_text():
                return
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, "not ready in 120 s"
        time.sleep(0.3)


def _disconnect_mid_stream(port: int) -> None:
    body = json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 62,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk


@pytest.mark.slow
def test_serve_generator_streams_to_openai_and_curl(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    directory = saved_generator(tmp_path / "tiny")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items()
           if k not in ("DYNVM_REDIS_URL", "DYNVM_STORE_SECRET", "DYNVM_STORE_DIR")}
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "dynvm", "serve", str(directory), "--port", str(port),
             "--max-batch-size", "4", "--no-online-compile"],
            stdout=stdout, stderr=stderr, env=env)
    try:
        _wait_ready(process, base, out)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        sampling = dynvm.Sampling(temperature=0.8, top_p=0.9, seed=11)
        chunks = list(client.completions.create(model="tiny", prompt=words([9, 10, 11]),
                                                max_tokens=10, temperature=0.8, top_p=0.9,
                                                seed=11, stream=True))
        tokens = [t for c in chunks for t in c.choices[0].token_ids]
        assert tokens == reference([9, 10, 11], 10, sampling)
        assert "".join(c.choices[0].text for c in chunks) == words(tokens)
        done = subprocess.run(
            [curl, "-sS", "-N", "-X", "POST", f"{base}/v2/models/tiny/generate_stream",
             "-d", json.dumps({"input_ids": [4, 5], "parameters": {"max_tokens": 7}})],
            capture_output=True, text=True, timeout=60, check=True)
        events = [json.loads(line[6:]) for line in done.stdout.splitlines()
                  if line.startswith("data: ")]
        assert [t for e in events for t in e["output_ids"]] == reference([4, 5], 7)
        _disconnect_mid_stream(port)
        deadline = time.monotonic() + 20
        while (stats := _stats(base))["running"] or stats["held"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        counters = stats["scheduler"]
        assert counters["cancelled"] == 1 and counters["tokens"] < 10 + 7 + 62, counters
        assert counters["admitted"] == counters["freed"] == 3, counters
        assert stats["cache_rows"] == 0 and stats["reserved_tokens"] == 0, stats
        # The one Runtime, the step over the KV state, is linked to the compile service.
        assert len(stats["fleet"]) == 1 and all(f["service_ok"] for f in stats["fleet"])
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert code == 0, err.read_text()[-3000:]
    assert "stopped" in out.read_text()
