"""Helpers of the Triton backend tests: hand-built specialized regions whose probes come
from a real code family, eager references, and the demo transformer's region.

Not a conftest on purpose (as tests/jit/_jit_helpers.py): import what you need.
"""

from __future__ import annotations

import functools
import importlib
import random

import torch

from dynvm.jit.guards import strong_signer
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, SpecOp, Var
from dynvm.jit.probes import family_live_ins
from dynvm.jit.specialize import specialize
from dynvm.shape_cluster import Family, family_for
from dynvm.vm.opcodes import opcode


def jit_helpers():
    return importlib.import_module("tests.jit._jit_helpers")


def op(name: str, dst: int | None, *args) -> SpecOp:
    """A SpecOp; ints in `args` are registers, floats/str/None literals, ConstRef as is."""
    values = tuple(Var(a) if isinstance(a, int) and not isinstance(a, bool) else
                   a if isinstance(a, ConstRef | Literal | list) else Literal(a) for a in args)
    return SpecOp(name, () if dst is None else (dst,), values, source_pc=0)


def family(example: dict[int, tuple[int, ...]], varying: set[tuple[int, int]],
           ratio: int = 4) -> Family:
    """The family of live-ins shaped like `example` (register -> dims, fp32, contiguous)
    whose (live-in position, axis) pairs in `varying` vary."""
    live_in = tuple(sorted(example))
    regs = [None] * (max(live_in) + 1)
    for reg, dims in example.items():
        regs[reg] = torch.empty(dims)
    signature = strong_signer(live_in)(regs)
    result = family_for(signature, varying, ratio)
    assert result is not None
    return result


def meta_value(value, values, constants):
    if isinstance(value, Var):
        return values[value.reg]
    if isinstance(value, ConstRef):
        return constants[value.index].to("meta")
    if isinstance(value, Literal):
        return value.value
    return [meta_value(v, values, constants) for v in value]


def build_region(ops: list[SpecOp], fam: Family, live_in: tuple[int, ...],
                 outputs: tuple[int, ...], constants: list[torch.Tensor]) -> SpecializedRegion:
    """A SpecializedRegion of `ops` with one probe per `fam.probe_dims()` (abstract values
    by running every op on meta tensors, as the specializer's abstract evaluation does)."""
    probes = []
    for dims in fam.probe_dims():
        values = dict(family_live_ins(live_in, fam, dims))
        for spec_op in ops:
            args = [meta_value(a, values, constants) for a in spec_op.args]
            result = opcode(spec_op.opcode).impl(*args)
            if len(spec_op.dsts) == 1:
                values[spec_op.dsts[0]] = result
            else:
                values.update(zip(spec_op.dsts, result))
        probes.append(values)
    return SpecializedRegion(0, live_in, tuple(ops), tuple((r, Var(r)) for r in outputs), (),
                             True, (), len(ops), tuple(probes))


def eager(spec: SpecializedRegion, inputs: dict[int, torch.Tensor],
          constants: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The region's outputs computed op by op with eager PyTorch."""
    values = dict(inputs)

    def real(value):
        if isinstance(value, Var):
            return values[value.reg]
        if isinstance(value, ConstRef):
            return constants[value.index]
        if isinstance(value, Literal):
            return value.value
        return [real(v) for v in value]

    for spec_op in spec.ops:
        result = opcode(spec_op.opcode).impl(*[real(a) for a in spec_op.args])
        if len(spec_op.dsts) == 1:
            values[spec_op.dsts[0]] = result
        else:
            values.update(zip(spec_op.dsts, result))
    return {reg: real(value) for reg, value in spec.outputs}


def run_region(runner, spec: SpecializedRegion, inputs: dict[int, torch.Tensor]):
    regs = [None] * (max([*spec.live_in, *(r for r, _ in spec.outputs)]) + 1)
    for reg, tensor in inputs.items():
        regs[reg] = tensor
    runner(regs)
    return {reg: regs[reg] for reg, _ in spec.outputs}


def sample_dims(fam: Family, rng: random.Random) -> list[tuple[int, ...]]:
    """Random member dims of the family: every varying dim uniform in its bounds."""
    return [tuple(rng.randint(low, high) for low, high in bounds) for bounds in fam.bounds]


def member_dims(fam: Family, rng: random.Random, count: int) -> list[list[tuple[int, ...]]]:
    """`count` distinct members: the family's bounds first, then random ones."""
    low = [tuple(lo for lo, _ in bounds) for bounds in fam.bounds]
    high = [tuple(hi for _, hi in bounds) for bounds in fam.bounds]
    found = [low, high]
    while len(found) < count:
        dims = sample_dims(fam, rng)
        if dims not in found:
            found.append(dims)
    return found[:count]


@functools.lru_cache(maxsize=1)
def transformer_family_region():
    """(program, region spec, family, module) of the small demo transformer, specialized
    for the family with varying batch and sequence length, as the JIT's engine does."""
    h = jit_helpers()
    program = h.compiled("transformer")
    region = program.regions[0]
    live_in = tuple(r.index for r in region.live_in)
    fam = family({0: (2, 8, h.SMALL_TRANSFORMER["hidden"])}, {(0, 0), (0, 1)})
    probes = [family_live_ins(live_in, fam, dims) for dims in fam.probe_dims()]
    spec = specialize(program, region, probes[0], tuple(probes[1:]))
    return program, spec, fam, h.demo("transformer").module
