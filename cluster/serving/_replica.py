"""`ModelReplica`: the Ray Serve deployment that serves one dynvm program over the Open
Inference Protocol (KServe v2): its routes and its life (start-up, shutdown).

Layout (one Serve application per model plus one for the server-level routes; Serve's
proxy routes by longest route prefix):

    app "dynvm-server"        route prefix /v2                 ServerFront
        GET /v2, /v2/health/live, /v2/health/ready; any /v2/models/<unknown>/... -> 404
    app "dynvm-model-<name>"  route prefix /v2/models/<name>   ModelReplica
        GET  /v2/models/<name>[/versions/1]            model metadata (dynamic dims -1)
        GET  /v2/models/<name>[/versions/1]/ready      200 once loaded
        POST /v2/models/<name>[/versions/1]/infer      JSON or binary-tensor extension
        GET  /v2/models/<name>/stats                   runtime.stats() + batching counters

A replica loads its .dvm program (`dynvm.load`) and makes one `Runtime` on its device
("auto": the GPU Ray assigned it, `num_gpus=1` per replica when the cluster has GPUs,
else the CPU), all as its `ServingConfig` says. Its jobs live in three modules: the
routes here (one `__call__`, Note [Plain __call__ routing]) and the gRPC RPCs, forwarded
to a `GrpcInference` (dynvm.cluster.protocol.grpc_v2); what both transports share, in
`_infer_seam` (admission, fault mapping); execution and batching in `_replica_exec`
(Note [Batchability decided once]); counters and the Prometheus refresh in
`_replica_stats`. The builders that deploy it are in `_deployment`. Request
bodies go through `dynvm.cluster.protocol._v2`, which validates everything before a
tensor exists.

Batching (Note [Request batching]): requests go through an `OpportunisticBatcher`
(dynvm.cluster.serving._batcher, Note [Opportunistic batching]): one that finds the model idle
runs at once, those that arrive while it is busy form the next batch of requests whose
inputs can be concatenated along dim 0 (every input's dim 0 is the same dynamic dim,
equal non-batch dims, total rows within the declared range); a batch is ONE Runtime
call on the batcher's worker thread, whose outputs are split back by rows. A batched
call that fails is re-run request by request so that every request gets its own answer
(or its own error).

Note [Lean request path]
~~~~~~~~~~~~~~~~~~~~~~~~
A request crosses threads at most twice: the parse threads decode a body larger than
INLINE_JSON_BYTES (off the event loop, Note [Bounded JSON]; a smaller one, ~0.02-0.1
ms of decoding (Note [Typed JSON fast path]), is decoded on the loop, where a hop would
cost more than the work), the
batcher's one worker thread runs its batch unless the batch is fast enough to run on the
loop (Note [Inline fast batches] in dynvm.cluster.serving._batcher) and, when the outputs are
small (WORKER_ENCODE_ELEMENTS), encodes its response in the same hop; the loop only
hands bytes to Serve. So a small request to a small model crosses no thread at all.
(Before: a parse hop, a hop to asyncio's default pool for the batch, and a third, to the
parse threads, for the response; plus serve.batch's own task and queue.) Measured
(issue 17, recommender, JSON, 8 clients, both with inline batches, 4 alternating 6 s
runs in one cluster, load 15-29): 202 req/s and 2.89 ms of replica CPU per request with
small bodies decoded on the loop, 171 req/s and 3.02 ms with every body on the parse
threads. Counters are fields of typed counters (dynvm.cluster._counters), each bumped
by one thread (the loop: requests, errors, rejections; the worker: the batch counters).
The loop's only other per-request work is appending the latency to two lists: the
Prometheus series, the latency histogram included, are refreshed by `_replica_stats`'
own thread, at most once a second and only after requests came; `/stats` is built on the
parse threads.

Note [Client or server fault]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A request whose inputs the program refuses (ShapeError, InputError) is the client's
fault: 400 naming the input. An instruction that fails at run time (ExecutionError) is
the server's, 500 with an error id, except when the failure is an index out of range
(its cause an IndexError): that comes from the request's own data (an embedding id past
the table), so it is a 400 as well. The error id of a 500 is in the body, the
Dynvm-Error-Id header and the log line, and, when the replica traces, on a
`dynvm.request.error` span in the request's trace (child of its traceparent).

Note [Request batching]
~~~~~~~~~~~~~~~~~~~~~~~
Concatenating requests is only correct for models whose rows
are independent (a recommender, an MLP). A model that mixes rows (the `branchy` demo
branches on the mean of the whole batch) must be served with batching off
(`BatchingOptions(enabled=False)`); dynvm cannot prove row independence from the
bytecode, so the caller decides, as with Triton's dynamic batcher.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

import dynvm
from dynvm.cluster.fleet._link import FleetLink, FleetOptions
from dynvm.cluster.fleet.compile_service import RayServiceClient
from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._http_errors import (
    error_response,
    fault_response,
    json_response,
    server_fault,
)
from dynvm.cluster.protocol._http_front import (
    MODEL_VERSION,
    HttpEncoder,
    bytes_response,
    check_model_name,
    read_body,
    route_miss,
    route_path,
)
from dynvm.cluster.protocol._seam import Fault, RequestParsing
from dynvm.cluster.protocol.grpc_v2 import TRACE_KEYS, GrpcInference
from dynvm.cluster.serving._infer_seam import ReplicaSeam
from dynvm.cluster.serving._replica_exec import ReplicaExecutor
from dynvm.cluster.serving._replica_stats import ReplicaStats
from dynvm.cluster.serving.serving_config import ServingConfig
from dynvm.telemetry import Telemetry
from dynvm.vm import dvm_file
from dynvm.vm.errors import ConfigError

# HTTP bodies up to this size are decoded on the event loop (Note [Lean request path]):
# JSON text costs far more per byte to decode than a gRPC message's raw contents, whose
# bound is grpc_v2.INLINE_GRPC_BYTES (64 KiB).
INLINE_JSON_BYTES = 8192


def pick_device(device: str | None) -> str:
    """'auto'/None: the (Ray-assigned, hence first visible) GPU when there is one."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class ReplicaServer:
    """One model on one device, served over the Open Inference Protocol (HTTP routes
    here; the gRPC service's RPCs forwarded to `self.grpc`, a GrpcInference of
    dynvm.cluster.protocol.grpc_v2, which sees this replica through its GrpcReplica
    interface: model_name, seam, parsing, is_ready(), metadata()).

    The class itself, without Serve: `ModelReplica` below is its deployment; tests build
    it directly (synchronously, no Ray)."""

    def __init__(self, model_name: str, dvm_path: str, config: ServingConfig | None = None,
                 probe_outputs: bool = True) -> None:
        config = config if config is not None else ServingConfig()
        self.model_name = check_model_name(model_name)
        self.config = config
        self.limits = config.limits
        self.program = dvm_file.load(dvm_path,
                                     signing_secret=self._signing_secret(config.fleet))
        self.device = pick_device(config.device)
        # OTEL_* in the replica's environment configure tracing (dynvm._env); none: off.
        self.runtime = dynvm.Runtime(self.program, self.device, jit=config.jit,
                                     telemetry=Telemetry.from_env())
        # Warm start (Note [Fleet promotion]): everything the fleet already compiled for
        # this program is installed before the replica reports ready.
        self.link = None
        fleet = config.fleet
        if fleet is not None and self.runtime.jit is not None:
            client = RayServiceClient.for_fleet(fleet)  # routes to the program's shard
            self.link = FleetLink(self.runtime, Path(dvm_path).read_bytes(), fleet,
                                  client).start()
        self.max_body_bytes = config.max_body_bytes
        self._parse_pool = ThreadPoolExecutor(self.limits.parse_threads,
                                              thread_name_prefix="dynvm-parse")
        self.executor = ReplicaExecutor(self.model_name, self.program, self.runtime,
                                        self.device, config, probe_outputs)
        self.outputs_meta = self.executor.outputs_meta
        self.output_names = [m.name for m in self.outputs_meta] or None
        self.request_stats = ReplicaStats(self.model_name, self.runtime, self.executor,
                                          self.link)
        self.parsing = RequestParsing(self.program.inputs, self.output_names,
                                      self.max_body_bytes, self.limits.refuse_non_finite)
        self.seam = ReplicaSeam(self.model_name, self.executor, self.request_stats,
                                self.limits, self.runtime.telemetry, self._parse_pool)
        self._http_encoder = HttpEncoder(self.model_name)
        self.grpc = GrpcInference(self)

    @property
    def draining(self) -> bool:
        """True once the replica stops taking requests (Note [Replica drain] in
        dynvm.cluster.serving._deployment)."""
        return self.seam.draining

    def _signing_secret(self, fleet: FleetOptions | None) -> bytes | None:
        if not self.limits.require_signed_programs:
            return None
        if fleet is None:
            raise ConfigError("ServingLimits.require_signed_programs needs the fleet's store "
                             "secret: serve with ServingConfig(fleet=FleetOptions(store))")
        return fleet.store.secret

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: stop the background threads.
        for part in ("link", "executor", "request_stats"):
            owner = getattr(self, part, None)
            if owner is not None:
                owner.close()

    # ------------------------------------------------------------------ API

    def is_ready(self) -> bool:
        """Readiness (/v2/health/ready asks it): a replica exists only once loaded, and
        is not ready once it drains."""
        return not self.draining

    def begin_drain(self) -> int:
        """Stop taking requests: readiness turns false, a new infer request gets 503 +
        Retry-After + Connection: close, those in flight finish. Returns how many are in
        flight (Note [Replica drain] in dynvm.cluster.serving._deployment)."""
        self.seam.draining = True
        return self.request_stats.in_flight

    def metadata(self) -> dict:
        """The model's v2 metadata (inputs, outputs; dynamic dims -1)."""
        return v2.model_metadata(self.model_name, [MODEL_VERSION], self.program.inputs,
                                 self.outputs_meta)

    def stats(self) -> dict:
        """Runtime, batching, request and fleet counters (Note [Lean request path])."""
        return self.request_stats.snapshot()

    # ------------------------------------------------------------------ gRPC
    # Serve's gRPC proxy calls the deployment's method named as the RPC; each is
    # answered by this replica's GrpcInference.

    async def ServerLive(self, request, grpc_context=None):  # noqa: N802 (RPC names)
        """GRPCInferenceService.ServerLive (GrpcInference.ServerLive)."""
        return await self.grpc.ServerLive(request, grpc_context)

    async def ServerReady(self, request, grpc_context=None):  # noqa: N802
        """GRPCInferenceService.ServerReady (GrpcInference.ServerReady)."""
        return await self.grpc.ServerReady(request, grpc_context)

    async def ServerMetadata(self, request, grpc_context=None):  # noqa: N802
        """GRPCInferenceService.ServerMetadata (GrpcInference.ServerMetadata)."""
        return await self.grpc.ServerMetadata(request, grpc_context)

    async def ModelReady(self, request, grpc_context=None):  # noqa: N802
        """GRPCInferenceService.ModelReady (GrpcInference.ModelReady)."""
        return await self.grpc.ModelReady(request, grpc_context)

    async def ModelMetadata(self, request, grpc_context=None):  # noqa: N802
        """GRPCInferenceService.ModelMetadata (GrpcInference.ModelMetadata)."""
        return await self.grpc.ModelMetadata(request, grpc_context)

    async def ModelInfer(self, request, grpc_context=None):  # noqa: N802
        """GRPCInferenceService.ModelInfer (GrpcInference.ModelInfer)."""
        return await self.grpc.ModelInfer(request, grpc_context)

    # ------------------------------------------------------------------ HTTP

    async def __call__(self, request: Request) -> Response:
        """Every HTTP request of the model's route prefix (Note [Plain __call__ routing])."""
        scope = request.scope
        try:
            route, version = route_path(scope)
            methods = (_VERSIONED_ROUTES if version is not None else _ROUTES).get(route)
            handler = methods.get(scope["method"]) if methods is not None else None
            if handler is None:
                return route_miss(request, route, version, _ROUTES, _VERSIONED_ROUTES)
            if version is not None and version != MODEL_VERSION:
                raise v2.NotFound(f"model {self.model_name!r} has no version "
                                  f"{v2.cut(repr(version))} (versions: {MODEL_VERSION})")
            return await handler(self, request, version)
        except v2.ProtocolError as exc:
            return error_response(exc, exc.status)
        except Exception as exc:  # what FastAPI's catch-all answered: logged, an error id
            return server_fault(f"{v2.cut(request.method, 20)} {v2.cut(request.url.path)}",
                                exc)

    async def _get_metadata(self, request: Request, version: str | None) -> Response:
        return json_response(self.metadata())

    async def _get_ready(self, request: Request, version: str | None) -> Response:
        return json_response({"name": self.model_name, "ready": not self.draining},
                             status=503 if self.draining else 200)

    async def _get_stats(self, request: Request, version: str | None) -> Response:
        return json_response(await self.seam.off_loop(self.stats))

    async def _infer_http(self, request: Request, version: str | None) -> Response:
        refusal = self.seam.admit()  # draining, or the in-flight bound: a quick 503
        if refusal is not None:
            return self._fault_response(refusal)
        trace = {k: request.headers[k] for k in TRACE_KEYS if k in request.headers} or None
        result = await self.seam.serve(
            functools.partial(self._infer_http_body, request, trace), trace)
        return self._fault_response(result) if isinstance(result, Fault) else result

    def _fault_response(self, fault: Fault) -> Response:
        return fault_response(fault, self.model_name, self.limits.retry_after_s)

    async def _infer_http_body(self, request: Request, trace: dict | None) -> Response:
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise v2.BadRequest(f"Content-Encoding {v2.cut(repr(encoding))} is not "
                                "supported")
        # On its way to the batcher: the next batch may wait for it (Note
        # [Opportunistic batching]); no await between the -1 and the submit below.
        batcher = self.executor.batcher
        batcher.arriving(1)
        try:
            body = await read_body(request, self.max_body_bytes)
            parse = functools.partial(self.parsing.parse, body,
                                      request.headers.get(v2.HEADER_LENGTH))
            parsed = (parse() if len(body) <= INLINE_JSON_BYTES
                      else await self.seam.off_loop(parse))
        finally:
            batcher.arriving(-1)
        del body
        response, headers = await self.seam.execute(parsed, trace, self._http_encoder)
        return bytes_response(response, dict(headers))


