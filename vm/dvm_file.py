"""The .dvm file: a `Program` (code, signature and constants) saved as one file.

Layout (integers little-endian; offsets count from the start of the file):

    magic            8 bytes  b"\\x89DVM\\r\\n\\x1a\\n"  (as PNG's: text-mode mangling shows)
    format version   u32      FORMAT_VERSION
    section count    u32
    section table    per section: name (8 bytes, ASCII, NUL-padded), version u32,
                     offset u64, length u64
    payloads         the sections' bytes, back to back, in table order
    checksum         sha256 of every byte before it (32 bytes)

Sections, each at version 1:

    CODE   msgpack map from `dynvm.vm.serialize.encode_header`: name, n_regs, inputs,
           constant specs, in_spec, out_spec, code and the program's content hash
    CONST  the constants as safetensors, keyed by constant name
           (see Note [complex128 constants])
    META   optional msgpack map of strings: torch and dynvm versions, writer; only its
           type is checked on load (at most META_MAX_BYTES, 64 short strings)

A reader of format version 1 rejects sections it does not know: a new section is a new
format version. Loading validates everything before using any of it; see
Note [Validating a .dvm file]. Nothing here ever unpickles.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import secrets
import struct
from dataclasses import dataclass
from types import MappingProxyType

import safetensors.torch
import torch

from dynvm.vm import dvm_signature
from dynvm.vm.bounded_decode import DecodeLimits
from dynvm.vm.dvm_raw_hash import check_raw_content_hash
from dynvm.vm.errors import (
    ChecksumError,
    CorruptSectionError,
    DvmFormatError,
    InputError,
    NotDvmFileError,
    SaveError,
    TruncatedFileError,
    VerifyError,
    VersionError,
)
from dynvm.vm.instr import Instr
from dynvm.vm.program import ConstSpec, DimSpec, InputSpec, Program
from dynvm.vm.serialize import (
    check_tied,
    decode_instr,
    dtype_named,
    encode_header,
    pack,
    tied_constants,
    unpack,
)
from dynvm.vm.torch_literals import literal_name

__all__ = [
    "FORMAT_VERSION", "MAGIC", "MAX_REGS", "SECTION_VERSIONS", "ChecksumError",
    "CorruptSectionError", "DvmFormatError", "NotDvmFileError", "TruncatedFileError",
    "VersionError", "dumps", "load", "loads", "save",
]

MAGIC = b"\x89DVM\r\n\x1a\n"
FORMAT_VERSION = 1
SECTION_VERSIONS = MappingProxyType({"CODE": 1, "CONST": 1, "META": 1})
"""The section names this format version knows, and the version of each it reads."""
REQUIRED_SECTIONS = ("CODE", "CONST")
MAX_SECTIONS = 64
MAX_REGS = 1 << 20
"""Largest register count a loaded program may declare. The verifier's cost grows with
the register count, so a forged count could otherwise stall a load."""
META_MAX_BYTES = 64 * 1024
"""Largest META section a loaded file may have (the writer's is about 100 bytes)."""
_META_LIMITS = DecodeLimits(max_bytes=META_MAX_BYTES, max_str=4096, max_map=64,
                            max_containers=1, max_depth=1)

_HEADER = struct.Struct("<8sII")    # magic, format version, section count
_ENTRY = struct.Struct("<8sIQQ")    # name, section version, offset, length
_DIGEST_SIZE = 32
_MIN_SIZE = _HEADER.size + _DIGEST_SIZE

# Note [Validating a .dvm file]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The bytes come from outside the process, so `loads` checks, cheapest first: the magic,
# the format version, the checksum of the whole file (or truncation, see Note [Truncated
# or corrupt]), the section table (names, duplicates, offsets in range, no overlaps or
# gaps, required sections present), the section versions; then the CODE section's
# top-level fields and specs, and the stored content hash against the hash of the raw
# bytes it covers (the CODE section without its hash field, and each constant's bytes as
# safetensors lays them out), before any instruction, tensor or treespec is built; then
# META, the instructions, the treespecs, the constants against the CODE section's specs,
# the verifier (via `Program`), and the stored content hash against the rebuilt
# program's. `load` checks the signature, when one is required, before all of it. Every
# msgpack section is decoded within limits that follow from what it holds (Note [Bounded
# decoding] in dynvm.vm.bounded_decode): META is one flat map of short strings, so a
# bomb there is refused at its first header. Every failure is a specific
# `DvmFormatError` subclass. Exceptions of other libraries are caught only around the
# single calls that decode outside bytes (msgpack in `serialize.unpack`, safetensors,
# the treespec parser); `struct` is never handed a buffer shorter than it reads.
#
# Note [Truncated or corrupt]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The header has no total length. A file whose checksum holds is complete. One whose
# checksum fails is reported as truncated when its own section table, read as the writer
# lays it out (payloads back to back in table order), promises more bytes than are
# present; otherwise its bytes were changed, and it is reported as a checksum error.
#
# Note [complex128 constants]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# safetensors has no complex128 dtype. Such a constant is stored as its float64
# `torch.view_as_real` view (shape + [2]) and turned back on load, where the CODE
# section's spec says complex128. The other dtypes of _CONSTANT_DTYPES are stored as
# they are; a constant of any other dtype is refused when the program is saved (input
# specs only name their dtype, so any dtype torch has is fine there).

_CONSTANT_DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128})


