"""A tiny generator saved as `dynvm serve` takes it (exported once per test session),
its word-level tokenizer, and a generator replica behind a real HTTP server in this
process (uvicorn on a thread: no Ray), for the generation serving tests."""

from __future__ import annotations

import asyncio
import threading
import time

import torch


def tiny_programs():
    """The tiny Llama-style generator's programs (tests/generation/_tiny.py): the step
    over the KV cache as state in compile_generator's default packed form and the pure
    prefill and decode, exported once per session and shared with tests/generation (the
    export is most of these tests' time)."""
    from tests.generation._tiny import tiny_generator

    return tiny_generator("llama")[1]


def word_tokenizer(vocab: int = 128):
    """A `tokenizers.Tokenizer` with one word per id: <pad> <s> </s> w3 ... w{vocab-1};
    text is the words joined by spaces, so ids and text map one to one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<pad>", "<s>", "</s>"])
    return tokenizer


def words(ids) -> str:
    """The text word_tokenizer gives these ids (special ones skipped)."""
    return " ".join(f"w{i}" for i in ids if i >= 3)


def saved_generator(directory, tokenizer: bool = True):
    """The tiny generator written to `directory` (with the word tokenizer)."""
    from dynvm._serve_generate_bundle import save_generator

    return save_generator(tiny_programs(), directory,
                          tokenizer=word_tokenizer() if tokenizer else None)


def reference(prompt, max_tokens: int, sampling=None, stop_tokens=None) -> list[int]:
    """What `Generator.generate` gives for one prompt (the interpreter)."""
    import dynvm

    with dynvm.Generator(tiny_programs(), jit=False, compile_ahead=False,
                         kv_state=False) as generator:
        out = generator.generate(torch.tensor([list(prompt)]), max_new_tokens=max_tokens,
                                 sampling=sampling, stop_tokens=stop_tokens)
    return out[0, len(prompt):].tolist()


class HttpServer:
    """`server` (an object with `async __call__(Request) -> Response`, as Serve calls a
    replica) behind uvicorn on a free loopback port, on a thread of its own."""

    def __init__(self, server) -> None:
        import uvicorn
        from starlette.requests import Request

        from tests.cluster._cluster_helpers import free_port

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            response = await server(Request(scope, receive))
            await response(scope, receive, send)

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._uvicorn.serve()),
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._uvicorn.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def close(self) -> None:
        """Stop the server and wait for its thread."""
        self._uvicorn.should_exit = True
        self._thread.join(10)
