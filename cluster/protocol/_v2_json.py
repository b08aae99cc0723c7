"""Bounded JSON decoding of v2 infer requests: the work and memory of parsing a body
depend on what the model's signature needs, not on what the client sent.

Note [Bounded JSON]
~~~~~~~~~~~~~~~~~~~
`json.loads` builds every value of a document before the caller sees any of it: a valid
request plus an ignored field of 22 million empty lists (63 MB, under the body limit)
cost 7-10 s of one thread and 1.7 GB of Python objects before the unknown field could be
ignored. So a request's JSON header is decoded with msgspec against a schema
(`_Header`, `_Input`, `_Output`) whose fields are `msgspec.Raw`: the decoder validates
the syntax of the whole document, skips unknown fields without building them (66 MB of
junk in 0.3 s and no allocation, measured), and keeps each known field as a slice of the
body. Each field is then decoded on its own, with a bound:

- every field except an input's `data` is small by nature (a name, a datatype, a shape,
  parameters): at most FIELD_BYTES of JSON;
- the document may hold at most MAX_OBJECTS objects (counting `{` bytes first, in C), so
  lists of input or output objects cannot be made to hold millions of them; a list
  element that is not an object stops the decoder at once;
- an input's `data` is decoded only after its shape passed the signature, and only when
  its JSON is no longer than such a shape can need (`data_byte_limit`: generous for
  pretty-printed numbers, proportional to the element count).

What is kept is at most the body itself plus the decoded data of tensors the model
accepts.

Note [Typed JSON fast path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Decoding each field on its own costs a decoder call per field: five inputs of four
fields each took ~40% of the replica's own work on the recommender's 0.7-1.7 KB bodies
(issue 17), against plain Serve's single `json.loads`. So two typed decoders go first,
each still within the bounds above:

- a header of at most TYPED_HEADER_BYTES is decoded in one pass with each input's
  `name`, `datatype` and `shape` typed (`_TypedHeader`: a non-empty string, a string, a
  list of non-negative integers); `data` and every `parameters` stay raw. A header that
  small holds at most that many bytes of names and shapes, so building them before the
  signature is checked keeps memory bounded by the header's size; a bigger one, or
  anything the types refuse, goes through `decode_header` and the field-by-field path,
  which words the refusal;
- an input's `data`, once its shape passed the signature and its size fits the shape
  (`data_byte_limit`, as before), is decoded by a decoder typed for the input's dtype:
  a flat list whose values have the dtype's Python type and lie in its range, checked
  in C while decoding (`flat_data_decoder`, `decode_flat_data`); numpy builds the
  tensor from that list where it rounds as torch.tensor does (v2_protocol's
  `_NUMPY_DTYPES`: not FP16, BF16 or the unsigned ints past UINT8). What it refuses
  (nested rows, the strings "NaN" & co., a value out of range, the wrong type) is
  decoded again by the general decoder, whose checks word the refusal or accept it
  (nested rows, non-finite strings).

A request is accepted or refused exactly as the field-by-field path would: the typed
decoders only accept what that path accepts, and everything after decoding (names,
datatypes, shapes, lengths, outputs) is one code path (a differential fuzz of the two
builds agreed on 6000 bodies; tests/cluster/test_v2_protocol.py sends every refusal
through both paths). Measured on the recommender's bodies (five inputs, 1-4 rows, in
process, load ~4): 58.5 -> 24.2 us per request (plain Serve's `json.loads` and
`np.asarray`, which check nothing: 17.4-20.0 us). JSON's grammar is RFC 8259's: a bare
NaN or Infinity token is malformed (Python's `json` accepted them); non-finite floats
travel as the strings "NaN", "Infinity" and "-Infinity" (Note [Non-finite JSON numbers]
in dynvm.cluster.protocol._v2).
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from dynvm.vm.errors import DynvmError

MAX_OBJECTS = 4096
"""JSON objects (`{`) a request header may contain."""
FIELD_BYTES = 64 * 1024
"""JSON bytes of any request field other than an input's `data`."""
TYPED_HEADER_BYTES = FIELD_BYTES
"""A header up to this size is decoded in one typed pass (Note [Typed JSON fast path])."""
_INDEX = re.compile(r"\$\[(\d+)\]")


