"""The .dvm container: round trips, and a specific DvmFormatError (never anything else)
for every way the bytes can be wrong.

The container helpers below (`split`, `build`, `rechecksum`) are written from the format
description, independently of `dynvm.vm.dvm_file`, so the tests also pin the layout.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import struct

import msgpack
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from dynvm.vm import dvm_file
from dynvm.vm.asm import assemble
from dynvm.vm.dvm_file import (
    ChecksumError,
    CorruptSectionError,
    DvmFormatError,
    NotDvmFileError,
    TruncatedFileError,
    VersionError,
)
from dynvm.vm.errors import VerifyError
from dynvm.vm.program import Program
from dynvm.vm.serialize import encode_header

MAGIC = b"\x89DVM\r\n\x1a\n"
HEADER = struct.Struct("<8sII")
ENTRY = struct.Struct("<8sIQQ")

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def treespec(example) -> str:
    return pytree.treespec_dumps(pytree.tree_flatten(example)[1])


ONE_TENSOR = treespec(((torch.zeros(1),), {}))
ONE_OUTPUT = treespec((torch.zeros(1),))

TINY = f"""
.program 'tiny'
.regs 4
.input 'x' float32 [batch:1..64, 8]
.const 'w' float32 [8, 8]
.in_spec {ONE_TENSOR!r}
.out_spec {ONE_OUTPUT!r}
     0  SHAPE_ASSERT %0, 'x', torch.float32, device("cpu"), ((1, 64, 'batch'), (8, 8, ''))
     1  %1 = LINEAR %0, c0, None
     2  %2 = RELU %1
     3  RETURN {{%2}}
"""

NO_CONSTANTS = f"""
.program 'no_constants'
.regs 2
.input 'x' float32 [batch:1..64, 8]
.in_spec {ONE_TENSOR!r}
.out_spec {ONE_OUTPUT!r}
     0  SHAPE_ASSERT %0, 'x', torch.float32, device("cpu"), ((1, 64, 'batch'), (8, 8, ''))
     1  %1 = RELU %0
     2  RETURN {{%1}}
"""

MANY_DTYPES = ("bfloat16", "float16", "float64", "int64", "int8", "uint8", "bool",
               "complex64", "complex128")
MANY = f"""
.program 'many constants'
.regs 2
.input 'x' float32 [batch:1..64, 8]
.const 'w' float32 [8, 8]
.const 'w_tied' float32 [8, 8]
.const 'empty' float32 [0, 3]
.const 'transposed' float32 [3, 2]
{chr(10).join(f".const '{d}' {d} [2, 3]" for d in MANY_DTYPES)}
.in_spec {ONE_TENSOR!r}
.out_spec {ONE_OUTPUT!r}
     0  SHAPE_ASSERT %0, 'x', torch.float32, device("cpu"), ((1, 64, 'batch'), (8, 8, ''))
     1  %1 = LINEAR %0, c1, None
     2  RETURN {{%1}}