@dataclass(frozen=True, slots=True)
class _Section:
    name: str
    version: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


# ---------------------------------------------------------------- writing ------------


def dumps(program: Program) -> bytes:
    """The .dvm file of `program`, as bytes."""
    _check_saveable(program)
    payloads = (("CODE", encode_header(program)), ("CONST", _encode_constants(program)),
                ("META", pack(_meta())))
    parts = [_HEADER.pack(MAGIC, FORMAT_VERSION, len(payloads))]
    offset = _HEADER.size + _ENTRY.size * len(payloads)
    for name, payload in payloads:
        parts.append(_ENTRY.pack(name.encode("ascii"), SECTION_VERSIONS[name], offset,
                                 len(payload)))
        offset += len(payload)
    parts.extend(payload for _, payload in payloads)
    body = b"".join(parts)
    return body + hashlib.sha256(body).digest()


def save(program: Program, path: str | os.PathLike,
         signing_secret: bytes | None = None) -> None:
    """Write `program` to `path` atomically: readers see the old file or the new one,
    never a part of it (a temporary file in the same directory, then `os.replace`).
    `signing_secret`: also write its signature, `<path>.sig` (Note [Signed programs])."""
    data = dumps(program)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never clobber anything; mode 0o666 lets the umask decide, as open() would.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)
    if signing_secret is not None:
        dvm_signature.sign_file(path, signing_secret)


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check_saveable(program: Program) -> None:
    """Refuse to write a file that `loads` would reject for a reason the writer can see."""
    for spec in program.constant_specs:
        if spec.dtype not in _CONSTANT_DTYPES:  # Note [complex128 constants]
            raise SaveError(f"cannot save program {program.name!r}: constant {spec.name!r} "
                             f"has dtype {literal_name(spec.dtype)}, which the .dvm format "
                             "cannot store")
    names = program.constant_names
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise SaveError(f"cannot save program {program.name!r}: constant names {twice} "
                         "are used more than once (constants are stored by name)")


def _encode_constants(program: Program) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple[int, int]] = set()
    tied = {name for name, _ in tied_constants(program)}   # Note [Tied constants]
    for name, tensor in zip(program.constant_names, program.constants, strict=True):
        if name in tied:
            continue
        tensor = tensor.detach().to("cpu")
        if tensor.dtype == torch.complex128:  # Note [complex128 constants]
            tensor = torch.view_as_real(tensor)
        tensor = tensor.contiguous()
        # safetensors refuses tensors that share storage (tied weights, views of one
        # buffer); each such constant after the first gets its own copy.
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes():
            if key in storages:
                tensor = tensor.clone()
            else:
                storages.add(key)
        tensors[name] = tensor
    return safetensors.torch.save(tensors)


def _meta() -> dict[str, str]:
    try:
        version = importlib.metadata.version("dynvm")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"torch": str(torch.__version__), "dynvm": version,
            "created_by": "dynvm.vm.dvm_file"}


# ---------------------------------------------------------------- reading ------------


def load(path: str | os.PathLike, signing_secret: bytes | None = None) -> Program:
    """Read and validate the .dvm file at `path` (see `loads`). With `signing_secret`,
    its signature `<path>.sig` must match before anything is parsed (Note [Signed
    programs]); a mismatch or no signature raises DvmSignatureError."""
    with open(path, "rb") as f:
        data = f.read()
    if signing_secret is not None:
        dvm_signature.check_file(path, data, signing_secret)
    try:
        return loads(data)
    except DvmFormatError as exc:
        exc.add_note(f"while loading {os.fspath(path)!r}")
        raise


