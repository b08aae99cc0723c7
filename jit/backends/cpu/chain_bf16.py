"""Convolution chains in bf16 under `JitConfig(precision="bf16")`: a pass over a region
already laid out channels-last.

Note [bf16 convolution chains]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Note [Lower-precision GEMMs] lowers a model's GEMMs to bf16 and left convolutions fp32.
On this host (AMX-BF16 and AVX512-BF16) oneDNN's bf16 convolutions are 3-6x faster than
its fp32 ones: ResNet-50's 23 convolution geometries at batch 1, channels-last, fused
relu, 2 threads (20:22 UTC, load 3.6), 49.5 ms of fp32 against 11.0 ms of bf16 for the
53 convolutions (the 7x7 stem 1.46 vs 0.30 ms, the 3x3 ones at 14x14 1.28 vs 0.23 ms).
A cast costs a pass over the tensor, so, as with the layout (Note [Channels-last
chains]), the precision is a property of a whole chain, not of one op: the values a
chain passes between its members are bf16, and casts sit only where the layout
conversions already are:
- into the chain, `TO_CHANNELS_LAST` becomes `TO_CHANNELS_LAST_BF16` (one pass does
  both the layout and the cast);
- out of it, `EXACT_NCHW`/`EXACT_NHWC` become their `_FP32` forms: what leaves a chain
  is fp32 in the interpreter's layout, so nothing outside sees a bf16 tensor;
- each fused convolution reads a bf16 copy of its packed weight (the fp32 packed copy
  unpacked, cast and packed again for the same input sizes, per batch where the bf16
  blocking differs within the input's batches, Note [Conv weights for one row or
  many]; cached beside the fp32 copy, so kernels sharing one share the other). The
  bias stays fp32 for the unary call (oneDNN adds it before rounding); the residual
  form's oneDNN call takes only a bias of the input's type, so there it is cast too.
The other members (pooling, keepdim means, activations, adds of chain values) compute in
bf16 because their operands are: torch returns a bf16 result for bf16 operands.

A chain goes bf16 only when every member is a fused oneDNN convolution or a layout
member whose tensor operands are all values of the chain or its entry copies: a
convolution left on torch (its weight a constant), a constant tensor operand or a
broadcast operand from outside the chain (a squeeze-excite scale) would meet a bf16
value with fp32 and either raise or promote. Such a chain stays fp32 and the kernel
header says so; two chains that read the same entry copy go bf16 together or not at all.

What rounds to bf16 is every convolution's input, weight and output and the residual
stream between the blocks of a chain; the interpreter stays fp32 as the reference
(Note [Lower-precision GEMMs]). The accuracy this gives is stated per model
(bench/precision_accuracy.py) and held to a tolerance in tests/jit/test_cpu_conv_bf16.py.
Not measured per chain: asking for bf16 is asking for the precision; the region's
layout choice (Note [Channels-last chains]) then times the bf16 chains against NCHW fp32.

Where ResNet-50's bf16 batch 1 loses to OpenVINO bf16 (2026-12-06 08:06-08:19 UTC, load
1.2-2.2, /tmp/h32r/bf16prof.py, amx1.py): both run AMX brgconv kernels at every
convolution, and oneDNN 3.2's alone (a primitive called again and again) run at or below
OpenVINO's per layer, yet in the chain each took ~60-90 us more (10.9 ms of convolutions
against 6.8). In one process jit-bf16 / OpenVINO bf16 was 1.377 with
OMP_WAIT_POLICY=passive (the bar's) and 0.990 with active: the gap is the second
thread's wake at each of the chain's 53 OpenMP regions, which OpenVINO's spinning
threads do not pay. Not yet acted on.
"""

from __future__ import annotations

import dataclasses

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu.channels_last import (
    EXACT_NCHW,
    EXACT_NCHW_FP32,
    EXACT_NHWC,
    EXACT_NHWC_FP32,
    TO_CHANNELS_LAST,
    TO_CHANNELS_LAST_BF16,
    LayoutPlan,
    is_layout_op,
)
from dynvm.jit.backends.cpu.conv import PackedPerBatch, _packed_per_batch
from dynvm.jit.backends.cpu.conv_residual import CONV_BINARY_INPLACE
from dynvm.jit.backends.cpu.fusion import CONV_BINARY, CONV_UNARY, is_fused
from dynvm.jit.backends.cpu.ir_match import probe_tensors
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.ir import ConstRef, Literal, Var
from dynvm.vm.isa import ChannelsLast
from dynvm.vm.opcodes import OPCODES

_mkldnn = torch.ops.mkldnn
_BF16_LAYOUT = {TO_CHANNELS_LAST: TO_CHANNELS_LAST_BF16, EXACT_NCHW: EXACT_NCHW_FP32,
                EXACT_NHWC: EXACT_NHWC_FP32}
# the weight's position in the fused calls' operands (x, [other,] weight, bias, ...)
_WEIGHT_AT = {CONV_UNARY: 1, CONV_BINARY: 2, CONV_BINARY_INPLACE: 2}