# Note [Plain __call__ routing]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The replica answers HTTP from its own `__call__`, not through `@serve.ingress(FastAPI)`:
# FastAPI's routing, its request wrapping and Serve's per-request route-name lookup in
# the ASGI app cost ~0.33 ms of CPU per request on the loaded 2-core host (py-spy, issue
# 17), more than the model call. Serve hands `__call__` a Starlette Request whose scope
# has the full path and, as root_path, the application's route prefix
# (/v2/models/<name>); the route is the rest of the path (`http_front.route_path`), an
# optional /versions/<v> taken off first, then one dict lookup by route and method. What
# FastAPI answered otherwise is kept: 404 "no route", 405 naming the allowed method (with
# Allow), 307 to the path without its trailing slash, the prefix itself (no slash) as
# its metadata route, the protocol's error body for all of them.
_ROUTES = {
    "": {"GET": ReplicaServer._get_metadata},
    "/": {"GET": ReplicaServer._get_metadata},
    "/ready": {"GET": ReplicaServer._get_ready},
    "/stats": {"GET": ReplicaServer._get_stats},
    "/infer": {"POST": ReplicaServer._infer_http},
}
# Under /versions/<version> (no /stats there).
_VERSIONED_ROUTES = {
    "": {"GET": ReplicaServer._get_metadata},
    "/ready": {"GET": ReplicaServer._get_ready},
    "/infer": {"POST": ReplicaServer._infer_http},
}

ModelReplica = serve.deployment(name="ModelReplica", max_ongoing_requests=256)(ReplicaServer)
