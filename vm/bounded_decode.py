"""Decoding bytes from outside the process (msgpack, JSON) within limits that follow from
what the bytes should hold (Note [Bounded decoding]).

One helper for every reader of outside bytes: the .dvm loader (`dynvm.vm.dvm_file`), its
signatures (`dynvm.vm.dvm_signature`), the kernel store's envelopes and program indexes
(`dynvm.cluster.store._signed`) and the announcements (`dynvm.cluster.fleet._announce`). It lives in
the VM layer so that every layer may import it; it imports nothing above `dynvm.vm`.

Note [Bounded decoding]
~~~~~~~~~~~~~~~~~~~~~~~
A msgpack header of five bytes can promise four million items, and each item of one
byte (an empty map) becomes a Python object of 64 bytes or more: a 4 MiB store entry
decoded to +280 MB in 2.2 s before anything looked at what it held, and every replica
that read it paid that (issue 28). Limiting the input's size does not help, since the
harm is the ratio. So every decode of outside bytes states what the document may hold:

* per container and per string: msgpack's own `max_array_len`, `max_map_len`,
  `max_str_len`, `max_bin_len`, `max_ext_len`, checked on each header before anything
  is allocated for it (a header over its limit fails in microseconds);
* in the whole document: `max_containers`, maps and arrays together, counted by a hook
  as each one is completed, so that many small containers (a map of four maps of four
  maps...) cannot add up to what one large header was refused for;
* nesting: `max_depth`, checked on the decoded object (whose size the limits above
  already bound); msgpack's own unpacker stops at 1,024 levels, so it never recurses
  deeply while decoding.

The limits follow from the structure: a store envelope is one map of four fields, an
index lists at most a store's per-program bound of keys, a .dvm META section is one
flat map of short strings. A document that breaks one is refused with
`DecodeLimitError`, naming the document, the limit and the value found; bytes that are
not msgpack (or JSON) at all raise `MalformedDocument`. Callers turn both into their
own error (a corrupt section, a corrupt artifact, an ignored announcement).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from dynvm.vm.errors import ConfigError, DynvmError

__all__ = ["DecodeError", "DecodeLimitError", "DecodeLimits", "MalformedDocument",
           "unpack_json", "unpack_msgpack"]


class DecodeError(DynvmError, ValueError):
    """Outside bytes that were not decoded: over a limit, or not a document at all."""


class DecodeLimitError(DecodeError):
    """A document that breaks a limit of its `DecodeLimits` (Note [Bounded decoding]);
    the message names the document, the limit and what was found."""


class MalformedDocument(DecodeError):
    """Bytes that are not a msgpack (or JSON) document."""


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """What one document of outside bytes may hold (Note [Bounded decoding])."""

    max_bytes: int
    """Size of the whole document, in bytes."""
    max_str: int = 0
    """Bytes of one string (UTF-8 encoded)."""
    max_bin: int = 0
    """Bytes of one binary value."""
    max_array: int = 0
    """Items of one array (list)."""
    max_map: int = 0
    """Entries of one map (dict)."""
    max_ext: int = 0
    """Bytes of one msgpack extension value."""
    max_containers: int | None = None
    """Maps and arrays in the whole document; None: only what the other limits allow."""
    max_depth: int | None = 1
    """Deepest nesting of maps and arrays (a flat map is depth 1, a scalar depth 0);
    None: msgpack's own bound of 1,024 levels, with no walk over the decoded object (for
    authenticated documents, whose every container that walk would visit)."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_str", "max_bin", "max_array", "max_map",
                     "max_ext"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigError(f"DecodeLimits.{name} must be an int >= 0, got {value!r}")
        for name in ("max_containers", "max_depth"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ConfigError(f"DecodeLimits.{name} must be None or an int >= 0, "
                                  f"got {value!r}")


def _check_size(data: object, limits: DecodeLimits, what: str) -> None:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedDocument(f"{what}: expected bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > limits.max_bytes:
        raise DecodeLimitError(f"{what}: {size} bytes, at most {limits.max_bytes} allowed")


_MSGPACK_DEPTH = 1024
"""msgpack's unpacker stops at this many levels (its own stack) whatever it is told."""


class _Counter:
    """The msgpack hooks that count containers as they are completed."""

    __slots__ = ("left", "limit", "what")

    def __init__(self, limit: int, what: str) -> None:
        self.left, self.limit, self.what = limit, limit, what

    def __call__(self, container):
        self.left -= 1
        if self.left < 0:
            raise DecodeLimitError(f"{self.what}: more than {self.limit} maps and arrays")
        return container


def unpack_msgpack(data: bytes | bytearray | memoryview, limits: DecodeLimits, what: str,
                   ext_hook: Callable[[int, bytes], object] | None = None) -> object:
    """The msgpack document in `data` (maps with string keys, binary as bytes, arrays as
    lists), if it stays within `limits`; `what` names the document in errors.

    Raises DecodeLimitError for a document over a limit and MalformedDocument for bytes
    that are not one msgpack document; an exception `ext_hook` raises on purpose (a
    DynvmError) passes through."""
    _check_size(data, limits, what)
    options = dict(raw=False, strict_map_key=True, use_list=True,
                   max_str_len=limits.max_str, max_bin_len=limits.max_bin,
                   max_array_len=limits.max_array, max_map_len=limits.max_map,
                   max_ext_len=limits.max_ext)
    if ext_hook is not None:
        options["ext_hook"] = ext_hook
    if limits.max_containers is not None:
        counter = _Counter(limits.max_containers, what)
        options["object_hook"] = options["list_hook"] = counter
    try:
        obj = msgpack.unpackb(data, **options)
    except DynvmError:
        raise
    except msgpack.StackError:  # a ValueError too: before the clause below
        raise DecodeLimitError(f"{what}: nested more than "
                               f"{min(limits.max_depth or _MSGPACK_DEPTH, _MSGPACK_DEPTH)} "
                               "levels") from None
    except ValueError as exc:
        # msgpack names a header over its limit as "N exceeds max_x_len(M)".
        if "exceeds max_" in str(exc):
            raise DecodeLimitError(f"{what}: {exc}") from None
        detail = str(exc) or type(exc).__name__
        raise MalformedDocument(f"{what}: not a msgpack document ({detail})") from None
    except Exception as exc:  # msgpack raises several unrelated types on bad bytes
        raise MalformedDocument(f"{what}: not a msgpack document ({type(exc).__name__}: "
                                f"{exc})") from None
    # Nesting never exceeds the container count: with few enough, no walk is needed.
    if limits.max_depth is not None and (limits.max_containers is None
                                         or limits.max_containers > limits.max_depth):
        check_depth(obj, limits.max_depth, what)
    return obj


def unpack_json(data: bytes | bytearray | memoryview | str, limits: DecodeLimits,
                what: str) -> object:
    """The JSON document in `data` within `limits` (`max_bytes` and `max_depth` apply;
    JSON's own amplification is small: every value costs at least one byte). Raises as
    `unpack_msgpack` does."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    _check_size(data, limits, what)
    try:
        obj = json.loads(bytes(data))
    except RecursionError:
        levels = limits.max_depth if limits.max_depth is not None else "Python's parser's"
        raise DecodeLimitError(f"{what}: nested more than {levels} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedDocument(f"{what}: not a JSON document ({exc})") from None
    if limits.max_depth is not None:
        check_depth(obj, limits.max_depth, what)
    return obj


def check_depth(obj: object, max_depth: int, what: str) -> None:
    """Raise DecodeLimitError if `obj` nests lists and dicts more than `max_depth` deep."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, list | dict):
            if depth > max_depth:
                raise DecodeLimitError(f"{what}: nested more than {max_depth} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children
                         if isinstance(child, list | dict))