"""


def _random(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randint(0, 100, shape, generator=gen, dtype=dtype)


def tiny_program() -> Program:
    return assemble(TINY, (_random(torch.float32, (8, 8), 0),))


def many_program() -> Program:
    w = _random(torch.float32, (8, 8), 1)
    w[0, 0] = float("nan")
    constants = [w, w, torch.zeros(0, 3), _random(torch.float32, (2, 3), 2).t()]
    constants += [_random(getattr(torch, d), (2, 3), 3 + i) for i, d in enumerate(MANY_DTYPES)]
    return assemble(MANY, tuple(constants))


@functools.cache
def tiny_bytes() -> bytes:
    return dvm_file.dumps(tiny_program())


# ------------------------------------------------------------ container helpers -----


def split(data: bytes) -> list[list]:
    """[[name, version, payload], ...] of a well-formed file, in table order."""
    magic, version, count = HEADER.unpack_from(data)
    assert magic == MAGIC and version == 1
    entries = []
    for i in range(count):
        name, section_version, offset, length = ENTRY.unpack_from(data, HEADER.size
                                                                  + i * ENTRY.size)
        entries.append([name.rstrip(b"\0").decode(), section_version,
                        data[offset:offset + length]])
    return entries


def build(entries, file_version: int = 1) -> bytes:
    """A file with these [name, version, payload] sections, laid out as the writer does,
    with a correct checksum."""
    parts = [HEADER.pack(MAGIC, file_version, len(entries))]
    offset = HEADER.size + ENTRY.size * len(entries)
    for name, version, payload in entries:
        parts.append(ENTRY.pack(name.encode() if isinstance(name, str) else name, version,
                                offset, len(payload)))
        offset += len(payload)
    parts += [payload for _, _, payload in entries]
    return rechecksum(b"".join(parts) + bytes(32))


def rechecksum(data: bytes) -> bytes:
    """`data` with its last 32 bytes replaced by the sha256 of the rest: the file gets past
    the checksum and into the section decoders."""
    return data[:-32] + hashlib.sha256(data[:-32]).digest()


def replace(data: bytes, name: str, payload: bytes) -> bytes:
    return build([[n, v, payload if n == name else p] for n, v, p in split(data)])


def code_header(data: bytes) -> dict:
    """The CODE section as plain msgpack (extension types kept as ExtType)."""
    payload = next(p for n, _, p in split(data) if n == "CODE")
    return msgpack.unpackb(payload, raw=False)


def content_hash(header: dict, const_payload: bytes) -> str:
    """The content hash a writer stores for this CODE header and CONST section: the
    header without its hash, then each declared constant's raw bytes in order."""
    digest = hashlib.sha256(msgpack.packb({k: v for k, v in header.items() if k != "hash"},
                                          use_bin_type=True))
    tensors = safetensors.torch.load(const_payload)
    for name, *_ in header["constants"]:
        if name in tensors:
            digest.update(_raw(tensors[name]))
    return digest.hexdigest()


def with_header(data: bytes, **fields) -> bytes:
    """`data` with these CODE fields, and (unless `hash` is one of them) the content hash
    a writer would store: a forger who recomputes it gets past the hash check into the
    structural ones."""
    header = code_header(data)
    header.update(fields)
    if "hash" not in fields:
        const = next(p for n, _, p in split(data) if n == "CONST")
        header.pop("hash")
        header["hash"] = content_hash(header, const)
    return replace(data, "CODE", msgpack.packb(header, use_bin_type=True))


def rehashed(data: bytes) -> bytes:
    """`data` with the content hash of its CODE and CONST sections as they are now."""
    return with_header(data)


def table_offset(index: int) -> int:
    return HEADER.size + index * ENTRY.size


# ------------------------------------------------------------ round trips -----------


def assert_same_program(a: Program, b: Program) -> None:
    assert a.code == b.code
    assert a.n_regs == b.n_regs
    assert a.inputs == b.inputs
    assert a.constant_names == b.constant_names
    assert (a.in_spec, a.out_spec, a.name) == (b.in_spec, b.out_spec, b.name)
    assert len(a.constants) == len(b.constants)
    for x, y in zip(a.constants, b.constants, strict=True):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        # Bit-identical, NaNs included.
        assert _raw(x) == _raw(y)
    assert a.content_hash == b.content_hash


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


@pytest.mark.parametrize("make", [tiny_program, many_program,
                                  lambda: assemble(NO_CONSTANTS)],
                         ids=["tiny", "many_dtypes", "no_constants"])
def test_round_trip(make):
    program = make()
    data = dvm_file.dumps(program)
    loaded = dvm_file.loads(data)
    assert_same_program(program, loaded)
    assert dvm_file.dumps(loaded) == data  # deterministic, and stable over a round trip


def test_loads_accepts_bytes_like_and_rejects_text():
    data = tiny_bytes()
    for view in (bytearray(data), memoryview(data)):
        assert dvm_file.loads(view).content_hash == tiny_program().content_hash
    with pytest.raises(TypeError):
        dvm_file.loads(data.decode("latin-1"))


