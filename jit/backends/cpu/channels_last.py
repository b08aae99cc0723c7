"""Chains of convolutions kept channels-last: a layout pass over the specialized IR.

Note [Channels-last chains]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
oneDNN's and torch's convolutions ran 1.5-2.3x faster here on a channels-last (NHWC)
input than on NCHW (Note [CPU conv fusion]), but a conversion costs a pass over the
tensor, about what one convolution saves. It pays only when a whole chain keeps the
layout, so this is a pass over the region, not a rewrite of one op:

- a *member* is an op whose values do not depend on its operands' strides and whose
  result stays channels-last when its 4-d operands are (torch's TensorIterator and its
  NHWC kernels carry the layout through): convolutions (torch's and the fused oneDNN
  calls of Note [CPU conv fusion]), batch norm, pooling, keepdim means, concatenation,
  and elementwise activations and arithmetic, with broadcast operands such as a
  squeeze-excite block's [N, C, 1, 1] scale. Its result must be a 4-d fp32 tensor that
  the interpreter lays out exactly NCHW or exactly NHWC at every probe (so that the way
  back is known), and its other results unused (batch norm's saved statistics, max
  pooling's indices);
- members linked by the values they pass form chains; a chain with no convolution is
  left alone (nothing in it is faster channels-last);
- a value entering a chain from outside (a live-in, the result of a non-member) is
  converted once, before its first member use (`to_channels_last`: a no-op when it is
  already); broadcast operands (a size-1 height or width) and constants are left;
- a chain value leaving to anything else (a view, a permute, a flatten, any op not in
  the member list, a region output) is converted back once, before its first such use,
  to *exactly* the strides the interpreter gives it at this signature (`exact_nchw` /
  `exact_nhwc`, which copy only when the strides differ, dims of size 1 included): the
  views the specializer folded, the next region's guard and the caller's `.view` all
  see what they would have seen without the pass;
- the fused oneDNN convolutions inside a chain take their channels-last forms (no
  conversion back after each, fusion's `CONV_*_NCHW`).

Correctness never rests on the layout rules above: every member computes the same
values whatever its operands' strides, and every value that leaves a chain is put back
into the interpreter's layout at run time. A wrong guess about how an op lays out its
result costs speed, not a wrong answer. In-place reuse (Note [In-place reuse]) stays
valid: it only ever writes into a value that dies at that op, so a converted copy (or an
alias, when no copy was needed) is never read after it is overwritten.

The rewritten region's abstract values give chain values (and the converted ones) their
channels-last strides, so arena planning (Note [Arena layout]) leaves them out: an
`out=` block over the arena is NCHW and would turn the chain back. That costs nothing
measured: on the zoo's CNNs the measured arena plans 0-2 ops of a kernel either way,
and planning every op it can ("all") ran as fast or slower, with or without this pass
(docs/BENCHMARKS.md, "CPU backend: channels-last conv chains (issue 15)"). A
conversion may return its operand (an arena block's view, say), so to the arena
planner it is a MOVE: the block stays live while the chain reads it.

Measured there, per exact kernel against the same kernel in NCHW (one thread):
ResNet, RegNet, DenseNet, EfficientNet and MobileNetV3 1.1-1.8x faster at every zoo
shape; ConvNeXt, whose blocks are NHWC already between their permutes, a tie (the
calibration keeps NCHW there unless channels-last wins by the margin).

Whether the region runs channels-last is measured (Note [Calibration]): the kernel is
emitted both ways and the two are timed on zero-filled live-ins of the planning probe's
shapes, the choice cached per (program, region, size class of its inputs, threads);
NCHW is the default and stays unless channels-last beats it by the calibrator's margin.
The kernel header says what was chosen, with both times (`dynvm explain`).

The pass needs the signature's strides: it runs only under a strong or family guard
(Note [Guard strength]); both compare the layout of every live-in (a family admits only
row-major tensors), so a channels-last input to a kernel built for NCHW fails the guard
and runs in the interpreter, or gets its own specialization. A weak guard admits any
layout, and the layouts the pass restores would be the probe's, not the call's: no pass.
"""

