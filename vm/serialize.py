"""msgpack encoding of a program's code and signature (never pickle).

Operand encoding is derived from the operand classes; literals that msgpack has no type
for (dtype, device, layout, memory format) travel as msgpack extension types holding
their names. Decoding checks every field's type and raises DvmFormatError naming the
instruction and operand that are wrong: the bytes come from outside the process.
"""

from __future__ import annotations

import msgpack
import torch

from dynvm.vm import torch_literals
from dynvm.vm.bounded_decode import DecodeError, DecodeLimits, unpack_msgpack
from dynvm.vm.errors import DvmFormatError, VerifyError
from dynvm.vm.instr import Instr
from dynvm.vm.opcodes import OPCODES
from dynvm.vm.operands import Const, Imm, IntList, Label, Operand, Reg, RegList
from dynvm.vm.torch_literals import UnknownTorchLiteral, literal_name

MAX_NESTING = 64
"""Deepest list/map nesting a msgpack section may have (real programs need about 8); the
decoders recurse, and this keeps them far from Python's recursion limit."""

# msgpack extension type codes for torch literals; names from dynvm.vm.torch_literals.
_EXT_KINDS = {1: "dtype", 2: "device", 3: "layout", 4: "memory_format"}
_EXT_CODES = {kind: code for code, kind in _EXT_KINDS.items()}


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype a .dvm file names `name` (DvmFormatError for an unknown one)."""
    try:
        return torch_literals.dtype_named(name)
    except UnknownTorchLiteral as exc:
        raise DvmFormatError(str(exc)) from None


def _pack_literal(value: object) -> object:
    kind = torch_literals.kind_of(value)
    if kind is not None:
        return msgpack.ExtType(_EXT_CODES[kind], literal_name(value).encode())
    if isinstance(value, tuple):
        return [_pack_literal(item) for item in value]
    return value


def _ext_hook(code: int, data: bytes) -> object:
    if code not in _EXT_KINDS:
        raise DvmFormatError(f"unknown msgpack extension type {code}")
    try:
        return torch_literals.literal_named(_EXT_KINDS[code], data.decode())
    except (UnicodeDecodeError, UnknownTorchLiteral) as exc:
        raise DvmFormatError(f"bad literal of extension type {code}: {data!r} ({exc})") from exc


def _unpack_literal(value: object) -> object:
    if isinstance(value, list):
        return tuple(_unpack_literal(item) for item in value)
    return value


def encode_operand(operand: Operand) -> list:
    """An operand as msgpack-ready data: a one-letter tag and its payload."""
    match operand:
        case Reg(index):
            return ["r", index]
        case Const(index):
            return ["c", index]
        case Imm(value):
            return ["i", _pack_literal(value)]
        case IntList(items):
            return ["l", [item if isinstance(item, int) else ["r", item.index]
                          for item in items]]
        case RegList(items):
            return ["t", [encode_operand(item) for item in items]]
        case Label(target):
            return ["j", target]
    raise TypeError(f"not an operand: {operand!r}")


def _index(value: object) -> int:
    if type(value) is not int or value < 0:
        raise DvmFormatError(f"expected an index, got {value!r}")
    return value


def decode_operand(data: object) -> Operand:
    """An operand from `encode_operand`'s form; malformed data raises DvmFormatError
    naming what was found."""
    if not (isinstance(data, list) and len(data) == 2 and isinstance(data[0], str)):
        raise DvmFormatError(f"malformed operand {data!r}")
    tag, payload = data
    if tag == "r":
        return Reg(_index(payload))
    if tag == "c":
        return Const(_index(payload))
    if tag == "j":
        return Label(_index(payload))
    if tag == "i":
        try:
            return Imm(_unpack_literal(payload))
        except VerifyError as exc:  # a literal of a type an immediate cannot hold
            raise DvmFormatError(str(exc)) from exc
    if tag == "l" and isinstance(payload, list):
        items: list[int | Reg] = []
        for item in payload:
            if type(item) is int:
                items.append(item)
            else:
                reg = decode_operand(item)
                if not isinstance(reg, Reg):
                    raise DvmFormatError(f"int list item {item!r} is not an int or register")
                items.append(reg)
        return IntList(tuple(items))
    if tag == "t" and isinstance(payload, list):
        regs = tuple(decode_operand(item) for item in payload)
        if not all(isinstance(r, Reg | Const) for r in regs):
            raise DvmFormatError(f"tensor list {payload!r} holds a non-tensor operand")
        return RegList(regs)  # type: ignore[arg-type]
    raise DvmFormatError(f"unknown operand tag {tag!r}")


def encode_instr(instr: Instr) -> list:
    """An instruction as `[opcode, destination registers, encoded operands]`."""
    return [instr.op, [d.index for d in instr.dsts], [encode_operand(a) for a in instr.args]]


def decode_instr(data: object, pc: int) -> Instr:
    """The instruction at `pc` from `encode_instr`'s form; DvmFormatError names the
    instruction and what is wrong with it."""
    try:
        if not (isinstance(data, list) and len(data) == 3):
            raise DvmFormatError("expected [opcode, dsts, args]")
        name, dsts, args = data
        if not isinstance(name, str) or name not in OPCODES:
            raise DvmFormatError(f"unknown opcode {name!r}")
        if not isinstance(dsts, list) or not isinstance(args, list):
            raise DvmFormatError("dsts and args must be lists")
        return Instr(name, tuple(Reg(_index(d)) for d in dsts),
                     tuple(decode_operand(a) for a in args))
    except DvmFormatError as exc:
        raise DvmFormatError(f"instruction {pc}: {exc}") from None


def pack(obj: object) -> bytes:
    """msgpack bytes of `obj` (binary strings kept as bytes)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes | memoryview, what: str, limits: DecodeLimits | None = None) -> object:
    """The object in msgpack `data`, decoded within `limits` (Note [Bounded decoding] in
    dynvm.vm.bounded_decode; None: no container or string larger than the data, at most
    MAX_NESTING levels); bytes that are not msgpack, or break a limit, raise
    DvmFormatError naming the section `what`."""
    if limits is None:
        size = memoryview(data).nbytes
        limits = DecodeLimits(max_bytes=size, max_str=size, max_bin=size, max_array=size,
                              max_map=size, max_ext=size, max_depth=MAX_NESTING)
    try:
        return unpack_msgpack(data, limits, f"section {what}", ext_hook=_ext_hook)
    except DecodeError as exc:
        raise DvmFormatError(str(exc)) from None