def test_layout():
    data = tiny_bytes()
    assert data[:8] == MAGIC
    assert struct.unpack_from("<I", data, 8) == (dvm_file.FORMAT_VERSION,) == (1,)
    assert hashlib.sha256(data[:-32]).digest() == data[-32:]
    sections = {name: (version, payload) for name, version, payload in split(data)}
    assert {name: v for name, (v, _) in sections.items()} == {"CODE": 1, "CONST": 1,
                                                              "META": 1}
    program = tiny_program()
    assert sections["CODE"][1] == encode_header(program)
    constants = safetensors.torch.load(sections["CONST"][1])
    assert list(constants) == ["w"] and torch.equal(constants["w"], program.constants[0])
    meta = msgpack.unpackb(sections["META"][1])
    assert meta["torch"] == str(torch.__version__) and "dynvm" in meta


def test_save_and_load(tmp_path):
    program = tiny_program()
    path = tmp_path / "tiny.dvm"
    dvm_file.save(program, path)
    assert_same_program(program, dvm_file.load(path))
    assert path.read_bytes() == dvm_file.dumps(program)
    # Overwriting is atomic and leaves no temporary file behind.
    other = assemble(NO_CONSTANTS)
    dvm_file.save(other, str(path))
    assert_same_program(other, dvm_file.load(str(path)))
    assert os.listdir(tmp_path) == ["tiny.dvm"]


def test_load_names_the_file(tmp_path):
    path = tmp_path / "broken.dvm"
    path.write_bytes(b"not a dvm file at all")
    with pytest.raises(NotDvmFileError) as info:
        dvm_file.load(path)
    assert any("broken.dvm" in note for note in info.value.__notes__)


def test_save_refuses_duplicate_constant_names():
    w = torch.zeros(8, 8)
    tiny = tiny_program()
    program = Program(code=tiny.code, n_regs=4, inputs=tiny.inputs, constants=(w, w),
                      constant_names=("w", "w"), in_spec=tiny.in_spec,
                      out_spec=tiny.out_spec)
    with pytest.raises(ValueError, match="'w'"):
        dvm_file.dumps(program)


def test_meta_section_is_optional():
    data = build([e for e in split(tiny_bytes()) if e[0] != "META"])
    assert dvm_file.loads(data).content_hash == tiny_program().content_hash


def test_errors_survive_pickling():
    # Ray ships exceptions between processes.
    for exc in (NotDvmFileError(b"abc", MAGIC), TruncatedFileError(10, 5),
                ChecksumError("aa", "bb"), VersionError("CODE", 1, 2),
                CorruptSectionError("CONST", "bad")):
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc) and str(copy) == str(exc)


# ------------------------------------------------------------ container errors ------


def test_wrong_magic():
    with pytest.raises(NotDvmFileError) as info:
        dvm_file.loads(b"PK\x03\x04" + tiny_bytes()[4:])
    assert "b'PK\\x03\\x04" in str(info.value)
    assert info.value.first_bytes == b"PK\x03\x04" + tiny_bytes()[4:8]


def test_text_mode_mangling_is_named():
    with pytest.raises(NotDvmFileError, match="text-mode"):
        dvm_file.loads(tiny_bytes().replace(b"\r\n", b"\n"))