def loads(data: bytes | bytearray | memoryview) -> Program:
    """The program in a .dvm file's bytes. Raises a `DvmFormatError` subclass, and no
    other exception, for any bytes that are not a valid .dvm file."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InputError(f"loads() takes bytes, not {type(data).__name__}")
    data = bytes(data)
    sections = _read_sections(data)
    for section in sections.values():
        expected = SECTION_VERSIONS[section.name]
        if section.version != expected:
            raise VersionError(section.name, expected, section.version)
    meta = _payload(data, sections["META"]) if "META" in sections else None
    return _decode_program(_payload(data, sections["CODE"]),
                           _payload(data, sections["CONST"]), meta)


def _payload(data: bytes, section: _Section) -> memoryview:
    return memoryview(data)[section.offset:section.end]   # no copy of a large section


def _read_sections(data: bytes) -> dict[str, _Section]:
    size = len(data)
    if data[:len(MAGIC)] != MAGIC:
        if size < len(MAGIC) and MAGIC.startswith(data):
            raise TruncatedFileError(_MIN_SIZE, size, at_least=True)
        raise NotDvmFileError(data[:len(MAGIC)], MAGIC, _magic_hint(data))
    if size < _HEADER.size:
        raise TruncatedFileError(_MIN_SIZE, size, at_least=True)
    _, version, count = _HEADER.unpack_from(data)
    if version != FORMAT_VERSION:
        raise VersionError("file", FORMAT_VERSION, version)
    _check_digest(data, count)
    return _parse_table(data, count)


def _magic_hint(data: bytes) -> str:
    if data[1:4] == b"DVM":
        return ("it looks like a .dvm file mangled by a text-mode transfer, which rewrites "
                "line endings or drops the high bit; copy it as binary")
    return ""


def _check_digest(data: bytes, count: int) -> None:
    """Note [Truncated or corrupt]."""
    size = len(data)
    computed = b""
    if size >= _MIN_SIZE:
        computed = hashlib.sha256(memoryview(data)[:size - _DIGEST_SIZE]).digest()
        if computed == data[size - _DIGEST_SIZE:]:
            return
    promised = _promised_size(data, count)
    if promised is not None and promised[0] > size:
        raise TruncatedFileError(promised[0], size, at_least=not promised[1])
    if size < _MIN_SIZE:
        raise TruncatedFileError(_MIN_SIZE, size, at_least=True)
    detail = ""
    if promised is not None and promised[1] and promised[0] < size:
        detail = f"{size - promised[0]} bytes more than its section table accounts for"
    raise ChecksumError(data[size - _DIGEST_SIZE:].hex(), computed.hex(), detail)


def _promised_size(data: bytes, count: int) -> tuple[int, bool] | None:
    """(size, exact) the header and table promise when laid out as the writer lays them
    out; exact is False when the table itself is cut off. None: not such a layout."""
    if count > MAX_SECTIONS:
        return None
    table_end = _HEADER.size + count * _ENTRY.size
    if len(data) < table_end:
        return table_end + _DIGEST_SIZE, False
    end = table_end
    for i in range(count):
        _, _, offset, length = _ENTRY.unpack_from(data, _HEADER.size + i * _ENTRY.size)
        if offset != end:
            return None
        end += length
    return end + _DIGEST_SIZE, True


def _parse_table(data: bytes, count: int) -> dict[str, _Section]:
    body_end = len(data) - _DIGEST_SIZE
    if count > MAX_SECTIONS:
        raise CorruptSectionError("section table",
                                  f"{count} sections, at most {MAX_SECTIONS} allowed")
    table_end = _HEADER.size + count * _ENTRY.size
    if table_end > body_end:
        raise CorruptSectionError("section table", f"{count} entries end at byte "
                                  f"{table_end}, past the end of the contents ({body_end})")
    sections: dict[str, _Section] = {}
    for i in range(count):
        raw, version, offset, length = _ENTRY.unpack_from(data, _HEADER.size + i * _ENTRY.size)
        name = _section_name(raw, i)
        if name in sections:
            raise CorruptSectionError(name, "appears twice in the section table")
        if name not in SECTION_VERSIONS:
            raise CorruptSectionError(name, f"unknown section (format version "
                                      f"{FORMAT_VERSION} has {', '.join(SECTION_VERSIONS)})")
        if offset < table_end or offset + length > body_end:
            raise CorruptSectionError(name, f"its bytes [{offset}, {offset + length}) lie "
                                      f"outside the payload area [{table_end}, {body_end})")
        sections[name] = _Section(name, version, offset, length)
    position, previous = table_end, None
    for section in sorted(sections.values(), key=lambda s: (s.offset, s.end)):
        if section.offset < position:
            raise CorruptSectionError(section.name, f"its bytes [{section.offset}, "
                                      f"{section.end}) overlap section {previous.name} "
                                      f"[{previous.offset}, {previous.end})")
        if section.offset > position:
            raise CorruptSectionError("section table", f"bytes [{position}, "
                                      f"{section.offset}) belong to no section")
        position, previous = section.end, section
    if position != body_end:
        raise CorruptSectionError("section table",
                                  f"bytes [{position}, {body_end}) belong to no section")
    for name in REQUIRED_SECTIONS:
        if name not in sections:
            raise CorruptSectionError(name, "required section is missing")
    return sections


def _section_name(raw: bytes, index: int) -> str:
    name = raw.rstrip(b"\0")
    if not name or b"\0" in name or not all(0x21 <= c < 0x7F for c in name):
        raise CorruptSectionError("section table", f"entry {index}: {raw!r} is not a "
                                  "section name (printable ASCII, NUL-padded to 8 bytes)")
    return name.decode("ascii")


def _unpack_section(payload: memoryview, section: str,
                    limits: DecodeLimits | None = None) -> object:
    """A msgpack section within `limits` (None: serialize.unpack's, bounded by the
    section's size and MAX_NESTING levels; Note [Bounded decoding])."""
    try:
        return unpack(payload, section, limits)
    except DvmFormatError as exc:
        raise CorruptSectionError(section,
                                  str(exc).removeprefix(f"section {section}: ")) from exc


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _check_meta(payload: memoryview) -> None:
    meta = _unpack_section(payload, "META", _META_LIMITS)
    if not (isinstance(meta, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise CorruptSectionError("META", f"expected a map of strings to strings, got "
                                  f"{_describe(meta)}")


# ---------------------------------------------------------------- the CODE section --

_CODE_FIELDS = MappingProxyType({
    "name": str, "n_regs": int, "inputs": list, "constants": list, "in_spec": str,
    "out_spec": str, "code": list, "hash": str})
_OPTIONAL_CODE_FIELDS = MappingProxyType({"state": list, "tied": list})


def _corrupt_code(problem: str) -> CorruptSectionError:
    return CorruptSectionError("CODE", problem)


def _decode_program(code_payload: memoryview, const_payload: memoryview,
                    meta_payload: memoryview | None) -> Program:
    header = _unpack_section(code_payload, "CODE")
    if not isinstance(header, dict):
        raise _corrupt_code(f"expected a map, got {_describe(header)}")
    missing = [key for key in _CODE_FIELDS if key not in header]
    if missing:
        raise _corrupt_code(f"fields {missing} are missing")
    unknown = sorted(repr(key) for key in header
                     if key not in _CODE_FIELDS and key not in _OPTIONAL_CODE_FIELDS)
    if unknown:
        raise _corrupt_code(f"unknown fields {', '.join(unknown)}")
    for key, kind in _CODE_FIELDS.items():
        if type(header[key]) is not kind:  # `is`, so that a bool is not taken for an int
            raise _corrupt_code(f"field {key!r} must be {kind.__name__}, got "
                                f"{_describe(header[key])}")
    state = header.get("state", [])
    if type(state) is not list or not all(type(i) is int for i in state):
        raise _corrupt_code(f"field 'state' must be a list of input indices, got "
                            f"{_describe(state)}")
    n_regs = header["n_regs"]
    if not 0 <= n_regs <= MAX_REGS:
        raise _corrupt_code(f"n_regs is {n_regs}, expected 0..{MAX_REGS}")
    inputs = tuple(_decode_input(i, item) for i, item in enumerate(header["inputs"]))
    specs = tuple(_decode_const_spec(i, item) for i, item in enumerate(header["constants"]))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise _corrupt_code(f"constant names repeat: {names}")
    try:   # Note [Tied constants]: a tied name's bytes are its first name's
        tied = check_tied(header.get("tied", []), names)
    except DvmFormatError as exc:
        raise _corrupt_code(str(exc)) from None
    unhashed = check_raw_content_hash(code_payload, len(header), header["hash"],
                                      const_payload, [tied.get(n, n) for n in names])
    if meta_payload is not None:
        _check_meta(meta_payload)
    code = _decode_code(header["code"])
    for key in ("in_spec", "out_spec"):
        _check_treespec(key, header[key])
    constants = _decode_constants(bytes(const_payload), specs, tied)
    try:
        program = Program(code=code, n_regs=n_regs, inputs=inputs, constants=constants,
                          constant_names=tuple(names), in_spec=header["in_spec"],
                          out_spec=header["out_spec"], name=header["name"],
                          state=tuple(state))
    except VerifyError as exc:
        raise _corrupt_code(f"the program does not verify: {exc}") from exc
    # The stored hash covers the raw bytes (checked above); the program hashes what it
    # re-encodes. Its constants are those raw bytes, so the code alone is compared, and
    # the verified hash is kept rather than every constant hashed a second time.
    if encode_header(program, with_hash=False) != unhashed:
        raise _corrupt_code("the loaded program does not re-encode to the file's bytes: the "
                            "section was written by another encoder or changed")
    program._cache["hash"] = header["hash"]
    return program


def _dtype(name: object, where: str) -> torch.dtype:
    if not isinstance(name, str):
        raise _corrupt_code(f"{where}: dtype must be a string, got {_describe(name)}")
    try:
        return dtype_named(name)
    except DvmFormatError:
        raise _corrupt_code(f"{where}: unknown dtype {name!r}") from None


def _is_triple(item: object) -> bool:
    return isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)


def _decode_input(index: int, item: object) -> InputSpec:
    if not (_is_triple(item) and isinstance(item[2], list)):
        raise _corrupt_code(f"input {index}: expected [name, dtype, dims], got "
                            f"{_describe(item)}")
    name, dtype_name, dims = item
    where = f"input {index} ({name!r})"
    return InputSpec(name, _dtype(dtype_name, where),
                     tuple(_decode_dim(f"{where} dim {j}", d) for j, d in enumerate(dims)))


def _decode_dim(where: str, item: object) -> DimSpec:
    # [name, low, high], or [name, low, high, scale, offset] (Note [Derived dims]).
    derived = isinstance(item, list) and len(item) == 5 and isinstance(item[0], str) \
        and all(type(v) is int for v in item[1:])
    if not (derived or _is_triple(item) and type(item[1]) is int and type(item[2]) is int):
        raise _corrupt_code(f"{where}: expected [name, low, high] or [name, low, high, "
                            f"scale, offset], got {_describe(item)}")
    name, low, high = item[:3]
    if not 0 <= low <= high:
        raise _corrupt_code(f"{where}: range {low}..{high} is empty or negative")
    if derived and item[3] < 1:
        raise _corrupt_code(f"{where}: derived dim scale {item[3]}, expected >= 1")
    return DimSpec(name, low, high, *item[3:])


def _decode_const_spec(index: int, item: object) -> ConstSpec:
    if not (_is_triple(item) and isinstance(item[2], list)
            and all(type(d) is int and d >= 0 for d in item[2])):
        raise _corrupt_code(f"constant {index}: expected [name, dtype, shape], got "
                            f"{_describe(item)}")
    name, dtype_name, shape = item
    return ConstSpec(name, _dtype(dtype_name, f"constant {index} ({name!r})"), tuple(shape))


def _decode_code(items: list) -> tuple[Instr, ...]:
    code = []
    for pc, item in enumerate(items):
        try:
            code.append(decode_instr(item, pc))
        except DvmFormatError as exc:
            raise _corrupt_code(str(exc)) from exc
    return tuple(code)


def _check_treespec(key: str, text: str) -> None:
    try:
        torch.utils._pytree.treespec_loads(text)
    except Exception as exc:  # json and pytree raise several unrelated types on bad text
        raise _corrupt_code(f"{key} is not a pytree treespec ({type(exc).__name__}: "
                            f"{exc})") from exc


# ---------------------------------------------------------------- the CONST section -


def _decode_constants(payload: bytes, specs: tuple[ConstSpec, ...],
                      tied: dict[str, str]) -> tuple[torch.Tensor, ...]:
    try:
        tensors = safetensors.torch.load(payload)
    except Exception as exc:  # the parser raises SafetensorError; its torch glue others
        raise CorruptSectionError("CONST", f"not valid safetensors ({type(exc).__name__}: "
                                  f"{exc})") from exc
    declared = {spec.name for spec in specs}
    extra = sorted(name for name in tensors if name not in declared)
    if extra:
        raise CorruptSectionError("CONST", f"holds tensors {extra} that the CODE section "
                                  "does not declare")
    constants = []
    for spec in specs:
        tensor = tensors.get(tied.get(spec.name, spec.name))
        if tensor is None:
            raise CorruptSectionError("CONST", f"constant {spec.name!r}, declared in the "
                                      "CODE section, is missing")
        if (spec.dtype == torch.complex128 and tensor.dtype == torch.float64
                and tuple(tensor.shape) == spec.shape + (2,)):  # Note [complex128 constants]
            tensor = torch.view_as_complex(tensor)
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise CorruptSectionError("CONST", f"constant {spec.name!r}: the CODE section "
                                      f"declares {spec.dtype} {list(spec.shape)}, CONST "
                                      f"holds {tensor.dtype} {list(tensor.shape)}")
        constants.append(tensor)
    return tuple(constants)
