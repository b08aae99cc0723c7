"""The Open Inference Protocol (KServe v2) over HTTP: parsing, validation, responses.

Pure functions, no Ray, no web framework: `dynvm.cluster.replica` feeds them the raw
body bytes and the `Inference-Header-Content-Length` header and sends back what they
build. Everything a client sends is validated before a tensor is made from it (DESIGN.md,
Invariants): the body size, the JSON header, every input's name, datatype, shape (rank,
each dim against its declared range, dims that share a name agreeing across inputs) and
the length of its data. Only then is a tensor built, from a validated slice of the body
copied into memory of its own (`torch.frombuffer` on a fresh `bytearray`). No pickle.

Every rejection is a `ProtocolError` carrying the HTTP status to answer with (400, 404
or 413) and a message that names the input and the problem; `error_body` turns one into
the protocol's `{"error": "..."}`.

Binary tensor extension: the body is a JSON header of `Inference-Header-Content-Length`
bytes followed by the raw bytes of each input that has `parameters.binary_data_size`, in
the order of the header's `inputs` list, little-endian, row-major. Responses are binary
when the request asks for it (`parameters.binary_data_output`, which tritonclient sends
by default, or `parameters.binary_data` on a requested output), JSON otherwise.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dynvm.vm.errors import DynvmError
from dynvm.vm.program import InputSpec

HEADER_LENGTH = "Inference-Header-Content-Length"
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
OUTPUT_PREFIX = "output__"
_MAX_NESTING = 64
_DIGITS = re.compile(r"[0-9]{1,20}")

# v2 datatype name <-> torch dtype. BYTES (strings) has no tensor counterpart here.
V2_TO_TORCH: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
TORCH_TO_V2: dict[torch.dtype, str] = {dtype: name for name, dtype in V2_TO_TORCH.items()}
KNOWN_DATATYPES = frozenset(V2_TO_TORCH) | {"BYTES"}


# ---------------------------------------------------------------------------- errors


class ProtocolError(DynvmError):
    """A request the server answers with an HTTP error; `status` is the code."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return type(self), (self.message,)


class BadRequest(ProtocolError):
    """Malformed body or header, or inputs that do not match the model (400)."""

    status = 400


class NotFound(ProtocolError):
    """Unknown model, version or route (404)."""

    status = 404


class PayloadTooLarge(ProtocolError):
    """The body is larger than the server's limit (413)."""

    status = 413


def error_body(error: BaseException | str) -> bytes:
    """The protocol's error body: `{"error": "<message>"}`."""
    message = error.message if isinstance(error, ProtocolError) else str(error)
    return json.dumps({"error": message}).encode()


# ---------------------------------------------------------------------------- helpers


def parse_length(text: str | None) -> int | None:
    """A decimal length header (ASCII digits only), or None when absent or not one."""
    if text is None or not _DIGITS.fullmatch(text.strip()):
        return None
    return int(text.strip())


def check_body_size(size: int, max_body_bytes: int) -> None:
    """Raise PayloadTooLarge when a body of `size` bytes exceeds the limit."""
    if size > max_body_bytes:
        raise PayloadTooLarge(f"request body is {size} bytes, the limit is {max_body_bytes}")


def cut(text: str, limit: int = 60) -> str:
    """`text`, cut to at most `limit` characters: every client-chosen string an error
    message echoes goes through here (or `_describe`), so no answer echoes a body."""
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."


