"""HTTP error responses of the v2 routes: the protocol's `{"error": "..."}` body for
every status, and an error id on every server fault (docs/ARCHITECTURE.md, Conventions 11).

A server fault (a 5xx) gets a fresh id that is in the response body, in the
`Dynvm-Error-Id` header, in the replica's log line (with the traceback) and, when the
request is traced, on the current span; an operator finds the one from the other.
"""

from __future__ import annotations

import json

from fastapi.responses import Response

from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._seam import Fault, FaultKind, record_server_fault

ERROR_ID_HEADER = "Dynvm-Error-Id"


def error_response(error: BaseException | str, status: int,
                   headers: dict[str, str] | None = None) -> Response:
    """The protocol's error body with `status` (and extra `headers`)."""
    return Response(v2.error_body(error), status_code=status, headers=headers,
                    media_type="application/json")


def json_response(obj, status: int = 200) -> Response:
    """`obj` as a JSON response."""
    return Response(json.dumps(obj).encode(), status_code=status,
                    media_type="application/json")


def server_fault(where: str, exc: BaseException, status: int = 500) -> Response:
    """Log `exc` with a new error id and answer `status` naming the id."""
    fault = record_server_fault(where, exc)
    return error_response(fault.message, status, {ERROR_ID_HEADER: fault.error_id})


def fault_response(fault: Fault, model_name: str, retry_after_s: int) -> Response:
    """An inference request's Fault as HTTP: the ProtocolError's 4xx, 503 + Retry-After
    when the replica is full (and Connection: close when it drains), 500 + the error id."""
    if fault.kind is FaultKind.CLIENT:
        return error_response(fault.error, fault.error.status)
    if fault.kind is FaultKind.BUSY:
        if fault.draining:
            return error_response(
                f"model {model_name!r} is shutting down on this replica; retry another "
                f"(after {retry_after_s} s)", 503,
                {"Retry-After": str(retry_after_s), "Connection": "close"})
        return error_response(f"model {model_name!r} is busy: {fault.message}; retry after "
                              f"{retry_after_s} s", 503, {"Retry-After": str(retry_after_s)})
    return error_response(fault.message, 500, {ERROR_ID_HEADER: fault.error_id})
