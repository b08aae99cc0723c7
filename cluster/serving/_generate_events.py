"""What a generator replica streams (dynvm.cluster.serving._generate_replica): each
protocol's response objects (OpenAI's `text_completion`, the v2 generate extension's),
its token events from a template, and the streaming response that ends a stream in one
write."""

from __future__ import annotations

import json
import uuid

from starlette.responses import StreamingResponse

from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._generate import TextStream, openai_error, sse
from dynvm.cluster.protocol._http_front import MODEL_VERSION


def templated_event(shape, token: int, piece: str) -> bytes:
    """`sse(shape.chunk(token, piece, None))`, from a template of the shape's own chunk
    made at its first token and kept on it (Note [Token events from a template])."""
    template = shape.__dict__.get("_template")
    if template is None:
        template = shape._template = TokenTemplate(shape)
    return template.event(token, piece)


class OpenAIShape:
    """OpenAI completion objects (`text_completion`), whole or as stream chunks."""

    done = "[DONE]"

    def __init__(self, model_name: str, created: int) -> None:
        self.head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                     "created": created, "model": model_name}

    def chunk(self, token: int | None, piece: str, reason: str | None) -> dict:
        return {**self.head, "choices": [{
            "index": 0, "text": piece, "logprobs": None, "finish_reason": reason,
            "token_ids": [] if token is None else [token]}]}

    def token_event(self, token: int, piece: str) -> bytes:
        return templated_event(self, token, piece)

    def whole(self, text: TextStream, reason: str) -> dict:
        prompt = self.prompt_tokens
        return {**self.head, "choices": [{
            "index": 0, "text": text.text, "logprobs": None, "finish_reason": reason,
            "token_ids": list(text.ids)}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": len(text.ids),
                      "total_tokens": prompt + len(text.ids)}}

    def error(self, message: str, status: int) -> dict:
        return openai_error(message, status)

    prompt_tokens = 0


class V2Shape:
    """The v2 generate extension's response objects (`output_ids`, `text_output`)."""

    done = None

    def __init__(self, model_name: str) -> None:
        self.head = {"model_name": model_name, "model_version": MODEL_VERSION}

    def chunk(self, token: int | None, piece: str, reason: str | None) -> dict:
        return {**self.head, "output_ids": [] if token is None else [token],
                "text_output": piece, "finish_reason": reason}

    def token_event(self, token: int, piece: str) -> bytes:
        return templated_event(self, token, piece)

    def whole(self, text: TextStream, reason: str) -> dict:
        return {**self.head, "output_ids": list(text.ids), "text_output": text.text,
                "finish_reason": reason}

    def error(self, message: str, status: int) -> dict:
        return {"error": v2.cut(message, 1000)}


# Note [Token events from a template]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A stream's token events differ only in the token id and the text piece; everything else
# (the completion's id, model, created, the nulls) is the same in each. Encoding each one
# as a dict through json.dumps on the replica's event loop costs a dict merge and a walk
# of the nested objects per token, under the GIL the scheduler's step also needs (the
# loop's chunk encoding was 6% of its GIL samples, docs/bench_log.md, issue 33). The
# template is the shape's own `sse(chunk(...))` encoded once with two marker values and
# cut around them; an event is then the bytes around the token id and the piece (the
# piece through json.dumps only when it is not empty). tests/cluster/
# test_generate_events.py checks it against the dict's encoding.

_TOKEN_MARK, _PIECE_MARK = 987654321, "\u0001piece\u0001"


class TokenTemplate:
    """A shape's token event as three byte strings around the token id and the piece
    (Note [Token events from a template])."""

    def __init__(self, shape) -> None:
        self.shape = shape
        whole = sse(shape.chunk(_TOKEN_MARK, _PIECE_MARK, None))
        piece = json.dumps(_PIECE_MARK).encode()   # the marker as sse's JSON encodes it
        token = str(_TOKEN_MARK).encode()
        # A head that holds a marker's text (a model named so) keeps the dict's way.
        self.usable = whole.count(piece) == 1 and whole.count(token) == 1
        if not self.usable:
            return
        self.token_first = whole.index(token) < whole.index(piece)
        first, second = (token, piece) if self.token_first else (piece, token)
        self.head, rest = whole.split(first)
        self.middle, self.end = rest.split(second)

    def event(self, token: int, piece: str) -> bytes:
        """The event of `token` and its text `piece`."""
        if not self.usable:
            return sse(self.shape.chunk(token, piece, None))
        text = json.dumps(piece).encode() if piece else b'""'
        ids = str(token).encode()
        first, second = (ids, text) if self.token_first else (text, ids)
        return b"".join((self.head, first, self.middle, second, self.end))


# Note [One write at a stream's end]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A stream ends with its last token (or tokens), the chunk with the finish reason, the
# protocol's end (`data: [DONE]`) and the chunked body's terminator. Sent as Starlette's
# StreamingResponse sends an iterator's items, that is four body messages, four passes
# through Serve's send wrapper and the HTTP server, four socket writes, all on the
# replica's event loop at the moment a sequence ends, when the scheduler's next step
# waits for the GIL behind them (docs/bench_log.md, issue 33: steps after a request's
# end were blocked p50 1.2-1.7 ms against 0.5 for the others). The replica's `_events`
# knows which tokens are the last (the scheduler hands a step's events over together,
# so the end arrives with them) and yields them with the finish chunk and the end as
# one item marked final, which `EventStream` sends as the last body message
# (`more_body` False): uvicorn writes it and the terminator in one write.


class EventStream(StreamingResponse):
    """A StreamingResponse over (bytes, more) pairs: each pair one body message, and
    the first pair with `more` False the last one (Note [One write at a stream's end]).
    Starlette's disconnect watching stays as it is."""

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for body, more in self.body_iterator:
            await send({"type": "http.response.body", "body": body, "more_body": more})
            if not more:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
