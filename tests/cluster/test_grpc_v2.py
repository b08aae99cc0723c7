"""The v2 gRPC protocol (KServe's GRPCInferenceService): message conversion and status
codes (pure, no Ray), then a real Serve app behind Serve's gRPC ingress, called with
tritonclient.grpc.
"""

from __future__ import annotations

import json
import math
import random
import urllib.request

import grpc
import numpy as np
import pytest
import torch

from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol import grpc_v2
from dynvm.cluster.protocol._seam import record_server_fault
from dynvm.cluster.serving._batcher import Overloaded
from dynvm.cluster.serving._infer_seam import fault_of
from dynvm.vm.errors import ExecutionError, ShapeError
from dynvm.vm.program import DimSpec, InputSpec

tritongrpc = pytest.importorskip("tritonclient.grpc")
pb = grpc_v2.protos()

# The end-to-end tests' Serve is the one shared with other modules (Note [Shared Serve in
# tests] in tests/cluster/_shared_serve.py); the pure tests run beside it.
pytestmark = pytest.mark.shared_serve

BATCH = DimSpec("batch", 1, 8)


def spec(dtype: torch.dtype, name: str = "x") -> InputSpec:
    return InputSpec(name, dtype, (BATCH, DimSpec("", 3, 3)))


def sample(dtype: torch.dtype, rows: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows)
    if dtype is torch.bool:
        return torch.randint(0, 2, (rows, 3), generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(rows, 3, generator=gen).to(dtype)
    if dtype is torch.uint64:  # above 2**63: the range int64 cannot hold
        return (torch.randint(0, 2**62, (rows, 3), generator=gen) * 3).view(torch.uint64)
    info = torch.iinfo(dtype)
    low, high = max(int(info.min), -(2**62)), min(int(info.max), 2**62)
    return torch.randint(low, high, (rows, 3), generator=gen, dtype=torch.int64).to(dtype)


def raw_request(tensors: dict[str, torch.Tensor], datatypes: dict | None = None,
                **fields):
    request = pb.ModelInferRequest(model_name="m", **fields)
    for name, t in tensors.items():
        datatype = (datatypes or {}).get(name, v2.datatype_of(t.dtype))
        request.inputs.add(name=name, datatype=datatype, shape=list(t.shape))
        request.raw_input_contents.append(t.contiguous().view(torch.uint8).numpy().tobytes())
    return request


def typed_request(name: str, datatype: str, shape, field: str, values):
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name=name, datatype=datatype, shape=list(shape))
    getattr(tensor.contents, field).extend(values)
    return request


def parse(request, specs, **kw) -> v2.InferRequest:
    return grpc_v2.parse_infer_request(request, specs, **kw)


