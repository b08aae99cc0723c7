"""What every v2 application (a model's, the server's) shares over HTTP: naming, body
reading within limits, the route-prefix fix, the plain router's path split and misses
(Note [Plain __call__ routing], dynvm.cluster.serving._replica), and the protocol's
`{"error": ...}` body for errors that FastAPI or Starlette raise themselves (404, 405,
validation), so that no route answers with FastAPI's `{"detail": ...}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import RedirectResponse, Response

from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._http_errors import error_response, server_fault
from dynvm.vm.errors import ConfigError

MODEL_VERSION = "1"
SERVER_APP = "dynvm-server"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class HttpEncoder:
    """The v2 HTTP infer response of a model's outputs, JSON or the binary extension (an
    `Encoder` of dynvm.cluster.protocol._seam): (body, headers)."""

    model_name: str
    """The model the response names."""

    def encode(self, outputs, request: v2.InferRequest) -> tuple[bytes, dict[str, str]]:
        """The response body and headers; raises v2.ProtocolError (an unknown output)."""
        return v2.build_infer_response(self.model_name, MODEL_VERSION, outputs, request)


def model_app_name(model_name: str) -> str:
    """The Serve application name of a model."""
    return f"dynvm-model-{model_name}"


def check_model_name(name: str) -> str:
    """`name` if it is a valid model name (it becomes a route), else ConfigError."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(f"model name {v2.cut(repr(name))} must match {_NAME_RE.pattern}")
    return name


async def read_body(request: Request, limit: int) -> bytearray:
    """The body, refused (413) as soon as its declared or read size passes `limit`. With
    a Content-Length, read into a buffer of exactly that size: a growing buffer would
    briefly hold two copies of a large body each time it is reallocated. A client that
    goes away mid-body is a client fault (400), not a server one."""
    try:
        return await _read_body(request, limit)
    except ClientDisconnect:
        raise v2.BadRequest("the client disconnected before the end of the body") from None


async def _read_body(request: Request, limit: int) -> bytearray:
    declared = v2.parse_length(request.headers.get("content-length"))
    if declared is None:
        body = bytearray()
        async for chunk in request.stream():
            v2.check_body_size(len(body) + len(chunk), limit)
            body += chunk
        return body
    v2.check_body_size(declared, limit)
    body = bytearray(declared)
    view = memoryview(body)
    size = 0
    async for chunk in request.stream():
        end = size + len(chunk)
        if end > declared:
            raise v2.BadRequest(f"the body is longer than its Content-Length ({declared})")
        view[size:end] = chunk
        size = end
    view.release()
    if size != declared:
        raise v2.BadRequest(f"the body ended after {size} bytes, its Content-Length is "
                            f"{declared}")
    return body


def route_path(scope) -> tuple[str | None, str | None]:
    """(route, version) of a request inside its application: the path after the route
    prefix (Serve's root_path), with a leading /versions/<version> taken off; route None
    when the path is not under the prefix or names an empty version."""
    path = scope["path"]
    root = scope.get("root_path", "")
    if not path.startswith(root):
        return None, None
    route = path[len(root):]
    if not route.startswith("/versions/"):
        return route, None
    version, slash, rest = route[len("/versions/"):].partition("/")
    if not version:
        return None, None
    return slash + rest, version


def route_miss(request: Request, route: str | None, version: str | None,
               routes: dict, versioned_routes: dict) -> Response:
    """The answer to a request no (route, method) of the tables serves, as FastAPI gave
    it: 405 with Allow when the route exists for another method, 307 to the path without
    its trailing slash when that one exists, else 404."""
    table = versioned_routes if version is not None else routes
    path = v2.cut(request.url.path)
    methods = table.get(route) if route is not None else None
    if methods is not None:
        allowed = ", ".join(methods)
        return error_response(f"method {v2.cut(request.method, 20)} is not allowed on {path} "
                              f"(allowed: {allowed})", 405, {"Allow": allowed})
    if route is not None and route.endswith("/") and route[:-1] in table:
        url = request.url
        return RedirectResponse(url.replace(path=url.path[:-1]), status_code=307)
    return error_response(f"no route {path}", 404)


def bytes_response(body: bytes, headers: dict[str, str]) -> Response:
    """A 200 with the already encoded `body` and its `headers` (Content-Type among them),
    handed to Starlette as they are: no copy of the headers, no media type to add."""
    return Response(body, 200, headers)


class RootWithoutSlash:
    """ASGI middleware: `/v2/models/<name>` (the app's route prefix itself, no trailing
    slash) is routed like `/v2/models/<name>/` instead of answered with a 307 redirect."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            root = scope.get("root_path", "")
            if scope["path"] in ("", root):
                scope = dict(scope, path=root + "/")
        await self.app(scope, receive, send)


def protocol_app(title: str) -> FastAPI:
    """A FastAPI app whose every error answer is the protocol's body."""
    app = FastAPI(title=title, openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(RootWithoutSlash)

    async def http_error(request: Request, exc: StarletteHTTPException):
        path = v2.cut(request.url.path)
        if exc.status_code == 404:
            message = f"no route {path}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
            message = (f"method {v2.cut(request.method, 20)} is not allowed on {path}"
                       + (f" (allowed: {allowed})" if allowed else ""))
        else:
            message = v2.cut(str(exc.detail), 200)
        return error_response(message, exc.status_code, dict(exc.headers or {}))

    async def invalid(request: Request, exc: RequestValidationError):
        return error_response(f"bad request to {v2.cut(request.url.path)}: "
                              f"{v2.cut(str(exc.errors()), 200)}", 400)

    async def fault(request: Request, exc: Exception):
        return server_fault(f"{v2.cut(request.method, 20)} {v2.cut(request.url.path)}", exc)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(Exception, fault)
    return app
