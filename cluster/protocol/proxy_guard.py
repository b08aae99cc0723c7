"""`ProxyGuard`: an ASGI middleware that runs inside Ray Serve's HTTP proxy, in front of
every route, so that limits hold before anything is buffered.

Note [Limits at the proxy]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Serve's proxy reads a request's body from the client as fast as it comes and queues it
for the replica, whatever the replica does with it: a replica that refused a 200 MB
chunked body with a 413 at 64 MiB had already let the proxy buffer 183 MB (and keep
~250 MB). So the limits that protect memory and connections are enforced here, in the
proxy process, through `HTTPOptions.middlewares`:

- a declared Content-Length over `max_body_bytes` is answered 413 before the body is
  read at all; a chunked body is counted as it arrives and refused (413) the moment it
  passes the limit: the proxy holds at most the limit;
- the body must arrive within `body_timeout_s` of the request's start, whatever the
  client declared: a client that sends a byte at a time, or declares more than it sends,
  gets a 408 and the request is dropped (the replica's handler is cancelled);
- an error the proxy produces itself (no route, a replica gone, overload) is rewritten
  into the protocol's `{"error": ...}` body, with an error id for a 5xx (logged here).

Serve 2.60 takes proxy middlewares only from the variable
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (`ProxyLimits.environment`), which `dynvm
serve` sets before it starts Ray; a Serve config deployment sets it on every node.

Per model limits (`max_body_bytes` of a model, lower than the proxy's) stay with the
replica. What the middleware cannot reach: uvicorn reads the request line and headers
before any ASGI code runs, and has no header timeout; a client that never finishes its
headers holds a connection (not a worker, nor body memory) until it disconnects.
`keep_alive_timeout_s` (uvicorn's) bounds idle keep-alive connections.

In Serve's direct ingress (Note [Direct ingress] in dynvm.cluster.protocol.ingress) there is no
proxy in a request's path: Serve builds each ingress replica's own uvicorn server from
the same HTTPOptions, these middlewares and the keep-alive bound included, so the guard
runs in the replica's process and every limit above holds there unchanged (tested in
tests/cluster/test_direct_ingress.py); what it protects is then the replica's memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass

from dynvm._env import PROXY_BODY_TIMEOUT_S, PROXY_MAX_BODY_BYTES, proxy_settings
from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._http_errors import ERROR_ID_HEADER
from dynvm.cluster.protocol._seam import new_error_id
from dynvm.vm.errors import ConfigError

logger = logging.getLogger("dynvm.cluster.proxy")
PROXY_CALLBACK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"  # Ray Serve's variable
GRPC_MAX_MESSAGE = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"  # Ray Serve's, read by its gRPC proxy
CALLBACK_PATH = "dynvm.cluster.protocol.proxy_guard:proxy_middlewares"
# Note [Proxy ready check]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Serve's controller gives a starting proxy 5 s to answer its ready check, then kills
# it. This proxy loads dynvm's protocol module (and torch with it: 1.3-1.8 s on an idle
# 2-core host) to build its middleware, and on a loaded host its start passed 5 s:
# `serve.start` failed with the proxy actor "killed by ray.kill" before it ran (a
# whole-suite rehearsal at load 4-6, 12 module setups). The controller reads this
# variable when it starts, so it goes with the others in `environment()`.
PROXY_READY_CHECK = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_CHECK_S = 30.0
_JSON = b"application/json"


@dataclass(frozen=True)
class ProxyLimits:
    """Limits of the HTTP proxy, for every model it routes to (Note [Limits at the
    proxy])."""

    max_body_bytes: int = v2.DEFAULT_MAX_BODY_BYTES
    """Largest request body the proxy accepts (a model may accept less)."""
    body_timeout_s: float = 30.0
    """The whole body must have arrived this long after the request started."""
    keep_alive_timeout_s: int = 5
    """An idle keep-alive connection is closed after this many seconds (uvicorn's)."""

    def __post_init__(self) -> None:
        if type(self.max_body_bytes) is not int or self.max_body_bytes < 1:
            raise ConfigError(f"ProxyLimits.max_body_bytes must be an integer >= 1, "
                             f"got {self.max_body_bytes!r}")
        for name in ("body_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"ProxyLimits.{name} must be a finite number > 0, "
                                 f"got {value!r}")

    @classmethod
    def from_env(cls) -> ProxyLimits:
        """The defaults, overridden by DYNVM_PROXY_* (dynvm._env.proxy_settings)."""
        settings = proxy_settings()
        overrides = {"max_body_bytes": settings.max_body_bytes,
                     "body_timeout_s": settings.body_timeout_s}
        return cls(**{k: v for k, v in overrides.items() if v is not None})

    def environment(self) -> dict[str, str]:
        """The variables that make Serve's proxies apply these limits: set them in the
        environment of the process that starts Ray (its proxies inherit them) before
        `ray.init`. Serve (2.60) takes HTTP proxy middlewares only from
        RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, not from `serve.start`; its gRPC
        server's message limit (both directions, Serve's one setting) only from
        RAY_SERVE_GRPC_MAX_MESSAGE_SIZE, which grpc checks against a message's length
        prefix before it buffers the message: RESOURCE_EXHAUSTED, no handler run. And
        the controller's ready check of a starting proxy, longer than Serve's 5 s
        (Note [Proxy ready check])."""
        return {PROXY_CALLBACK: CALLBACK_PATH,
                PROXY_READY_CHECK: repr(PROXY_READY_CHECK_S),  # Note [Proxy ready check]
                PROXY_MAX_BODY_BYTES: str(self.max_body_bytes),
                PROXY_BODY_TIMEOUT_S: repr(float(self.body_timeout_s)),
                GRPC_MAX_MESSAGE: str(self.max_body_bytes)}

    def http_options(self, host: str, port: int) -> dict:
        """`http_options` for `serve.start`: the address and keep-alive bound."""
        return {"host": host, "port": port,
                "keep_alive_timeout_s": max(1, math.ceil(self.keep_alive_timeout_s))}


def proxy_middlewares() -> list:
    """Serve's proxy calls this (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, see
    `ProxyLimits.environment`); limits from DYNVM_PROXY_*. For a Serve config file, set
    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=dynvm.cluster.protocol.proxy_guard:proxy_middlewares
    on every node."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyGuard, limits=ProxyLimits.from_env())]


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class ProxyGuard:
    """ASGI middleware enforcing ProxyLimits in Serve's proxy."""

    def __init__(self, app, limits: ProxyLimits | None = None) -> None:
        self.app = app
        self.limits = limits if limits is not None else ProxyLimits()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        declared = v2.parse_length((_header(scope, b"content-length") or b"").decode("latin-1")
                                   or None)
        if declared is not None and declared > limit:
            await _answer(send, 413, f"request body is {declared} bytes, the limit is {limit}")
            return
        await _Exchange(self.app, scope, receive, send, self.limits).run()


async def _answer(send, status: int, message: str, headers: list | None = None) -> None:
    body = v2.error_body(message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", _JSON),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class _Exchange:
    """One request through the guard: a counted, timed `receive`; a `send` that turns
    non-protocol error bodies into the protocol's."""

    def __init__(self, app, scope, receive, send, limits: ProxyLimits) -> None:
        self.app, self.scope, self._receive, self._send = app, scope, receive, send
        self.limits = limits
        self.deadline = time.monotonic() + limits.body_timeout_s
        self.size = 0
        self.body_done = False
        self.refused = False       # the guard answered; the app's answer is dropped
        self.started = False       # a response start went to the client
        self.held: dict | None = None  # an error start whose body is being rewritten
        self.held_body = bytearray()

    async def run(self) -> None:
        await self.app(self.scope, self.receive, self.send)

    async def _refuse(self, status: int, message: str) -> dict:
        if not self.started and not self.refused:
            self.refused = True
            await _answer(self._send, status, message)
        return {"type": "http.disconnect"}

    async def receive(self) -> dict:
        if self.refused:
            return {"type": "http.disconnect"}
        if self.body_done:  # after the body, only a disconnect can come: no deadline
            return await self._receive()
        remaining = self.deadline - time.monotonic()
        try:
            message = await asyncio.wait_for(self._receive(), max(remaining, 0.001))
        except TimeoutError:
            return await self._refuse(408, f"the request body did not arrive within "
                                           f"{self.limits.body_timeout_s:g} s "
                                           f"({self.size} bytes received)")
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.limits.max_body_bytes:
                return await self._refuse(413, f"request body is more than "
                                               f"{self.limits.max_body_bytes} bytes, "
                                               f"the limit is {self.limits.max_body_bytes}")
            self.body_done = not message.get("more_body", False)
        return message

    async def send(self, message: dict) -> None:
        if self.refused:
            return
        kind = message["type"]
        if kind == "http.response.start":
            headers = dict(message.get("headers", ()))
            content_type = headers.get(b"content-type", b"")
            if message["status"] >= 400 and not content_type.startswith(_JSON):
                self.held = message  # the proxy's own error page: rewritten below
                return
            self.started = True
        elif kind == "http.response.body" and self.held is not None:
            self.held_body += message.get("body", b"")
            if message.get("more_body", False):
                return
            await self._send_rewritten()
            return
        await self._send(message)

    async def _send_rewritten(self) -> None:
        status = self.held["status"]
        text = v2.cut(bytes(self.held_body).decode("utf-8", "replace").strip(), 300)
        headers = [(k, v) for k, v in self.held.get("headers", ())
                   if k.lower() not in (b"content-type", b"content-length")]
        if status >= 500:
            error_id = new_error_id()
            logger.error("proxy answered %s for %s: error id %s: %s", status,
                         v2.cut(self.scope.get("path", "")), error_id, text)
            text = f"server error (error id {error_id}): {text}"
            headers.append((ERROR_ID_HEADER.lower().encode(), error_id.encode()))
        body = json.dumps({"error": text}).encode()
        self.started = True
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [*headers, (b"content-type", _JSON),
                                      (b"content-length", str(len(body)).encode())]})
        await self._send({"type": "http.response.body", "body": body})
