"""The Open Inference Protocol parser/validator and response builder (no Ray)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol import _v2_json as v2_json
from dynvm.vm.program import DimSpec, InputSpec
from tests._fuzz import fuzz_settings

BATCH = DimSpec("batch", 1, 16)
INPUTS = (
    InputSpec("dense", torch.float32, (BATCH, DimSpec("", 3, 3))),
    InputSpec("ids", torch.int64, (BATCH, DimSpec("", 2, 2))),
)


def json_body(dense_shape=(2, 3), ids_shape=(2, 2), **overrides) -> dict:
    dense = [float(i) for i in range(int(np.prod(dense_shape)))]
    ids = list(range(int(np.prod(ids_shape))))
    body = {"inputs": [
        {"name": "dense", "datatype": "FP32", "shape": list(dense_shape), "data": dense},
        {"name": "ids", "datatype": "INT64", "shape": list(ids_shape), "data": ids},
    ]}
    body.update(overrides)
    return body


def binary_body(dense: np.ndarray, ids: np.ndarray, header_extra: dict | None = None
                ) -> tuple[bytes, str]:
    header = {"inputs": [
        {"name": "dense", "datatype": "FP32", "shape": list(dense.shape),
         "parameters": {"binary_data_size": dense.nbytes}},
        {"name": "ids", "datatype": "INT64", "shape": list(ids.shape),
         "parameters": {"binary_data_size": ids.nbytes}},
    ], **(header_extra or {})}
    raw = json.dumps(header).encode()
    return raw + dense.tobytes() + ids.tobytes(), str(len(raw))


def parse(body, **kw) -> v2.InferRequest:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    return v2.parse_infer_request(body, INPUTS, **kw)


def test_json_request_parses_into_tensors():
    req = parse(json_body(id="r1"))
    assert req.id == "r1" and req.outputs is None and not req.binary_output
    assert req.tensors[0].dtype == torch.float32 and req.tensors[0].shape == (2, 3)
    assert torch.equal(req.tensors[0].flatten(), torch.arange(6, dtype=torch.float32))
    assert torch.equal(req.tensors[1], torch.arange(4).reshape(2, 2))


def test_nested_json_data_is_accepted():
    body = json_body()
    body["inputs"][1]["data"] = [[0, 1], [2, 3]]
    assert torch.equal(parse(body).tensors[1], torch.arange(4).reshape(2, 2))


def test_binary_request_parses_and_owns_its_memory():
    dense = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.arange(8, dtype=np.int64).reshape(4, 2)
    body, length = binary_body(dense, ids, {"parameters": {"binary_data_output": True}})
    req = parse(body, header_length=length)
    assert req.binary_output
    assert torch.equal(req.tensors[0], torch.from_numpy(dense))
    assert torch.equal(req.tensors[1], torch.from_numpy(ids))
    req.tensors[0].add_(1)  # writable, not a view of the (immutable) body


def test_request_order_of_inputs_does_not_matter():
    body = json_body()
    body["inputs"].reverse()
    req = parse(body)
    assert req.tensors[0].dtype == torch.float32 and req.tensors[1].dtype == torch.int64


BAD = [
    ("malformed json", b"{not json", None, 400, "malformed JSON"),
    ("not an object", b"[1, 2]", None, 400, "JSON object"),
    ("no inputs", {"outputs": []}, None, 400, "'inputs'"),
    ("unknown input", {"inputs": [{"name": "bogus", "datatype": "FP32", "shape": [1],
                                   "data": [1.0]}]}, None, 400, "unknown input 'bogus'"),
    ("missing input", {"inputs": json_body()["inputs"][:1]}, None, 400, "missing input 'ids'"),
    ("duplicate input", {"inputs": json_body()["inputs"] * 2}, None, 400, "given twice"),
    ("wrong datatype", json_body(), {"dtype": ("dense", "FP64")}, 400,
     "input 'dense': datatype 'FP64'"),
    ("bogus datatype", json_body(), {"dtype": ("dense", "FLOAT")}, 400, "not a v2 datatype"),
    ("rank mismatch", json_body(dense_shape=(6,)), None, 400,
     "input 'dense': shape [6] has rank 1"),
    ("static dim", json_body(dense_shape=(2, 4)), None, 400, "input 'dense': dim 1 is 4"),
    ("dim out of range", json_body(dense_shape=(17, 3), ids_shape=(17, 2)), None, 400,
     "outside its declared range [1, 16]"),
    ("zero batch", json_body(dense_shape=(0, 3), ids_shape=(0, 2)), None, 400,
     "outside its declared range"),
    ("shared dim disagrees", json_body(dense_shape=(2, 3), ids_shape=(3, 2)), None, 400,
     "input 'ids': dim 0 (batch) is 3 but input 'dense' has batch=2"),
    ("data length", json_body(), {"data": ("dense", [1.0, 2.0])}, 400,
     "input 'dense': 'data' has 2 elements"),
    ("string in data", json_body(), {"data": ("ids", ["a", 1, 2, 3])}, 400,
     "input 'ids': datatype INT64 needs integers"),
    ("float for int", json_body(), {"data": ("ids", [0.5, 1, 2, 3])}, 400, "needs integers"),
    ("int64 overflow", json_body(), {"data": ("ids", [2**63, 1, 2, 3])}, 400, "out of range"),
    ("bool for float", json_body(), {"data": ("dense", [True] * 6)}, 400, "needs numbers"),
    ("negative shape", json_body(dense_shape=(2, 3)), {"shape": ("dense", [-2, 3])}, 400,
     "non-negative integers"),
    ("no data", json_body(), {"data": ("dense", None)}, 400, "no 'data'"),
    ("shared memory", json_body(), {"params": ("dense", {"shared_memory_region": "x"})}, 400,
     "shared memory"),
    ("bad outputs", json_body(outputs=[{"nam": 1}]), None, 400, "outputs[0]"),
    ("bad binary_data_output", json_body(parameters={"binary_data_output": "yes"}), None, 400,
     "binary_data_output"),
]


def _apply(body, change):
    if not change:
        return body
    (kind, (name, value)), = change.items()
    entry = next(e for e in body["inputs"] if e["name"] == name)
    if kind == "dtype":
        entry["datatype"] = value
    elif kind == "shape":
        entry["shape"] = value
    elif kind == "params":
        entry["parameters"] = value
    elif value is None:
        del entry["data"]
    else:
        entry["data"] = value
    return body


@pytest.mark.parametrize("label,body,change,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_name_the_problem(label, body, change, status, needle):
    if isinstance(body, dict):
        body = json.loads(json.dumps(body))  # fresh copy per case
    with pytest.raises(v2.ProtocolError) as info:
        parse(_apply(body, change))
    assert info.value.status == status
    assert needle in info.value.message, info.value.message
    assert json.loads(v2.error_body(info.value)) == {"error": info.value.message}


@pytest.mark.parametrize("label,body,change,status,needle",
                         [b for b in BAD if isinstance(b[1], dict)],
                         ids=[b[0] for b in BAD if isinstance(b[1], dict)])
def test_typed_and_field_by_field_paths_answer_alike(label, body, change, status, needle):
    # Note [Typed JSON fast path]: an unknown field past TYPED_HEADER_BYTES sends the
    # same request through the field-by-field decoder; the answer must not change.
    small = json.dumps(_apply(json.loads(json.dumps(body)), change)).encode()
    big = small[:-1] + b', "pad": "' + b"x" * v2_json.TYPED_HEADER_BYTES + b'"}'
    assert v2_json.decode_typed_header(big) is None
    answers = []
    for raw in (small, big):
        with pytest.raises(v2.ProtocolError) as info:
            parse(raw)
        answers.append((info.value.status, info.value.message))
    assert answers[0] == answers[1]


def test_typed_data_takes_what_the_general_decoder_takes():
    # Flat, typed and in range: the typed decoder; nested rows, "NaN" strings and
    # integral floats for FP32: the general one. Same tensors either way.
    body = json_body()
    body["inputs"][0]["data"] = [[0, 1.5, "NaN"], [3, -4e38 / 2, 5]]
    req = parse(body)
    assert torch.isnan(req.tensors[0][0, 2])
    assert req.tensors[0][1].tolist() == [3.0, float(np.float32(-2e38)), 5.0]
    body = json_body()
    body["inputs"][1]["data"] = [-2**63, 2**63 - 1, 0, 7]
    assert parse(body).tensors[1].flatten().tolist() == [-2**63, 2**63 - 1, 0, 7]
    # FP16 keeps torch's rounding (double -> float -> half), which numpy's single
    # rounding does not give for this value.
    halves = (InputSpec("h", torch.float16, (DimSpec("n", 1, 4),)),)
    value = 1 + 2**-11 + 2**-40
    got = v2.parse_infer_request(json.dumps({"inputs": [
        {"name": "h", "datatype": "FP16", "shape": [1], "data": [value]}]}).encode(), halves)
    assert torch.equal(got.tensors[0], torch.tensor([value], dtype=torch.float16))


def test_unknown_output_is_rejected_when_outputs_are_known():
    with pytest.raises(v2.BadRequest, match="unknown output 'nope'"):
        parse(json_body(outputs=[{"name": "nope"}]), output_names=["output__0"])


def test_oversize_body_is_413():
    with pytest.raises(v2.PayloadTooLarge) as info:
        parse(json_body(), max_body_bytes=10)
    assert info.value.status == 413 and "limit is 10" in info.value.message


@pytest.mark.parametrize("length,needle", [
    ("abc", "must be a non-negative integer"),
    ("-1", "must be a non-negative integer"),
    ("99999", "the body has only"),
    ("5", "malformed JSON"),
])
def test_bad_header_length(length, needle):
    dense = np.zeros((2, 3), np.float32)
    ids = np.zeros((2, 2), np.int64)
    body, _ = binary_body(dense, ids)
    with pytest.raises(v2.BadRequest, match=needle):
        parse(body, header_length=length)


def test_binary_size_and_tail_must_match():
    dense = np.zeros((2, 3), np.float32)
    ids = np.zeros((2, 2), np.int64)
    body, length = binary_body(dense, ids)
    with pytest.raises(v2.BadRequest, match="binary section"):  # truncated tail
        parse(body[:-4], header_length=length)
    with pytest.raises(v2.BadRequest, match="after the JSON header"):  # trailing junk
        parse(body + b"xx", header_length=length)
    header = json.loads(body[: int(length)])
    header["inputs"][0]["parameters"]["binary_data_size"] = 20
    raw = json.dumps(header).encode()
    with pytest.raises(v2.BadRequest, match="input 'dense': binary_data_size is 20"):
        parse(raw + body[int(length):], header_length=str(len(raw)))


def test_json_response_and_binary_response_roundtrip():
    out = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([True, False])]
    req = parse(json_body(id="x"))
    body, headers = v2.build_infer_response("m", "1", out, req)
    assert headers == {"Content-Type": "application/json"}
    doc = json.loads(body)
    assert doc["id"] == "x" and doc["model_name"] == "m"
    assert doc["outputs"][0] == {"name": "output__0", "datatype": "FP32", "shape": [2, 3],
                                 "data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}
    assert doc["outputs"][1]["datatype"] == "BOOL" and doc["outputs"][1]["data"] == [True, False]

    req = parse(json_body(parameters={"binary_data_output": True}))
    body, headers = v2.build_infer_response("m", "1", out, req)
    n = int(headers[v2.HEADER_LENGTH])
    doc = json.loads(body[:n])
    size0 = doc["outputs"][0]["parameters"]["binary_data_size"]
    assert size0 == 24
    got = np.frombuffer(body[n:n + size0], dtype=np.float32).reshape(2, 3)
    assert np.array_equal(got, out[0].numpy())
    assert body[n + size0:] == b"\x01\x00"

    # Per-output choice and selection.
    req = parse(json_body(outputs=[{"name": "output__1", "parameters": {"binary_data": False}}]))
    doc = json.loads(v2.build_infer_response("m", "1", out, req)[0])
    assert [o["name"] for o in doc["outputs"]] == ["output__1"]


def test_metadata_reports_dynamic_dims_as_minus_one():
    probes = [[torch.zeros(1, 1)], [torch.zeros(2, 1)]]
    meta = v2.model_metadata("m", ["1"], INPUTS, v2.output_metadata_from_probes(probes))
    assert meta["inputs"] == [
        {"name": "dense", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "ids", "datatype": "INT64", "shape": [-1, 2]},
    ]
    assert meta["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": [-1, 1]}]


# --------------------------------------------------------------------------- fuzzing

FUZZ = fuzz_settings(300)

_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                          st.floats(allow_nan=True), st.text(max_size=8))
_json_values = st.recursive(_json_scalars, lambda children: st.one_of(
    st.lists(children, max_size=6),
    st.dictionaries(st.sampled_from(["name", "datatype", "shape", "data", "parameters",
                                     "inputs", "outputs", "binary_data_size", "id"]),
                    children, max_size=5)), max_leaves=30)


@st.composite
def _plausible_bodies(draw):
    """Bodies close to valid ones, so the fuzz reaches the deep checks."""
    entries = []
    for spec in draw(st.permutations(INPUTS))[: draw(st.integers(0, 2))]:
        shape = draw(st.lists(st.integers(-1, 20), min_size=0, max_size=3))
        entry = {"name": draw(st.sampled_from([spec.name, "bogus"])),
                 "datatype": draw(st.sampled_from(["FP32", "INT64", "BOOL", "BYTES", 3])),
                 "shape": shape}
        if draw(st.booleans()):
            entry["data"] = draw(st.one_of(
                st.lists(st.integers(-5, 5), max_size=40),
                st.lists(st.floats(allow_nan=True), max_size=40), _json_values))
        else:
            entry["parameters"] = {"binary_data_size": draw(st.integers(-1, 200))}
        entries.append(entry)
    header = json.dumps({"inputs": entries}).encode()
    tail = draw(st.binary(max_size=200))
    length = draw(st.one_of(st.just(str(len(header))), st.none(),
                            st.integers(-5, 400).map(str), st.text(max_size=5)))
    return header + tail, length


@FUZZ
@given(body=st.one_of(st.binary(max_size=300), _json_values.map(lambda v: json.dumps(v).encode())),
       length=st.one_of(st.none(), st.text(max_size=6)))
def test_fuzz_random_bodies_raise_only_protocol_errors(body, length):
    try:
        req = v2.parse_infer_request(body, INPUTS, header_length=length, max_body_bytes=1000)
    except v2.ProtocolError as exc:
        assert 400 <= exc.status < 500
        return
    assert len(req.tensors) == len(INPUTS)


@FUZZ
@given(case=_plausible_bodies())
def test_fuzz_plausible_bodies_raise_only_protocol_errors(case):
    body, length = case
    try:
        req = v2.parse_infer_request(body, INPUTS, header_length=length)
    except v2.ProtocolError as exc:
        assert 400 <= exc.status < 500
        return
    for tensor, spec in zip(req.tensors, INPUTS, strict=True):
        assert tensor.dtype == spec.dtype and tensor.dim() == len(spec.dims)


def test_long_data_lists_are_checked_like_short_ones():
    # 1024 values or more are type- and range-checked in C first (_only_types): the same
    # requests pass and the same refusals come back as on the per-value path.
    rows = DimSpec("n", 1, 4096)
    for dtype, datatype, good, bad_values in (
            (torch.float32, "FP32", 0.5, ((1e39, "out of range"), (True, "needs numbers"),
                                          ("x", "needs numbers"))),
            (torch.int32, "INT32", 7, ((2**40, "out of range"), (1.5, "needs integers"),
                                       (True, "needs integers")))):
        inputs = (InputSpec("x", dtype, (rows,)),)

        def body(data, datatype=datatype):
            return json.dumps({"inputs": [{"name": "x", "datatype": datatype,
                                           "shape": [len(data)], "data": data}]}).encode()

        values = [good] * 2048
        parsed = v2.parse_infer_request(body(values), inputs)
        assert torch.equal(parsed.tensors[0], torch.full((2048,), good, dtype=dtype))
        for bad, needle in bad_values:
            data = list(values)
            data[1000] = bad
            with pytest.raises(v2.BadRequest, match=needle):
                v2.parse_infer_request(body(data), inputs)
    floats = (InputSpec("x", torch.float32, (rows,)),)
    data = [0.5] * 2048
    data[7] = "NaN"
    parsed = v2.parse_infer_request(json.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [2048], "data": data}]}).encode(), floats)
    assert torch.isnan(parsed.tensors[0][7]) and not torch.isnan(parsed.tensors[0][8])
