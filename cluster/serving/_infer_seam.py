"""One inference request's way through a replica, written once for every transport
(the `InferSeam` of dynvm.cluster.protocol._seam): admission (the drain and the in-flight
bound, Note [Replica drain] in dynvm.cluster.serving._deployment), the request counted
in flight, execution through the batcher with the transport's encoder (small responses
encoded on the worker thread, Note [Lean request path] in dynvm.cluster.serving._replica)
and whose fault an error is (Note [Client or server fault] there), counted and, for a
server fault, logged with an error id on a span of the request's trace. HTTP renders the
resulting Fault as 400/503/500, gRPC as INVALID_ARGUMENT/UNAVAILABLE/INTERNAL.

`RequestGate` is the part of it every replica shares, the generator's
(dynvm.cluster.serving._generate_replica) included: admission, counting and fault mapping;
`ReplicaSeam` adds a model's execution and parse threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from opentelemetry import propagate
from opentelemetry import trace as otel_trace

from dynvm.cluster._counters import RequestCounters
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


class Tally(Protocol):
    """What a gate counts requests with: `ReplicaStats` (an inference replica's, with
    its latency window) or `RequestTally` (a generator's)."""

    in_flight: int
    counters: RequestCounters

    def tracked(self) -> contextlib.AbstractContextManager:
        """Around one request: counted in flight and in `requests`."""
        ...


class RequestTally:
    """A replica's request counters and requests in flight, and nothing else (on the
    event loop only)."""

    def __init__(self) -> None:
        self.counters = RequestCounters()
        self.in_flight = 0

    @contextlib.contextmanager
    def tracked(self):
        """Around one request: counted in flight and in `requests`."""
        self.in_flight += 1
        self.counters.requests += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class RequestGate:
    """Every replica's admission and fault mapping, whatever it runs (a model's
    inference, a generator's completions): the drain, the in-flight bound, requests
    counted in flight, and whose fault an error is (counted; a server fault logged
    with an error id, traced). `classify` is `fault_of` for a model; a generator gives
    its own (its busy and timeout errors). `draining` turns true once the replica
    stops taking requests (`begin_drain`)."""

    def __init__(self, model_name: str, tally: Tally, telemetry, limit: int | None = None,
                 classify: Callable[[BaseException], Fault | None] | None = None) -> None:
        self.model_name = model_name
        self.tally = tally
        self.telemetry = telemetry
        self.limit = limit
        self.classify = (functools.partial(fault_of, model_name=model_name)
                         if classify is None else classify)
        self.draining = False

    def admit(self) -> Fault | None:
        """Bounded concurrency: past the limit, a quick BUSY the client may retry, instead
        of one more body held in memory and one more request queued behind the others."""
        if self.draining:
            return Fault(FaultKind.BUSY, "shutting down on this replica; retry another",
                         Overloaded("shutting down on this replica; retry another"),
                         draining=True)
        limit = self.limit
        if limit is not None and self.tally.in_flight >= limit:
            self.tally.counters.rejected_busy += 1
            why = f"{self.tally.in_flight} requests in flight on this replica, the limit is " \
                  f"{limit}"
            return Fault(FaultKind.BUSY, why, Overloaded(why))
        return None

    def tracked(self) -> contextlib.AbstractContextManager:
        """Around one request whose answer outlives `serve` (a stream): counted in flight."""
        return self.tally.tracked()

    async def serve(self, work: Callable[[], Awaitable[R]], trace: dict | None) -> R | Fault:
        """`work()`'s response, counted in flight; its exception as a counted Fault."""
        with self.tally.tracked():
            try:
                return await work()
            except Exception as exc:  # every error becomes this request's answer
                return self.fault(exc, trace)

    def fault(self, exc: Exception, trace: dict | None) -> Fault:
        """Whose fault `exc` is (`classify`), counted; a server fault (CallBudgetError
        included) is logged with an error id, traced."""
        fault = self.classify(exc)
        if fault is not None and fault.kind is FaultKind.BUSY:
            self.tally.counters.rejected_busy += 1
            return fault
        self.tally.counters.errors += 1
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


class ReplicaSeam:
    """The InferSeam of one model replica: its RequestGate (`admit`, `serve` and `fault`
    are the gate's), its executor (`execute`) and its parse threads (`off_loop`)."""

    def __init__(self, model_name: str, executor: ReplicaExecutor, stats: ReplicaStats,
                 limits: ServingLimits, telemetry, parse_pool: ThreadPoolExecutor) -> None:
        self.model_name = model_name
        self.executor = executor
        self.gate = RequestGate(model_name, stats, telemetry,
                                limit=limits.max_concurrent_requests)
        self.parse_pool = parse_pool
        # The gate's own methods, not wrappers: no extra frame on every request's way.
        self.admit, self.serve, self.fault = self.gate.admit, self.gate.serve, self.gate.fault

    @property
    def draining(self) -> bool:
        """Whether the replica stopped taking requests."""
        return self.gate.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.gate.draining = value

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