class JsonError(DynvmError, ValueError):
    """A decoding problem, phrased for the client; v2_protocol turns it into a 400."""


# Fields are `msgspec.Raw` (msgspec takes no `Raw | None`): None when absent, the raw
# JSON otherwise (b"null" for an explicit null).


class _Input(msgspec.Struct):
    name: msgspec.Raw = None
    datatype: msgspec.Raw = None
    shape: msgspec.Raw = None
    parameters: msgspec.Raw = None
    data: msgspec.Raw = None


class _Output(msgspec.Struct):
    name: msgspec.Raw = None
    parameters: msgspec.Raw = None


class _Header(msgspec.Struct):
    id: msgspec.Raw = None
    parameters: msgspec.Raw = None
    inputs: msgspec.Raw = None
    outputs: msgspec.Raw = None


class _TypedInput(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    datatype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    parameters: msgspec.Raw = None
    data: msgspec.Raw = None


class _TypedHeader(msgspec.Struct):
    inputs: list[_TypedInput]
    id: msgspec.Raw = None
    parameters: msgspec.Raw = None
    outputs: msgspec.Raw = None


_HEADER = msgspec.json.Decoder(_Header)
_TYPED_HEADER = msgspec.json.Decoder(_TypedHeader)
_INPUTS = msgspec.json.Decoder(list[_Input])
_OUTPUTS = msgspec.json.Decoder(list[_Output])
_ANY = msgspec.json.Decoder()

# Every way a decoder refuses bytes. msgspec.DecodeError covers its ValidationError; the
# sites that word a ValidationError apart catch that first. msgspec checks a string's
# UTF-8 only when it builds the string, not when it skips it into a `Raw` field: invalid
# UTF-8 inside a field passes `decode_header` and surfaces here, at the field's own
# decode.
_MALFORMED = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)


def describe_raw(raw, limit: int = 60) -> str:
    """A short description of a JSON value the client sent (raw JSON: msgspec.Raw or
    bytes-like), without decoding or copying a big one."""
    data = bytes(memoryview(raw)[:4 * limit + 1])
    if len(data) <= 4 * limit:
        try:
            text = repr(_ANY.decode(data))
        except (*_MALFORMED, ValueError):
            text = data.decode("utf-8", "replace")
    else:
        text = data[:limit].decode("utf-8", "replace")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def starts_with(raw: msgspec.Raw | None, prefix: bytes) -> bool:
    """Whether raw JSON starts with `prefix` (without copying a big value)."""
    return raw is not None and bytes(memoryview(raw)[:len(prefix)]) == prefix


def is_null(raw: msgspec.Raw | None) -> bool:
    """Absent, or an explicit JSON null."""
    return raw is None or (len(raw) == 4 and bytes(raw) == b"null")