from __future__ import annotations

import dataclasses

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu.arena_choice import zeros_like_abstract
from dynvm.jit.backends.cpu.fusion import (
    CONV_BINARY,
    CONV_BINARY_NCHW,
    CONV_UNARY,
    CONV_UNARY_NCHW,
)
from dynvm.jit.ir import SpecializedRegion, SpecOp, Var
from dynvm.jit.specialize import add_frees
from dynvm.vm.isa import ChannelsLast
from dynvm.vm.opcodes import OPCODES

_CL = torch.channels_last
LAYOUT_VARIANT = "layout"
TO_CHANNELS_LAST = "TO_CHANNELS_LAST"
EXACT_NCHW = "EXACT_NCHW"
EXACT_NHWC = "EXACT_NHWC"


def to_channels_last(x):
    """`x` channels-last (itself when it already is: the in-place rule of the Note)."""
    return x.contiguous(memory_format=_CL)


def _nchw_strides(shape) -> tuple[int, ...]:
    _, c, h, w = (max(d, 1) for d in shape)
    return (c * h * w, h * w, w, 1)


def _nhwc_strides(shape) -> tuple[int, ...]:
    _, c, h, w = (max(d, 1) for d in shape)
    return (h * w * c, 1, w * c, c)


def exact_nchw(x):
    """`x` with torch's default strides (dims of size 1 included: the next region's
    guard compares them), copied only when it has others."""
    if x.stride() == _nchw_strides(x.shape):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def exact_nhwc(x):
    """`x` with the strides `torch.empty(..., memory_format=channels_last)` gives."""
    if x.stride() == _nhwc_strides(x.shape):
        return x
    return x.clone(memory_format=_CL)


def to_channels_last_bf16(x):
    """`x` channels-last in bf16 (Note [bf16 convolution chains] in chain_bf16): cast
    first, then laid out, which moves half the bytes in the layout's pass (ResNet-50's
    input at batch 1: 0.09 ms, against 0.17 ms for one `to(bf16, channels_last)`)."""
    return x.to(torch.bfloat16).contiguous(memory_format=_CL)


def exact_nchw_fp32(x):
    """A bf16 chain value back in fp32 with torch's default strides."""
    return exact_nchw(x.to(torch.float32, memory_format=torch.contiguous_format))


def exact_nhwc_fp32(x):
    """A bf16 chain value back in fp32 with channels-last strides."""
    return exact_nhwc(x.to(torch.float32, memory_format=_CL))


TO_CHANNELS_LAST_BF16 = "TO_CHANNELS_LAST_BF16"
EXACT_NCHW_FP32 = "EXACT_NCHW_FP32"
EXACT_NHWC_FP32 = "EXACT_NHWC_FP32"
LAYOUT_KERNELS = {TO_CHANNELS_LAST: to_channels_last, EXACT_NCHW: exact_nchw,
                  EXACT_NHWC: exact_nhwc, TO_CHANNELS_LAST_BF16: to_channels_last_bf16,
                  EXACT_NCHW_FP32: exact_nchw_fp32, EXACT_NHWC_FP32: exact_nhwc_fp32}
_EXIT = {"nchw": EXACT_NCHW, "nhwc": EXACT_NHWC}

_FUSED_CL = {CONV_UNARY_NCHW: CONV_UNARY, CONV_BINARY_NCHW: CONV_BINARY,
             CONV_UNARY: CONV_UNARY, CONV_BINARY: CONV_BINARY}
# Members and convolutions from the opcode table (OpSpec.channels_last): elementwise ops
# (their values ignore operands' strides, their result keeps an NHWC layout: checked
# against torch in tests/jit/test_cpu_layout.py), ops with NHWC kernels of their own,
# and convolutions, with the fused oneDNN forms of the latter.
_CONVS = frozenset({*(name for name, spec in OPCODES.items()
                      if spec.channels_last is ChannelsLast.CONVOLUTION), *_FUSED_CL})
