"""Ray Serve replicas serving dynvm programs over the Open Inference Protocol (KServe v2).

Layout (one Serve application per model plus one for the server-level routes; Serve's
proxy routes by longest route prefix):

    app "dynvm-server"        route prefix /v2                 ServerFront
        GET /v2, /v2/health/live, /v2/health/ready; any /v2/models/<unknown>/... -> 404
    app "dynvm-model-<name>"  route prefix /v2/models/<name>   ModelReplica
        GET  /v2/models/<name>[/versions/1]            model metadata (dynamic dims -1)
        GET  /v2/models/<name>[/versions/1]/ready      200 once loaded
        POST /v2/models/<name>[/versions/1]/infer      JSON or binary-tensor extension
        GET  /v2/models/<name>/stats                   runtime.stats() + batching counters

A `ModelReplica` loads its .dvm program (`dynvm.load`) and makes one `Runtime` on its
device ("auto": the GPU Ray assigned it, `num_gpus=1` per replica when the cluster has
GPUs, else the CPU). Request bodies go through `dynvm.cluster.v2_protocol`, which
validates everything before a tensor exists; errors are 4xx with `{"error": "..."}`.

Batching (Note [Request batching]): requests go through an `OpportunisticBatcher`
(dynvm.cluster.batcher, Note [Opportunistic batching]): one that finds the model idle
runs at once, those that arrive while it is busy form the next batch of requests whose
inputs can be concatenated along dim 0 (every input's dim 0 is the same dynamic dim,
equal non-batch dims, total rows within the declared range); a batch is ONE Runtime
call on the batcher's worker thread, whose outputs are split back by rows. A group whose outputs do
not have the batch as dim 0, or whose batched call fails, is re-run request by request so
that every request gets its own answer (or its own error).

Note [Lean request path]
~~~~~~~~~~~~~~~~~~~~~~~~
A request crosses threads twice: the parse threads decode its body (off the event loop,
Note [Bounded JSON]), the batcher's one worker thread runs its batch and, when the
outputs are small (WORKER_ENCODE_ELEMENTS), encodes its response in the same hop; the
loop only hands bytes to Serve. (Before: a parse hop, a hop to asyncio's default pool
for the batch, and a third, to the parse threads, for the response; plus serve.batch's
own task and queue.) Counters are plain dict entries, each bumped by one thread (the
loop: requests, errors, rejections; the worker: the batch counters); the Prometheus
refresh walks stats() at most once a second, on the worker, never per request.

Note [Request batching]
~~~~~~~~~~~~~~~~~~~~~~~
Concatenating requests is only correct for models whose rows
are independent (a recommender, an MLP). A model that mixes rows (the `branchy` demo
branches on the mean of the whole batch) must be served with `batching=False`; dynvm
cannot prove row independence from the bytecode, so the caller decides, as with
Triton's dynamic batcher.
"""

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import Request
from fastapi.responses import Response
from opentelemetry import context as otel_context
from opentelemetry import propagate
from ray import serve
from ray.serve.api import RunTarget
from torch.utils import _pytree as pytree

import dynvm
from dynvm.cluster import v2_protocol as v2
from dynvm.cluster.batcher import OpportunisticBatcher, Overloaded
from dynvm.cluster.compile_service import RayServiceClient
from dynvm.cluster.config import BatchingOptions
from dynvm.cluster.fleet_link import FleetLink, FleetOptions
from dynvm.cluster.http_errors import error_response as _error_response
from dynvm.cluster.http_errors import json_response as _json_response
from dynvm.cluster.http_errors import server_fault
from dynvm.cluster.http_front import (  # noqa: F401 (names of this module's API)
    MODEL_VERSION,
    SERVER_APP,
    check_model_name,
    model_app_name,
    protocol_app,
    read_body,
)
from dynvm.cluster.limits import ServingLimits
from dynvm.cluster.metrics import ReplicaMetrics
from dynvm.cluster.server_front import ServerFront
from dynvm.jit.config import JitConfig
from dynvm.telemetry import Telemetry
from dynvm.vm import dvm_file
from dynvm.vm.budget import CallBudget
from dynvm.vm.errors import CallBudgetError, ExecutionError, InputError, ShapeError

