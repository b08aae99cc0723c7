"""`GeneratorReplica`: the Ray Serve deployment that serves a generator (a directory
written by `save_generator`, dynvm._serve_generate_bundle) with continuous batching
(dynvm.cluster.serving._generate_scheduler) over OpenAI's completions and the KServe v2 generate
extension (dynvm.cluster.protocol._generate).

One Serve application, route prefix `/`, answers every route (a generator is served
alone by `dynvm serve`):

    POST /v1/completions                          OpenAI completions; "stream": true: SSE
    GET  /v1/models                               the model, as OpenAI lists models
    POST /v2/models/<name>/generate               v2 generate extension
    POST /v2/models/<name>/generate_stream        the same as server-sent events
    GET  /v2/models/<name>[/ready|/stats]         metadata, readiness, counters
    GET  /v2, /v2/health/live, /v2/health/ready   the server's v2 routes
    GET  /metrics                                 Prometheus text (generate_metrics)

Like the inference replica (dynvm.cluster.serving._replica), it runs on Serve's own loop and
never blocks it: the model runs on the scheduler's thread, a step's tokens come back
through one `call_soon_threadsafe` (Note [One hop per step] in
dynvm.cluster.serving._generate_outbox), and a stream writes the events it has at
once (Note [Writes of what is ready]). A client that goes away (Serve cancels its request; a plain
ASGI server fails the next write) cancels its sequence, freed at the scheduler's next
step. Limits: the body (ServingConfig.max_body_bytes), prompt and max_tokens
(SchedulerConfig), the waiting room (503 + Retry-After), the time of one request
(SchedulerConfig.request_seconds; 504 or an error event).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from opentelemetry import propagate
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

import dynvm
from dynvm._serve_generate_bundle import load_generator
from dynvm.cluster._counters import as_dict
from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._generate import (
    Completion,
    RequestError,
    TextStream,
    openai_error,
    parse_openai,
    parse_v2_generate,
    sse,
)
from dynvm.cluster.protocol._http_errors import (
    ERROR_ID_HEADER,
    error_response,
    json_response,
    server_fault,
)
from dynvm.cluster.protocol._http_front import MODEL_VERSION, check_model_name, read_body
from dynvm.cluster.protocol._seam import Fault, FaultKind
from dynvm.cluster.serving._generate_events import EventStream, OpenAIShape, V2Shape
from dynvm.cluster.serving._generate_metrics import GenerateMetrics
from dynvm.cluster.serving._generate_scheduler import (
    GenerateBusy,
    GenerateScheduler,
    GenerateTimeout,
    SchedulerConfig,
)
from dynvm.cluster.serving._generate_slice import request_slice, thread_slice
from dynvm.cluster.serving._generate_warm import warm_scheduler
from dynvm.cluster.serving._infer_seam import RequestGate, RequestTally
from dynvm.cluster.serving._replica import pick_device
from dynvm.cluster.serving.serving_config import ServingConfig
from dynvm.telemetry import Telemetry
from dynvm.vm.errors import InputError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# Note [Writes of what is ready]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every token is its own server-sent event, as clients count them; but a stream whose
# writer finds several events already queued (the loop was busy with other streams, or
# a step ended more than one of its events: the last token and the end) writes them in
# one body message: one pass through Starlette, Serve and the HTTP server, one socket
# write, instead of one each. Nothing waits to gather: what is queued when the writer
# looks goes out, so a token is never held back for a later one.


class GeneratorServer:
    """A generator on one device behind OpenAI's and the v2 generate routes. The class
    itself, without Serve: `GeneratorReplica` is its deployment; tests build it directly."""

    def __init__(self, model_name: str, path: str, config: ServingConfig | None = None,
                 scheduler: SchedulerConfig | None = None, metrics_to_ray: bool = True,
                 telemetry: Telemetry | None = None) -> None:
        config = config if config is not None else ServingConfig()
        self.model_name = check_model_name(model_name)
        self.config = config
        bundle = load_generator(path)
        self.tokenizer = bundle.tokenizer
        self.programs = bundle.programs
        self.generator = dynvm.Generator(bundle.programs, pick_device(config.device),
                                         jit=config.jit, compile_ahead=False)
        # Warm start (Note [Fleet promotion]): what the fleet compiled for the programs
        # this replica runs is installed before it reports ready; one link per Runtime.
        self.links = self._fleet_links(Path(path), config.fleet)
        self.metrics = GenerateMetrics(self.model_name, export_to_ray=metrics_to_ray)
        self.scheduler = GenerateScheduler(self.generator, scheduler, self.metrics)
        # Note [Warm before ready]: without a fleet, the step's shapes are compiled here,
        # before Serve sees the constructor return (the replica is not ready until then).
        self.warm = warm_scheduler(self.scheduler, 0.0 if self.links else
                                   self.scheduler.config.warm_seconds)
        # A span per generation (Note [Global tracer provider]): OTEL_* in the replica's
        # environment, else the application's global provider, else none.
        self.telemetry = telemetry if telemetry is not None else Telemetry.from_env()
        # Admission (the drain), requests counted in flight (what the drain reads, Note
        # [Replica drain]) and whose fault an error is: the seam every replica shares.
        self.request_stats = RequestTally()
        self.gate = RequestGate(self.model_name, self.request_stats, self.telemetry,
                                classify=_fault_of)
        self.created = int(time.time())
        self.loop_slice: float | None = None   # the event loop thread's, at its first request
        self._loop_sliced = False

    def _fleet_links(self, directory: Path, fleet) -> list:
        """A FleetLink per Runtime the scheduler calls (the step over the KV state, or
        prefill and decode), each with its .dvm file's bytes; none without a fleet or a
        JIT."""
        if fleet is None:
            return []
        from dynvm.cluster.fleet._link import FleetLink
        from dynvm.cluster.fleet.compile_service import RayServiceClient

        generator = self.generator
        runtimes = (("step.dvm", generator.step),) if generator.step is not None else (
            ("prefill.dvm", generator.prefill), ("decode.dvm", generator.decode))
        client = RayServiceClient.for_fleet(fleet)
        return [FleetLink(runtime, (directory / name).read_bytes(), fleet, client).start()
                for name, runtime in runtimes if runtime.jit is not None]

    def close(self) -> None:
        """Stop the scheduler (sequences still running end in an error), the fleet links
        and the JIT."""
        self.scheduler.close()
        for link in self.links:
            link.close()
        self.generator.close()

    def __del__(self) -> None:
        if getattr(self, "scheduler", None) is not None:
            self.close()

    @property
    def draining(self) -> bool:
        """True once the replica stops taking requests (Note [Replica drain])."""
        return self.gate.draining

    def begin_drain(self) -> int:
        """Stop taking requests (Note [Replica drain]); returns how many are in flight."""
        self.gate.draining = True
        return self.request_stats.in_flight

    def stats(self) -> dict:
        """Scheduler counters, occupancy, the latency snapshot and the step's JIT work
        (promotions, compiles and their seconds so far; settled: nothing queued or on
        probation)."""
        return {"model": self.model_name, **as_dict(self.request_stats.counters),
                "in_flight": self.request_stats.in_flight,
                "scheduler": dict(self.scheduler.counters),
                **self.metrics.snapshot(), **self.scheduler.occupancy(),
                "warm": dict(self.warm), "jit": self._jit_work(),
                "thread_slice_s": {"scheduler": self.scheduler.thread_slice,
                                   "loop": self.loop_slice},
                "fleet": [link.stats() for link in self.links]}

    def _jit_work(self) -> dict:
        generator = self.generator
        runtime = generator.step if generator.step is not None else generator.decode
        if runtime is None or runtime.jit is None:
            return {}
        stats = runtime.stats()
        return {"promotions": stats["promotions"], "compiles": stats["compiles"],
                "compile_seconds": stats["compile_seconds"], "settled": runtime.settled()}

    # ------------------------------------------------------------------ HTTP

    async def __call__(self, request: Request) -> Response:
        """Every HTTP request (route prefix `/`)."""
        if not self._loop_sliced:   # Note [Short slices for the step's threads]
            self._slice_loop_thread()
        path = request.scope["path"]
        root = request.scope.get("root_path", "")
        if root and root != "/" and path.startswith(root):
            path = path[len(root):] or "/"
        method = request.method
        openai = path.startswith("/v1/")
        try:
            return await self._route(request, method, path.rstrip("/") or "/")
        except RequestError as exc:
            return self._error(openai, str(exc), exc.status, exc.param, exc.code)
        except v2.ProtocolError as exc:
            return self._error(openai, str(exc), exc.status)
        except Exception as exc:
            return server_fault(f"{v2.cut(method, 20)} {v2.cut(request.url.path)}", exc)

    def _slice_loop_thread(self) -> None:
        """The event loop's thread asks for the scheduler's slice (once, on that thread)."""
        self._loop_sliced = True
        wanted = self.scheduler.config.thread_slice_s
        if wanted > 0:
            request_slice(wanted)
        self.loop_slice = thread_slice()

    def _error(self, openai: bool, message: str, status: int, param: str | None = None,
               code: str | None = None, headers: dict | None = None) -> Response:
        if openai:
            return json_response_with(openai_error(message, status, param, code), status,
                                      headers)
        return error_response(message, status, headers)

    async def _route(self, request: Request, method: str, path: str) -> Response:
        model = f"/v2/models/{self.model_name}"
        gets = {"/v2": self._server_metadata, "/v2/health/live": self._live,
                "/v2/health/ready": self._ready, model: self._metadata,
                f"{model}/versions/{MODEL_VERSION}": self._metadata,
                f"{model}/ready": self._ready, f"{model}/stats": self._stats,
                "/v1/models": self._models, "/metrics": self._prometheus}
        posts = {"/v1/completions": self._openai, f"{model}/generate": self._generate,
                 f"{model}/generate_stream": self._generate}
        for table, allowed in ((gets, "GET"), (posts, "POST")):
            if method == allowed and path in table:
                return await table[path](request, path)
        if path in gets or path in posts:
            allow = "GET" if path in gets else "POST"
            raise RequestError(f"method {v2.cut(method, 20)} is not allowed on {path} "
                               f"(allowed: {allow})", 405)
        raise RequestError(f"no route {v2.cut(request.url.path)}", 404)

    async def _server_metadata(self, request, path) -> Response:
        return json_response({"name": "dynvm", "version": dynvm.__version__,
                              "extensions": ["generate"]})

    async def _live(self, request, path) -> Response:
        return json_response({"live": True})

    async def _ready(self, request, path) -> Response:
        return json_response({"name": self.model_name, "ready": not self.draining},
                             status=503 if self.draining else 200)

    async def _metadata(self, request, path) -> Response:
        p = self.programs
        return json_response({"name": self.model_name, "versions": [MODEL_VERSION],
                              "platform": "dynvm-generator", "max_length": p.max_length,
                              "max_batch": p.max_batch, "eos_token_ids": list(p.eos_token_ids),
                              "tokenizer": self.tokenizer is not None})

    async def _stats(self, request, path) -> Response:
        return json_response(self.stats())

    async def _models(self, request, path) -> Response:
        return json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created,
             "owned_by": "dynvm", "max_model_len": self.programs.max_length}]})

    async def _prometheus(self, request, path) -> Response:
        return Response(self.metrics.prometheus_text(), 200,
                        media_type="text/plain; version=0.0.4")

    async def _openai(self, request, path) -> Response:
        body = await read_body(request, self.config.max_body_bytes)
        completion = parse_openai(bytes(body), self.model_name, self.tokenizer)
        shape = OpenAIShape(self.model_name, self.created)
        shape.prompt_tokens = len(completion.request.prompt)
        return await self._serve(completion, shape, _trace_headers(request))

    async def _generate(self, request, path) -> Response:
        body = await read_body(request, self.config.max_body_bytes)
        stream = path.endswith("_stream")
        completion = parse_v2_generate(bytes(body), self.tokenizer, stream)
        return await self._serve(completion, V2Shape(self.model_name),
                                 _trace_headers(request))

    # ------------------------------------------------------------------ generation

    async def _serve(self, completion: Completion, shape, trace: dict | None) -> Response:
        openai = isinstance(shape, OpenAIShape)
        refusal = self.gate.admit()  # draining: a quick 503
        if refusal is not None:
            return self._fault_response(openai, refusal)
        if not completion.stream:
            result = await self.gate.serve(
                lambda: self._whole(completion, shape, trace), trace)
            return self._fault_response(openai, result) if isinstance(result, Fault) \
                else result
        try:
            seq, events = self._submit(completion)
        except Exception as exc:  # a bad request or a full waiting room
            return self._fault_response(openai, self.gate.fault(exc, trace))
        text = TextStream(self.tokenizer, completion.stop_strings)
        pieces = self._pieces(seq, events, text, trace)
        return EventStream(self._events(seq, text, pieces, shape), 200, SSE_HEADERS,
                            media_type="text/event-stream")

    def _submit(self, completion: Completion):
        """The sequence submitted to the scheduler and the queue its events arrive on
        (on this loop, a step's events in one hop: Note [One hop per step])."""
        events: asyncio.Queue = asyncio.Queue()
        seq = self.scheduler.submit(completion.request, events.put_nowait,
                                    loop=asyncio.get_running_loop())
        return seq, events

    async def _whole(self, completion: Completion, shape, trace: dict | None) -> Response:
        """A whole (not streamed) completion's response; raises the request's error."""
        seq, events = self._submit(completion)
        text = TextStream(self.tokenizer, completion.stop_strings)
        pieces = self._pieces(seq, events, text, trace)
        try:
            async for _, _ in pieces:
                pass
        finally:
            await pieces.aclose()
        text.flush()
        return json_response(shape.whole(text, self._reason(seq, text)))

    def _fault_response(self, openai: bool, fault: Fault) -> Response:
        """A generation request's Fault in its protocol's shape: 400 naming the parameter,
        504 past the request's time, 503 + Retry-After when busy or draining, 500 + the
        error id (the v2 error body, as every server fault)."""
        if fault.kind is FaultKind.CLIENT:
            if isinstance(fault.error, GenerateTimeout):
                return self._error(openai, fault.message, 504)
            # The scheduler's messages begin with the parameter's name.
            return self._error(openai, fault.message, 400, fault.message.partition(":")[0])
        if fault.kind is FaultKind.BUSY:
            if fault.draining:
                return self._error(openai, f"model {self.model_name!r} is shutting down on "
                                   f"this replica; retry another", 503, headers=self._retry())
            return self._error(openai, f"model {self.model_name!r} is busy: {fault.message}; "
                               f"retry after {self.config.limits.retry_after_s} s", 503,
                               headers=self._retry())
        return error_response(fault.message, 500, {ERROR_ID_HEADER: fault.error_id})

    def _retry(self) -> dict:
        return {"Retry-After": str(self.config.limits.retry_after_s)}

    @staticmethod
    def _reason(seq, text: TextStream) -> str:
        return "stop" if text.stopped else (seq.finish_reason or "stop")

    async def _pieces(self, seq, events: asyncio.Queue, text: TextStream,
                      trace: dict | None):
        """(ready, last) pairs: `ready` a list of (token, text piece), the tokens queued
        when it was read (Note [Writes of what is ready]); `last` True on the pair that
        ends the sequence (its tokens may be none). Raises the sequence's error after
        the tokens before it. On exit (the end, a stop string, a client gone) the
        sequence is cancelled if it still runs."""
        try:
            while True:
                ready, end = [], None
                kind, value = await events.get()
                while True:
                    if kind == "token":
                        ready.append((value, text.push(value)))
                        if text.stopped:
                            end = ("end", None)
                            break
                    else:
                        end = (kind, value)
                        break
                    if events.empty():
                        break
                    kind, value = events.get_nowait()
                if end is not None and end[0] == "error":
                    if ready:
                        yield ready, False
                    raise end[1]
                if ready or end is not None:
                    yield ready, end is not None
                if end is not None:
                    return
        finally:
            if seq.finish_reason is None:
                seq.cancel()
                self.scheduler.wake()
            self._span(seq, text, trace)

    def _span(self, seq, text: TextStream, trace: dict | None) -> None:
        """A `dynvm.generate` span from the sequence's arrival to now, child of the
        request's traceparent, with its time to first token, tokens and end."""
        telemetry = self.telemetry
        if not telemetry.enabled:
            telemetry = Telemetry.from_global()
            if telemetry is None:
                return
        now = time.monotonic()
        start = time.time_ns() - int((now - seq.arrived) * 1e9)
        parent = propagate.extract(trace) if trace else None
        span = telemetry.tracer.start_span("dynvm.generate", context=parent, start_time=start)
        first = seq.first_token_at
        span.set_attributes({
            "dynvm.model": self.model_name,
            "dynvm.generate.prompt_tokens": len(seq.request.prompt),
            "dynvm.generate.completion_tokens": len(text.ids),
            "dynvm.generate.finish_reason": self._reason(seq, text) if seq.finish_reason
            or text.stopped else "cancelled",
            "dynvm.generate.ttft_s": -1.0 if first is None else first - seq.arrived,
            "dynvm.generate.tokens_per_s": (len(text.ids) / (now - first)
                                            if first is not None and now > first else 0.0)})
        span.end()

    async def _events(self, seq, text: TextStream, pieces, shape):
        """The SSE body as (bytes, more) pairs (`EventStream`): a chunk per token, then
        one with the finish reason (and any text held back), then the protocol's end,
        those three in one write (Note [One write at a stream's end]); an error becomes
        an error event in the protocol's shape. A client that goes away closes this
        generator: `pieces` closes with it and cancels the sequence."""
        tail = b"" if shape.done is None else sse(shape.done)
        with self.gate.tracked():  # in flight while it streams
            try:
                async for ready, last in pieces:   # Note [Writes of what is ready]
                    body = b"".join([shape.token_event(token, piece)
                                     for token, piece in ready])
                    if not last:
                        yield body, True
                        continue
                    end = sse(shape.chunk(None, text.flush(), self._reason(seq, text)))
                    yield body + end + tail, False
                    return
            except GenerateTimeout as exc:
                yield sse(shape.error(str(exc), 504)), True
            except Exception as exc:
                yield sse(shape.error(f"server error: {type(exc).__name__}: "
                                      f"{v2.cut(str(exc), 300)}", 500)), True
            finally:
                await pieces.aclose()
            yield tail, False


def _fault_of(exc: BaseException) -> Fault | None:
    """Whose fault a generation request's error is: a full waiting room is BUSY; a
    request the scheduler refuses (InputError: its message names the parameter) or one
    past its time (GenerateTimeout, 504) is the request's; anything else is None, a
    server fault."""
    if isinstance(exc, GenerateBusy):
        return Fault(FaultKind.BUSY, str(exc), exc)
    if isinstance(exc, InputError | GenerateTimeout):
        return Fault(FaultKind.CLIENT, str(exc), exc)
    return None


def _trace_headers(request: Request) -> dict | None:
    """The request's W3C trace-context headers, if it has any."""
    return {k: request.headers[k] for k in ("traceparent", "tracestate")
            if k in request.headers} or None


def json_response_with(doc, status: int, headers: dict | None) -> Response:
    """`doc` as JSON with `status` and extra headers."""
    response = json_response(doc, status)
    response.headers.update(headers or {})
    return response


GeneratorReplica = serve.deployment(name="GeneratorReplica",
                                    max_ongoing_requests=512)(GeneratorServer)


def generator_application(name: str, path: str, config: ServingConfig | None = None,
                          scheduler: SchedulerConfig | None = None):
    """The bound Serve deployment of one generator, its replicas on Serve's own loop
    (Note [Replica on Serve's loop] in dynvm.cluster.serving._deployment)."""
    from dynvm.cluster.serving._deployment import REPLICA_ENV, drain_options

    config = config if config is not None else ServingConfig()
    return GeneratorReplica.options(
        name=f"GeneratorReplica-{check_model_name(name)}",
        num_replicas=config.num_replicas,
        ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus or 0.0,
                           "runtime_env": {"env_vars": REPLICA_ENV}},
        logging_config={"enable_access_log": config.access_log}, **drain_options(config),
    ).bind(name, str(path), config, scheduler)


def serve_generator(name: str, path: str, config: ServingConfig | None = None,
                    scheduler: SchedulerConfig | None = None) -> dict:
    """Deploy a generator as the one application at route prefix `/` (Serve must be
    started; with `config.fleet`, the compile service too). In direct ingress, waits for
    the replica's port. Returns {app name: DeploymentHandle}."""
    from dynvm.cluster.protocol._http_front import model_app_name
    from dynvm.cluster.protocol.ingress import direct_addresses

    config = config if config is not None else ServingConfig()
    app = model_app_name(name)
    handle = serve.run(generator_application(name, path, config, scheduler), name=app,
                       route_prefix="/")
    if config.ingress == "direct":
        direct_addresses([app])
    return {app: handle}