MEMBERS = _CONVS | frozenset(name for name, spec in OPCODES.items()
                             if spec.channels_last is not None)


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """The region rewritten channels-last, and what the rewrite did."""

    spec: SpecializedRegion
    chains: int
    convolutions: int
    conversions_in: int
    conversions_out: int
    chain_sets: tuple = ()
    """Per chain: (its values' registers, the registers of the channels-last copies its
    members read), frozensets (Note [bf16 convolution chains] in chain_bf16)."""

    def describe(self) -> str:
        return (f"{self.chains} chain(s) of {self.convolutions} convolution(s), "
                f"{self.conversions_in} conversion(s) in, {self.conversions_out} out")


def _layout(values) -> str | None:
    """"nchw" / "nhwc" when every probe's value is a 4-d fp32 tensor laid out exactly so
    (a value that is both, [N, C, 1, 1] say, is "nchw" if its strides are torch's
    default), else None."""
    found = None
    for value in values:
        if not (isinstance(value, torch.Tensor) and value.dim() == 4
                and value.dtype == torch.float32):
            return None
        strides = value.stride()
        here = ("nchw" if strides == _nchw_strides(value.shape) else
                "nhwc" if strides == _nhwc_strides(value.shape) else None)
        if here is None or found not in (None, here):
            return None
        found = here
    return found


def _spread(values) -> bool:
    """Whether a 4-d operand is worth converting: it has a height and width (not a
    broadcast [N, C, 1, 1] scale)."""
    return all(v.shape[2] * v.shape[3] > 1 for v in values)


