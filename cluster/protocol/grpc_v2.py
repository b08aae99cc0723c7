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
import math
import sys
from typing import Protocol

import grpc
import msgspec
from google.protobuf.message import DecodeError

import dynvm
from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._http_front import MODEL_VERSION
from dynvm.cluster.protocol._seam import Fault, FaultKind, InferSeam, RequestParsing
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


@dataclasses.dataclass(frozen=True)
class GrpcEncoder:
    """The ModelInferResponse of a model's outputs (an `Encoder` of
    dynvm.cluster.protocol._seam)."""

    model_name: str
    """The model the response names."""

    def encode(self, outputs, request: v2.InferRequest):
        """`infer_response`; raises v2.ProtocolError (an unknown output)."""
        return infer_response(self.model_name, outputs, request)


def model_metadata_response(doc: dict):
    """A ModelMetadataResponse from the HTTP metadata document (v2.model_metadata)."""
    pb = protos()
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=doc["name"], versions=doc["versions"], platform=doc["platform"],
        inputs=[tensor(**entry) for entry in doc["inputs"]],
        outputs=[tensor(**entry) for entry in doc["outputs"]])


# ---------------------------------------------------------------------------- status


def grpc_status(fault: Fault, model_name: str) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details of a request's Fault (classified once, for every
    transport, by the replica's seam: Note [Client or server fault] in
    dynvm.cluster.serving._replica)."""
    if fault.kind is FaultKind.CLIENT:
        if isinstance(fault.error, v2.NotFound):
            return grpc.StatusCode.NOT_FOUND, fault.message
        if isinstance(fault.error, v2.PayloadTooLarge):
            return grpc.StatusCode.RESOURCE_EXHAUSTED, fault.message
        return grpc.StatusCode.INVALID_ARGUMENT, fault.message
    if fault.kind is FaultKind.BUSY:
        return grpc.StatusCode.UNAVAILABLE, f"model {model_name!r} is busy: {fault.message}"
    return grpc.StatusCode.INTERNAL, fault.message  # the error id included


# ---------------------------------------------------------------------------- servicer


class GrpcReplica(Protocol):
    """What `GrpcInference` needs of the model replica it answers for."""

    model_name: str
    """The model this replica serves."""
    seam: InferSeam
    """Admission, execution and the fault mapping, shared with HTTP."""
    parsing: RequestParsing
    """How a request body is validated (the HTTP path's validator)."""

    def is_ready(self) -> bool:
        """Readiness: loaded and not draining."""
        ...

    def metadata(self) -> dict:
        """The HTTP metadata document (v2.model_metadata)."""
        ...


class GrpcInference:
    """The RPCs of GRPCInferenceService for one model replica (`GrpcReplica`): each RPC
    method is what Serve's gRPC proxy calls on the deployment by name, which the
    replica forwards here. An inference goes through the replica's seam as an HTTP
    infer request does: the same in-flight bound (UNAVAILABLE past it), counters,
    latency series and fault mapping."""

    def __init__(self, replica: GrpcReplica) -> None:
        self.replica = replica
        self.encoder = GrpcEncoder(replica.model_name)

    async def ServerLive(self, request, grpc_context=None):  # noqa: N802 (RPC names)
        """Live: this replica answers."""
        return protos().ServerLiveResponse(live=True)

    async def ServerReady(self, request, grpc_context=None):  # noqa: N802
        """Ready: this replica's model is loaded."""
        return protos().ServerReadyResponse(ready=bool(self.replica.is_ready()))

    async def ServerMetadata(self, request, grpc_context=None):  # noqa: N802
        """Name and version of the server (no extensions over gRPC)."""
        doc = v2.server_metadata(dynvm.__version__)
        return protos().ServerMetadataResponse(name=doc["name"], version=doc["version"],
                                               extensions=[])

    async def ModelReady(self, request, grpc_context=None):  # noqa: N802
        """Whether this model (and version, if given) is ready; NOT_FOUND for another."""
        pb = protos()
        try:
            self._check_model(request)
        except v2.ProtocolError as exc:
            return self._error(grpc_context, _client(exc), pb.ModelReadyResponse())
        return pb.ModelReadyResponse(ready=bool(self.replica.is_ready()))

    async def ModelMetadata(self, request, grpc_context=None):  # noqa: N802
        """The HTTP metadata document's content: inputs and outputs, -1 for dynamic."""
        try:
            self._check_model(request)
        except v2.ProtocolError as exc:
            return self._error(grpc_context, _client(exc), protos().ModelMetadataResponse())
        return model_metadata_response(self.replica.metadata())

    async def ModelInfer(self, request, grpc_context=None):  # noqa: N802
        """One inference through the replica's seam (class docstring)."""
        seam = self.replica.seam
        refusal = seam.admit()  # Note [Replica drain] in _deployment; the in-flight bound
        if refusal is not None:
            return self._error(grpc_context, refusal, protos().ModelInferResponse())
        trace = _trace(grpc_context)
        result = await seam.serve(lambda: self._infer(request, trace), trace)
        if isinstance(result, Fault):
            return self._error(grpc_context, result, protos().ModelInferResponse())
        return result

    async def _infer(self, request, trace):
        self._check_model(request)
        seam = self.replica.seam
        if _request_bytes(request) <= INLINE_GRPC_BYTES:
            parsed = self._parse(request)
        else:
            parsed = await seam.off_loop(self._parse, request)
        return await seam.execute(parsed, trace, self.encoder)

    def _parse(self, request) -> v2.InferRequest:
        parsing = self.replica.parsing
        return parse_infer_request(request, parsing.inputs,
                                   max_body_bytes=parsing.max_body_bytes,
                                   output_names=parsing.output_names,
                                   refuse_non_finite=parsing.refuse_non_finite)

    def _check_model(self, request) -> None:
        """Raises the ProtocolError of a request that is malformed (Note [Malformed gRPC
        messages]) or names another model or version."""
        if isinstance(request, MalformedMessage):
            raise request.error()
        if isinstance(request, protos().ModelInferRequest):
            name, version = request.model_name, request.model_version
        else:  # ModelReadyRequest, ModelMetadataRequest
            name, version = request.name, request.version
        model_name = self.replica.model_name
        if name != model_name:
            raise v2.NotFound(f"this application serves model {model_name!r}, not "
                              f"{v2.cut(repr(name))} (route with the 'application' metadata "
                              "key: dynvm-model-<name>)")
        if version not in ("", MODEL_VERSION):
            raise v2.NotFound(f"model {model_name!r} has no version "
                              f"{v2.cut(repr(version))} (versions: {MODEL_VERSION})")

    def _error(self, grpc_context, fault: Fault, empty):
        if grpc_context is None:  # called directly, not through Serve: raise it
            raise fault.error
        code, details = grpc_status(fault, self.replica.model_name)
        grpc_context.set_code(code)
        grpc_context.set_details(details)
        return empty


def _client(error: v2.ProtocolError) -> Fault:
    """The CLIENT fault of a ProtocolError raised before any inference."""
    return Fault(FaultKind.CLIENT, error.message, error)


def _trace(grpc_context) -> dict | None:
    """The request's W3C trace-context metadata, if any."""
    if grpc_context is None:
        return None
    found = {key: value for key, value in grpc_context.invocation_metadata()
             if key in TRACE_KEYS}
    return found or None
