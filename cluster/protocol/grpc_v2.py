"""The Open Inference Protocol over gRPC (KServe's `GRPCInferenceService`) on a model
replica, through Ray Serve's gRPC ingress.

Serve's gRPC proxy registers the service from `grpc_options()` and calls the method of
the ingress deployment named as the RPC (ModelInfer, ModelMetadata, ...) with the
decoded request message and a `grpc_context` keyword. It routes by the `application`
metadata key alone, never by the message's `model_name`: every call names the model's
Serve application, `model_app_name(name)` ("dynvm-model-<name>"), e.g. with
tritonclient.grpc: `client.infer(name, inputs, headers={"application": ...})`. A model
replica answers the server-level RPCs too (ServerLive, ServerReady, ServerMetadata), so
any model's application does for those.

The messages are tritonclient's compiled KServe protos (tritonclient.grpc.service_pb2);
without tritonclient installed, HTTP serving works as before and `grpc_options` says
what is missing.

Note [tritonclient's proto module name]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
tritonclient's service_pb2 builds its message classes under the module name
"grpc_service_pb2" (its .proto's file name), which nothing provides. Serve's proxy
pickles each request message on its way to the replica, and pickle finds a class by its
module name: without that module, every RPC fails with a PicklingError. Importing this
module registers tritonclient's service_pb2 under that name in sys.modules; the proxy
imports it (SERVICER_FUNCTION lives here) and so does every model replica (through
dynvm.cluster.serving._replica) before its first request.

Note [gRPC requests through the HTTP validator]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ModelInferRequest is rewritten as the HTTP binary-tensor body it stands for (a JSON
header naming each input's datatype, shape and `binary_data_size`, then the inputs'
raw bytes) and parsed by `v2_protocol.parse_infer_request`: one validator, so every
rule of the HTTP path (datatypes, declared dim ranges, dims shared between inputs, BOOL
bytes, non-finite refusal, body limit, shared memory refused, messages that name the
input) holds for gRPC without a second copy of it. Typed `contents` (the small-tensor
form) become the header's JSON `data`. What this costs is one more copy of the raw
bytes (into the body) next to the copy the validator makes anyway; the gRPC messages
were already decoded by Serve, so the validator's work bound is the message size.
Requests of at most INLINE_GRPC_BYTES are parsed on the event loop (21-32 us for 4-64
KiB of raw contents on the loaded 2-core host, less than a thread hop); larger ones on
the replica's parse threads. (An HTTP body's bound, replica.INLINE_JSON_BYTES, is 8 KiB:
JSON text costs more per byte.)

Note [Malformed gRPC messages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Serve's gRPC proxy parses each request message with the deserializer registered for its
method before routing it. grpc's own handling of a deserializer that raises (bytes that
are not the message, a truncated one, or a proto3 string field that is not UTF-8, which
protobuf refuses as corrupt wire format) answers INTERNAL or UNKNOWN, which clients read
as a server fault. So the handlers are registered here, from the protos' service
descriptor, with a parser that returns a `MalformedMessage` (type and size, nothing the
client sent) instead of raising; the replica's RPC answers it INVALID_ARGUMENT like any
other client fault, counted as an error.

Status codes: a client fault (ProtocolError, or a model error that the HTTP path answers
with a 400, Note [Client or server fault]) is INVALID_ARGUMENT, an unknown model or
version NOT_FOUND, a message past the body limit RESOURCE_EXHAUSTED, a full replica
UNAVAILABLE (the code clients retry, as HTTP's 503), a server fault INTERNAL with the
error id that the log carries.
The code is set on Serve's `grpc_context` and an empty message returned: Serve's proxy
then answers with that code and details (raising instead would log a traceback per bad
request).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import sys

import grpc
import msgspec
from google.protobuf.message import DecodeError

import dynvm
from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._http_front import MODEL_VERSION
from dynvm.cluster.serving._batcher import Overloaded
from dynvm.cluster.serving._faults import is_client_fault
from dynvm.vm.errors import DynvmError

# What Serve's gRPC proxy imports to register the service (gRPCOptions).
SERVICER_FUNCTION = "dynvm.cluster.protocol.grpc_v2.add_inference_servicer"
PROTO_MODULE = "tritonclient.grpc.service_pb2"
PROTO_MODULE_AS_BUILT = "grpc_service_pb2"  # Note [tritonclient's proto module name]
SERVICE = "GRPCInferenceService"  # in the protos' package "inference"
INLINE_GRPC_BYTES = 64 * 1024
TRACE_KEYS = ("traceparent", "tracestate")

# The typed field of InferTensorContents that carries each datatype's values; FP16 and
# BF16 have none (raw_input_contents only), BYTES is not a tensor datatype here.
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
}
# Parameters of the HTTP binary extension: set here from the message's own structure,
# never taken from a client's gRPC parameters.
_HTTP_ONLY_PARAMS = frozenset({"binary_data_size", "binary_data", "binary_data_output"})


class GrpcUnavailable(DynvmError, RuntimeError):
    """gRPC serving needs tritonclient's KServe protos, which are not installed."""


