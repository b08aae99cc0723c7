"""The stored content hash of a .dvm file against the raw bytes it covers, checked
before anything is decoded from them or built (Note [Validating a .dvm file] in
dynvm.vm.dvm_file)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import msgpack

from dynvm.vm.bounded_decode import DecodeError, DecodeLimits, unpack_json
from dynvm.vm.errors import CorruptSectionError

# Safetensors' JSON header: {name: {"dtype", "shape": [...], "data_offsets": [a, b]}}.
_CONST_HEADER_DEPTH = 3


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_raw_content_hash(code_payload: memoryview, n_fields: int, stored: str,
                            const_payload: memoryview, names: list[str]) -> bytes:
    """The stored content hash against the bytes it covers, before anything is built
    from them (Note [Validating a .dvm file]): `Program.content_hash` hashes
    `encode_header(with_hash=False)` and each constant's bytes in program order, which
    are the CODE section without its last field ("hash") and the constants' raw
    safetensors data. Returns that CODE section without its hash: what
    `encode_header(program, with_hash=False)` of the loaded program must give."""
    packer = msgpack.Packer(use_bin_type=True)
    suffix = packer.pack("hash") + packer.pack(stored)
    head = packer.pack_map_header(n_fields)
    if code_payload.nbytes <= len(head) + len(suffix) \
            or bytes(code_payload[:len(head)]) != head \
            or bytes(code_payload[code_payload.nbytes - len(suffix):]) != suffix:
        raise CorruptSectionError("CODE", "the content hash is not the last of its fields "
                                  "as the writer lays them out: the section was re-encoded "
                                  "or changed")
    unhashed = packer.pack_map_header(n_fields - 1) \
        + bytes(code_payload[len(head):code_payload.nbytes - len(suffix)])
    digest = hashlib.sha256(unhashed)
    for data in _raw_constants(const_payload, names):
        digest.update(data)
    if digest.hexdigest() != stored:
        raise CorruptSectionError("CODE", f"stored content hash {stored!r} differs from the "
                                  f"hash of the file's code and constant bytes "
                                  f"{digest.hexdigest()!r}: code or constants were changed "
                                  "after the file was written")
    return unhashed


def _raw_constants(payload: memoryview, names: list[str]) -> Iterator[memoryview]:
    """The bytes of each constant in `names`' order, read from the safetensors
    layout (an 8-byte little-endian header size, a JSON header, the data) without
    building a tensor."""
    def corrupt(problem: str) -> CorruptSectionError:
        return CorruptSectionError("CONST", f"not valid safetensors ({problem})")

    if payload.nbytes < 8:
        raise corrupt(f"{payload.nbytes} bytes, shorter than its 8-byte header size")
    size = int.from_bytes(payload[:8], "little")
    if size > payload.nbytes - 8:
        raise corrupt(f"header of {size} bytes, {payload.nbytes - 8} bytes follow")
    limits = DecodeLimits(max_bytes=size, max_depth=_CONST_HEADER_DEPTH)
    try:
        header = unpack_json(payload[8:8 + size], limits, "header")
    except DecodeError as exc:
        raise corrupt(str(exc)) from None
    if not isinstance(header, dict):
        raise corrupt(f"the header is a {type(header).__name__}, not a map")
    declared = set(names)
    extra = sorted(name for name in header if name not in declared and name != "__metadata__")
    if extra:
        raise CorruptSectionError("CONST", f"holds tensors {extra} that the CODE section "
                                  "does not declare")
    data = payload[8 + size:]
    for name in names:
        entry = header.get(name)
        if entry is None:
            raise CorruptSectionError("CONST", f"constant {name!r}, declared in the CODE "
                                      "section, is missing")
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data.nbytes):
            raise corrupt(f"constant {name!r}: data offsets {_describe(offsets)} are not "
                          f"within the {data.nbytes} data bytes")
        yield data[offsets[0]:offsets[1]]