def cut_points() -> list[int]:
    size = len(tiny_bytes())
    table_end = HEADER.size + 3 * ENTRY.size
    return [0, 1, 7, 8, 12, 15, 16, 20, table_end - 1, table_end, table_end + 5,
            size // 2, size - 33, size - 32, size - 1]


@pytest.mark.parametrize("cut", cut_points())
def test_truncated(cut):
    with pytest.raises(TruncatedFileError) as info:
        dvm_file.loads(tiny_bytes()[:cut])
    error = info.value
    assert error.present == cut and error.expected > cut
    assert f"{error.expected} bytes" in str(error) and f"{cut} present" in str(error)
    if cut >= HEADER.size + 3 * ENTRY.size:  # table intact: the exact size is known
        assert error.expected == len(tiny_bytes()) and not error.at_least


def test_wrong_file_version():
    data = bytearray(tiny_bytes())
    struct.pack_into("<I", data, 8, 2)
    with pytest.raises(VersionError) as info:
        dvm_file.loads(bytes(data))
    assert (info.value.section, info.value.expected, info.value.actual) == ("file", 1, 2)
    assert "version 2" in str(info.value) and "version 1" in str(info.value)


@pytest.mark.parametrize("index, name", [(0, "CODE"), (1, "CONST"), (2, "META")])
def test_wrong_section_version(index, name):
    entries = split(tiny_bytes())
    assert entries[index][0] == name
    entries[index][1] = 7
    with pytest.raises(VersionError) as info:
        dvm_file.loads(build(entries))
    assert (info.value.section, info.value.expected, info.value.actual) == (name, 1, 7)
    message = str(info.value)
    assert name in message and "version 7" in message and "version 1" in message


def test_bad_checksum():
    data = bytearray(tiny_bytes())
    data[-1] ^= 0x01
    with pytest.raises(ChecksumError):
        dvm_file.loads(bytes(data))


def test_bit_flip_in_payload_fails_the_checksum():
    data = bytearray(tiny_bytes())
    data[len(data) // 2] ^= 0x10
    with pytest.raises(ChecksumError) as info:
        dvm_file.loads(bytes(data))
    assert info.value.stored == tiny_bytes()[-32:].hex()


def test_trailing_bytes_fail_the_checksum():
    with pytest.raises(ChecksumError, match="5 bytes more"):
        dvm_file.loads(tiny_bytes() + b"extra")


def _table_edit(index: int, field: str, value) -> bytes:
    data = bytearray(tiny_bytes())
    name, version, offset, length = ENTRY.unpack_from(data, table_offset(index))
    fields = {"name": name, "version": version, "offset": offset, "length": length}
    fields[field] = value
    ENTRY.pack_into(data, table_offset(index), *fields.values())
    return rechecksum(bytes(data))


@pytest.mark.parametrize("edit, section, problem", [
    ((0, "name", b"CONST"), "CONST", "twice"),
    ((0, "name", b"DEBUG"), "DEBUG", "unknown section"),
    ((0, "name", b"CO\0DE"), "section table", "not a section name"),
    ((0, "name", b"\0" * 8), "section table", "not a section name"),
    ((2, "name", b"CODE"), "CODE", "twice"),
    ((0, "offset", 0), "CODE", "outside"),
    ((1, "length", 2**63), "CONST", "outside"),
    ((0, "length", 10**6), "CODE", "outside"),
    ((1, "offset", HEADER.size + 3 * ENTRY.size + 2), "CONST", "overlap"),
    ((0, "length", 5), "section table", "belong to no section"),
    ((2, "length", 0), "section table", "belong to no section"),
])
def test_section_table_errors(edit, section, problem):
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.loads(_table_edit(*edit))
    assert info.value.section == section and problem in info.value.problem


def test_missing_required_section():
    entries = [e for e in split(tiny_bytes()) if e[0] != "CONST"]
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.loads(build(entries))
    assert info.value.section == "CONST" and "missing" in str(info.value)


def test_too_many_sections():
    data = bytearray(tiny_bytes())
    struct.pack_into("<I", data, 12, 10_000)
    with pytest.raises(CorruptSectionError, match="at most"):
        dvm_file.loads(rechecksum(bytes(data)))


# ------------------------------------------------------------ section contents ------


def test_corrupt_msgpack_past_the_checksum():
    payload = next(p for n, _, p in split(tiny_bytes()) if n == "CODE")
    data = replace(tiny_bytes(), "CODE", payload[:10] + b"\xc1" + payload[11:])
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.loads(data)
    assert info.value.section == "CODE" and "msgpack" in info.value.problem


@pytest.mark.parametrize("fields, problem", [
    ({"inputs": "x"}, "'inputs' must be list"),
    ({"n_regs": "4"}, "'n_regs' must be int"),
    ({"n_regs": True}, "'n_regs' must be int"),
    ({"n_regs": 2**40}, "n_regs is"),
    ({"n_regs": -1}, "n_regs is"),
    ({"name": 7}, "'name' must be str"),
    ({"extra": 1}, "unknown fields 'extra'"),
    ({"inputs": [["x", "float32"]]}, "input 0"),
    ({"inputs": [["x", "float33", []]]}, "unknown dtype 'float33'"),
    ({"inputs": [["x", "float32", [["b", 5, 2]]]]}, "range 5..2"),
    ({"inputs": [["x", "float32", [["b", 1.0, 2]]]]}, "dim 0"),
    ({"constants": [["w", "float32", [8, -8]]]}, "constant 0"),
    ({"constants": [["w", "float32", [8, 8]], ["w", "float32", [8, 8]]]}, "repeat"),
    ({"code": [["NO_SUCH_OP", [], []]]}, "unknown opcode"),
    ({"code": [["RELU", [1], [["r", -1]]]]}, "instruction 0"),
    ({"in_spec": "{not json"}, "in_spec is not a pytree treespec"),
    ({"out_spec": json.dumps([1, {"type": "no.such.Type", "context": "null",
                                   "children_spec": []}])}, "out_spec"),
])
def test_code_section_structure(fields, problem):
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.loads(with_header(tiny_bytes(), **fields))
    assert info.value.section == "CODE"
    assert problem in info.value.problem


def test_code_section_not_a_map():
    data = replace(tiny_bytes(), "CODE", msgpack.packb([1, 2, 3]))
    with pytest.raises(CorruptSectionError, match="expected a map"):
        dvm_file.loads(data)


def test_missing_code_field():
    header = code_header(tiny_bytes())
    del header["code"]
    data = replace(tiny_bytes(), "CODE", msgpack.packb(header))
    with pytest.raises(CorruptSectionError, match="'code'"):
        dvm_file.loads(data)


def test_deep_nesting_is_refused():
    deep = b"\x91" * 900 + b"\x90"  # msgpack allows 1024 levels; Python recursion less
    header = code_header(tiny_bytes())
    body = msgpack.packb({k: v for k, v in header.items() if k != "code"})
    # Splice the deep list in as the "code" field: fixmap grows by one entry.
    assert body[0] == 0x87
    payload = b"\x88" + body[1:] + msgpack.packb("code") + deep
    with pytest.raises(CorruptSectionError, match="nested"):
        dvm_file.loads(replace(tiny_bytes(), "CODE", payload))


def test_forged_hash():
    data = with_header(tiny_bytes(), hash="0" * 64)
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.loads(data)
    assert info.value.section == "CODE" and "hash" in info.value.problem


def test_changed_code_with_old_hash_is_caught():
    header = code_header(tiny_bytes())
    code = header["code"]
    code[2] = ["NEG", code[2][1], code[2][2]]  # RELU -> NEG, hash left as it was
    data = with_header(tiny_bytes(), code=code, hash=header["hash"])
    with pytest.raises(CorruptSectionError, match="content hash"):
        dvm_file.loads(data)


def test_changed_constant_with_old_hash_is_caught():
    data = replace(tiny_bytes(), "CONST", safetensors.torch.save({"w": torch.ones(8, 8)}))
    with pytest.raises(CorruptSectionError, match="content hash"):
        dvm_file.loads(data)


def test_a_code_section_another_encoder_wrote_is_caught():
    # n_regs as a 9-byte int64 where the writer uses one byte: the same values, other
    # bytes, and a content hash recomputed over them. The loaded program's hash is the
    # verified one, so what it re-encodes must be exactly those bytes.
    data = tiny_bytes()
    header = code_header(data)
    canonical = msgpack.packb("n_regs") + msgpack.packb(header["n_regs"])
    wide = msgpack.packb("n_regs") + b"\xd3" + header["n_regs"].to_bytes(8, "big")
    unhashed = msgpack.packb({k: v for k, v in header.items() if k != "hash"},
                             use_bin_type=True)
    assert unhashed.count(canonical) == 1 and unhashed[0] == 0x80 | (len(header) - 1)
    unhashed = unhashed.replace(canonical, wide)
    const = next(p for n, _, p in split(data) if n == "CONST")
    digest = hashlib.sha256(unhashed)
    tensors = safetensors.torch.load(const)
    for name, *_ in header["constants"]:
        digest.update(_raw(tensors[name]))
    code = (bytes([0x80 | len(header)]) + unhashed[1:] + msgpack.packb("hash")
            + msgpack.packb(digest.hexdigest()))
    with pytest.raises(CorruptSectionError, match="does not re-encode"):
        dvm_file.loads(replace(data, "CODE", code))


def test_verify_error_becomes_corrupt_code_section():
    header = code_header(tiny_bytes())
    header["code"][3] = ["RETURN", [], [["t", [["r", 3]]]]]  # %3 is never written
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.loads(with_header(tiny_bytes(), code=header["code"]))
    assert info.value.section == "CODE" and "does not verify" in info.value.problem
    assert isinstance(info.value.__cause__, VerifyError)


@pytest.mark.parametrize("tensors, problem", [
    ({"w": torch.zeros(8, 8, dtype=torch.float64)}, "torch.float64"),
    ({"w": torch.zeros(4, 8)}, "[4, 8]"),
    ({}, "missing"),
    ({"w": torch.zeros(8, 8), "extra": torch.zeros(1)}, "'extra'"),
    ({"v": torch.zeros(8, 8)}, "'v'"),
])
def test_constants_disagree_with_specs(tensors, problem):
    data = rehashed(replace(tiny_bytes(), "CONST", safetensors.torch.save(tensors)))
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.loads(data)
    assert info.value.section == "CONST" and problem in info.value.problem


@pytest.mark.parametrize("payload", [b"", b"\x00" * 8, b"garbage!" * 4,
                                     struct.pack("<Q", 2**60) + b"{}",
                                     struct.pack("<Q", 2) + b"[]"])
def test_constants_not_safetensors(payload):
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.loads(replace(tiny_bytes(), "CONST", payload))
    assert info.value.section == "CONST" and "safetensors" in info.value.problem


@pytest.mark.parametrize("meta", [msgpack.packb([1]), msgpack.packb({"torch": 2}),
                                  b"\xc1"])
def test_bad_meta(meta):
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.loads(replace(tiny_bytes(), "META", meta))
    assert info.value.section == "META"


# ------------------------------------------------------------ fuzzing ---------------


def loads_or_format_error(data: bytes) -> object:
    """loads(data), or the DvmFormatError it raised; any other exception fails the test."""
    try:
        return dvm_file.loads(data)
    except DvmFormatError as exc:
        return exc


@FUZZ
@given(st.data())
def test_fuzz_truncation(data):
    blob = tiny_bytes()
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(TruncatedFileError):
        dvm_file.loads(blob[:cut])


@FUZZ
@given(st.data())
def test_fuzz_bit_flips(data):
    blob = bytearray(tiny_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(blob) - 1))
        blob[position] ^= 1 << data.draw(st.integers(0, 7))
    assume(bytes(blob) != tiny_bytes())
    with pytest.raises(DvmFormatError):
        dvm_file.loads(bytes(blob))


@FUZZ
@given(st.data())
def test_fuzz_byte_overwrites(data):
    blob = bytearray(tiny_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    assume(bytes(blob) != tiny_bytes())
    with pytest.raises(DvmFormatError):
        dvm_file.loads(bytes(blob))


@FUZZ
@given(st.data())
def test_fuzz_section_table_edits_past_the_checksum(data):
    blob = bytearray(tiny_bytes())
    index = data.draw(st.integers(0, 2))
    old = ENTRY.unpack_from(blob, table_offset(index))
    field = data.draw(st.integers(0, 3))
    if field == 0:
        value = data.draw(st.sampled_from([b"CODE", b"CONST", b"META", b""])
                          | st.binary(min_size=8, max_size=8))
    else:
        size_bits = 32 if field == 1 else 64
        value = data.draw(st.integers(0, 2**size_bits - 1)
                          | st.integers(0, len(blob) + 8))
    new = list(old)
    new[field] = value
    assume(ENTRY.pack(*new) != ENTRY.pack(*old))
    ENTRY.pack_into(blob, table_offset(index), *new)
    with pytest.raises(DvmFormatError):
        dvm_file.loads(rechecksum(bytes(blob)))


@FUZZ
@given(st.data())
def test_fuzz_header_edits_past_the_checksum(data):
    blob = bytearray(tiny_bytes())
    position = data.draw(st.integers(0, HEADER.size - 1))
    blob[position] = data.draw(st.integers(0, 255))
    assume(bytes(blob) != tiny_bytes())
    with pytest.raises(DvmFormatError):
        dvm_file.loads(rechecksum(bytes(blob)))


@FUZZ
@given(st.data())
def test_fuzz_payload_overwrites_past_the_checksum(data):
    entries = split(tiny_bytes())
    entry = entries[data.draw(st.integers(0, len(entries) - 1))]
    payload = bytearray(entry[2])
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del payload[data.draw(st.integers(0, len(payload))):]
    entry[2] = bytes(payload)
    loads_or_format_error(build(entries))  # a META edit may well stay valid


# Arbitrary msgpack values, to stand where the decoders expect specific structures.
MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8)
    | st.sampled_from(["r", "c", "i", "l", "t", "j", "RELU", "RETURN", "float32", ""]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=4),
    max_leaves=12)


