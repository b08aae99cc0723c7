"""The text key of a code family.

Note [Family keys]
~~~~~~~~~~~~~~~~~~
A family key goes into the cache key of every artifact compiled for the family, and the
compile service shares those artifacts between processes and machines through Redis. So
the key is built only from text that every process and Python version derives alike:
dtype and device names, the layout class, dim bounds, and scalar literals. Never id()
(differs per process) and never hash() (str hashes are randomised per process).

Form: one part per live-in, joined by "|":

    tensor  t:<dtype>:<device>:<layout>[<dim>,<dim>,...]   dim: "32" static, "17..64" varying
    scalar  s:<type>:<literal>

e.g. "t:float32:cpu:contiguous[17..64,32,256]|s:int:7".

The key must tell two families apart exactly when they serve different signatures, so:

- It is a function of the family's structure and bounds alone; equal structures give
  equal text. That is why a float is written after adding 0.0: -0.0 == 0.0, so both are
  one structure (and one guard), and both must print as "0.0".
- Different families give different text. Literals come from a closed list of types whose
  `==` is exact within the type (types are part of the structure, so 1, 1.0 and True are
  three structures) and whose text is unambiguous: strings are written with repr(), which
  escapes quotes and newlines, so a string's text ends at its closing quote and a "|"
  inside it cannot be mistaken for a separator. A scalar outside that list (a tuple, where
  (1, 2) == (True, 2.0); a NaN, which equals nothing; any other object, whose repr may
  hold an address) has no key, and its signatures get exact specializations only.
"""

from __future__ import annotations

import math

import torch

from dynvm.vm.torch_literals import literal_name

# Scalar types whose literals a key can hold, with the name the key gives each type.
_SCALAR_TYPES: dict[type, str] = {
    type(None): "None",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    torch.dtype: "dtype",
    torch.device: "device",
    torch.layout: "layout",
    torch.memory_format: "memory_format",
}


def scalar_text(kind: type, value: object) -> str | None:
    """'s:<type>:<literal>' for a scalar live-in, or None when it cannot be keyed."""
    name = _SCALAR_TYPES.get(kind)
    if name is None or type(value) is not kind:
        return None
    if kind is float:
        if math.isnan(value):  # type: ignore[arg-type]
            return None
        literal = repr(value + 0.0)  # type: ignore[operator]
    elif kind in (torch.dtype, torch.layout, torch.memory_format, torch.device):
        literal = literal_name(value)
    else:
        literal = repr(value)
    return f"s:{name}:{literal}"


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `float32`: the dtype as family keys (and files) spell it."""
    return literal_name(dtype)


def tensor_text(dtype: torch.dtype, device: torch.device, layout: str,
                bounds: tuple[tuple[int, int], ...]) -> str:
    """A tensor live-in's part of a family key: dtype, device, layout and each
    dim's bounds (`n` for a fixed dim, `low..high` for a varying one)."""
    dims = ",".join(str(low) if low == high else f"{low}..{high}" for low, high in bounds)
    return f"t:{dtype_name(dtype)}:{device}:{layout}[{dims}]"