def plan_channels_last(spec: SpecializedRegion) -> LayoutPlan | None:
    """`spec` with its convolution chains channels-last (Note [Channels-last chains]),
    or None when it has no chain with a convolution."""
    probes = spec.abstract
    if not probes:
        return None
    ops = list(spec.ops)
    uses: dict[int, int] = {}
    for op in ops:
        for value in flat_values(op.args):
            if isinstance(value, Var):
                uses[value.reg] = uses.get(value.reg, 0) + 1
    for _, value in spec.outputs:
        if isinstance(value, Var):
            uses[value.reg] = uses.get(value.reg, 0) + 1

    def values_of(reg):
        return [probe.get(reg) for probe in probes]

    layout: dict[int, str] = {}          # member result -> the interpreter's layout
    member_at: dict[int, int] = {}       # member result -> its op's position
    for position, op in enumerate(ops):
        if op.opcode not in MEMBERS or not op.dsts:
            continue
        if op.variant not in ("", "inplace") and op.opcode not in _FUSED_CL:
            continue
        if any(uses.get(d, 0) for d in op.dsts[1:]):
            continue
        found = _layout(values_of(op.dsts[0]))
        if found is None:
            continue
        layout[op.dsts[0]] = found
        member_at[op.dsts[0]] = position
    # Chains: members joined through the values they pass (union-find on positions).
    parent = {p: p for p in member_at.values()}

    def root(p):
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p
    for position in member_at.values():
        for value in flat_values(ops[position].args):
            if isinstance(value, Var) and value.reg in member_at:
                parent[root(member_at[value.reg])] = root(position)
    with_conv = {root(p) for p in member_at.values() if ops[p].opcode in _CONVS}
    members = {p for p in member_at.values() if root(p) in with_conv}
    if not members:
        return None
    chain_values = {reg for reg, p in member_at.items() if p in members}

    next_reg = max([*spec.live_in, *(d for op in ops for d in op.dsts),
                    *(r for r, _ in spec.outputs),
                    *(v.reg for op in ops for v in flat_values(op.args)
                      if isinstance(v, Var))], default=0) + 1
    entered: dict[int, int] = {}         # outside value -> its channels-last copy
    left: dict[int, int] = {}            # chain value -> its copy in the interpreter's layout
    extra: dict[int, tuple] = {}         # new register -> per-probe abstract value
    new_ops: list[SpecOp] = []

    def fresh() -> int:
        nonlocal next_reg
        next_reg += 1
        return next_reg - 1

    def enter(reg: int, source_pc: int) -> int:
        if reg not in entered:
            entered[reg] = fresh()
            extra[entered[reg]] = tuple(v.contiguous(memory_format=_CL)
                                        for v in values_of(reg))
            new_ops.append(SpecOp(TO_CHANNELS_LAST, (entered[reg],), (Var(reg),),
                                  source_pc, variant=LAYOUT_VARIANT))
        return entered[reg]

    def leave(reg: int, source_pc: int) -> int:
        if reg not in left:
            left[reg] = fresh()
            extra[left[reg]] = tuple(values_of(reg))
            new_ops.append(SpecOp(_EXIT[layout[reg]], (left[reg],), (Var(reg),),
                                  source_pc, variant=LAYOUT_VARIANT))
        return left[reg]

    entries_of: dict[int, set] = {}      # chain root -> the entered copies it reads

    def rewrite(arg, member: bool, source_pc: int, chain: int = -1):
        if isinstance(arg, list):
            return [rewrite(a, member, source_pc, chain) for a in arg]
        if not isinstance(arg, Var):
            return arg
        if not member:
            return Var(leave(arg.reg, source_pc)) if arg.reg in chain_values else arg
        if arg.reg in chain_values:
            return arg
        values = values_of(arg.reg)
        if all(isinstance(v, torch.Tensor) and v.dim() == 4 and v.dtype == torch.float32
               for v in values) and _spread(values):
            entries_of.setdefault(chain, set()).add(enter(arg.reg, source_pc))
            return Var(entered[arg.reg])
        return arg

    for position, op in enumerate(ops):
        member = position in members
        chain = root(position) if member else -1
        args = tuple(rewrite(a, member, op.source_pc, chain) for a in op.args)
        opcode = _FUSED_CL.get(op.opcode, op.opcode) if member else op.opcode
        new_ops.append(dataclasses.replace(op, opcode=opcode, args=args))
    outputs = []
    last_pc = ops[-1].source_pc if ops else 0
    for out_reg, value in spec.outputs:
        if isinstance(value, Var) and value.reg in chain_values:
            value = Var(leave(value.reg, last_pc))
        outputs.append((out_reg, value))
    leaving = {v.reg for _, v in outputs if isinstance(v, Var)}
    abstract = []
    for index, probe in enumerate(probes):
        probe = dict(probe)
        for reg in chain_values:
            if layout[reg] == "nchw" and isinstance(probe.get(reg), torch.Tensor):
                probe[reg] = probe[reg].contiguous(memory_format=_CL)
        probe.update({reg: values[index] for reg, values in extra.items()})
        abstract.append(probe)
    rewritten = dataclasses.replace(spec, ops=tuple(add_frees(new_ops, leaving)),
                                    outputs=tuple(outputs), abstract=tuple(abstract))
    roots = sorted({root(p) for p in members})
    chain_sets = tuple(
        (frozenset(reg for reg, p in member_at.items() if p in members and root(p) == r),
         frozenset(entries_of.get(r, ()))) for r in roots)
    convolutions = sum(1 for p in members if ops[p].opcode in _CONVS)
    return LayoutPlan(rewritten, len(roots), convolutions, len(entered), len(left),
                      chain_sets)


def is_layout_op(op: SpecOp) -> bool:
    """Whether `op` is a conversion this pass inserted."""
    return op.variant == LAYOUT_VARIANT