def _malformed(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return f"a string is not UTF-8 ({exc.reason} at byte {exc.start} of it)"
    if "UTF-8" in str(exc):
        return "a string is not valid UTF-8 (RFC 8259 JSON is UTF-8 text)"
    return str(exc)


def decode_header(raw: bytes | bytearray, what: str) -> _Header:
    """The top-level object (`what`: "the request", ...), its fields kept as raw JSON;
    unknown fields skipped."""
    objects = raw.count(b"{")
    if objects > MAX_OBJECTS:
        raise JsonError(f"{what} has {objects} JSON objects, the limit is {MAX_OBJECTS}")
    try:
        return _HEADER.decode(raw)
    except msgspec.ValidationError:
        raise JsonError(f"{what} must be a JSON object, got {describe_raw(raw)}") from None
    except _MALFORMED as exc:
        raise JsonError(f"malformed JSON in {what}: {_malformed(exc)}") from None


def decode_typed_header(raw: bytes | bytearray) -> _TypedHeader | None:
    """The header with its inputs' names, datatypes and shapes decoded and typed, in one
    pass; None when it is too big for that or irregular in any way (then
    `decode_header` and the field-by-field path word what is wrong; Note [Typed JSON
    fast path])."""
    if len(raw) > TYPED_HEADER_BYTES or raw.count(b"{") > MAX_OBJECTS:
        return None
    try:
        return _TYPED_HEADER.decode(raw)
    except _MALFORMED:
        return None


def _object_list(raw: msgspec.Raw, decoder, what: str) -> list:
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        found = _INDEX.search(str(exc))
        if found is None:  # the value itself is not a list
            raise JsonError(f"'{what}' must be a list, got {describe_raw(raw)}") from None
        raise JsonError(f"{what}[{found.group(1)}] must be an object ({exc})") from None
    except _MALFORMED as exc:
        raise JsonError(f"'{what}': {_malformed(exc)}") from None


def decode_inputs(raw: msgspec.Raw) -> list[_Input]:
    """The request's `inputs` list, each object's fields kept raw."""
    return _object_list(raw, _INPUTS, "inputs")


def decode_outputs(raw: msgspec.Raw) -> list[_Output]:
    """The request's `outputs` list, each object's fields kept raw."""
    return _object_list(raw, _OUTPUTS, "outputs")


def field(raw: msgspec.Raw | None, what: str, default=None):
    """A small field's value (at most FIELD_BYTES of JSON); `default` when absent."""
    if raw is None:
        return default
    if len(raw) > FIELD_BYTES:
        raise JsonError(f"{what} is {len(raw)} bytes of JSON, the limit is {FIELD_BYTES}")
    try:
        return _ANY.decode(raw)
    except _MALFORMED as exc:
        raise JsonError(f"{what}: {_malformed(exc)}") from None


def data_byte_limit(numel: int, rank: int) -> int:
    """The most JSON bytes a `data` field of `numel` numbers in `rank` dims may take:
    64 bytes a number (a float64 written out in full takes 24; the rest is room for
    separators and indentation), 8 more a dim for the brackets of nested rows."""
    return 256 + numel * (64 + 8 * rank)


def flat_data_decoder(kind: type, low: float | None = None,
                      high: float | None = None) -> msgspec.json.Decoder:
    """A decoder of a flat JSON list of `kind` values (bool, int or float), each within
    [low, high], checked in C (Note [Typed JSON fast path])."""
    item = kind if low is None else Annotated[kind, msgspec.Meta(ge=low, le=high)]
    return msgspec.json.Decoder(list[item])


def _check_data_size(raw: msgspec.Raw, numel: int, rank: int, where: str) -> None:
    limit = data_byte_limit(numel, rank)
    if len(raw) > limit:
        raise JsonError(f"{where}: 'data' is {len(raw)} bytes of JSON, more than the "
                        f"{numel} elements of its shape can take ({limit})")


def decode_flat_data(raw: msgspec.Raw, numel: int, rank: int, where: str,
                     flat: msgspec.json.Decoder) -> list | None:
    """An input's `data` as the list `flat` (a `flat_data_decoder`) decodes, when its
    size fits its (validated) shape; None when `flat` refuses it (`decode_data` then)."""
    _check_data_size(raw, numel, rank, where)
    try:
        return flat.decode(raw)
    except _MALFORMED:
        return None


def decode_data(raw: msgspec.Raw, numel: int, rank: int, where: str):
    """An input's `data`, decoded only when its size fits its (validated) shape."""
    _check_data_size(raw, numel, rank, where)
    try:
        return _ANY.decode(raw)
    except msgspec.ValidationError as exc:  # "Number out of range" (e.g. 1e400)
        raise JsonError(f"{where}: 'data': {exc}") from None
    except _MALFORMED as exc:
        raise JsonError(f"{where}: 'data': {_malformed(exc)}") from None
