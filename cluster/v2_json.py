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
accepts. JSON's grammar is RFC 8259's: a bare NaN or Infinity token is malformed (Python's
`json` accepted them); non-finite floats travel as the strings "NaN", "Infinity" and
"-Infinity" (Note [Non-finite JSON numbers] in dynvm.cluster.v2_protocol).
"""

from __future__ import annotations

import re

import msgspec

from dynvm.vm.errors import DynvmError

MAX_OBJECTS = 4096
"""JSON objects (`{`) a request header may contain."""
FIELD_BYTES = 64 * 1024
"""JSON bytes of any request field other than an input's `data`."""
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


_HEADER = msgspec.json.Decoder(_Header)
_INPUTS = msgspec.json.Decoder(list[_Input])
_OUTPUTS = msgspec.json.Decoder(list[_Output])
_ANY = msgspec.json.Decoder()


def describe_raw(raw, limit: int = 60) -> str:
    """A short description of a JSON value the client sent (raw JSON: msgspec.Raw or
    bytes-like), without decoding or copying a big one."""
    data = bytes(memoryview(raw)[:4 * limit + 1])
    if len(data) <= 4 * limit:
        try:
            text = repr(_ANY.decode(data))
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError):
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
    if isinstance(exc, UnicodeDecodeError):  # msgspec checks UTF-8 only when it decodes
        return f"a string is not UTF-8 ({exc.reason} at byte {exc.start} of it)"
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
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise JsonError(f"malformed JSON in {what}: {_malformed(exc)}") from None


def _object_list(raw: msgspec.Raw, decoder, what: str) -> list:
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        found = _INDEX.search(str(exc))
        if found is None:  # the value itself is not a list
            raise JsonError(f"'{what}' must be a list, got {describe_raw(raw)}") from None
        raise JsonError(f"{what}[{found.group(1)}] must be an object ({exc})") from None
    except (RecursionError, UnicodeDecodeError) as exc:
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
    except (msgspec.ValidationError, RecursionError, UnicodeDecodeError) as exc:
        raise JsonError(f"{what}: {_malformed(exc)}") from None


def data_byte_limit(numel: int, rank: int) -> int:
    """The most JSON bytes a `data` field of `numel` numbers in `rank` dims may take:
    64 bytes a number (a float64 written out in full takes 24; the rest is room for
    separators and indentation), 8 more a dim for the brackets of nested rows."""
    return 256 + numel * (64 + 8 * rank)


def decode_data(raw: msgspec.Raw, numel: int, rank: int, where: str):
    """An input's `data`, decoded only when its size fits its (validated) shape."""
    limit = data_byte_limit(numel, rank)
    if len(raw) > limit:
        raise JsonError(f"{where}: 'data' is {len(raw)} bytes of JSON, more than the "
                        f"{numel} elements of its shape can take ({limit})")
    try:
        return _ANY.decode(raw)
    except msgspec.ValidationError as exc:  # "Number out of range" (e.g. 1e400)
        raise JsonError(f"{where}: 'data': {exc}") from None
    except (RecursionError, UnicodeDecodeError) as exc:
        raise JsonError(f"{where}: 'data': {_malformed(exc)}") from None