@functools.cache
def protos():
    """tritonclient.grpc.service_pb2 (the KServe v2 gRPC messages), registered under
    the module name its classes carry (Note [tritonclient's proto module name])."""
    try:
        module = importlib.import_module(PROTO_MODULE)
    except ImportError as exc:
        raise GrpcUnavailable(f"gRPC serving needs tritonclient's protos: pip install "
                              f"'tritonclient[http]' grpcio ({exc})") from None
    sys.modules.setdefault(PROTO_MODULE_AS_BUILT, module)
    return module


def grpc_options(port: int) -> dict:
    """`grpc_options` for `serve.start`: the v2 gRPC service on `port` (all interfaces,
    Serve's choice). Raises GrpcUnavailable early when the protos are missing."""
    protos()
    return {"port": int(port), "grpc_servicer_functions": [SERVICER_FUNCTION]}


@dataclasses.dataclass(frozen=True)
class MalformedMessage:
    """What a request message that protobuf cannot parse arrives as: its type and size,
    so the RPC answers INVALID_ARGUMENT (Note [Malformed gRPC messages])."""

    type_name: str
    """The message type it should have been, e.g. "ModelInferRequest"."""
    size: int
    """Its length in bytes."""

    def error(self) -> v2.BadRequest:
        """The client fault it stands for."""
        return v2.BadRequest(f"the {self.type_name} message ({self.size} bytes) cannot be "
                             "parsed: its wire format is corrupt or a string field is not "
                             "valid UTF-8")


def _tolerant_parser(message_class):
    """`message_class.FromString` that returns a MalformedMessage instead of raising."""
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return MalformedMessage(message_class.DESCRIPTOR.name, len(data))
    return parse


