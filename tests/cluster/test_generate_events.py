"""What a generator replica writes for a stream: token events from a template equal the
protocol objects' own JSON (Note [Token events from a template]), and a stream's last
token, its finish chunk, `[DONE]` and the chunked body's end go out in one HTTP chunk
(Note [One write at a stream's end]), read off a real socket from a replica behind a
real uvicorn (no Ray)."""

from __future__ import annotations

import json
import socket

import pytest

from dynvm.cluster.protocol._generate import sse
from dynvm.cluster.serving._generate_events import OpenAIShape, V2Shape
from dynvm.cluster.serving._generate_replica import GeneratorServer
from dynvm.cluster.serving._generate_scheduler import SchedulerConfig
from dynvm.cluster.serving.serving_config import ServingConfig
from tests.cluster._generate_helpers import HttpServer, reference, saved_generator

PIECES = ["", "w5", " w17", 'a "quoted" word', "back\\slash", "new\nline", "é ü 中文",
          "\u0001", "</s>"]


@pytest.mark.parametrize("shape", [OpenAIShape("tiny", 1733400000), V2Shape("tiny"),
                                   OpenAIShape("m987654321", 5), V2Shape("987654321")],
                         ids=["openai", "v2", "openai-marker-name", "v2-marker-name"])
def test_token_events_equal_the_chunks_json(shape):
    """For every token and piece, the template's event is byte for byte the SSE event
    of the shape's chunk (also where the model's name holds the template's marker)."""
    for token in (0, 7, 31999, 987654321):
        for piece in PIECES:
            assert shape.token_event(token, piece) == sse(shape.chunk(token, piece, None))


def _chunks(sock: socket.socket) -> list[bytes]:
    """The HTTP chunks of a chunked response read off `sock`, until the last (empty)
    one, which is kept as b""."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, data = data.split(b"\r\n\r\n", 1)
    assert b"transfer-encoding: chunked" in head.lower(), head
    chunks = []
    while True:
        while b"\r\n" not in data:
            more = sock.recv(65536)
            assert more, chunks
            data += more
        size_line, rest = data.split(b"\r\n", 1)
        size = int(size_line, 16)
        while len(rest) < size + 2:
            more = sock.recv(65536)
            assert more, chunks
            rest += more
        chunks.append(rest[:size])
        data = rest[size + 2:]
        if size == 0:
            return chunks


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    bundle = saved_generator(tmp_path_factory.mktemp("generator") / "tiny")
    server = GeneratorServer("tiny", str(bundle), ServingConfig(device="cpu", jit=False),
                             SchedulerConfig(max_sequences=4), metrics_to_ray=False)
    http_server = HttpServer(server)
    yield server, http_server
    http_server.close()
    server.close()


@pytest.mark.parametrize("path,doc,done", [
    ("/v1/completions", {"prompt": [5, 17, 42], "max_tokens": 7, "temperature": 0,
                         "ignore_eos": True, "stream": True}, True),
    ("/v2/models/tiny/generate_stream",
     {"input_ids": [5, 17, 42], "parameters": {"max_tokens": 7, "ignore_eos": True}},
     False)], ids=["openai", "v2"])
def test_a_streams_end_is_one_chunk(served, path, doc, done):
    """The last HTTP chunk with a body holds the last token's event, the finish chunk
    and (OpenAI) `[DONE]`, and the chunked end follows it at once; the tokens are
    `Generator.generate`'s; the connection serves a second request (kept alive)."""
    server, http_server = served
    body = json.dumps(doc).encode()
    request = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    expected = reference((5, 17, 42), 7, None, ())
    with socket.create_connection(("127.0.0.1", http_server.port), timeout=30) as sock:
        for _ in range(2):
            sock.sendall(request)
            chunks = _chunks(sock)
            assert chunks[-1] == b""
            events = [e for chunk in chunks for e in chunk.split(b"\n\n") if e]
            docs = [e[len(b"data: "):] for e in events]
            assert (docs[-1] == b"[DONE]") == done
            objects = [json.loads(d) for d in docs if d != b"[DONE]"]
            ids = [t for o in objects for t in (o["choices"][0]["token_ids"]
                                                if done else o["output_ids"])]
            assert ids == expected
            last = [e for e in chunks[-2].split(b"\n\n") if e]
            assert len(last) >= (3 if done else 2), chunks[-2]
            finish = json.loads(last[-2 if done else -1][len(b"data: "):])
            reason = (finish["choices"][0]["finish_reason"] if done
                      else finish["finish_reason"])
            assert reason == "length"
            # the tokens before the end: one event per token, none held back
            assert sum(len(c.split(b"\n\n")) - 1 for c in chunks) == len(expected) + 1 + done
    assert server.scheduler.wait_idle(20) and not server.scheduler.held


def test_stats_show_the_steps_jit_work(served, tmp_path):
    """/stats carries the step's JIT work: nothing without the JIT; with it, the
    compiles of the warm-up before ready and whether the JIT has settled."""
    server, _ = served
    assert server.stats()["jit"] == {}
    bundle = saved_generator(tmp_path / "tiny", tokenizer=False)
    warmed = GeneratorServer("tiny", str(bundle), ServingConfig(device="cpu"),
                             SchedulerConfig(max_sequences=4, warm_seconds=20),
                             metrics_to_ray=False)
    try:
        work = warmed.stats()["jit"]
        assert set(work) == {"promotions", "compiles", "compile_seconds", "settled"}, work
        assert work["compile_seconds"] > 0, work
        assert work["promotions"] >= work["compiles"] >= 1, work
        assert work["settled"] == warmed.generator.step.settled()
    finally:
        warmed.close()