def _describe(value) -> str:
    return cut(repr(value))


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def datatype_of(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_V2[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no Open Inference Protocol datatype") from None


def _json_loads(raw: bytes, what: str):
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON in {what}: {exc}") from None


# ---------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool


@dataclass(frozen=True)
class InferRequest:
    """A validated infer request: one tensor per program input, in program order."""

    id: str | None
    tensors: tuple[torch.Tensor, ...]
    outputs: tuple[RequestedOutput, ...] | None
    """The outputs asked for, in order; None = all of them."""
    binary_output: bool
    """Default format of outputs not listed with their own `binary_data`."""


@dataclass(frozen=True)
class _RawInput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: object  # JSON data (list/scalar) or None when binary
    binary_size: int | None


def _bool_param(params: Mapping, key: str, where: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{where}: parameter {key!r} must be true or false, "
                         f"got {_describe(value)}")
    return value


def _params(obj: Mapping, where: str) -> Mapping:
    params = obj.get("parameters", {})
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadRequest(f"{where}: 'parameters' must be an object, got {_describe(params)}")
    for key in params:
        if key.startswith("shared_memory"):
            raise BadRequest(f"{where}: shared memory ({key!r}) is not supported")
    return params


def _parse_raw_input(obj, index: int) -> _RawInput:
    if not isinstance(obj, dict):
        raise BadRequest(f"inputs[{index}] must be an object, got {_describe(obj)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"inputs[{index}] has no 'name' (a non-empty string)")
    where = f"input {_describe(name)}"  # not yet matched: the client's, maybe huge
    datatype = obj.get("datatype")
    if not isinstance(datatype, str):
        raise BadRequest(f"{where}: missing 'datatype' (a string such as \"FP32\")")
    shape = obj.get("shape")
    if not isinstance(shape, list):
        raise BadRequest(f"{where}: missing 'shape' (a list of non-negative integers)")
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise BadRequest(f"{where}: shape {_describe(shape)} must be a list of "
                             "non-negative integers")
    params = _params(obj, where)
    binary_size = params.get("binary_data_size")
    has_data = "data" in obj
    if binary_size is not None:
        if type(binary_size) is not int or binary_size < 0:
            raise BadRequest(f"{where}: binary_data_size must be a non-negative integer, "
                             f"got {_describe(binary_size)}")
        if has_data:
            raise BadRequest(f"{where}: has both 'data' and binary_data_size")
    elif not has_data:
        raise BadRequest(f"{where}: no 'data' and no binary_data_size")
    return _RawInput(name, datatype, tuple(shape), obj.get("data"), binary_size)


def _check_shape(raw: _RawInput, spec: InputSpec, bound: dict[str, tuple[int, str]]) -> None:
    where = f"input {spec.name!r}"
    if len(raw.shape) != len(spec.dims):
        raise BadRequest(f"{where}: shape {list(raw.shape)} has rank {len(raw.shape)}, "
                         f"expected rank {len(spec.dims)} "
                         f"[{', '.join(str(d) for d in spec.dims)}]")
    for axis, (size, dim) in enumerate(zip(raw.shape, spec.dims, strict=True)):
        if dim.is_static:
            if size != dim.low:
                raise BadRequest(f"{where}: dim {axis} is {size}, expected {dim.low}")
            continue
        if not dim.low <= size <= dim.high:
            raise BadRequest(f"{where}: dim {axis} ({dim.name}) is {size}, outside its "
                             f"declared range [{dim.low}, {dim.high}]")
        if dim.name in bound and bound[dim.name][0] != size:
            other_size, other = bound[dim.name]
            raise BadRequest(f"{where}: dim {axis} ({dim.name}) is {size} but input "
                             f"{other!r} has {dim.name}={other_size}")
        bound.setdefault(dim.name, (size, spec.name))


def _flatten_json(data, where: str) -> list:
    """Row-major flattening of nested JSON lists, iterative (no recursion limit)."""
    if not isinstance(data, list):
        return [data]
    out: list = []
    stack = [(iter(data), 0)]
    while stack:
        items, depth = stack[-1]
        for item in items:
            if isinstance(item, list):
                if depth + 1 > _MAX_NESTING:
                    raise BadRequest(f"{where}: 'data' is nested too deeply")
                stack.append((iter(item), depth + 1))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _check_json_values(values: list, dtype: torch.dtype, datatype: str, where: str) -> None:
    if dtype is torch.bool:
        for v in values:
            if type(v) is not bool:
                raise BadRequest(f"{where}: datatype BOOL needs true/false values, "
                                 f"got {_describe(v)}")
    elif dtype.is_floating_point:
        for v in values:
            if type(v) not in (int, float):
                raise BadRequest(f"{where}: datatype {datatype} needs numbers, "
                                 f"got {_describe(v)}")
    else:
        info = torch.iinfo(dtype)
        lo, hi = int(info.min), int(info.max)
        if dtype is torch.uint64:
            lo, hi = 0, 2**64 - 1
        for v in values:
            if type(v) is not int:
                raise BadRequest(f"{where}: datatype {datatype} needs integers, "
                                 f"got {_describe(v)}")
            if not lo <= v <= hi:
                raise BadRequest(f"{where}: value {v} is out of range for {datatype}")


def _json_tensor(raw: _RawInput, dtype: torch.dtype) -> torch.Tensor:
    where = f"input {raw.name!r}"
    values = _flatten_json(raw.data, where)
    expected = _numel(raw.shape)
    if len(values) != expected:
        raise BadRequest(f"{where}: 'data' has {len(values)} elements, shape "
                         f"{list(raw.shape)} needs {expected}")
    _check_json_values(values, dtype, raw.datatype, where)
    if dtype is torch.uint64:
        # Values >= 2**63 do not fit torch.tensor's int64 path: reinterpret the bits.
        bits = torch.tensor([v - 2**64 if v >= 2**63 else v for v in values], dtype=torch.int64)
        return bits.view(torch.uint64).reshape(raw.shape)
    if dtype in (torch.uint16, torch.uint32):
        return torch.tensor(values, dtype=torch.int64).to(dtype).reshape(raw.shape)
    return torch.tensor(values, dtype=dtype).reshape(raw.shape)


def _binary_tensor(raw: _RawInput, dtype: torch.dtype, chunk: bytes) -> torch.Tensor:
    if not chunk:
        return torch.empty(raw.shape, dtype=dtype)
    if dtype is torch.bool:
        # torch.frombuffer keeps any byte in a bool tensor, and a C++ bool holding 2 or
        # 255 is undefined behaviour in the kernels: refuse it, as the JSON path refuses
        # values other than true/false.
        bad = len(chunk) - len(chunk.lstrip(b"\x00\x01"))
        if bad < len(chunk):
            raise BadRequest(f"input {raw.name!r}: datatype BOOL needs bytes 0 or 1, "
                             f"byte {bad} of its binary data is {chunk[bad]}")
    # A copy of the validated slice: the tensor owns its memory, the body can go.
    flat = torch.frombuffer(bytearray(chunk), dtype=dtype)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is LE
        flat = flat.view(torch.uint8).reshape(-1, flat.element_size()).flip(1) \
            .reshape(-1).view(dtype)
    return flat.reshape(raw.shape)


def split_binary_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(JSON header, binary tail) per the `Inference-Header-Content-Length` header."""
    if header_length is None:
        return body, b""
    text = header_length.strip()
    if not _DIGITS.fullmatch(text):
        raise BadRequest(f"{HEADER_LENGTH} must be a non-negative integer, "
                         f"got {_describe(header_length)}")
    length = int(text)
    if length > len(body):
        raise BadRequest(f"{HEADER_LENGTH} is {length} but the body has only "
                         f"{len(body)} bytes")
    return body[:length], body[length:]


def parse_infer_request(
    body: bytes,
    inputs: Sequence[InputSpec],
    *,
    header_length: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    output_names: Sequence[str] | None = None,
) -> InferRequest:
    """Parse and validate an infer request body against the program's inputs.

    `header_length` is the `Inference-Header-Content-Length` header (None for a pure JSON
    body); `output_names`, when known, lets a request naming an unknown output fail here.
    Raises only `ProtocolError` subclasses.
    """
    if not isinstance(body, bytes | bytearray | memoryview):
        raise BadRequest("request body must be bytes")
    body = bytes(body)
    check_body_size(len(body), max_body_bytes)
    header_raw, tail = split_binary_body(body, header_length)
    what = "the request" if header_length is None else \
        f"the JSON header (the first {len(header_raw)} bytes, per {HEADER_LENGTH})"
    header = _json_loads(header_raw, what)
    if not isinstance(header, dict):
        raise BadRequest(f"the request must be a JSON object, got {_describe(header)}")

    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest(f"'id' must be a string, got {_describe(request_id)}")
    params = _params(header, "request")
    binary_output = _bool_param(params, "binary_data_output", "request")

    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list):
        raise BadRequest("the request has no 'inputs' list")
    parsed = [_parse_raw_input(obj, i) for i, obj in enumerate(raw_inputs)]

    specs = {spec.name: spec for spec in inputs}
    seen: dict[str, _RawInput] = {}
    for raw in parsed:
        if raw.name not in specs:
            raise BadRequest(f"unknown input {_describe(raw.name)}; the model's inputs are "
                             f"{', '.join(repr(s.name) for s in inputs)}")
        if raw.name in seen:
            raise BadRequest(f"input {raw.name!r} is given twice")
        seen[raw.name] = raw
    missing = [spec.name for spec in inputs if spec.name not in seen]
    if missing:
        raise BadRequest(f"missing input {', '.join(repr(n) for n in missing)}")

    # Signature: datatype and shape of every input before any data is looked at.
    bound: dict[str, tuple[int, str]] = {}
    for raw in parsed:
        spec = specs[raw.name]
        expected = TORCH_TO_V2.get(spec.dtype, str(spec.dtype))
        if raw.datatype != expected:
            known = "" if raw.datatype in KNOWN_DATATYPES else " (not a v2 datatype)"
            raise BadRequest(f"input {raw.name!r}: datatype {_describe(raw.datatype)}{known}, "
                             f"expected {expected}")
        _check_shape(raw, spec, bound)

    # Binary sections: sizes must match the shapes and add up to the tail exactly.
    offsets: dict[str, tuple[int, int]] = {}
    offset = 0
    for raw in parsed:
        if raw.binary_size is None:
            continue
        dtype = specs[raw.name].dtype
        needed = _numel(raw.shape) * dtype.itemsize
        if raw.binary_size != needed:
            raise BadRequest(f"input {raw.name!r}: binary_data_size is {raw.binary_size} "
                             f"bytes, shape {list(raw.shape)} of {raw.datatype} needs {needed}")
        if offset + needed > len(tail):
            raise BadRequest(f"input {raw.name!r}: binary data ends at byte {offset + needed} "
                             f"of the binary section, which has only {len(tail)} bytes "
                             f"(check {HEADER_LENGTH})")
        offsets[raw.name] = (offset, offset + needed)
        offset += needed
    if offset != len(tail):
        raise BadRequest(f"the body has {len(tail)} bytes after the JSON header, the inputs' "
                         f"binary_data_size add up to {offset} (check {HEADER_LENGTH})")

    requested = _parse_requested_outputs(header, binary_output, output_names)

    tensors: dict[str, torch.Tensor] = {}
    for raw in parsed:
        dtype = specs[raw.name].dtype
        if raw.name in offsets:
            start, end = offsets[raw.name]
            tensors[raw.name] = _binary_tensor(raw, dtype, tail[start:end])
        else:
            tensors[raw.name] = _json_tensor(raw, dtype)
    return InferRequest(
        id=request_id,
        tensors=tuple(tensors[spec.name] for spec in inputs),
        outputs=requested,
        binary_output=binary_output,
    )


def _parse_requested_outputs(header: Mapping, binary_output: bool,
                             output_names: Sequence[str] | None
                             ) -> tuple[RequestedOutput, ...] | None:
    outputs = header.get("outputs")
    if outputs is None:
        return None
    if not isinstance(outputs, list):
        raise BadRequest(f"'outputs' must be a list, got {_describe(outputs)}")
    result = []
    for i, obj in enumerate(outputs):
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise BadRequest(f"outputs[{i}] must be an object with a 'name'")
        name = obj["name"]
        if output_names is not None and name not in output_names:
            raise BadRequest(f"unknown output {_describe(name)}; the model's outputs are "
                             f"{', '.join(repr(n) for n in output_names)}")
        params = _params(obj, f"output {_describe(name)}")
        binary = _bool_param(params, "binary_data", f"output {_describe(name)}") \
            if "binary_data" in params else binary_output
        result.append(RequestedOutput(name, binary))
    return tuple(result)


# ---------------------------------------------------------------------------- responses


def output_name(index: int) -> str:
    return f"{OUTPUT_PREFIX}{index}"


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def _tensor_json(t: torch.Tensor) -> list:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype in (torch.uint16, torch.uint32):
        flat = flat.to(torch.int64)
    elif flat.dtype is torch.uint64:
        return [v + 2**64 if v < 0 else v for v in flat.view(torch.int64).tolist()]
    return flat.tolist()


def build_infer_response(model_name: str, model_version: str | None,
                         outputs: Sequence[torch.Tensor], request: InferRequest
                         ) -> tuple[bytes, dict[str, str]]:
    """The response body and headers for `outputs` (named output__0, output__1, ...)."""
    by_name = {output_name(i): t for i, t in enumerate(outputs)}
    if request.outputs is None:
        wanted = [RequestedOutput(name, request.binary_output) for name in by_name]
    else:
        wanted = list(request.outputs)
        for want in wanted:
            if want.name not in by_name:
                raise BadRequest(f"unknown output {_describe(want.name)}; the model's outputs are "
                                 f"{', '.join(repr(n) for n in by_name)}")
    entries = []
    chunks: list[bytes] = []
    for want in wanted:
        t = by_name[want.name]
        entry = {"name": want.name, "datatype": datatype_of(t.dtype), "shape": list(t.shape)}
        if want.binary:
            raw = _tensor_bytes(t)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = _tensor_json(t)
        entries.append(entry)
    response: dict = {"model_name": model_name}
    if model_version:
        response["model_version"] = model_version
    if request.id is not None:
        response["id"] = request.id
    response["outputs"] = entries
    header = json.dumps(response).encode()
    if not chunks:
        return header, {"Content-Type": "application/json"}
    return header + b"".join(chunks), {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(len(header)),
    }


# ---------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class TensorMetadata:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 for a dynamic dim

    def as_json(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def input_metadata(spec: InputSpec) -> TensorMetadata:
    shape = tuple(d.low if d.is_static else -1 for d in spec.dims)
    return TensorMetadata(spec.name, TORCH_TO_V2.get(spec.dtype, str(spec.dtype)), shape)


def output_metadata_from_probes(probes: Sequence[Sequence[torch.Tensor]]
                                ) -> list[TensorMetadata]:
    """Output metadata from the results of runs at different input sizes: a dim that
    differs between runs (or whose rank differs) is reported as -1."""
    if not probes:
        return []
    first = probes[0]
    result = []
    for i, t in enumerate(first):
        shapes = [tuple(p[i].shape) for p in probes if i < len(p)]
        if len({len(s) for s in shapes}) != 1:
            shape: tuple[int, ...] = (-1,)
        else:
            shape = tuple(col[0] if len(set(col)) == 1 else -1 for col in zip(*shapes))
        result.append(TensorMetadata(output_name(i), TORCH_TO_V2.get(t.dtype, str(t.dtype)),
                                     shape))
    return result


def model_metadata(name: str, versions: Sequence[str], inputs: Sequence[InputSpec],
                   outputs: Sequence[TensorMetadata], platform: str = "dynvm") -> dict:
    return {
        "name": name,
        "versions": list(versions),
        "platform": platform,
        "inputs": [input_metadata(spec).as_json() for spec in inputs],
        "outputs": [o.as_json() for o in outputs],
    }


def server_metadata(version: str) -> dict:
    return {"name": "dynvm", "version": version, "extensions": ["binary_tensor_data"]}
