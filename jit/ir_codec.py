"""Operands of the specialized-region IR as msgpack-ready data, and back.

Shared by everything that stores the IR outside the process: the Triton artifact's
launch plan and the portable specializations the compile service sends to replicas.
Values are tagged lists: [tag, payload]. Literals come from a closed set of types
(None, bool, int, str, float, lists, tuples, dtypes, devices, memory formats, layouts);
decoding anything else raises `IrCodecError`, never builds an arbitrary object.
"""

from __future__ import annotations

import math

from dynvm.jit.ir import ConstRef, Literal, Var
from dynvm.vm import torch_literals
from dynvm.vm.errors import DynvmError
from dynvm.vm.torch_literals import UnknownTorchLiteral


class IrCodecError(DynvmError, ValueError):
    """Data that is not an encoded IR operand (the message names what was wrong)."""


def encode_literal(value) -> list:
    """A literal operand (None, bool, int, float, str, list, tuple, dtype, device,
    memory format, layout) as tagged, msgpack-ready data; non-finite floats by name."""
    if value is None or isinstance(value, bool | int | str):
        return ["py", value]
    if isinstance(value, float):
        return ["py", value] if math.isfinite(value) else ["float", repr(value)]
    if isinstance(value, list | tuple):
        return ["list" if isinstance(value, list) else "tuple",
                [encode_literal(v) for v in value]]
    kind = torch_literals.kind_of(value)
    if kind is not None:
        return [kind, torch_literals.literal_name(value)]
    raise IrCodecError(f"literal {value!r} of type {type(value).__name__} cannot be encoded")


def decode_literal(data):
    """A literal from `encode_literal`'s form; anything else raises IrCodecError."""
    tag, payload = pair(data, "literal")
    if tag == "py":
        if payload is not None and not isinstance(payload, bool | int | float | str):
            raise IrCodecError(f"literal: unexpected {type(payload).__name__}")
        return payload
    if tag == "float" and payload in ("inf", "-inf", "nan"):
        return float(payload)
    if tag in ("list", "tuple") and isinstance(payload, list):
        items = [decode_literal(v) for v in payload]
        return items if tag == "list" else tuple(items)
    if tag in torch_literals.KINDS:
        try:
            return torch_literals.literal_named(tag, payload)
        except UnknownTorchLiteral as exc:
            raise IrCodecError(f"literal: {exc}") from None
    raise IrCodecError(f"literal: unknown tag {tag!r} or payload {payload!r}")


def encode_value(value) -> list:
    """A specialized op's operand (Var, ConstRef, Literal or a list of them), tagged."""
    if isinstance(value, Var):
        return ["var", value.reg]
    if isinstance(value, ConstRef):
        return ["const", value.index]
    if isinstance(value, Literal):
        return ["lit", encode_literal(value.value)]
    if isinstance(value, list):
        return ["values", [encode_value(v) for v in value]]
    raise IrCodecError(f"value {value!r} cannot be encoded")


def decode_value(data):
    """An operand from `encode_value`'s form; anything else raises IrCodecError."""
    tag, payload = pair(data, "value")
    if tag in ("var", "const") and isinstance(payload, int) and not isinstance(payload, bool):
        return Var(payload) if tag == "var" else ConstRef(payload)
    if tag == "lit":
        return Literal(decode_literal(payload))
    if tag == "values" and isinstance(payload, list):
        return [decode_value(v) for v in payload]
    raise IrCodecError(f"value: unknown tag {tag!r} or payload {payload!r}")


def pair(data, what: str):
    """`data` as (tag, payload), checking that it is a two-element list whose first
    element is a string (IrCodecError naming `what` otherwise)."""
    if not (isinstance(data, list | tuple) and len(data) == 2 and isinstance(data[0], str)):
        raise IrCodecError(f"{what}: expected [tag, payload], got {data!r}")
    return data[0], data[1]