def _replace_at_random_path(value, data):
    """`value` with one node, found by a random walk from the root, replaced by an
    arbitrary msgpack value."""
    if isinstance(value, list) and value and data.draw(st.booleans()):
        index = data.draw(st.integers(0, len(value) - 1))
        return value[:index] + [_replace_at_random_path(value[index], data)] + value[index + 1:]
    if isinstance(value, dict) and value and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(value)))
        return {**value, key: _replace_at_random_path(value[key], data)}
    return data.draw(MSGPACK_VALUES)


@FUZZ
@given(st.data())
def test_fuzz_code_structure_past_the_checksum(data):
    header = code_header(tiny_bytes())
    key = data.draw(st.sampled_from(sorted(header)))
    header[key] = _replace_at_random_path(header[key], data)
    payload = msgpack.packb(header, use_bin_type=True)
    loads_or_format_error(replace(tiny_bytes(), "CODE", payload))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=4),
    max_leaves=12)
SAFETENSORS_DTYPES = ["F32", "F64", "F16", "BF16", "I64", "I8", "U8", "BOOL", "C64", "XX",
                      "F8_E4M3", "U64"]


@FUZZ
@given(st.data())
def test_fuzz_constants_past_the_checksum(data):
    tensors = data.draw(st.dictionaries(
        st.sampled_from(["w", "v", "__metadata__", ""]) | st.text(max_size=4),
        st.fixed_dictionaries({
            "dtype": st.sampled_from(SAFETENSORS_DTYPES) | st.text(max_size=4),
            "shape": st.lists(st.integers(-1, 300), max_size=3),
            "data_offsets": st.lists(st.integers(-1, 300), min_size=0, max_size=3),
        }) | JSON_VALUES, max_size=3))
    header = json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    body = data.draw(st.binary(max_size=300))
    payload = struct.pack("<Q", data.draw(st.sampled_from([len(header)])
                                          | st.integers(0, 2**64 - 1))) + header + body
    result = loads_or_format_error(replace(tiny_bytes(), "CONST", payload))
    assert isinstance(result, CorruptSectionError)