LATENCY_WINDOW = 1024      # recent requests whose latency stats() summarizes
# Responses of at most this many output elements are encoded on the model's worker
# thread right after the batch (Note [Lean request path]); larger ones on the parse
# threads, so that a big JSON encode does not hold the model.
WORKER_ENCODE_ELEMENTS = 4096
METRICS_EVERY_S = 1.0      # Prometheus series are refreshed at most this often


def pick_device(device: str | None) -> str:
    """'auto'/None: the (Ray-assigned, hence first visible) GPU when there is one."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@contextlib.contextmanager
def _attached(context):
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


def _replica_tag() -> str | None:
    """Serve's id of this replica (the Prometheus `replica` tag), None outside Serve."""
    try:
        return serve.get_replica_context().replica_tag
    except Exception:  # not running inside a Serve replica (a direct test)
        return None


def _rss_bytes() -> int | None:
    """This process's resident memory (Linux /proc), None where there is none."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _percentiles_ms(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50": None, "p99": None, "count": 0}
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50": at(0.50), "p99": at(0.99), "count": len(ordered)}


@dataclass
class _Outcome:
    """What the batch method hands back per request: outputs or the error to raise."""

    outputs: list[torch.Tensor] | None = None
    error: BaseException | None = None
    response: tuple[bytes, dict[str, str]] | None = None   # encoded on the worker thread


model_api = protocol_app("dynvm model replica")


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(model_api)
class ModelReplica:
    """One model on one device, served over the Open Inference Protocol."""

    def __init__(self, model_name: str, dvm_path: str, device: str | None = "auto",
                 jit: bool | JitConfig = True,
                 batch_options: BatchingOptions | None = None, batching: bool = True,
                 max_body_bytes: int = v2.DEFAULT_MAX_BODY_BYTES, probe_outputs: bool = True,
                 fleet: FleetOptions | None = None, limits: ServingLimits | None = None
                 ) -> None:
        self.model_name = check_model_name(model_name)
        self.limits = limits if limits is not None else ServingLimits()
        self._budget = self.limits.call_budget()
        self.program = dvm_file.load(dvm_path, signing_secret=self._signing_secret(fleet))
        self.device = pick_device(device)
        # OTEL_* in the replica's environment configure tracing (dynvm._env); none: off.
        self.runtime = dynvm.Runtime(self.program, self.device, jit=jit,
                                     telemetry=Telemetry.from_env())
        # Warm start (Note [Fleet promotion]): everything the fleet already compiled for
        # this program is installed before the replica reports ready.
        self.link = None
        if fleet is not None and self.runtime.jit is not None:
            client = RayServiceClient(fleet.service_name, fleet.service_namespace,
                                      fleet.service_timeout_s)
            self.link = FleetLink(self.runtime, Path(dvm_path).read_bytes(), fleet,
                                  client).start()
        self.metrics = ReplicaMetrics(self.model_name)
        self._metrics_at = 0.0
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._replica = _replica_tag()
        self.max_body_bytes = int(max_body_bytes)
        self._batch_dim = self._find_batch_dim() if batching else None
        self.batch_options = batch_options if batch_options is not None else BatchingOptions()
        self.batcher = OpportunisticBatcher(
            self._execute, self.batch_options,
            high_rows=self._batch_dim[1] if self._batch_dim is not None else None)
        self.counters = {"requests": 0, "errors": 0, "vm_calls": 0, "batches": 0,
                         "batched_vm_calls": 0, "batched_requests": 0,
                         "max_requests_per_vm_call": 0, "unbatched_fallbacks": 0,
                         "rejected_busy": 0}
        self._in_flight = 0
        self._parse_pool = ThreadPoolExecutor(self.limits.parse_threads,
                                              thread_name_prefix="dynvm-parse")
        self.outputs_meta = self._probe_outputs() if probe_outputs else []
        self.output_names = [m.name for m in self.outputs_meta] or None

    # ------------------------------------------------------------------ setup

    def _signing_secret(self, fleet: FleetOptions | None) -> bytes | None:
        if not self.limits.require_signed_programs:
            return None
        if fleet is None:
            raise ValueError("ServingLimits.require_signed_programs needs the fleet's store "
                             "secret: serve with fleet=FleetOptions(store)")
        return fleet.store.secret

    def _find_batch_dim(self) -> tuple[str, int] | None:
        """(name, high) of the dynamic dim 0 every input shares, or None."""
        names = set()
        high = None
        for spec in self.program.inputs:
            if not spec.dims or spec.dims[0].is_static:
                return None
            names.add(spec.dims[0].name)
            high = spec.dims[0].high if high is None else min(high, spec.dims[0].high)
        if len(names) != 1 or high is None:
            return None
        return names.pop(), high

    def _probe_inputs(self, bump: bool) -> list[torch.Tensor]:
        sizes: dict[str, int] = {}
        for spec in self.program.inputs:
            for d in spec.dims:
                if not d.is_static:
                    size = min(d.low + 1, d.high) if bump else d.low
                    sizes.setdefault(d.name, size)
        return [torch.zeros([d.low if d.is_static else sizes[d.name] for d in spec.dims],
                            dtype=spec.dtype, device=self.device)
                for spec in self.program.inputs]

    def _probe_outputs(self) -> list[v2.TensorMetadata]:
        """Output datatypes and shapes (-1 where they vary) from two zero-input runs."""
        try:
            probes = [self._run(self._probe_inputs(bump)) for bump in (False, True)]
        except Exception:  # a model that rejects zeros: outputs are learnt per request
            return []
        return v2.output_metadata_from_probes(probes)

    # ------------------------------------------------------------------ running

    def _run(self, tensors: Sequence[torch.Tensor],
             budget: CallBudget | None = None) -> list[torch.Tensor]:
        inputs = [t.to(self.device) for t in tensors]
        result = self.runtime(*inputs, budget=budget or self._budget)
        leaves = pytree.tree_leaves(result)
        outputs = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                leaf = torch.tensor(leaf)
            outputs.append(leaf.detach().to("cpu"))
        return outputs

    def _run_recorded(self, tensors: Sequence[torch.Tensor],
                      budget: CallBudget | None = None) -> list[torch.Tensor]:
        """`_run`, telling the batcher whether this row count ran entirely specialized
        (what shape-aware batching learns from, Note [Opportunistic batching])."""
        specialized, interpreted = self.runtime.region_calls()
        outputs = self._run(tensors, budget)
        if self._batch_dim is not None:
            now_specialized, now_interpreted = self.runtime.region_calls()
            self.batcher.record(tensors[0].shape[0], now_interpreted == interpreted
                                and now_specialized > specialized)
        return outputs

    def _run_one(self, tensors: Sequence[torch.Tensor],
                 budget: CallBudget | None = None) -> _Outcome:
        try:
            return _Outcome(outputs=self._run_recorded(tensors, budget))
        except Exception as exc:  # handed to this request's caller
            return _Outcome(error=exc)

    def _groups(self, requests: Sequence[v2.InferRequest]) -> list[list[int]]:
        """Indices of requests that can share one VM call, in arrival order."""
        if self._batch_dim is None:
            return [[i] for i in range(len(requests))]
        _, high = self._batch_dim
        groups: list[list[int]] = []
        keys: list[tuple] = []
        rows: list[int] = []
        for i, req in enumerate(requests):
            key = tuple((t.dtype, tuple(t.shape[1:])) for t in req.tensors)
            n = req.tensors[0].shape[0]
            for g, group in enumerate(groups):
                if keys[g] == key and rows[g] + n <= high:
                    group.append(i)
                    rows[g] += n
                    break
            else:
                groups.append([i])
                keys.append(key)
                rows.append(n)
        return groups

    def _trace_parent(self, carrier: dict | None):
        """Run a VM call as a child of the HTTP request's W3C trace context, if any."""
        if carrier is None or self.runtime.telemetry is None:
            return contextlib.nullcontext()
        return _attached(propagate.extract(carrier))

    def _run_batch(self, requests: Sequence[v2.InferRequest],
                   traces: Sequence[dict | None]) -> tuple[list[_Outcome], dict]:
        """Runs in a worker thread: one VM call per group, split back per request. A
        batched call joins the trace of its first request (a span has one parent)."""
        outcomes: list[_Outcome | None] = [None] * len(requests)
        counts = {"vm_calls": 0, "batched_vm_calls": 0, "batched_requests": 0,
                  "max_requests_per_vm_call": 1, "unbatched_fallbacks": 0}
        for group in self._groups(requests):
            with self._trace_parent(traces[group[0]]):
                self._run_group(requests, traces, group, outcomes, counts)
        return [o if o is not None else _Outcome(error=RuntimeError("not run"))
                for o in outcomes], counts

    def _run_group(self, requests, traces, group: list[int], outcomes: list,
                   counts: dict) -> None:
        """One batched VM call for `group`, or one call per request when batching does
        not apply or fails; fills `outcomes` and `counts`. After a batched call that ran
        past its budget, the re-runs share one budget between them (each gets its share),
        so that a runaway request holds the worker for about two budgets, not one per
        request of its batch (Note [Call budget])."""
        budget = None
        if len(group) > 1:
            sizes = [requests[i].tensors[0].shape[0] for i in group]
            total = sum(sizes)
            try:
                cat = [torch.cat([requests[i].tensors[k] for i in group])
                       for k in range(len(self.program.inputs))]
                outputs = self._run_recorded(cat)
                counts["vm_calls"] += 1
                if all(o.dim() >= 1 and o.shape[0] == total for o in outputs):
                    pieces = [o.split(sizes) for o in outputs]
                    for j, i in enumerate(group):
                        outcomes[i] = _Outcome(outputs=[p[j].clone() for p in pieces])
                    counts["batched_vm_calls"] += 1
                    counts["batched_requests"] += len(group)
                    counts["max_requests_per_vm_call"] = max(
                        counts["max_requests_per_vm_call"], len(group))
                    return
            except CallBudgetError:
                budget = dataclasses.replace(
                    self._budget, seconds=self._budget.seconds / len(group))
            except Exception:  # each request re-runs below and gets its own error
                pass
            counts["unbatched_fallbacks"] += 1
        for i in group:
            with self._trace_parent(traces[i]):
                outcomes[i] = self._run_one(requests[i].tensors, budget)
            counts["vm_calls"] += 1

    def _execute(self, items: list[tuple[v2.InferRequest, dict | None]]) -> list[_Outcome]:
        """One batch, on the batcher's worker thread (Note [Opportunistic batching]).
        The counters it bumps are bumped only here; the Prometheus refresh (a walk of
        stats()) happens here at most once a second, never on the event loop."""
        requests = [request for request, _ in items]
        traces = [trace for _, trace in items]
        outcomes, counts = self._run_batch(requests, traces)
        for request, outcome in zip(requests, outcomes, strict=True):
            outputs = outcome.outputs
            if outputs is not None and sum(o.numel() for o in outputs) \
                    <= WORKER_ENCODE_ELEMENTS:
                # A ProtocolError is raised again, as a 4xx, by the handler's own encode.
                with contextlib.suppress(v2.ProtocolError):
                    outcome.response = v2.build_infer_response(
                        self.model_name, MODEL_VERSION, outputs, request)
        counters = self.counters
        counters["batches"] += 1
        for key, value in counts.items():
            if key == "max_requests_per_vm_call":
                counters[key] = max(counters[key], value)
            else:
                counters[key] += value
        now = time.monotonic()
        if now - self._metrics_at >= METRICS_EVERY_S:
            self._metrics_at = now
            self.metrics.update(self.stats())
        return outcomes

    async def infer_request(self, request: v2.InferRequest,
                            trace: dict | None = None) -> list[torch.Tensor]:
        """Run one validated request through the batcher; raises its error (Overloaded
        when too many wait already). `trace`: the request's W3C trace-context headers
        (traceparent, tracestate), if it had any."""
        outcome = await self._submit(request, trace)
        if outcome.error is not None:
            raise outcome.error
        return outcome.outputs

    async def _submit(self, request: v2.InferRequest, trace: dict | None) -> _Outcome:
        tensors = request.tensors
        if self._batch_dim is not None and tensors:
            rows = tensors[0].shape[0]
            key = tuple((t.dtype, tuple(t.shape[1:])) for t in tensors)
        else:
            rows, key = 1, None
        return await self.batcher.submit((request, trace), rows, key,
                                         sum(t.nbytes for t in tensors))

    # ------------------------------------------------------------------ HTTP

    def is_ready(self) -> bool:
        return True

    def _check_version(self, version: str | None) -> None:
        if version is not None and version != MODEL_VERSION:
            raise v2.NotFound(f"model {self.model_name!r} has no version "
                              f"{v2.cut(repr(version))} (versions: {MODEL_VERSION})")

    def metadata(self) -> dict:
        return v2.model_metadata(self.model_name, [MODEL_VERSION], self.program.inputs,
                                 self.outputs_meta)

    def stats(self) -> dict:
        stats = {"model": self.model_name, "replica": self._replica, **self.runtime.stats(),
                 **self.counters, "in_flight": self._in_flight,
                 "batching": self.batcher.stats(),
                 "latency_ms": _percentiles_ms(list(self._latencies)),
                 "process": {"pid": os.getpid(), "rss_bytes": _rss_bytes()}}
        if self.link is not None:
            stats["fleet"] = self.link.stats()
            stats["store"] = stats["fleet"]["store"]
        return stats

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: stop the link's and batcher's threads.
        link = getattr(self, "link", None)
        if link is not None:
            link.close()
        batcher = getattr(self, "batcher", None)
        if batcher is not None:
            batcher.close()

    async def _handle(self, version: str | None, action) -> Response:
        try:
            self._check_version(version)
            return await action()
        except v2.ProtocolError as exc:
            return _error_response(exc, exc.status)

    @model_api.get("/")
    async def get_metadata(self) -> Response:
        return await self._handle(None, self._metadata_response)

    @model_api.get("/versions/{version}")
    async def get_version_metadata(self, version: str) -> Response:
        return await self._handle(version, self._metadata_response)

    async def _metadata_response(self) -> Response:
        return _json_response(self.metadata())

    @model_api.get("/ready")
    async def get_ready(self) -> Response:
        return await self._handle(None, self._ready_response)

    @model_api.get("/versions/{version}/ready")
    async def get_version_ready(self, version: str) -> Response:
        return await self._handle(version, self._ready_response)

    async def _ready_response(self) -> Response:
        return _json_response({"name": self.model_name, "ready": True})

    @model_api.get("/stats")
    async def get_stats(self) -> Response:
        return _json_response(self.stats())

    @model_api.post("/infer")
    async def post_infer(self, request: Request) -> Response:
        return await self._handle(None, lambda: self._infer_http(request, None))

    @model_api.post("/versions/{version}/infer")
    async def post_version_infer(self, version: str, request: Request) -> Response:
        return await self._handle(version, lambda: self._infer_http(request, version))

    async def _infer_http(self, request: Request, version: str | None) -> Response:
        # Bounded concurrency: past the limit, a quick 503 the client may retry, instead
        # of one more body held in memory and one more request queued behind the others.
        if self._in_flight >= self.limits.max_concurrent_requests:
            return self._busy_response(
                f"{self._in_flight} requests in flight on this replica, the limit is "
                f"{self.limits.max_concurrent_requests}")
        self._in_flight += 1
        start = time.perf_counter()
        try:
            return await self._infer_http_timed(request, version)
        finally:
            self._in_flight -= 1
            seconds = time.perf_counter() - start
            self._latencies.append(seconds)
            self.metrics.observe_request(seconds)

    def _busy_response(self, why: str) -> Response:
        """503 + Retry-After: the replica is full (`why`), the client may retry."""
        self.counters["rejected_busy"] += 1
        return _error_response(
            f"model {self.model_name!r} is busy: {why}; retry after "
            f"{self.limits.retry_after_s} s", 503,
            {"Retry-After": str(self.limits.retry_after_s)})

    async def _off_loop(self, fn, *args, **kwargs):
        """Run `fn` on the replica's parse threads: decoding a body or encoding a response
        never blocks the event loop that serves the other requests."""
        return await asyncio.get_running_loop().run_in_executor(
            self._parse_pool, functools.partial(fn, *args, **kwargs))

    async def _infer_http_timed(self, request: Request, version: str | None) -> Response:
        self.counters["requests"] += 1
        try:
            encoding = request.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise v2.BadRequest(f"Content-Encoding {v2.cut(repr(encoding))} is not "
                                    "supported")
            # On its way to the batcher: the next batch may wait for it (Note
            # [Opportunistic batching]); no await between the -1 and the submit below.
            self.batcher.arriving(1)
            try:
                body = await read_body(request, self.max_body_bytes)
                parsed = await self._off_loop(
                    v2.parse_infer_request, body, self.program.inputs,
                    header_length=request.headers.get(v2.HEADER_LENGTH),
                    max_body_bytes=self.max_body_bytes, output_names=self.output_names,
                    refuse_non_finite=self.limits.refuse_non_finite)
            finally:
                self.batcher.arriving(-1)
            del body
            trace = {k: request.headers[k] for k in ("traceparent", "tracestate")
                     if k in request.headers} or None
            outcome = await self._submit(parsed, trace)
            if outcome.error is not None:
                if isinstance(outcome.error, ShapeError | InputError | ExecutionError):
                    raise v2.BadRequest(f"model {self.model_name!r}: {outcome.error}")
                raise outcome.error
            if outcome.response is not None:  # Note [Lean request path]
                body, headers = outcome.response
                headers = dict(headers)
            else:
                body, headers = await self._off_loop(
                    v2.build_infer_response, self.model_name, version or MODEL_VERSION,
                    outcome.outputs, parsed)
        except v2.ProtocolError:
            self.counters["errors"] += 1
            raise
        except Overloaded as exc:  # the batcher's queue is full (BatchingOptions.max_queued)
            return self._busy_response(str(exc))
        except Exception as exc:  # a server fault, CallBudgetError included: logged, an id
            self.counters["errors"] += 1
            return server_fault(f"model {self.model_name!r}", exc)
        media_type = headers.pop("Content-Type")
        return Response(body, status_code=200, headers=headers, media_type=media_type)