def refused(request, specs, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(v2.ProtocolError) as info:
        parse(request, specs, **kw)
    return grpc_v2.grpc_status(fault_of(info.value, "m"), "m")


def as_float(t) -> np.ndarray:
    return np.asarray(t, dtype=np.float64) if not isinstance(t, torch.Tensor) else \
        t.to(torch.float64).numpy() if t.dtype is not torch.uint64 else \
        np.asarray(t.view(torch.int64).numpy().view(np.uint64), dtype=np.float64)


@pytest.mark.parametrize("datatype", sorted(v2.V2_TO_TORCH))
def test_raw_contents_round_trip_every_datatype(datatype):
    dtype = v2.V2_TO_TORCH[datatype]
    tensor = sample(dtype)
    parsed = parse(raw_request({"x": tensor}, id="r-7"), [spec(dtype)])
    assert parsed.tensors[0].dtype == dtype
    assert torch.equal(parsed.tensors[0].view(torch.uint8), tensor.view(torch.uint8))
    response = grpc_v2.infer_response("m", [parsed.tensors[0]], parsed)
    assert response.id == "r-7" and response.model_name == "m"
    assert response.outputs[0].datatype == datatype
    got = tritongrpc.InferResult(response).as_numpy("output__0")  # the client's reading
    assert got.shape == (2, 3)
    assert np.array_equal(np.asarray(got, dtype=np.float64), as_float(tensor))


@pytest.mark.parametrize("datatype", sorted(grpc_v2._CONTENTS_FIELD))
def test_typed_contents_every_datatype(datatype):
    dtype = v2.V2_TO_TORCH[datatype]
    tensor = sample(dtype, rows=3)
    values = (tensor.view(torch.int64).tolist() if dtype is torch.uint64 else tensor.tolist())
    if dtype is torch.uint64:
        values = [[v + 2**64 if v < 0 else v for v in row] for row in values]
    flat = [v for row in values for v in row]
    request = typed_request("x", datatype, (3, 3), grpc_v2._CONTENTS_FIELD[datatype], flat)
    parsed = parse(request, [spec(dtype)])
    assert torch.equal(parsed.tensors[0], tensor)


def test_typed_floats_carry_non_finite_values_unless_refused():
    values = [1.0, math.nan, math.inf, -math.inf, 0.5, -2.0]
    request = typed_request("x", "FP32", (2, 3), "fp32_contents", values)
    got = parse(request, [spec(torch.float32)]).tensors[0].flatten().tolist()
    assert got[0] == 1.0 and math.isnan(got[1]) and got[2:4] == [math.inf, -math.inf]
    code, details = refused(request, [spec(torch.float32)], refuse_non_finite=True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "element 1" in details


def test_requested_outputs_are_answered_in_order():
    request = raw_request({"x": sample(torch.float32)})
    request.outputs.add(name="output__1")
    parsed = parse(request, [spec(torch.float32)], output_names=["output__0", "output__1"])
    outputs = [torch.zeros(2, 1), torch.arange(4, dtype=torch.int32)]
    response = grpc_v2.infer_response("m", outputs, parsed)
    assert [o.name for o in response.outputs] == ["output__1"]
    assert list(tritongrpc.InferResult(response).as_numpy("output__1")) == [0, 1, 2, 3]


def test_unknown_output_is_invalid_argument():
    request = raw_request({"x": sample(torch.float32)})
    request.outputs.add(name="logits")
    code, details = refused(request, [spec(torch.float32)], output_names=["output__0"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'logits'" in details


def _wrong_field():
    return typed_request("x", "FP32", (2, 3), "int64_contents", range(6))


def _int8_out_of_range():
    return typed_request("x", "INT8", (1, 3), "int_contents", [1, 300, 2])


def _fp16_typed():
    return typed_request("x", "FP16", (1, 3), "fp32_contents", [1.0, 2.0, 3.0])


def _bytes_input():
    return typed_request("x", "BYTES", (1, 3), "bytes_contents", [b"a", b"b", b"c"])


def _short_raw():
    request = raw_request({"x": sample(torch.float32)})
    request.raw_input_contents[0] = request.raw_input_contents[0][:-4]
    return request


def _raw_and_contents():
    request = raw_request({"x": sample(torch.float32)})
    request.inputs[0].contents.fp32_contents.extend([0.0] * 6)
    return request


def _too_many_raw():
    request = raw_request({"x": sample(torch.float32)})
    request.raw_input_contents.append(b"\x00" * 24)
    return request


def _shared_memory():
    request = raw_request({"x": sample(torch.float32)})
    request.inputs[0].parameters["shared_memory_region"].string_param = "region0"
    return request


def _bool_byte_two():
    request = raw_request({"x": sample(torch.bool)})
    request.raw_input_contents[0] = b"\x01\x02\x00" * 2
    return request


BAD_REQUESTS = {
    "wrong datatype": (lambda: raw_request({"x": sample(torch.float64)}), "expected FP32"),
    "dim out of range": (lambda: raw_request({"x": sample(torch.float32, rows=9)}),
                         "outside its declared range [1, 8]"),
    "unknown input": (lambda: raw_request({"y": sample(torch.float32)}), "unknown input 'y'"),
    "missing input": (lambda: pb.ModelInferRequest(model_name="m"), "missing input 'x'"),
    "wrong contents field": (_wrong_field, "contents.fp32_contents"),
    "FP16 as typed contents": (_fp16_typed, "raw_input_contents"),
    "BYTES": (_bytes_input, "datatype 'BYTES'"),
    "short raw contents": (_short_raw, "raw_input_contents[0] has 20 bytes"),
    "raw and typed mixed": (_raw_and_contents, "has contents"),
    "one raw entry too many": (_too_many_raw, "2 entries for 1 inputs"),
    "shared memory": (_shared_memory, "shared memory"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_are_invalid_argument_naming_the_problem(case):
    build, expected = BAD_REQUESTS[case]
    code, details = refused(build(), [spec(torch.float32)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in details


def test_values_outside_their_datatype_are_refused():
    code, details = refused(_bool_byte_two(), [spec(torch.bool)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bytes 0 or 1" in details
    code, details = refused(_int8_out_of_range(), [spec(torch.int8)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "value 300 is out of range for INT8" in details


def test_message_past_the_body_limit_is_resource_exhausted():
    request = raw_request({"x": sample(torch.float32, rows=8)})
    code, details = refused(request, [spec(torch.float32)], max_body_bytes=100)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "the limit is 100" in details


def status(error: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The gRPC status of a request's error; None for a server fault."""
    fault = fault_of(error, "rec")
    return None if fault is None else grpc_v2.grpc_status(fault, "rec")


def test_status_of_model_errors_overload_and_faults():
    code, details = status(ShapeError("dim 0 is 0"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "model 'rec': dim 0 is 0"
    code, _ = status(Overloaded("64 requests wait already"))
    assert code == grpc.StatusCode.UNAVAILABLE
    code, _ = status(v2.NotFound("no version '2'"))
    assert code == grpc.StatusCode.NOT_FOUND
    assert status(RuntimeError("kernel exploded")) is None  # a server fault
    code, details = grpc_v2.grpc_status(record_server_fault("model 'rec'",
                                                            RuntimeError("kernel exploded")),
                                        "rec")
    assert code == grpc.StatusCode.INTERNAL
    assert "error id " in details and "RuntimeError: kernel exploded" in details


def test_execution_errors_follow_the_http_rule():
    # Note [Client or server fault]: an index past a table is the request's data.
    try:
        raise ExecutionError("index_select failed") from IndexError("index 99 is out of bounds")
    except ExecutionError as data_fault:
        assert status(data_fault)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert status(ExecutionError("addmm failed")) is None


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The recommender behind a real Serve gRPC ingress (and its HTTP proxy, as `dynvm
    serve --grpc-port` runs it): (tritonclient gRPC client, demo, routing headers, HTTP
    port)."""
    pytest.importorskip("ray.serve")
    from dynvm.cluster import ServingConfig, serve_models
    from dynvm.cluster.protocol._http_front import model_app_name
    from tests.cluster._cluster_helpers import saved_recommender
    from tests.cluster._shared_serve import shared_serve

    demo, _, path = saved_recommender(tmp_path_factory.mktemp("grpc"))
    with shared_serve() as stack:
        port, grpc_port = stack.port, stack.grpc_port
        serve_models({"recommender": str(path)},
                     ServingConfig(device="cpu", jit=False, num_cpus=0.5))
        client = tritongrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            yield client, demo, {"application": model_app_name("recommender")}, port
        finally:
            client.close()


def infer_inputs(tensors) -> list:
    inputs = []
    for i, t in enumerate(tensors):
        name = "dense" if i == 0 else f"sparse{i - 1}"
        item = tritongrpc.InferInput(name, list(t.shape), v2.datatype_of(t.dtype))
        item.set_data_from_numpy(t.numpy())
        inputs.append(item)
    return inputs


@pytest.mark.slow
def test_grpc_infer_matches_eager(served):
    client, demo, headers, _ = served
    rng = random.Random(3)
    for _ in range(4):
        tensors = demo.sample_inputs(rng)
        result = client.infer("recommender", infer_inputs(tensors), headers=headers,
                              request_id="req-1")
        with torch.inference_mode():
            expected = demo.module(*tensors).numpy()
        assert result.get_response().id == "req-1"
        np.testing.assert_allclose(result.as_numpy("output__0"), expected,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_grpc_health_and_metadata(served):
    client, _, headers, _ = served
    assert client.is_server_live(headers=headers)
    assert client.is_server_ready(headers=headers)
    assert client.is_model_ready("recommender", headers=headers)
    assert client.get_server_metadata(headers=headers).name == "dynvm"
    meta = client.get_model_metadata("recommender", headers=headers)
    assert meta.name == "recommender" and list(meta.versions) == ["1"]
    assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs][:2] == \
        [("dense", "FP32", [-1, 13]), ("sparse0", "INT64", [-1, 3])]
    assert [(o.name, o.datatype) for o in meta.outputs] == [("output__0", "FP32")]


@pytest.mark.slow
def test_grpc_errors_carry_their_status(served):
    from tritonclient.utils import InferenceServerException

    client, demo, headers, _ = served
    tensors = list(demo.example_inputs)
    tensors[0] = torch.zeros(tensors[0].shape[0], 12)  # dense has 13 features
    with pytest.raises(InferenceServerException) as bad:
        client.infer("recommender", infer_inputs(tensors), headers=headers)
    assert bad.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'dense'" in bad.value.message() and "expected 13" in bad.value.message()
    with pytest.raises(InferenceServerException) as other:
        client.get_model_metadata("ranker", headers=headers)
    assert other.value.status() == "StatusCode.NOT_FOUND"
    # Serve routes by the `application` metadata key alone: without it, NOT_FOUND.
    with pytest.raises(InferenceServerException) as unrouted:
        client.infer("recommender", infer_inputs(demo.example_inputs))
    assert unrouted.value.status() == "StatusCode.NOT_FOUND"
    assert "Application metadata not set" in unrouted.value.message()


@pytest.mark.slow
def test_grpc_requests_count_in_the_replica_stats(served):
    client, demo, headers, port = served

    def counters() -> dict:
        url = f"http://127.0.0.1:{port}/v2/models/recommender/stats"
        with urllib.request.urlopen(url, timeout=60) as response:
            return json.loads(response.read())

    before = counters()
    client.infer("recommender", infer_inputs(demo.example_inputs), headers=headers)
    with pytest.raises(Exception, match="INVALID_ARGUMENT"):
        client.infer("recommender", infer_inputs([torch.zeros(1, 12)]), headers=headers)
    after = counters()
    assert after["requests"] - before["requests"] == 2
    assert after["errors"] - before["errors"] == 1
    assert after["in_flight"] == 0


def test_dynvm_serve_grpc_port_flag(tmp_path):
    from dynvm._serve_cmd import _hint, options_from_args
    from tests.cluster.test_serve_cmd import _serve_args

    path = tmp_path / "rec.dvm"
    path.write_bytes(b"x")  # options_from_args only checks that the file exists
    assert options_from_args(_serve_args(str(path))).grpc_port is None
    options = options_from_args(_serve_args(str(path), "--grpc-port", "9101"))
    assert options.grpc_port == 9101
    hint = _hint(options, {})   # proxy ingress: no replica addresses
    assert "127.0.0.1:9101" in hint and "dynvm-model-rec" in hint