# grpc's handler constructor by (client streaming, server streaming).
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_inference_servicer(servicer, server) -> None:
    """Register GRPCInferenceService on Serve's gRPC server (Serve replaces every
    handler's behaviour with its own routing; `servicer` is its placeholder), each
    request parsed by a tolerant parser (Note [Malformed gRPC messages])."""
    pb = protos()
    service = pb.DESCRIPTOR.services_by_name[SERVICE]
    handlers = {
        method.name: _HANDLER_KINDS[method.client_streaming, method.server_streaming](
            getattr(servicer, method.name),
            request_deserializer=_tolerant_parser(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString)
        for method in service.methods}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


with contextlib.suppress(GrpcUnavailable):  # Note [tritonclient's proto module name]
    protos()


# ---------------------------------------------------------------------------- requests


def _param_value(param):
    kind = param.WhichOneof("parameter_choice")
    return None if kind is None else getattr(param, kind)


def _params(params) -> dict:
    return {key: _param_value(value) for key, value in params.items()
            if key not in _HTTP_ONLY_PARAMS}


def _json_values(values, datatype: str) -> list:
    """A typed contents field as JSON data; non-finite floats as the strings the
    validator reads back (Note [Non-finite JSON numbers])."""
    values = list(values)
    if datatype in ("FP32", "FP64"):
        return [v if math.isfinite(v) else v2._non_finite_text(v) for v in values]
    return values


def _typed_data(tensor, where: str) -> list:
    """The values of an input sent as typed `contents`."""
    present = [field.name for field, _ in tensor.contents.ListFields()]
    field = _CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        # No typed field (FP16, BF16) or no tensor datatype (BYTES, unknown): the
        # validator names the datatype problem; the values do not matter.
        if tensor.datatype in v2.V2_TO_TORCH and present:
            raise v2.BadRequest(f"{where}: datatype {tensor.datatype} has no typed contents "
                                "field; send it in raw_input_contents")
        return []
    if any(name != field for name in present):
        raise v2.BadRequest(f"{where}: datatype {v2.cut(tensor.datatype)} carries its values "
                            f"in contents.{field}, got {', '.join(present)}")
    return _json_values(getattr(tensor.contents, field), tensor.datatype)


def _check_raw_size(tensor, raw: bytes, index: int, where: str) -> None:
    """The size check of raw_input_contents, worded for gRPC (the validator's says
    binary_data_size, which a gRPC client never sent)."""
    dtype = v2.V2_TO_TORCH.get(tensor.datatype)
    if dtype is None or any(dim < 0 for dim in tensor.shape):
        return  # the validator names the datatype or the shape
    needed = math.prod(tensor.shape) * dtype.itemsize
    if len(raw) != needed:
        raise v2.BadRequest(f"{where}: raw_input_contents[{index}] has {len(raw)} bytes, "
                            f"shape {list(tensor.shape)} of {tensor.datatype} needs {needed}")


def _binary_body(request) -> tuple[bytes, str]:
    """(body, Inference-Header-Content-Length) of the HTTP binary-tensor body that
    `request` stands for (Note [gRPC requests through the HTTP validator])."""
    raws = list(request.raw_input_contents)
    if raws and len(raws) != len(request.inputs):
        raise v2.BadRequest(f"raw_input_contents has {len(raws)} entries for "
                            f"{len(request.inputs)} inputs (one per input, in order)")
    inputs = []
    for i, tensor in enumerate(request.inputs):
        where = f"input {v2.cut(repr(tensor.name))}"
        entry = {"name": tensor.name, "datatype": tensor.datatype,
                 "shape": list(tensor.shape)}
        params = _params(tensor.parameters)
        if raws:
            if tensor.HasField("contents"):
                raise v2.BadRequest(f"{where}: has contents, but the request sends its "
                                    "inputs in raw_input_contents")
            _check_raw_size(tensor, raws[i], i, where)
            params["binary_data_size"] = len(raws[i])
        else:
            entry["data"] = _typed_data(tensor, where)
        if params:
            entry["parameters"] = params
        inputs.append(entry)
    header: dict = {"inputs": inputs, "parameters": _params(request.parameters)}
    if request.id:
        header["id"] = request.id
    if request.outputs:
        header["outputs"] = [{"name": out.name, "parameters": _params(out.parameters)}
                             for out in request.outputs]
    head = msgspec.json.encode(header)
    return head + b"".join(raws), str(len(head))


def parse_infer_request(request, inputs, *, max_body_bytes: int = v2.DEFAULT_MAX_BODY_BYTES,
                        output_names=None, refuse_non_finite: bool = False) -> v2.InferRequest:
    """A ModelInferRequest as the validated v2.InferRequest that the HTTP path makes
    (Note [gRPC requests through the HTTP validator]); raises ProtocolError."""
    try:
        body, header_length = _binary_body(request)
    except (msgspec.EncodeError, OverflowError) as exc:  # a parameter JSON cannot carry
        raise v2.BadRequest(f"the request cannot be read: {v2.cut(str(exc), 200)}") from None
    return v2.parse_infer_request(body, inputs, header_length=header_length,
                                  max_body_bytes=max_body_bytes, output_names=output_names,
                                  refuse_non_finite=refuse_non_finite)


def _request_bytes(request) -> int:
    return sum(len(raw) for raw in request.raw_input_contents) + \
        sum(tensor.contents.ByteSize() for tensor in request.inputs)


# ---------------------------------------------------------------------------- responses


def infer_response(model_name: str, outputs, request: v2.InferRequest):
    """The ModelInferResponse of `outputs` (output__0, ...): the requested ones, or all,
    each as raw_output_contents (what tritonclient's as_numpy reads)."""
    pb = protos()
    by_name = {v2.output_name(i): t for i, t in enumerate(outputs)}
    wanted = list(by_name) if request.outputs is None else [o.name for o in request.outputs]
    response = pb.ModelInferResponse(model_name=model_name, model_version=MODEL_VERSION,
                                     id=request.id or "")
    for name in wanted:
        tensor = by_name.get(name)
        if tensor is None:
            raise v2.BadRequest(f"unknown output {v2.cut(repr(name))}; the model's outputs "
                                f"are {', '.join(repr(n) for n in by_name)}")
        response.outputs.add(name=name, datatype=v2.datatype_of(tensor.dtype),
                              shape=list(tensor.shape))
        # The bytes the HTTP binary extension sends (v2's own encoder, shared).
        response.raw_output_contents.append(v2._tensor_bytes(tensor))
    return response


def model_metadata_response(doc: dict):
    """A ModelMetadataResponse from the HTTP metadata document (v2.model_metadata)."""
    pb = protos()
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=doc["name"], versions=doc["versions"], platform=doc["platform"],
        inputs=[tensor(**entry) for entry in doc["inputs"]],
        outputs=[tensor(**entry) for entry in doc["outputs"]])


