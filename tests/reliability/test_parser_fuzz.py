"""Fuzzing the infer request parser (`dynvm.cluster.protocol._v2.parse_infer_request`),
called directly: whatever the body and headers, only a `ProtocolError` (4xx) comes out,
and what is accepted matches the declared signature.

tests/cluster/test_v2_protocol.py already fuzzes random bodies and near-valid JSON
bodies against a two-input FP32/INT64 signature. This file widens that: every tensor
datatype the protocol maps (BOOL, unsigned, half precision), shared dynamic dims across
inputs, and byte-level mutations of valid JSON *and* binary-extension bodies together
with their `Inference-Header-Content-Length` header, which is where length arithmetic
can go wrong. The HTTP endpoint gets its own (smaller) fuzz in test_bad_input_http.py.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dynvm.cluster.protocol import _v2 as v2
from dynvm.vm.program import DimSpec, InputSpec
from tests._fuzz import fuzz_settings
from tests.cluster import _mutations as mutations

FUZZ = fuzz_settings(200)
MAX_BODY = 4096

BATCH = DimSpec("batch", 1, 8)
SEQ = DimSpec("seq", 2, 6)
INPUTS = (
    InputSpec("x", torch.float32, (BATCH, SEQ)),
    InputSpec("mask", torch.bool, (BATCH, SEQ)),
    InputSpec("ids", torch.uint64, (BATCH, DimSpec("", 2, 2))),
    InputSpec("h", torch.float16, (DimSpec("", 3, 3),)),
    InputSpec("b", torch.uint8, (BATCH,)),
)
NUMPY = {torch.float32: np.float32, torch.bool: np.bool_, torch.uint64: np.uint64,
         torch.float16: np.float16, torch.uint8: np.uint8}


def _arrays(batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 10 + seq)
    return {
        "x": rng.standard_normal((batch, seq)).astype(np.float32),
        "mask": rng.integers(0, 2, (batch, seq)).astype(np.bool_),
        "ids": rng.integers(0, 2**64 - 1, (batch, 2), dtype=np.uint64),
        "h": rng.standard_normal(3).astype(np.float16),
        "b": rng.integers(0, 256, batch).astype(np.uint8),
    }


def json_request(batch: int = 2, seq: int = 3) -> dict:
    return {"id": "fuzz", "inputs": [
        {"name": spec.name, "datatype": v2.TORCH_TO_V2[spec.dtype], "shape": list(a.shape),
         "data": a.tolist()}
        for spec, a in zip(INPUTS, _arrays(batch, seq).values(), strict=True)]}


def binary_request(batch: int = 2, seq: int = 3) -> tuple[bytes, str]:
    arrays = _arrays(batch, seq)
    header = {"inputs": [
        {"name": spec.name, "datatype": v2.TORCH_TO_V2[spec.dtype], "shape": list(a.shape),
         "parameters": {"binary_data_size": a.nbytes}}
        for spec, a in zip(INPUTS, arrays.values(), strict=True)],
        "parameters": {"binary_data_output": True}}
    raw = json.dumps(header).encode()
    return raw + b"".join(a.tobytes() for a in arrays.values()), str(len(raw))


def parse(body: bytes, length: str | None) -> v2.InferRequest | None:
    """The parsed request, or None after checking the rejection is a well-formed 4xx."""
    try:
        request = v2.parse_infer_request(body, INPUTS, header_length=length,
                                         max_body_bytes=MAX_BODY, output_names=["output__0"])
    except v2.ProtocolError as error:
        assert 400 <= error.status < 500
        assert error.message and isinstance(error.message, str)
        assert json.loads(v2.error_body(error)) == {"error": error.message}
        return None
    check_accepted(request)
    return request


def check_accepted(request: v2.InferRequest) -> None:
    """An accepted request satisfies the signature: dtypes, ranks, ranges, shared dims."""
    assert len(request.tensors) == len(INPUTS)
    bound: dict[str, int] = {}
    for tensor, spec in zip(request.tensors, INPUTS, strict=True):
        assert tensor.dtype == spec.dtype and tensor.dim() == len(spec.dims)
        for size, dim in zip(tensor.shape, spec.dims, strict=True):
            assert dim.low <= size <= dim.high
            if not dim.is_static:
                assert bound.setdefault(dim.name, size) == size
    if request.tensors[1].numel():  # BOOL tensors hold only 0/1 bytes
        assert int(request.tensors[1].view(torch.uint8).max()) <= 1


def test_the_fuzz_seeds_are_valid():
    # The mutations below start from these; both must parse, or the fuzz tests nothing.
    body = json.dumps(json_request()).encode()
    request = parse(body, None)
    assert request is not None and request.id == "fuzz"
    assert request.tensors[2].dtype == torch.uint64
    binary, length = binary_request()
    request = parse(binary, length)
    assert request is not None and request.binary_output
    expected = _arrays(2, 3)
    for tensor, array in zip(request.tensors, expected.values(), strict=True):
        assert np.array_equal(tensor.numpy(), array)


# ------------------------------------------------------------------ byte-level mutations


def mutated_bytes(data: bytes):
    """Damaged copies of `data`; a set byte is one that matters to JSON."""
    return mutations.mutated_bytes(data, st.sampled_from(b'{}[]",:0123456789-.eE \x00\xff'))


def _header_lengths(true_length: int):
    return st.one_of(
        st.just(str(true_length)),
        st.integers(-3, true_length + 64).map(str),
        st.sampled_from(["", " ", "+5", "0x10", "1e3", "\u0663\u0662", "9" * 30, "12 ",
                         "\t7", "-0", "NaN"]),
        st.none())


@FUZZ
@given(st.data())
def test_fuzz_mutated_json_bodies(data):
    body = json.dumps(json_request(data.draw(st.integers(1, 8)),
                                   data.draw(st.integers(2, 6)))).encode()
    parse(data.draw(mutated_bytes(body)),
          data.draw(st.one_of(st.none(), _header_lengths(len(body)))))


@FUZZ
@given(st.data())
def test_fuzz_mutated_binary_bodies(data):
    body, length = binary_request(data.draw(st.integers(1, 8)), data.draw(st.integers(2, 6)))
    mutate_header = data.draw(st.booleans())
    if mutate_header:
        body = data.draw(mutated_bytes(body))
    else:  # keep the JSON header intact, damage only the tensor bytes or the length
        head = int(length)
        body = body[:head] + data.draw(mutated_bytes(body[head:]))
    parse(body, data.draw(_header_lengths(int(length))))


@FUZZ
@given(st.data())
def test_fuzz_tensor_bytes_in_place(data):
    """Overwrite tensor bytes without changing any length: every byte pattern is a valid
    FP32/FP16/UINT value, but a BOOL byte other than 0 or 1 is not (check_accepted)."""
    body, length = binary_request(data.draw(st.integers(1, 8)), data.draw(st.integers(2, 6)))
    out = bytearray(body)
    for _ in range(data.draw(st.integers(1, 3))):
        out[data.draw(st.integers(int(length), len(out) - 1))] = data.draw(st.integers(0, 255))
    parse(bytes(out), length)


# ------------------------------------------------------------------ structured edits

_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.sampled_from([2**63, 2**64, -1, 0, 1, 255, 256, 65504, 65520]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6))
_json_any = st.recursive(_json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=8), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20)
_FIELDS = ["name", "datatype", "shape", "data", "parameters"]


@FUZZ
@given(st.data())
def test_fuzz_structured_edits(data):
    """Replace, delete or retype fields of a valid request, several at once."""
    doc = json_request(data.draw(st.integers(1, 8)), data.draw(st.integers(2, 6)))
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["top", "input", "data item", "parameters"]))
        if where == "top":
            key = data.draw(st.sampled_from(["id", "inputs", "outputs", "parameters"]))
            doc[key] = data.draw(_json_any | st.just([{"name": "output__0",
                                                        "parameters": {"binary_data": 1}}]))
            continue
        if not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
            continue
        entry = data.draw(st.sampled_from(doc["inputs"]))
        if not isinstance(entry, dict):
            continue
        if where == "input":
            key = data.draw(st.sampled_from(_FIELDS))
            if data.draw(st.booleans()):
                entry.pop(key, None)
            else:
                entry[key] = data.draw(_json_any)
        elif where == "data item" and isinstance(entry.get("data"), list) and entry["data"]:
            row = entry["data"]
            if isinstance(row[0], list) and row[0]:
                row = data.draw(st.sampled_from(row))
            if isinstance(row, list) and row:
                row[data.draw(st.integers(0, len(row) - 1))] = data.draw(_json_leaf)
        elif where == "parameters":
            entry["parameters"] = {data.draw(st.sampled_from(
                ["binary_data_size", "binary_data", "shared_memory_region", "x"])):
                data.draw(_json_leaf)}
    parse(json.dumps(doc).encode(), None)


@FUZZ
@given(st.data())
def test_fuzz_shapes_against_declared_ranges(data):
    """Any shape list for any input: accepted only inside the declared ranges, with
    shared dims agreeing (check_accepted), else a 400 that names the input."""
    doc = json_request()
    entry = data.draw(st.sampled_from(doc["inputs"]))
    shape = data.draw(st.lists(st.integers(-2, 12), max_size=3))
    entry["shape"] = shape
    fill = data.draw(st.sampled_from([0, 1, True, 0.5]))
    entry["data"] = [fill] * int(np.prod(shape)) if all(s >= 0 for s in shape) else []
    try:
        request = v2.parse_infer_request(json.dumps(doc).encode(), INPUTS)
    except v2.BadRequest as error:
        assert repr(entry["name"]) in error.message
        return
    check_accepted(request)


@FUZZ
@given(st.binary(max_size=MAX_BODY + 64), st.one_of(st.none(), st.text(max_size=8)))
def test_fuzz_random_bytes(body, length):
    parse(body, length)


# ------------------------------------------------------------------ numbers, nesting, encodings

_NUMBER_TEXTS = st.one_of(
    st.integers(-(2**80), 2**80).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from([
        "1e400", "-1e400", "1e39", "-1e39", "3.4028235e38", "3.5e38", "65504", "65520",
        "70000", "-70000", "1e-400", "-0", "-0.0", "0e0", "1E+2", "1" * 400, "1." + "0" * 400,
        "NaN", "Infinity", "-Infinity", '"NaN"', '"Infinity"', '"-Infinity"', '"nan"',
        '"1.5"', "0x10", "01", "+1", ".5", "1.", "true", "null", "[]", "{}"]))
_STRING_VALUES = {'"NaN"': math.nan, '"Infinity"': math.inf, '"-Infinity"': -math.inf}
_SENTINEL = 4242


@FUZZ
@given(st.data())
def test_fuzz_numbers(data):
    """Any number text in any input's data: accepted only when it fits the datatype
    (never an inf or a wrapped integer the client did not write), else a 400 naming
    the input."""
    doc = json_request()
    index = data.draw(st.sampled_from([0, 2, 3, 4]))  # x FP32, ids UINT64, h FP16, b UINT8
    entry = doc["inputs"][index]
    flat = np.array(entry["data"], dtype=object).reshape(-1)
    flat[0] = _SENTINEL
    entry["data"] = flat.tolist()
    token = data.draw(_NUMBER_TEXTS)
    body = json.dumps(doc).replace(str(_SENTINEL), token, 1).encode()
    request = parse(body, None)
    if request is None:
        return
    got = request.tensors[index].reshape(-1)[0]
    if entry["datatype"] in ("FP32", "FP16"):
        if token in _STRING_VALUES:
            expected = _STRING_VALUES[token]
            assert math.isnan(expected) if got.isnan() else float(got) == expected
        else:  # a plain number: finite, and the value written (to the dtype's rounding)
            value = float(token)
            assert torch.isfinite(got) and math.isfinite(value)
            assert float(got) == float(torch.tensor(value, dtype=got.dtype))
    else:
        assert int(got.to(torch.int64) if entry["datatype"] != "UINT64" else
                   got.view(torch.int64)) % 2**64 == int(token) % 2**64
        assert 0 <= int(token) < 2**(64 if entry["datatype"] == "UINT64" else 8)


def _nestings(values: list, shape: tuple[int, int]):
    """Ways to write `values` (row-major, shape [a, b]) in JSON: (data, valid)."""
    a, b = shape
    rows = [values[i * b:(i + 1) * b] for i in range(a)]
    ragged = [list(r) for r in rows]
    ragged[-1] = ragged[-1][:-1] + [ragged[-1][-1:]]  # last value one level deeper
    short = [list(r) for r in rows]
    short[0] = short[0][:-1]
    return st.sampled_from([
        (values, True), (rows, True),
        ([values[i * a:(i + 1) * a] for i in range(b)], a == b),  # nested as [b, a]
        ([[v] for v in values], b == 1),                            # one level too deep
        ([rows], False), (ragged, False), (short + [[values[-1]]], False),
        (values[0], False), (values + values[:1], False)])


@FUZZ
@given(st.data())
def test_fuzz_nesting(data):
    """`data` flat or nested exactly as the shape is accepted with the same tensor;
    any other nesting (ragged rows, transposed, too deep) is a 400 naming the input."""
    batch, seq = data.draw(st.integers(1, 8)), data.draw(st.integers(2, 6))
    doc = json_request(batch, seq)
    values = np.array(doc["inputs"][0]["data"], dtype=np.float32).reshape(-1).tolist()
    nested, valid = data.draw(_nestings(values, (batch, seq)))
    doc["inputs"][0]["data"] = nested
    try:
        request = v2.parse_infer_request(json.dumps(doc).encode(), INPUTS)
    except v2.BadRequest as error:
        assert not valid, (nested, error.message)
        assert "input 'x'" in error.message
        return
    assert valid, nested
    assert torch.equal(request.tensors[0],
                       torch.tensor(values, dtype=torch.float32).reshape(batch, seq))


_ENCODINGS = st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-be", "utf-32",
                              "latin-1", "escaped", "surrogate", "overlong", "nul"])


@FUZZ
@given(st.data())
def test_fuzz_encodings(data):
    """The same request in other text encodings and with escapes: only UTF-8 JSON (RFC
    8259) is read; escapes decode to the same names; everything else is a 400."""
    doc = json_request(data.draw(st.integers(1, 4)), data.draw(st.integers(2, 6)))
    encoding = data.draw(_ENCODINGS)
    text = json.dumps(doc)
    if encoding == "escaped":  # "x" written as \u0078: the same request
        body = text.replace('"name": "x"', '"name": "\\u0078"', 1).encode()
    elif encoding == "surrogate":  # a lone surrogate escape in a name
        body = text.replace('"name": "x"', '"name": "x\\ud800"', 1).encode()
    elif encoding == "overlong":  # an overlong UTF-8 "/" inside a string
        body = text.replace('"fuzz"', '"fu\xc0\xafzz"', 1).encode("latin-1")
    elif encoding == "nul":
        body = text.replace('"fuzz"', '"fu\x00zz"', 1).encode()
    elif encoding == "latin-1":
        body = text.replace('"fuzz"', '"f\xfczz"', 1).encode("latin-1")
    else:
        body = text.encode(encoding)
    request = parse(body, None)
    if encoding in ("utf-8", "escaped"):
        assert request is not None
    if encoding in ("utf-16", "utf-16-be", "utf-32", "utf-8-sig", "surrogate", "overlong",
                    "latin-1", "nul"):
        assert request is None, encoding


# ------------------------------------------------------------------ what the fuzz found


def test_binary_bool_bytes_other_than_0_or_1_are_refused():
    # Found by test_fuzz_tensor_bytes_in_place: torch.frombuffer kept the byte 2 in a
    # BOOL tensor (undefined behaviour for the kernels); JSON already refused non-bools.
    body, length = binary_request()
    head = int(length)
    mask_at = head + _arrays(2, 3)["x"].nbytes + 4  # the 5th byte of "mask"
    bad = bytearray(body)
    bad[mask_at] = 2
    with pytest.raises(v2.BadRequest) as caught:
        v2.parse_infer_request(bytes(bad), INPUTS, header_length=length)
    assert caught.value.message == ("input 'mask': datatype BOOL needs bytes 0 or 1, "
                                    "byte 4 of its binary data is 2")


# Found by test_fuzz_encodings (draws 1, 2, 'overlong') and the HTTP fuzz (an input name
# "\x80ense"): msgspec checks a string's UTF-8 only when it builds it, so a bad string
# passed the header's decode (its fields are kept raw) and the field's own decode raised
# msgspec.DecodeError, which nothing mapped: a 500. Every field, JSON and binary header.
_STRINGS = {  # (bytes spliced into the JSON text, what the parser must say)
    "invalid byte": (b"\x80ense", "utf-8"),
    "overlong": (b"fu\xc0\xafzz", "utf-8"),
    "encoded surrogate": (b"x\xed\xa0\x80", "utf-8"),  # CESU-8, not UTF-8
    "lone surrogate escape": (b"x\\ud800", "malformed"),
    "raw NUL": (b"x\x00", "malformed"),  # a control character inside a string
    "escaped NUL": (b"x\\u0000", "valid"),  # valid JSON: a NUL in the string
}
_PLACES = ["input name", "datatype", "parameter key", "parameter value", "data", "id",
           "output name", "request parameter"]
_SPLICE = "SPLICEDSTRING"


def _with_string(doc: dict, place: str) -> dict:
    """`doc` with _SPLICE as the string at `place`."""
    entry = doc["inputs"][0]
    if place == "input name":
        entry["name"] = _SPLICE
    elif place == "datatype":
        entry["datatype"] = _SPLICE
    elif place == "parameter key":
        entry.setdefault("parameters", {})[_SPLICE] = 1
    elif place == "parameter value":
        entry.setdefault("parameters", {})["note"] = _SPLICE
    elif place == "data":
        entry["data"][0][0] = _SPLICE
    elif place == "id":
        doc["id"] = _SPLICE
    elif place == "output name":
        doc["outputs"] = [{"name": _SPLICE}]
    else:
        doc.setdefault("parameters", {})["note"] = _SPLICE
    return doc


_CASES = [(kind, place, label) for kind in ("json", "binary") for place in _PLACES
          for label in _STRINGS
          if not (kind == "binary" and place == "data")]  # binary data is raw bytes


@pytest.mark.parametrize("kind,place,label", _CASES)
def test_bad_strings_in_any_field_are_a_400(kind, place, label):
    splice, verdict = _STRINGS[label]
    if kind == "json":
        head = json.dumps(_with_string(json_request(), place)).encode()
        body, length = head.replace(_SPLICE.encode(), splice), None
    else:
        binary, length = binary_request()
        header = _with_string(json.loads(binary[:int(length)]), place)
        head = json.dumps(header).encode().replace(_SPLICE.encode(), splice)
        body, length = head + binary[int(length):], str(len(head))
    try:
        v2.parse_infer_request(body, INPUTS, header_length=length,
                               output_names=["output__0"])
    except v2.ProtocolError as error:
        assert error.status == 400, error.message
        message = error.message
    else:
        message = None
    if verdict == "utf-8":  # refused, naming the field
        where = {"input name": "inputs[0].name", "datatype": "input 'x': 'datatype'",
                 "parameter key": "input 'x': 'parameters'",
                 "parameter value": "input 'x': 'parameters'", "data": "input 'x': 'data'",
                 "id": "'id'", "output name": "outputs[0].name",
                 "request parameter": "request: 'parameters'"}[place]
        assert message == f"{where}: a string is not valid UTF-8 (RFC 8259 JSON is UTF-8 " \
                          "text)", message
    elif verdict == "malformed":
        assert message is not None and message.startswith("malformed JSON in the "), message
    elif place in ("input name", "datatype", "data", "output name"):  # a NUL is no match
        assert message is not None and "'x\\x00'" in message, message
    else:  # a NUL in an id or a parameter is a string like any other
        assert message is None


def test_a_huge_client_name_is_not_echoed_whole():
    # Error texts quote client-chosen names; a name as large as a field may be (64 KiB
    # of JSON, Note [Bounded JSON]) must not come back as a message of that size.
    for field in ("inputs", "outputs"):
        doc = json_request()
        name = "n" * 60_000
        if field == "inputs":
            doc["inputs"][0]["name"] = name
        else:
            doc["outputs"] = [{"name": name}]
        with pytest.raises(v2.BadRequest) as caught:
            v2.parse_infer_request(json.dumps(doc).encode(), INPUTS,
                                   output_names=["output__0"])
        assert f"unknown {field[:-1]} 'nnnn" in caught.value.message
        assert len(caught.value.message) < 300, len(caught.value.message)


# ------------------------------------------------------------------ bounds (Note [Bounded JSON])


def _time_and_peak(fn):
    import time
    import tracemalloc

    tracemalloc.start()
    start = time.perf_counter()
    try:
        fn()
    finally:
        seconds = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return seconds, peak


AMPLIFIERS = [
    # (case, the JSON text spliced in, where, the error expected or None = accepted)
    ("junk top-level field", b'"junk": [' + b"[]," * 2_000_000 + b"[]]", "top", None),
    ("junk field in an input", b'"junk": [' + b"[]," * 2_000_000 + b"[]]", "input", None),
    ("a million objects in outputs", b'"outputs": [' + b"{}," * 1_000_000 + b"{}]", "top",
     "JSON objects, the limit is 4096"),
    ("a million numbers as inputs", b'"inputs": [' + b"0," * 1_000_000 + b"0]", "replace",
     "inputs[0] must be an object"),
    ("deep nesting", b'"junk": ' + b"[" * 100_000 + b"]" * 100_000, "top", "nested too deeply"),
    ("huge parameters", b'"parameters": {"x": [' + b"0," * 100_000 + b"0]}", "input",
     "'parameters' is 200010 bytes of JSON, the limit is 65536"),
    ("data far longer than its shape", b'"data": [' + b"0," * 1_000_000 + b"0]", "x data",
     "more than the 6 elements of its shape can take"),
]


@pytest.mark.parametrize("case,splice,where,error", AMPLIFIERS, ids=[a[0] for a in AMPLIFIERS])
def test_amplifying_bodies_cost_little_work_and_memory(case, splice, where, error):
    """Each body is a few MB; decoding it takes well under a second and allocates well
    under the body's size, whether it is accepted (junk skipped) or refused."""
    body = json.dumps(json_request(2, 3)).encode()
    if where == "top":
        body = body[:-1] + b", " + splice + b"}"
    elif where == "input":
        body = body.replace(b'"name": "mask"', splice + b', "name": "mask"', 1)
    elif where == "replace":
        body = b'{"id": "fuzz", ' + splice + b"}"
    else:
        start = body.index(b'"data": ', body.index(b'"name": "x"'))
        end = body.index(b"]]", start) + 2
        body = body[:start] + splice + body[end:]
    outcome = {}

    def run() -> None:
        try:
            outcome["request"] = v2.parse_infer_request(body, INPUTS, max_body_bytes=2**26)
        except v2.BadRequest as exc:
            outcome["error"] = exc.message

    seconds, peak = _time_and_peak(run)
    print(f"\n{case}: {len(body) / 1e6:.1f} MB body, {seconds * 1000:.0f} ms, peak "
          f"{peak / 1e6:.2f} MB allocated: {outcome.get('error', 'accepted')[:70]}")
    if error is None:
        assert "request" in outcome, outcome
        check_accepted(outcome["request"])
    else:
        assert error in outcome.get("error", ""), outcome
    assert peak < len(body) / 2


def test_non_finite_inputs_are_values_unless_the_model_refuses_them():
    doc = json_request(2, 3)
    doc["inputs"][0]["data"][0][0] = "NaN"
    doc["inputs"][0]["data"][0][1] = "-Infinity"
    body = json.dumps(doc).encode()
    x = v2.parse_infer_request(body, INPUTS).tensors[0]
    assert torch.isnan(x[0, 0]) and x[0, 1] == -math.inf
    with pytest.raises(v2.BadRequest, match=r"input 'x': element 0 is nan, and this model "
                                            r"refuses NaN and Inf"):
        v2.parse_infer_request(body, INPUTS, refuse_non_finite=True)
    binary, length = binary_request(2, 3)
    head = int(length)
    bad = bytearray(binary)
    bad[head + 4:head + 8] = np.array([np.inf], np.float32).tobytes()  # x[0, 1]
    assert v2.parse_infer_request(bytes(bad), INPUTS, header_length=length).tensors[0][0, 1] \
        == math.inf
    with pytest.raises(v2.BadRequest, match=r"input 'x': element 1 is inf"):
        v2.parse_infer_request(bytes(bad), INPUTS, header_length=length,
                               refuse_non_finite=True)
