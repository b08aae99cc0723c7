"""Torch literals by name: dtypes, layouts, memory formats and devices, and back.

Every place that writes one of these outside the process (the .dvm file and its text
form, the specialized-region IR, portable specializations) names it the way torch
prints it without the `torch.` prefix (`float32`, `channels_last`, `sparse_coo`,
`cuda:0`) and reads it back here, so there is one table and one set of names. The tables
are read from torch itself, so every dtype a tensor can carry has a name, including the
ones a newer torch adds. Reading a name is a lookup in a closed table (or
`torch.device`), never `getattr(torch, name)`: the names come from outside the process.

This module is in the VM layer because the VM's file format uses it; the JIT's codecs
import it from here. What a particular format can store (safetensors has no complex128,
for instance) is that format's business, not a question of names.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from dynvm.vm.errors import DynvmError


class UnknownTorchLiteral(DynvmError, ValueError):
    """A name that is not a torch dtype, layout, memory format or device (the message
    names the kind and the name). Callers with their own format error raise that one
    from this, keeping the message."""


def literal_name(value: object) -> str:
    """The name of a torch dtype, layout, memory format or device, as files spell it
    (`torch.float32` -> `float32`, `device('cuda:0')` -> `cuda:0`)."""
    return str(value).removeprefix("torch.")


def _named(kind: type) -> Mapping[str, object]:
    # Aliases (torch.float, torch.half, ...) are the same objects as the canonical
    # names and print as those, so each value gets exactly one name. Private values
    # (torch._mkldnn) are no literal a program may carry.
    table = {literal_name(v): v for v in vars(torch).values() if isinstance(v, kind)}
    return MappingProxyType({name: table[name] for name in sorted(table)
                             if not name.startswith("_")})


DTYPES: Mapping[str, torch.dtype] = _named(torch.dtype)  # type: ignore[assignment]
LAYOUTS: Mapping[str, torch.layout] = _named(torch.layout)  # type: ignore[assignment]
MEMORY_FORMATS: Mapping[str, torch.memory_format] = _named(  # type: ignore[assignment]
    torch.memory_format)
_TABLES: Mapping[str, Mapping[str, object]] = MappingProxyType(
    {"dtype": DTYPES, "layout": LAYOUTS, "memory_format": MEMORY_FORMATS})
KINDS = (*_TABLES, "device")


def kind_of(value: object) -> str | None:
    """"dtype", "layout", "memory_format" or "device" for a torch literal, else None."""
    for kind, cls in (("dtype", torch.dtype), ("layout", torch.layout),
                      ("memory_format", torch.memory_format), ("device", torch.device)):
        if isinstance(value, cls):
            return kind
    return None


def literal_named(kind: str, name: object) -> object:
    """The torch literal of `kind` (one of KINDS) that `name` names; UnknownTorchLiteral
    for anything else (a name of another kind, a non-string, an unknown kind)."""
    if not isinstance(name, str):
        raise UnknownTorchLiteral(f"a {kind} name must be a string, got "
                                  f"{type(name).__name__}")
    if kind == "device":
        try:
            return torch.device(name)
        except (RuntimeError, ValueError, TypeError):
            raise UnknownTorchLiteral(f"unknown device {name!r}") from None
    table = _TABLES.get(kind)
    if table is None:
        raise UnknownTorchLiteral(f"unknown kind of torch literal {kind!r} (known: "
                                  f"{', '.join(KINDS)})")
    try:
        return table[name]
    except KeyError:
        raise UnknownTorchLiteral(f"unknown {kind} {name!r}") from None


def dtype_named(name: object) -> torch.dtype:
    """The dtype `name` names (`float32`); UnknownTorchLiteral for an unknown one."""
    return literal_named("dtype", name)  # type: ignore[return-value]


def any_literal_named(name: str) -> object:
    """The dtype, layout or memory format `name` names, whichever it is (the text
    form writes all three as `torch.<name>`); UnknownTorchLiteral otherwise."""
    for table in _TABLES.values():
        if name in table:
            return table[name]
    raise UnknownTorchLiteral(f"unknown torch literal {name!r}")
