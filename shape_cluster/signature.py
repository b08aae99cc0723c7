"""The signature format, and the accessors every module reads it with.

Note [Signature format]
~~~~~~~~~~~~~~~~~~~~~~~
A region's strong signature (Note [Guard strength] in dynvm.jit.guards builds it) is
a tuple with one entry per live-in register, in live-in order:

- a tensor: (Shape, dtype, strides, storage offset, device), the Shape interned (Note
  [Interned shapes] in dynvm.vm.shapes), so a signature hashes and compares in C;
- anything else (an int, a float, a dtype ...): (type, value).

The JIT builds signatures (dynvm.jit.guards), the families read them (dynvm.
shape_cluster.families), the engine turns them into meta tensors. Each tells a tensor
entry from a scalar one with `is_tensor_entry` and takes dims with `entry_dims`, here,
rather than by its own test (the length of the entry in one place, the type of its first
item in another): the format lives in one module. It sits in shape_cluster, not in the
JIT, because shape_cluster imports only dynvm.vm (docs/ARCHITECTURE.md, Layout) and the JIT may
import shape_cluster.
"""

from __future__ import annotations

from dynvm.vm.shapes import Shape

TENSOR_FIELDS = ("shape", "dtype", "strides", "storage offset", "device")


def is_tensor_entry(entry: tuple) -> bool:
    """Whether a signature entry describes a tensor (else a scalar: (type, value))."""
    return isinstance(entry[0], Shape)


def entry_dims(entry: tuple) -> tuple[int, ...] | None:
    """A tensor entry's dims; None for a scalar entry."""
    return entry[0].dims if isinstance(entry[0], Shape) else None


def scalar_entry(value) -> tuple:
    """The entry of a non-tensor live-in."""
    return (type(value), value)