# ---------------------------------------------------------------------------- status


def status_of(error: BaseException, model_name: str, is_client_fault
              ) -> tuple[grpc.StatusCode, str] | None:
    """The gRPC status code and details for an error of a request to `model_name`, or
    None for a server fault (INTERNAL, `internal_status`). `is_client_fault(error)`
    tells a model call's client faults from server faults (the HTTP path's rule, Note
    [Client or server fault] in dynvm.cluster.serving._replica)."""
    if isinstance(error, v2.NotFound):
        return grpc.StatusCode.NOT_FOUND, error.message
    if isinstance(error, v2.PayloadTooLarge):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, error.message
    if isinstance(error, v2.ProtocolError):
        return grpc.StatusCode.INVALID_ARGUMENT, error.message
    if is_client_fault(error):
        return grpc.StatusCode.INVALID_ARGUMENT, f"model {model_name!r}: {error}"
    if isinstance(error, Overloaded):
        return grpc.StatusCode.UNAVAILABLE, f"model {model_name!r} is busy: {error}"
    return None


def internal_status(fault) -> tuple[grpc.StatusCode, str]:
    """INTERNAL with the message of the HTTP path's 500 `fault` (its log line, error id
    and span are made already), the error id included."""
    return grpc.StatusCode.INTERNAL, json.loads(fault.body)["error"]


# ---------------------------------------------------------------------------- servicer