def _dim_record(dim) -> list:
    # A derived dim adds its relation; a plain one keeps three items (Note [Derived dims]).
    if dim.is_derived:
        return [dim.name, dim.low, dim.high, dim.scale, dim.offset]
    return [dim.name, dim.low, dim.high]


# Note [Tied constants]
# ~~~~~~~~~~~~~~~~~~~~~
# A model may use one parameter in two places (GPT-2's token embedding is its LM head),
# and the lowered program then holds the same tensor as two constants. safetensors
# refuses two names over one storage, and copying the second doubled GPT-2's file (its
# largest weight twice). The CODE header instead lists each such constant with the
# first constant it is the same tensor as ("tied": [[name, first name], ...], present
# only when there is one); CONST stores the first alone, and loading gives the tied
# name that very tensor, so the loaded program holds it once in memory too. The content
# hash covers the list and each constant's bytes in program order, as before.


def check_tied(tied: object, names: list[str]) -> dict[str, str]:
    """The header's "tied" list as {name: first name}, or DvmFormatError: each pair two
    declared constants, the first appearing earlier and not tied itself."""
    if type(tied) is not list:
        raise DvmFormatError(f"CODE field 'tied' must be a list, got {type(tied).__name__}")
    position = {name: i for i, name in enumerate(names)}
    sources: dict[str, str] = {}
    for pair in tied:
        if not (type(pair) is list and len(pair) == 2 and all(
                type(n) is str and n in position for n in pair)
                and position[pair[1]] < position[pair[0]] and pair[1] not in sources
                and pair[0] not in sources):
            raise DvmFormatError(f"CODE field 'tied': {str(pair)[:80]} is not [a constant, "
                                 "an earlier untied constant]")
        sources[pair[0]] = pair[1]
    return sources


def tied_constants(program) -> list[list[str]]:
    """[name, first name] for each constant that is the same tensor as an earlier one
    (same storage, offset, shape, strides, dtype: GPT-2's embedding and LM head): the
    .dvm stores its bytes once, under the first name (Note [Tied constants])."""
    first: dict[tuple, str] = {}
    tied = []
    for name, tensor in zip(program.constant_names, program.constants):
        if not tensor.untyped_storage().nbytes():
            continue
        key = (tensor.device.type, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(),
               tensor.dtype)
        if key in first:
            tied.append([name, first[key]])
        else:
            first[key] = name
    return tied


def encode_header(program, with_hash: bool = True) -> bytes:
    """The program minus its constant data, as msgpack bytes (the CODE section)."""
    body = {
        "name": program.name,
        "n_regs": program.n_regs,
        "inputs": [[i.name, literal_name(i.dtype), [_dim_record(d) for d in i.dims]]
                   for i in program.inputs],
        "constants": [[c.name, literal_name(c.dtype), list(c.shape)]
                      for c in program.constant_specs],
        "in_spec": program.in_spec,
        "out_spec": program.out_spec,
        "code": [encode_instr(instr) for instr in program.code],
    }
    tied = tied_constants(program)
    if tied:   # Note [Tied constants]; absent otherwise: bytes and hash stay as they were
        body["tied"] = tied
    if program.state:   # absent for a pure program: its bytes and hash stay as they were
        body["state"] = list(program.state)
    if with_hash:
        body["hash"] = program.content_hash
    return pack(body)