@dataclass(frozen=True)
class Autoscaling:
    """Ray Serve autoscaling of each model's deployment."""

    min_replicas: int = 1
    """Never fewer replicas than this."""
    max_replicas: int = 4
    """Never more replicas than this."""
    target_ongoing_requests: float = 2.0
    """Serve adds replicas when requests in flight per replica exceed this."""
    upscale_delay_s: float = 3.0
    """How long load must stay above target before a replica is added."""
    downscale_delay_s: float = 30.0
    """How long load must stay below target before a replica is removed."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"Autoscaling needs 0 <= min_replicas <= max_replicas, max >= 1; "
                             f"got {self.min_replicas}..{self.max_replicas}")
        if self.target_ongoing_requests <= 0:
            raise ValueError("Autoscaling.target_ongoing_requests must be > 0")

    def as_serve_config(self) -> dict:
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.min_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "metrics_interval_s": 0.5, "look_back_period_s": 2.0}


def batching_options(options: BatchingOptions | None = None,
                     max_batch_size: int | None = None,
                     batch_wait_timeout_s: float | None = None) -> BatchingOptions:
    """`options` (default BatchingOptions()) with the older keyword overrides applied:
    `batch_wait_timeout_s` is now the longest hold (`max_delay_s`), never a wait that a
    lone request pays (Note [Opportunistic batching])."""
    options = options if options is not None else BatchingOptions()
    changes = {}
    if max_batch_size is not None:
        changes["max_batch_size"] = int(max_batch_size)
    if batch_wait_timeout_s is not None:
        changes["max_delay_s"] = float(batch_wait_timeout_s)
    return dataclasses.replace(options, **changes) if changes else options


def model_application(name: str, path, *, device: str | None = "auto",
                      jit: bool | JitConfig = True,
                      batch_options: BatchingOptions | None = None,
                      max_batch_size: int | None = None,
                      batch_wait_timeout_s: float | None = None, batching: bool = True,
                      max_body_bytes: int = v2.DEFAULT_MAX_BODY_BYTES, num_replicas: int = 1,
                      num_cpus: float = 1.0, num_gpus: float | None = None,
                      fleet: FleetOptions | None = None,
                      autoscaling: Autoscaling | None = None,
                      limits: ServingLimits | None = None):
    """The bound Serve deployment of one model (what `serve_models` and the
    `serve run` builder in dynvm.cluster.serve_app deploy). Ray must be initialized.
    `num_gpus=None`: one GPU per replica when the Ray cluster has GPUs, none otherwise.
    `batch_options`: Note [Opportunistic batching]; `max_batch_size` and
    `batch_wait_timeout_s` override its fields (`batching_options`)."""
    import ray

    check_model_name(name)
    options = batching_options(batch_options, max_batch_size, batch_wait_timeout_s)
    if num_gpus is None:
        num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    scaling = ({"autoscaling_config": autoscaling.as_serve_config()}
               if autoscaling is not None else {"num_replicas": num_replicas})
    return ModelReplica.options(
        name=f"ModelReplica-{name}",
        max_ongoing_requests=max(256, 4 * options.max_batch_size),
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        **scaling,
    ).bind(name, str(path), device, jit, options, bool(batching), max_body_bytes, True,
           fleet, limits)


def serve_models(models: Mapping[str, str], *, device: str | None = "auto",
                 jit: bool | JitConfig = True,
                 batch_options: BatchingOptions | None = None,
                 max_batch_size: int | None = None, batch_wait_timeout_s: float | None = None,
                 batching: bool | Mapping[str, bool] = True,
                 max_body_bytes: int = v2.DEFAULT_MAX_BODY_BYTES,
                 num_replicas: int = 1, num_cpus: float = 1.0,
                 num_gpus: float | None = None, fleet: FleetOptions | None = None,
                 autoscaling: Autoscaling | None = None,
                 limits: ServingLimits | None = None) -> dict:
    """Deploy one Serve application per model (route prefix /v2/models/<name>) plus the
    server application (route prefix /v2). Serve must already be started (`serve.start`).

    `num_gpus=None`: one GPU per replica when the Ray cluster has GPUs, none otherwise.
    `batching` may be per model ({name: bool}); see Note [Request batching].
    `batch_options` (Note [Opportunistic batching]): sizes, hold and queue bound;
    `max_batch_size` and `batch_wait_timeout_s` override its fields.
    `fleet`: share compiled specializations through the compile service and the kernel
    store (dynvm.cluster.fleet_link); start the service first (`start_compile_service`).
    `autoscaling`: Serve autoscales each model between its bounds (`num_replicas` is
    then ignored). `limits`: per-request bounds (dynvm.cluster.limits.ServingLimits).
    Returns {app name: DeploymentHandle}.
    """
    targets = []
    for name, path in models.items():
        batch_on = batching.get(name, True) if isinstance(batching, Mapping) else batching
        app = model_application(name, path, device=device, jit=jit,
                                batch_options=batch_options, max_batch_size=max_batch_size,
                                batch_wait_timeout_s=batch_wait_timeout_s,
                                batching=bool(batch_on), max_body_bytes=max_body_bytes,
                                num_replicas=num_replicas, num_cpus=num_cpus,
                                num_gpus=num_gpus, fleet=fleet, autoscaling=autoscaling,
                                limits=limits)
        targets.append(RunTarget(app, name=model_app_name(name),
                                 route_prefix=f"/v2/models/{name}"))
    targets.append(RunTarget(ServerFront.bind(list(models)), name=SERVER_APP,
                             route_prefix="/v2"))
    # All applications deploy at once (in parallel); returns when all are running.
    handles = serve.run_many(targets)
    return {target.name: handle for target, handle in zip(targets, handles, strict=True)}
