"""The two generation protocols a generator replica speaks: OpenAI's completions
(`POST /v1/completions`, streamed as server-sent events with `"stream": true`) and the
KServe v2 generate extension (`POST /v2/models/<m>/generate`, `.../generate_stream`).
Bodies are read into one `Completion` (the scheduler's request, whether to stream, the
stop strings); tokens are turned into text by `TextStream`; errors take each protocol's
own shape: OpenAI's `{"error": {"message", "type", "param", "code"}}`, the v2
protocol's `{"error": "..."}`.

Defaults differ as the protocols do: OpenAI samples at temperature 1.0 unless told
otherwise, max_tokens 16; the v2 generate extension is greedy unless a temperature > 0
is given. Temperature 0 is greedy in both. The prompt is token ids (a list of ints:
OpenAI `prompt`, v2 `input_ids`) or, when the model ships a tokenizer, text (OpenAI
`prompt`, v2 `text_input`). Outputs carry the token ids (`token_ids` in an OpenAI choice,
`output_ids` in v2) and the text when there is a tokenizer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from dynvm._sampling import Sampling
from dynvm.cluster.protocol import _v2 as v2
from dynvm.vm.errors import InputError

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate: what a generation protocol's body asks for, and what
    the scheduler (dynvm.cluster.serving._generate_scheduler) takes."""

    prompt: tuple[int, ...]
    """Prompt token ids (at least one)."""
    max_tokens: int = 16
    """New tokens at most."""
    sampling: Sampling | None = None
    """None: greedy."""
    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end the sequence (kept in its output); None: the model's eos tokens."""


class RequestError(InputError):
    """A request the protocol refuses: its HTTP status, message and the parameter."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass(frozen=True)
class Completion:
    """One parsed generation request, whichever protocol it came in."""

    request: GenerationRequest
    """What the scheduler runs."""
    stream: bool
    """Answer as server-sent events."""
    stop_strings: tuple[str, ...] = ()
    """Text that ends the sequence (cut from the output; needs a tokenizer)."""


def openai_error(message: str, status: int, param: str | None = None,
                 code: str | None = None) -> dict:
    """OpenAI's error body."""
    kind = {400: "invalid_request_error", 404: "NotFoundError", 413: "invalid_request_error",
            503: "server_overloaded", 504: "timeout"}.get(status, "server_error")
    return {"error": {"message": v2.cut(message, 1000), "type": kind, "param": param,
                      "code": code}}


def _json_object(body: bytes) -> dict:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"the body is not valid JSON: {v2.cut(str(exc), 200)}") from None
    if not isinstance(doc, dict):
        raise RequestError(f"the body must be a JSON object, got {type(doc).__name__}")
    return doc


def _int(doc: dict, key: str, default, low: int, high: int | None = None):
    value = doc.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{key}: expected an integer, got {v2.cut(repr(value), 60)}",
                           param=key)
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise RequestError(f"{key}: expected {bound}, got {value}", param=key)
    return value


def _float(doc: dict, key: str, default: float, low: float, high: float,
           low_open: bool = False) -> float:
    value = doc.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value) or value > high or value < low or \
            (low_open and value == low):
        side = "(" if low_open else "["
        raise RequestError(f"{key}: expected a number in {side}{low}, {high}], got "
                           f"{v2.cut(repr(value), 60)}", param=key)
    return float(value)


def _token_ids(value, key: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RequestError(f"{key}: expected a list of token ids (integers)", param=key)
    return tuple(value)


def _stops(value, tokenizer) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or \
            len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop: expected a non-empty string or up to {MAX_STOP_STRINGS} "
                           f"of them, each at most {MAX_STOP_CHARS} characters", param="stop")
    if stops and tokenizer is None:
        raise RequestError("stop: stop strings need text, and this model ships no "
                           "tokenizer; give stop_token_ids instead", param="stop")
    return tuple(stops)


def _prompt(value, tokenizer, key: str) -> tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]   # a batch of one
    if isinstance(value, str):
        if tokenizer is None:
            raise RequestError(f"{key}: this model ships no tokenizer; give the prompt as "
                               f"token ids (a list of integers)", param=key)
        return tuple(tokenizer.encode(value).ids)
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        raise RequestError(f"{key}: one prompt per request (got a batch of {len(value)})",
                           param=key)
    return _token_ids(value, key)


