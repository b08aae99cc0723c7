"""The seam between a transport and a replica's execution, the same for HTTP and gRPC:
what a transport hands the replica (a validated request, its trace context and an
`Encoder` that turns outputs into the transport's response) and what it gets back (the
response, or a `Fault` it renders in its own terms: HTTP 4xx/503/500, gRPC
INVALID_ARGUMENT/UNAVAILABLE/INTERNAL).

`InferSeam` is the interface a transport calls; a model replica implements it once
(dynvm.cluster.serving._infer_seam: the in-flight bound, the drain, the fault mapping of
Note [Client or server fault] in dynvm.cluster.serving._replica). The transports
(the replica's HTTP routes, grpc_v2.GrpcInference) know this module and nothing of the
replica's internals, so no transport imports the serving floor back.
"""

from __future__ import annotations

import enum
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from opentelemetry import trace as otel_trace

from dynvm.cluster.protocol import _v2 as v2
from dynvm.vm.program import InputSpec

# The logger every transport's server faults go to (its name is the one operators
# filter on since the HTTP routes came first).
logger = logging.getLogger("dynvm.cluster.http")

R = TypeVar("R")


class FaultKind(enum.Enum):
    """Whose fault a request's failure is, which decides every transport's answer."""

    CLIENT = "client"
    """The request's: HTTP its ProtocolError's 4xx, gRPC INVALID_ARGUMENT and kin."""
    BUSY = "busy"
    """Nobody's: the replica is full or draining; HTTP 503 + Retry-After, gRPC UNAVAILABLE."""
    SERVER = "server"
    """The server's: logged with an error id; HTTP 500, gRPC INTERNAL."""


@dataclass(frozen=True)
class Fault:
    """A request's failure, classified once, for a transport to render."""

    kind: FaultKind
    """Whose fault it is."""
    message: str
    """CLIENT: the ProtocolError's message; BUSY: why the replica refused (without the
    model's name); SERVER: the message naming the error id."""
    error: BaseException
    """What the request raised (CLIENT: the v2.ProtocolError to answer, a model's own
    client fault rewritten as a BadRequest naming the model)."""
    error_id: str | None = None
    """SERVER: the id in the log line, the response and the trace."""
    draining: bool = False
    """BUSY: refused because the replica is shutting down (clients retry another)."""


class Encoder(Protocol[R]):
    """How one transport answers a successful inference: the executor may call `encode`
    on the batcher's worker thread right after the batch (Note [Lean request path] in
    dynvm.cluster.serving._replica)."""

    def encode(self, outputs: list, request: v2.InferRequest) -> R:
        """The response carrying `outputs` (the requested ones); raises v2.ProtocolError
        for a client fault (an unknown output name)."""
        ...


class InferSeam(Protocol):
    """What a transport calls to run one inference request on a replica."""

    def admit(self) -> Fault | None:
        """None when a new request may start; else the BUSY fault to answer at once
        (draining, or the in-flight bound reached)."""
        ...

    async def serve(self, work: Callable[[], Awaitable[R]], trace: dict | None) -> R | Fault:
        """`work()`'s response, counted in flight; any exception it raises becomes
        this request's Fault (counted, a server fault logged with an id and traced)."""
        ...

    async def execute(self, request: v2.InferRequest, trace: dict | None,
                      encoder: Encoder[R]) -> R:
        """`request` run through the batcher, its outputs encoded by `encoder`;
        raises the request's error."""
        ...

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the replica's parse threads (never on the event loop)."""
        ...


@dataclass(frozen=True)
class RequestParsing:
    """How a replica validates a request body (HTTP's, or the one a gRPC message stands
    for: Note [gRPC requests through the HTTP validator] in grpc_v2)."""

    inputs: Sequence[InputSpec]
    """The program's inputs."""
    output_names: Sequence[str] | None
    """The model's output names when known (an unknown requested output fails early)."""
    max_body_bytes: int
    """The body limit (ServingConfig.max_body_bytes)."""
    refuse_non_finite: bool
    """ServingLimits.refuse_non_finite."""

    def parse(self, body: bytes, header_length: str | None) -> v2.InferRequest:
        """The validated request of `body`; raises v2.ProtocolError."""
        return v2.parse_infer_request(body, self.inputs, header_length=header_length,
                                      max_body_bytes=self.max_body_bytes,
                                      output_names=self.output_names,
                                      refuse_non_finite=self.refuse_non_finite)


def new_error_id() -> str:
    """A fresh id for one server fault (16 hex digits)."""
    return secrets.token_hex(8)


def record_server_fault(where: str, exc: BaseException) -> Fault:
    """Log `exc` with a new error id (and put it on the current span, if recording): the
    SERVER fault naming the id (docs/ARCHITECTURE.md, Conventions 11)."""
    error_id = new_error_id()
    logger.error("%s: error id %s: %s: %s", where, error_id, type(exc).__name__, exc,
                 exc_info=exc)
    span = otel_trace.get_current_span()
    if span.is_recording():
        span.set_attribute("dynvm.error_id", error_id)
        span.record_exception(exc)
    message = (f"{where}: server error (error id {error_id}): "
               f"{type(exc).__name__}: {v2.cut(str(exc), 500)}")
    return Fault(FaultKind.SERVER, message, exc, error_id)