class GrpcInferenceMixin:
    """The RPCs of GRPCInferenceService, for a Serve deployment that is also a v2 model
    replica. What it uses of the class it is mixed into: `model_name`, `program`
    (its `inputs`), `output_names`, `max_body_bytes`, `limits` (ServingLimits),
    `draining` (True once the replica stops taking requests),
    `request_stats` (`full`, `tracked`, `counters`: gRPC requests count as HTTP ones
    do), `_off_loop(fn, ...)` (the parse threads), `_server_fault(error, trace)`
    (the traced 500), and the replica's seam, `infer_request(request, trace)`,
    `metadata()` and `is_ready()`."""

    async def ServerLive(self, request, grpc_context=None):  # noqa: N802 (RPC names)
        """Live: this replica answers."""
        return protos().ServerLiveResponse(live=True)

    async def ServerReady(self, request, grpc_context=None):  # noqa: N802
        """Ready: this replica's model is loaded."""
        return protos().ServerReadyResponse(ready=bool(self.is_ready()))

    async def ServerMetadata(self, request, grpc_context=None):  # noqa: N802
        """Name and version of the server (no extensions over gRPC)."""
        doc = v2.server_metadata(dynvm.__version__)
        return protos().ServerMetadataResponse(name=doc["name"], version=doc["version"],
                                               extensions=[])

    async def ModelReady(self, request, grpc_context=None):  # noqa: N802
        """Whether this model (and version, if given) is ready; NOT_FOUND for another."""
        pb = protos()
        try:
            self._grpc_check_model(request)
        except v2.ProtocolError as exc:
            return self._grpc_error(grpc_context, exc, pb.ModelReadyResponse())
        return pb.ModelReadyResponse(ready=bool(self.is_ready()))

    async def ModelMetadata(self, request, grpc_context=None):  # noqa: N802
        """The HTTP metadata document's content: inputs and outputs, -1 for dynamic."""
        try:
            self._grpc_check_model(request)
        except v2.ProtocolError as exc:
            return self._grpc_error(grpc_context, exc, protos().ModelMetadataResponse())
        return model_metadata_response(self.metadata())

    async def ModelInfer(self, request, grpc_context=None):  # noqa: N802
        """One inference through the replica's batcher, as an HTTP infer request: the
        same in-flight bound (UNAVAILABLE past it), counters and latency series."""
        stats = self.request_stats
        limit = self.limits.max_concurrent_requests
        if self.draining:  # as HTTP answers 503 (Note [Replica drain] in _deployment)
            return self._grpc_error(grpc_context, Overloaded(
                "shutting down on this replica; retry another"),
                protos().ModelInferResponse())
        if stats.full(limit):
            stats.counters.rejected_busy += 1
            return self._grpc_error(grpc_context, Overloaded(
                f"{stats.in_flight} requests in flight on this replica, the limit is "
                f"{limit}"), protos().ModelInferResponse())
        with stats.tracked():
            return await self._grpc_infer(request, grpc_context)

    async def _grpc_infer(self, request, grpc_context):
        trace = _trace(grpc_context)
        try:
            self._grpc_check_model(request)
            if _request_bytes(request) <= INLINE_GRPC_BYTES:
                parsed = self._grpc_parse(request)
            else:
                parsed = await self._off_loop(self._grpc_parse, request)
            outputs = await self.infer_request(parsed, trace)
            return infer_response(self.model_name, outputs, parsed)
        except Exception as exc:  # every error becomes this request's status
            busy = isinstance(exc, Overloaded)
            counters = self.request_stats.counters
            if busy:
                counters.rejected_busy += 1
            else:
                counters.errors += 1
            return self._grpc_error(grpc_context, exc, protos().ModelInferResponse(), trace)

    def _grpc_parse(self, request) -> v2.InferRequest:
        return parse_infer_request(request, self.program.inputs,
                                   max_body_bytes=self.max_body_bytes,
                                   output_names=self.output_names,
                                   refuse_non_finite=self.limits.refuse_non_finite)

    def _grpc_check_model(self, request) -> None:
        """Raises the ProtocolError of a request that is malformed (Note [Malformed gRPC
        messages]) or names another model or version."""
        if isinstance(request, MalformedMessage):
            raise request.error()
        if isinstance(request, protos().ModelInferRequest):
            name, version = request.model_name, request.model_version
        else:  # ModelReadyRequest, ModelMetadataRequest
            name, version = request.name, request.version
        if name != self.model_name:
            raise v2.NotFound(f"this application serves model {self.model_name!r}, not "
                              f"{v2.cut(repr(name))} (route with the 'application' metadata "
                              "key: dynvm-model-<name>)")
        if version not in ("", MODEL_VERSION):
            raise v2.NotFound(f"model {self.model_name!r} has no version "
                              f"{v2.cut(repr(version))} (versions: {MODEL_VERSION})")

    def _grpc_error(self, grpc_context, error: BaseException, empty, trace=None):
        if grpc_context is None:  # called directly, not through Serve: raise it
            raise error
        status = status_of(error, self.model_name, is_client_fault)
        if status is None:
            status = internal_status(self._server_fault(error, trace))
        grpc_context.set_code(status[0])
        grpc_context.set_details(status[1])
        return empty


def _trace(grpc_context) -> dict | None:
    """The request's W3C trace-context metadata, if any."""
    if grpc_context is None:
        return None
    found = {key: value for key, value in grpc_context.invocation_metadata()
             if key in TRACE_KEYS}
    return found or None