def layout_comment(op: SpecOp) -> str:
    """The source listing's comment for a conversion."""
    what = {TO_CHANNELS_LAST: "into the chain: channels-last",
            EXACT_NCHW: "out of the chain: NCHW, as the interpreter lays it out",
            EXACT_NHWC: "out of the chain: NHWC, as the interpreter lays it out",
            TO_CHANNELS_LAST_BF16: "into the chain: channels-last, bf16",
            EXACT_NCHW_FP32: "out of the chain: fp32, NCHW, as the interpreter lays it out",
            EXACT_NHWC_FP32: "out of the chain: fp32, NHWC, as the interpreter lays it out"}
    return f"layout: {what[op.opcode]} (Note [Channels-last chains])"




# Note [Layout verdicts across batch sizes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The layout question runs the whole region, both ways, about eight times (a warm-up run
# of each kernel, then at least three rounds), each run on the compile thread and
# uninterruptible: at ResNet-50's batch 2 that was 5.0 s of wall time (1.7 s of it
# waiting for calls) with runs of 65-130 ms that a call beginning meanwhile shares the
# cores with (2026-12-05 09:38, load 3-4: seven JIT calls of the warm-up overlapped it,
# batch 2 at 184, 130 and 355 ms against the interpreter's ~140-200), and the batch-1
# kernel then asked it again for 2.0 s. The answer is a property of the region's chains,
# not of the batch: per exact kernel channels-last ran 1.1-1.8x faster at every zoo
# shape of ResNet, RegNet, DenseNet, EfficientNet and MobileNetV3, and a tie for
# ConvNeXt. So a clear verdict measured for the same region and thread count at another
# size class is reused (`REUSE_RATIO`: the winner at most 0.8x the loser); a close call
# is measured again at the new size, since which side of the margin it lands on may
# depend on the size. The kernel header says which size class the verdict came from.
REUSE_RATIO = 0.8


def choose_channels_last(spec: SpecializedRegion, plan: LayoutPlan, load, calibrator,
                         key, device: torch.device, related=None) -> tuple[bool, str]:
    """Whether the region runs channels-last, measured (Note [Channels-last chains]):
    `load(spec) -> fn(regs)` builds a kernel without an arena; the answer and a note.
    `related(other_key)`: whether a verdict under another key was measured for the same
    region at another size class (Note [Layout verdicts across batch sizes])."""
    planning = spec.abstract[0]
    if any(planning.get(reg) is None for reg in spec.live_in):
        return False, "(not measured: a live-in has no abstract value; NCHW kept)"
    reused = None
    if related is not None and calibrator.known("channels-last region", key) is None:
        reused = calibrator.decisive_answer("channels-last region", related, REUSE_RATIO)
    if reused is not None:
        other, choice = reused
        times = (f"NCHW vs channels-last: {choice.seconds['nchw'] * 1e3:.3f} vs "
                 f"{choice.seconds['channels_last'] * 1e3:.3f} ms at {other}")
        if choice.name == "channels_last":
            return True, f"(reused, {times})"
        return False, f"-> NCHW kept (reused, {times})"
    size = 1 + max([*spec.live_in, *(reg for reg, _ in spec.outputs)], default=0)

    def candidates():
        # Built only when this key was never measured (Note [Calibration]).
        base: list = [None] * size
        for reg in spec.live_in:
            base[reg] = zeros_like_abstract(planning[reg], device)
        nchw, nhwc = load(spec), load(plan.spec)

        def run(fn):
            def call():
                with torch.no_grad():
                    fn(list(base))
            return call
        return {"nchw": run(nchw), "channels_last": run(nhwc)}
    try:
        choice = calibrator.choose("channels-last region", key, candidates)
    except Exception as exc:  # the region refused zero-filled inputs: keep what it was
        return False, (f"-> NCHW kept (not measured: the region raised on the timing "
                       f"inputs: {type(exc).__name__}: {str(exc)[:120]})")
    times = (f"NCHW vs channels-last: {choice.seconds['nchw'] * 1e3:.3f} vs "
             f"{choice.seconds['channels_last'] * 1e3:.3f} ms")
    if choice.name == "channels_last":
        return True, f"(measured, {times})"
    return False, f"-> NCHW kept (channels-last measured no faster here, {times})"
