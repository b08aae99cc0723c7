"""One inference request's way through a replica, written once for every transport
(the `InferSeam` of dynvm.cluster.protocol._seam): admission (the drain and the in-flight
bound, Note [Replica drain] in dynvm.cluster.serving._deployment), the request counted
in flight, execution through the batcher with the transport's encoder (small responses
encoded on the worker thread, Note [Lean request path] in dynvm.cluster.serving._replica)
and whose fault an error is (Note [Client or server fault] there), counted and, for a
server fault, logged with an error id on a span of the request's trace. HTTP renders the
resulting Fault as 400/503/500, gRPC as INVALID_ARGUMENT/UNAVAILABLE/INTERNAL.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from opentelemetry import propagate
from opentelemetry import trace as otel_trace

from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._seam import Encoder, Fault, FaultKind, record_server_fault
from dynvm.cluster.serving._batcher import Overloaded
from dynvm.cluster.serving._limits import ServingLimits
from dynvm.cluster.serving._replica_exec import ReplicaExecutor
from dynvm.cluster.serving._replica_stats import ReplicaStats
from dynvm.vm.errors import ExecutionError, InputError, ShapeError

R = TypeVar("R")


def is_client_fault(error: BaseException) -> bool:
    """Whether a model call's error is the request's fault (Note [Client or server
    fault])."""
    if isinstance(error, ShapeError | InputError):
        return True
    return isinstance(error, ExecutionError) and isinstance(error.__cause__, IndexError)


def fault_of(exc: BaseException, model_name: str) -> Fault | None:
    """The CLIENT or BUSY fault `exc` is for a request to `model_name`, or None for a
    server fault (Note [Client or server fault]): a ProtocolError as it is, a model's
    own client fault as a BadRequest naming the model, Overloaded (the batcher's queue
    is full: max_queued) as BUSY."""
    if isinstance(exc, Overloaded):
        return Fault(FaultKind.BUSY, str(exc), exc)
    if is_client_fault(exc):
        exc = v2.BadRequest(f"model {model_name!r}: {exc}")
    if isinstance(exc, v2.ProtocolError):
        return Fault(FaultKind.CLIENT, exc.message, exc)
    return None


class ReplicaSeam:
    """The InferSeam of one model replica: its executor, request counters, limits,
    telemetry and parse threads. `draining` turns true once the replica stops taking
    requests (`ReplicaServer.begin_drain`)."""

    def __init__(self, model_name: str, executor: ReplicaExecutor, stats: ReplicaStats,
                 limits: ServingLimits, telemetry, parse_pool: ThreadPoolExecutor) -> None:
        self.model_name = model_name
        self.executor = executor
        self.stats = stats
        self.limits = limits
        self.telemetry = telemetry
        self.parse_pool = parse_pool
        self.draining = False

    def admit(self) -> Fault | None:
        """Bounded concurrency: past the limit, a quick BUSY the client may retry, instead
        of one more body held in memory and one more request queued behind the others."""
        if self.draining:
            return Fault(FaultKind.BUSY, "shutting down on this replica; retry another",
                         Overloaded("shutting down on this replica; retry another"),
                         draining=True)
        limit = self.limits.max_concurrent_requests
        if self.stats.full(limit):
            self.stats.counters.rejected_busy += 1
            why = f"{self.stats.in_flight} requests in flight on this replica, the limit is " \
                  f"{limit}"
            return Fault(FaultKind.BUSY, why, Overloaded(why))
        return None

    async def serve(self, work: Callable[[], Awaitable[R]], trace: dict | None) -> R | Fault:
        """`work()`'s response, counted in flight; its exception as a counted Fault."""
        with self.stats.tracked():
            try:
                return await work()
            except Exception as exc:  # every error becomes this request's answer
                return self.fault(exc, trace)

    def fault(self, exc: Exception, trace: dict | None) -> Fault:
        """Whose fault `exc` is (`fault_of`), counted; a server fault (CallBudgetError
        included) is logged with an error id, traced."""
        fault = fault_of(exc, self.model_name)
        if fault is not None and fault.kind is FaultKind.BUSY:
            self.stats.counters.rejected_busy += 1
            return fault
        self.stats.counters.errors += 1
        return fault if fault is not None else self._server_fault(exc, trace)

    def _server_fault(self, exc: Exception, trace: dict | None) -> Fault:
        """A SERVER fault whose error id the trace carries too, on a
        `dynvm.request.error` span (child of the request's traceparent)."""
        where = f"model {self.model_name!r}"
        telemetry = self.telemetry
        if telemetry is None or not telemetry.enabled:
            return record_server_fault(where, exc)
        parent = propagate.extract(trace) if trace is not None else None
        with telemetry.tracer.start_as_current_span("dynvm.request.error", context=parent) \
                as span:
            span.set_status(otel_trace.StatusCode.ERROR)
            return record_server_fault(where, exc)

    async def execute(self, request: v2.InferRequest, trace: dict | None,
                      encoder: Encoder[R]) -> R:
        """`request` through the batcher; its response (encoded on the worker when small,
        else on the parse threads), or raises its error."""
        outcome = await self.executor.submit(request, trace, encoder)
        if outcome.error is not None:
            raise outcome.error
        if outcome.response is not None:  # Note [Lean request path]
            return outcome.response
        return await self.off_loop(encoder.encode, outcome.outputs, request)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` on the replica's parse threads: decoding a body or encoding a response
        never blocks the event loop that serves the other requests."""
        return await asyncio.get_running_loop().run_in_executor(
            self.parse_pool, functools.partial(fn, *args))
