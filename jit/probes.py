"""The abstract live-ins a specialization is built from: meta tensors (and scalar values)
standing for one signature, or for one probe of a family (Note [Probes] in
dynvm.jit.specialize), and a family cut to the program's declared ranges first."""

from __future__ import annotations

import torch

from dynvm.shape_cluster import TENSOR, Family
from dynvm.shape_cluster.signature import is_tensor_entry


def family_live_ins(live_in: tuple[int, ...], family: Family, dims) -> dict[int, object]:
    """Meta tensors (contiguous, as every family member is) for one probe of a family."""
    values = {}
    for index, part, probe in zip(live_in, family.structure, dims):
        if part.tag == TENSOR:
            values[index] = torch.empty(probe, dtype=part.dtype, device="meta")
        else:
            values[index] = part.value
    return values


def clip_to_declared(family: Family, live_in: tuple[int, ...], inputs,
                     input_registers: frozenset[int]) -> Family:
    """A family's buckets cut to the program's declared dim ranges (`inputs`: the
    program's input specs) where its live-ins are program inputs (`input_registers`:
    registers that hold them wherever read), so that its kernel never covers inputs the
    program refuses."""
    bounds = []
    for register, dims in zip(live_in, family.bounds):
        if dims is None or register not in input_registers:
            bounds.append(dims)
            continue
        declared = inputs[register].dims
        bounds.append(tuple((max(low, d.low), min(high, d.high)) if low != high
                            else (low, high) for (low, high), d in zip(dims, declared)))
    clipped = tuple(bounds)
    if clipped == family.bounds:
        return family
    return Family(family.structure, clipped)


def abstract_live_ins(live_in: tuple[int, ...], signature: tuple) -> dict[int, object]:
    """Meta tensors (and scalar values) standing for a signature's live-ins."""
    values = {}
    for index, entry in zip(live_in, signature):
        if is_tensor_entry(entry):
            shape, dtype, strides, offset, _device = entry
            values[index] = torch.empty_strided(shape.dims, strides, dtype=dtype,
                                                device="meta")
        else:
            values[index] = entry[1]
    return values