def _request(doc: dict, prompt: tuple[int, ...], default_temperature: float,
             default_max_tokens: int) -> GenerationRequest:
    temperature = _float(doc, "temperature", default_temperature, 0.0, 100.0)
    top_p = _float(doc, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _int(doc, "top_k", 0, -1)
    seed = _int(doc, "seed", None, -(2**63), 2**63 - 1)
    max_tokens = _int(doc, "max_tokens", default_max_tokens, 1)
    stop_ids = doc.get("stop_token_ids")
    stop_ids = None if stop_ids is None else _token_ids(stop_ids, "stop_token_ids")
    if doc.get("ignore_eos") is True:
        stop_ids = stop_ids or ()
    sampling = None if temperature == 0 else Sampling(
        temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
        seed=None if seed is None else seed % 2**63)
    return GenerationRequest(prompt, max_tokens, sampling, stop_ids)


# OpenAI parameters whose other values this server does not implement: refused, never
# silently ignored.
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None,
                "presence_penalty": 0, "frequency_penalty": 0}


def parse_openai(body: bytes, model_name: str, tokenizer) -> Completion:
    """A `POST /v1/completions` body (RequestError naming the parameter)."""
    doc = _json_object(body)
    model = doc.get("model")
    if model is not None and model != model_name:
        raise RequestError(f"The model {v2.cut(repr(model), 100)} does not exist (this "
                           f"server serves {model_name!r})", 404, "model", "model_not_found")
    for key, default in _UNSUPPORTED.items():
        if doc.get(key, default) not in (default, None):
            raise RequestError(f"{key}: only {default!r} is supported", param=key)
    if "prompt" not in doc:
        raise RequestError("prompt: required", param="prompt")
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream: expected true or false", param="stream")
    return Completion(_request(doc, _prompt(doc["prompt"], tokenizer, "prompt"), 1.0, 16),
                      stream, _stops(doc.get("stop"), tokenizer))


def parse_v2_generate(body: bytes, tokenizer, stream: bool) -> Completion:
    """A v2 `generate` / `generate_stream` body: `input_ids` or `text_input`, and a
    `parameters` object (RequestError naming the field)."""
    doc = _json_object(body)
    parameters = doc.get("parameters", {})
    if not isinstance(parameters, dict):
        raise RequestError("parameters: expected a JSON object", param="parameters")
    if ("input_ids" in doc) == ("text_input" in doc):
        raise RequestError("give exactly one of input_ids (token ids) and text_input")
    if "text_input" in doc:
        if not isinstance(doc["text_input"], str):
            raise RequestError("text_input: expected a string", param="text_input")
        prompt = _prompt(doc["text_input"], tokenizer, "text_input")
    else:
        prompt = _token_ids(doc["input_ids"], "input_ids")
    return Completion(_request(parameters, prompt, 0.0, 16), stream,
                      _stops(parameters.get("stop"), tokenizer))


def sse(doc) -> bytes:
    """One server-sent event carrying `doc` as JSON (or the text [DONE])."""
    data = doc if isinstance(doc, str) else json.dumps(doc, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class TextStream:
    """Token ids -> the text to send so far, holding back what may still become a stop
    string or an incomplete character; `stopped` once a stop string appeared (the text
    is cut before it)."""

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.sent = 0          # characters of the text already handed out
        self.stopped = False
        self.text = ""

    def push(self, token: int) -> str:
        """Add a token; the new text that is safe to send."""
        self.ids.append(token)
        if self.tokenizer is None:
            return ""
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stops:
            at = self.text.find(stop)
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
        if self.stopped:
            return self.flush()
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe -= 1
        for stop in self.stops:  # a suffix that begins a stop string waits
            for size in range(min(len(stop) - 1, safe), 0, -1):
                if self.text[:safe].endswith(stop[:size]):
                    safe -= size
                    break
        piece = self.text[self.sent:max(safe, self.sent)]
        self.sent += len(piece)
        return piece

    def flush(self) -> str:
        """The rest of the text (at the end)."""
        piece = self.text[self.sent:]
        self.sent = len(self.text)
        return piece
