"""HTTP error responses of the v2 routes: the protocol's `{"error": "..."}` body for
every status, and an error id on every server fault (docs/ARCHITECTURE.md, Conventions 11).

A server fault (a 5xx) gets a fresh id that is in the response body, in the
`Dynvm-Error-Id` header, in the replica's log line (with the traceback) and, when the
request is traced, on the current span; an operator finds the one from the other.
"""

from __future__ import annotations

import json
import logging
import secrets

from fastapi.responses import Response
from opentelemetry import trace

from dynvm.cluster.protocol import _v2 as v2

ERROR_ID_HEADER = "Dynvm-Error-Id"
logger = logging.getLogger("dynvm.cluster.http")


def error_response(error: BaseException | str, status: int,
                   headers: dict[str, str] | None = None) -> Response:
    """The protocol's error body with `status` (and extra `headers`)."""
    return Response(v2.error_body(error), status_code=status, headers=headers,
                    media_type="application/json")


def json_response(obj, status: int = 200) -> Response:
    """`obj` as a JSON response."""
    return Response(json.dumps(obj).encode(), status_code=status,
                    media_type="application/json")


def new_error_id() -> str:
    """A fresh id for one server fault (16 hex digits)."""
    return secrets.token_hex(8)


def server_fault(where: str, exc: BaseException, status: int = 500) -> Response:
    """Log `exc` with a new error id and answer `status` naming the id."""
    error_id = new_error_id()
    logger.error("%s: error id %s: %s: %s", where, error_id, type(exc).__name__, exc,
                 exc_info=exc)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("dynvm.error_id", error_id)
        span.record_exception(exc)
    message = (f"{where}: server error (error id {error_id}): "
               f"{type(exc).__name__}: {v2.cut(str(exc), 500)}")
    return error_response(message, status, {ERROR_ID_HEADER: error_id})
