"""Signatures of a region's live-ins, and the guards built from them.

Note [Guard strength]
~~~~~~~~~~~~~~~~~~~~~
A specialization records the guard it needs, chosen from what it assumes:

- strong: it folded shapes into constants, dropped views, or picked kernels for a layout.
  Its guard is the full signature: per tensor live-in the interned Shape (compared by
  identity, see Note [Interned shapes]), dtype, strides, storage offset and device; per
  scalar live-in its type and value. The same shape with other strides or another
  storage offset is another signature, so a view never reaches code compiled for a
  contiguous tensor.
- weak: it assumed nothing about shapes or layout (straight-line code with the same
  operations as the interpreter). Its guard checks only rank, element count, dtype and
  device per tensor (dtype and device because generated code may bind dtype-specific
  constants), and scalars by value; one weak specialization serves many shapes.

- family: a code family's kernel (Note [Code families] in dynvm.shape_cluster) checks
  the structure (rank, dtype, device, contiguous layout) and that every dim lies within
  the family's bounds; the answer is memoized per strong signature.

A guard is data: a tuple compared by the region cache's dict lookup, which *is* the
check. No source is generated or eval'd for it. `first_failure` explains, for
diagnostics, which check of a specialization's guard a call failed.

Note [Layout keys]
~~~~~~~~~~~~~~~~~~
The strong signature interns each shape (Note [Interned shapes]) so that profiles,
families and portable records share one Shape per dims; on the request path that costs
a table lookup per tensor (and, for a shape no one holds any more, an insert under a
lock). The hot path therefore looks up a cheaper key first: the same facts (per tensor
its torch.Size, strides, storage offset, dtype and device; per scalar its type and
value), in one flat tuple, not interned. A region resolves each new layout key once, to
its strong signature and to the specialization that serves it (exact, family or weak, or
none), and memoizes that; the memo is cleared whenever the region's tables change. So a
guard stays one dict lookup, on a key that compares the same facts as the strong
signature: two calls share a key only if they share a signature. Measured (timeit,
key + dict lookup, interleaved, median of 15, on the loaded 2-core box where both run
~3x their quiet cost): 1 tensor live-in 3.9 us against 4.0 us for sign + lookup, 3
tensors 8.5 against 10.2, 5 tensors 14.8 against 17.5. What is left is torch's five
attribute reads per tensor (shape, strides, offset, dtype, device).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from dynvm.shape_cluster.signature import TENSOR_FIELDS, is_tensor_entry
from dynvm.vm.shapes import intern_shape

_Tensor = torch.Tensor


class GuardStrength(enum.Enum):
    """What a guard checks (Note [Guard strength])."""

    STRONG = "strong"
    WEAK = "weak"
    FAMILY = "family"  # structure + per-dim bucket bounds (Note [Code families])


def strong_signer(live_in: tuple[int, ...]) -> Callable[[list], tuple]:
    """A function building the strong signature of `live_in` from a register file."""

    def sign(regs: list) -> tuple:
        # The entries of Note [Signature format] (dynvm.shape_cluster.signature), built
        # inline: this runs once per new layout of every region.
        key = []
        for index in live_in:
            value = regs[index]
            if isinstance(value, _Tensor):
                key.append((intern_shape(value.shape), value.dtype, value.stride(),
                            value.storage_offset(), value.device))
            else:
                key.append((type(value), value))
        return tuple(key)

    return sign


def layout_signer(live_in: tuple[int, ...]) -> Callable[[list], tuple]:
    """The hot path's key (Note [Layout keys]): the facts of the strong signature, flat
    and uninterned."""

    def sign(regs: list) -> tuple:
        key: list = []
        append = key.append
        for index in live_in:
            value = regs[index]
            if isinstance(value, _Tensor):
                append(value.shape)
                append(value.stride())
                append(value.storage_offset())
                append(value.dtype)
                append(value.device)
            else:
                append(type(value))
                append(value)
        return tuple(key)

    return sign


def weak_signer(live_in: tuple[int, ...]) -> Callable[[list], tuple]:
    """A function building the weak signature of the live-ins in a register file:
    rank, element count, dtype and device of each tensor, type and value of each scalar."""
    def sign(regs: list) -> tuple:
        key = []
        for index in live_in:
            value = regs[index]
            if isinstance(value, _Tensor):
                key.append((value.dim(), value.numel(), value.dtype, value.device))
            else:
                key.append((type(value), value))
        return tuple(key)

    return sign


def weak_of(signature: tuple) -> tuple:
    """The weak signature implied by a strong one."""
    weak = []
    for entry in signature:
        if is_tensor_entry(entry):
            shape, dtype, _strides, _offset, device = entry
            weak.append((shape.rank, shape.numel, dtype, device))
        else:
            weak.append(entry)
    return tuple(weak)


_STRONG_FIELDS = TENSOR_FIELDS
_WEAK_FIELDS = ("rank", "element count", "dtype", "device")


def first_failure(live_in: tuple[int, ...], expected: tuple, actual: tuple,
                  strength: GuardStrength) -> str | None:
    """The first check of a guard that `actual` fails, as 'what: expected X, got Y'."""
    fields = _STRONG_FIELDS if strength is GuardStrength.STRONG else _WEAK_FIELDS
    for index, want, got in zip(live_in, expected, actual):
        if want == got:
            continue
        if len(want) != len(got) or isinstance(want[0], type):
            return f"live-in %{index}: expected {_show(want)}, got {_show(got)}"
        for name, w, g in zip(fields, want, got):
            if w != g:
                return f"live-in %{index} {name}: expected {_show(w)}, got {_show(g)}"
    return None


def _show(value) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type):
        return repr(value[1])
    return repr(getattr(value, "dims", value))


def describe(signature: tuple) -> str:
    """Human-readable form: '(4, 32, 256) float32 contiguous; 7'."""
    parts = []
    for entry in signature:
        if is_tensor_entry(entry):
            shape, dtype, strides, offset, device = entry
            layout = "contiguous" if _is_contiguous(shape.dims, strides) else f"strides {strides}"
            if offset:
                layout += f" offset {offset}"
            parts.append(f"{shape.dims} {str(dtype).removeprefix('torch.')} {layout} "
                         f"{device}")
        else:
            parts.append(repr(entry[1]))
    return "; ".join(parts)


def _is_contiguous(dims, strides) -> bool:
    # Exactly torch's default strides: describe() feeds the cache key, so two signatures
    # may share a description only if they are equal (strides of size-1 dims included).
    expected = 1
    for dim, stride in zip(reversed(dims), reversed(strides)):
        if stride != expected:
            return False
        expected *= max(dim, 1)
    return True