def bf16_supported() -> bool:
    """Whether oneDNN runs bf16 convolutions natively on this CPU."""
    try:
        return bool(_mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def bf16_chains(plan: LayoutPlan, prepacked: PrepackCache) -> tuple[LayoutPlan, str]:
    """`plan` with each chain that may run in bf16 doing so (Note [bf16 convolution
    chains]), and the header note's text ("" when the plan has no chain)."""
    if not plan.chain_sets:
        return plan, ""
    if not bf16_supported():
        return plan, "; convolutions kept fp32 (oneDNN has no native bf16 on this CPU)"
    spec = plan.spec
    ops = list(spec.ops)
    probes = spec.abstract
    producer = {d: i for i, op in enumerate(ops) for d in op.dsts}
    eligible = [all(r in producer and _member_ok(ops[producer[r]], values | entries, probes)
                    for r in values) for values, entries in plan.chain_sets]
    changed = True
    while changed:   # chains sharing an entry copy go bf16 together or not at all
        changed = False
        for i, (_, entries) in enumerate(plan.chain_sets):
            if eligible[i] and any(not eligible[j] and entries & other
                                   for j, (_, other) in enumerate(plan.chain_sets)):
                eligible[i], changed = False, True
    chosen = [s for s, ok in zip(plan.chain_sets, eligible) if ok]
    if not chosen:
        return plan, f"; convolutions kept fp32 ({len(eligible)} chain(s) not all bf16-able)"
    values = frozenset().union(*(v for v, _ in chosen))
    entries = frozenset().union(*(e for _, e in chosen))
    convolutions = 0
    for position, op in enumerate(ops):
        if is_layout_op(op) and op.opcode in _BF16_LAYOUT and (
                op.dsts[0] in entries or (op.opcode != TO_CHANNELS_LAST
                                          and op.args[0].reg in values)):
            ops[position] = dataclasses.replace(op, opcode=_BF16_LAYOUT[op.opcode])
        elif op.dsts and op.dsts[0] in values and op.opcode in _WEIGHT_AT:
            ops[position] = _bf16_conv(op, probes, prepacked)
            convolutions += 1
    abstract = []
    for probe in probes:
        probe = dict(probe)
        for reg in values | entries:
            if isinstance(probe.get(reg), torch.Tensor):
                probe[reg] = probe[reg].to(torch.bfloat16)
        abstract.append(probe)
    rewritten = dataclasses.replace(spec, ops=tuple(ops), abstract=tuple(abstract))
    kept = len(eligible) - len(chosen)
    note = (f"; {len(chosen)} chain(s) in bf16 ({convolutions} convolution(s)"
            + (f"; {kept} kept fp32: a member is not bf16-able" if kept else "") + ")")
    return dataclasses.replace(plan, spec=rewritten), note


def _member_ok(op, allowed: frozenset, probes) -> bool:
    """Whether `op` computes its chain value in bf16 from bf16 operands (the Note's
    conditions): a fused convolution, or a layout member with no operand from outside."""
    fused = op.opcode in _WEIGHT_AT and is_fused(op)
    if not fused:
        spec = OPCODES.get(op.opcode)
        if spec is None or spec.channels_last in (None, ChannelsLast.CONVOLUTION):
            return False
    for at, arg in enumerate(op.args):
        if fused and at in (_WEIGHT_AT[op.opcode], _WEIGHT_AT[op.opcode] + 1):
            continue   # the packed weight and the bias: rewritten below
        for value in flat_values([arg]):
            if isinstance(value, ConstRef):
                return False
            if isinstance(value, Literal) and isinstance(value.value, torch.Tensor):
                return False
            if isinstance(value, Var) and value.reg not in allowed and any(
                    isinstance(p.get(value.reg), torch.Tensor) for p in probes):
                return False
    if fused:
        weight = op.args[_WEIGHT_AT[op.opcode]]
        return isinstance(weight, Literal) and isinstance(
            weight.value, (torch.Tensor, PackedPerBatch))
    return True


def _bf16_conv(op, probes, prepacked: PrepackCache):
    """The fused convolution `op` reading a bf16 copy of its packed weight, packed per
    batch where oneDNN's bf16 blocking differs within the input's batches (Note [Conv
    weights for one row or many]; it may differ where the fp32 one does not)."""
    at = _WEIGHT_AT[op.opcode]
    padding, stride, dilation, groups = (a.value for a in op.args[at + 2:at + 6])
    xs = probe_tensors(probes, op.args[0].reg)
    weight = op.args[at].value
    source = weight if isinstance(weight, torch.Tensor) else next(
        p for p in weight.packs if p is not None)
    key = prepacked.key_of(source)
    # the fp32 copy's key without its input size; an uncached copy is packed uncached
    cache, base = (prepacked, (*key[:-1], "bf16")) if key else (PrepackCache(), ("bf16",))
    new_weight = _packed_per_batch(source.to_dense().to(torch.bfloat16), base, padding,
                                   stride, dilation, groups, list(xs[0].shape),
                                   {t.shape[0] for t in xs}, cache)
    args = list(op.args)
    args[at] = Literal(new_weight)
    bias = args[at + 1]
    if at == 2 and isinstance(bias, Literal) and isinstance(bias.value, torch.Tensor):
        args[at + 1] = Literal(bias.value.to(torch.bfloat16))
    return dataclasses.replace(op, args=tuple(args))
