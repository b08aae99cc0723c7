"""Attention in bf16 between bf16 GEMMs: a pass over a region after the bf16 lowering
(Note [Lower-precision GEMMs]).

Note [bf16 attention between bf16 GEMMs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The bf16 lowering keeps everything but the GEMMs fp32, so a BERT layer's attention
casts three times: the Q/K/V GEMM's bf16 result to fp32 (TO_FP32 of the whole [M, 3D]
result), SDPA in fp32, and its result back to bf16 for the output projection (TO_BF16,
after a copy that undoes the heads' permute). OpenVINO's bf16 runs the attention
matmuls in bf16. torch's CPU flash attention takes bf16 q, k and v (fp32 accumulation
inside, a bf16 result) with a boolean mask, so here the cast after the GEMM goes, the
views between (split, view, permute) carry the bf16 value, SDPA reads bf16 and writes
bf16, and where its result reaches only the casts into bf16 GEMMs (through views),
those casts go too; otherwise one TO_FP32 follows SDPA and its readers stay fp32.

Which: a TO_FP32 of the lowering whose value reaches, through view ops that read it as
their first operand only, nothing but SDPA's q, k or v, where each such SDPA's three
come that way and its mask is boolean or absent (a float mask would need bf16 too:
left fp32). What rounds besides the GEMMs' inputs and outputs: softmax's probabilities
times V in the flash kernel's bf16 GEMM (fp32 accumulation), and the attention's output
(already rounded before, as the output projection's input).

Measured (torch 2.13 flash attention, 2 threads passive, BERT-base heads 12 x 64, the
Q/K/V views of one [M, 2304] result, a boolean mask; 2026-12-05 20:19 UTC, load 3-5):
SDPA fp32 / bf16 ms 0.109 / 0.121 at 1x16, 0.530 / 0.354 at 1x128, 0.874 / 0.476 at
2x128, 0.897 / 0.695 at 8x64, 3.259 / 1.538 at 8x128; besides, the casts it removes
took 0.09-0.39 ms (the Q/K/V result to fp32) and 0.005-0.22 ms (the output back).
Whole BERT-base calls (4 layers), in one process on / off, interleaved with an A/A
(20:32 UTC, load 2.3-3.4): 1x16 0.938, 1x64 0.936, 1x128 0.915, 2x128 0.892, 8x64 0.889
(A/A 1.010-1.026). Distance from eager fp32 there, max |out - fp32| over the output
(|fp32| up to 3.8-5.1): 0.0110 / 0.0114 / 0.0114 at 1x16 / 1x128 / 8x64, OpenVINO bf16's
0.0111 / 0.0154 / 0.0133 on the same inputs (20:52 UTC).

Note [One bf16 mask bias a call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Given a boolean mask, SDPA first makes an additive one in its operands' dtype (0 where
kept, -inf where masked: `convert_boolean_attn_mask`), on every call: BERT's four layers
make the same [B, 1, S, S] bias four times a call from one mask. So where the SDPAs this
pass puts in bf16 read a boolean mask, one op (`MASK_BIAS`, before the first of them)
makes that bias once, as SDPA would, and each of them reads it; the results are the same
bits (the same bias reaches the same kernel). The boolean mask's other readers keep it;
where an op between two of those SDPAs writes in place into the mask (or a view of it),
the later SDPA gets a bias made after that write.
Measured (SDPA alone, bf16 Q/K/V views of one [B, S, 2304] result, BERT-base's heads,
2 threads passive, 60 calls interleaved, 2026-12-06 01:32 UTC, load 0.3-0.6), ms a call,
boolean [B, 1, S, S] mask against the bf16 bias made beforehand: 2x64 0.226 / 0.202,
4x64 0.448 / 0.417, 4x128 1.128 / 1.086, 8x64 0.856 / 0.818, 8x128 2.329 / 2.215 (no mask
at all: 0.204 / 0.417 / 1.024 / 0.820 / 2.134), so the conversion is most of what the
mask costs the kernel. Whole BERT-base calls (4 layers, exact kernels) in one process, on /
off, 20 rounds interleaved with an A/A of two "off" runtimes (02:41 UTC, load 1.8-2.3):
2x16 0.967, 2x64 1.001, 2x128 0.994, 4x32 0.979, 4x64 0.977, 4x128 0.977, 8x16 0.988, 8x64
0.987, 8x128 0.965 (A/A 0.972-1.016): the ~1-3% it predicts, at the edge of the A/A; on
and off gave the same bits at every shape.
"""

from __future__ import annotations

import dataclasses

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu.ir_match import probe_tensors
from dynvm.jit.backends.cpu.precision import MASK_BIAS, PRECISION_VARIANT, TO_BF16, TO_FP32
from dynvm.jit.ir import Literal, SpecializedRegion, SpecOp, Var
from dynvm.jit.specialize import add_frees
from dynvm.vm.opcodes import OPCODES

# Ops that only reshape or view their first operand: the dtype flows through them.
_VIEWS = frozenset({"SPLIT_WITH_SIZES", "SPLIT", "VIEW", "RESHAPE_IF", "PERMUTE",
                    "TRANSPOSE", "UNSQUEEZE", "SQUEEZE"})
_SDPA = "SDPA"
_MASK_NOTE = "Note [One bf16 mask bias a call]"   # cited in a kernel's header


def _retyped(value: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `value`'s shape, strides and offset, of dtype bf16."""
    size = value.storage_offset() + 1 + sum(
        (n - 1) * s for n, s in zip(value.shape, value.stride()) if n > 0)
    base = torch.empty(max(size, 1), dtype=torch.bfloat16, device="meta")
    return base.as_strided(value.shape, value.stride(), value.storage_offset())


class _Region:
    """The ops of one region with who reads each register."""

    def __init__(self, spec: SpecializedRegion) -> None:
        self.ops = list(spec.ops)
        self.leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
        self.readers: dict[int, list[int]] = {}
        for position, op in enumerate(self.ops):
            for value in flat_values(op.args):
                if isinstance(value, Var):
                    self.readers.setdefault(value.reg, []).append(position)

    def view_tree(self, reg: int):
        """(registers, end ops) of the values viewed from `reg`: `registers` hold `reg`
        and every view of it; `end ops` are (position, register) of the other ops that
        read one of them. None where one leaves the region or a view op reads it twice."""
        registers, ends, stack = [], [], [reg]
        while stack:
            current = stack.pop()
            if current in self.leaving:
                return None
            registers.append(current)
            for position in dict.fromkeys(self.readers.get(current, ())):
                op = self.ops[position]
                reads = sum(v == Var(current) for v in flat_values(op.args))
                if op.opcode in _VIEWS and op.args[0] == Var(current) and reads == 1:
                    stack.extend(op.dsts)
                else:
                    ends.append((position, current))
        return registers, ends

    def written_between(self, reg: int, start: int, end: int) -> bool:
        """Whether an op strictly between positions `start` and `end` writes in place
        into `reg` or a view of it (Note [One bf16 mask bias a call])."""
        viewed, stack = {reg}, [reg]
        while stack:
            for position in self.readers.get(stack.pop(), ()):
                op = self.ops[position]
                if op.opcode in _VIEWS and isinstance(op.args[0], Var) \
                        and op.args[0].reg in viewed:
                    fresh = [d for d in op.dsts if d not in viewed]
                    viewed.update(fresh)
                    stack.extend(fresh)
        return any("inplace" in op.variant and isinstance(op.args[0], Var)
                   and op.args[0].reg in viewed for op in self.ops[start + 1:end])


def bf16_attention(spec: SpecializedRegion, *, mask_bias: bool = True
                   ) -> tuple[SpecializedRegion, str]:
    """`spec` with its attention in bf16 where the Q/K/V come from bf16 GEMMs (Note [bf16
    attention between bf16 GEMMs]), and a note saying how many (or ""); with
    `mask_bias`, their boolean masks made into one bf16 bias each (Note [One bf16 mask
    bias a call])."""
    region = _Region(spec)
    ops, probes = region.ops, spec.abstract
    trees = {}   # TO_FP32 position -> the fp32 registers viewed from its result
    for position, op in enumerate(ops):
        if op.opcode != TO_FP32 or op.variant != PRECISION_VARIANT:
            continue
        tree = region.view_tree(op.dsts[0])
        if tree is None or not tree[1] or any(
                ops[at].opcode != _SDPA or Var(reg) not in ops[at].args[:3]
                or Var(reg) in ops[at].args[3:] for at, reg in tree[1]):
            continue
        trees[position] = tree
    while True:   # every SDPA's q, k and v bf16, or the trees feeding it stay fp32
        bf16_regs = {reg for registers, _ in trees.values() for reg in registers}
        sdpas = {at for _, ends in trees.values() for at, _ in ends}
        bad = {at for at in sdpas if not _sdpa_takes_bf16(ops[at], bf16_regs, probes)}
        if not bad:
            break
        trees = {p: t for p, t in trees.items() if not {at for at, _ in t[1]} & bad}
    if not trees:
        return spec, ""
    probes = [dict(p) for p in probes]
    renamed: dict[int, int] = {}     # register -> the register that now holds its value
    dropped: set[int] = set()
    for position, (registers, _) in trees.items():
        cast = ops[position]
        renamed[cast.dsts[0]] = cast.args[0].reg
        dropped.add(position)
        for reg in registers[1:]:
            for probe in probes:
                probe[reg] = _retyped(probe[reg])
    next_reg = max({r for op in ops for r in op.dsts} | set(spec.live_in)) + 1
    biases: dict[int, int] = {}      # boolean mask register -> its bf16 bias register
    before: dict[int, SpecOp] = {}   # SDPA position -> the MASK_BIAS made before it
    made_at: dict[int, int] = {}     # boolean mask register -> where its bias is made
    for at in sorted(sdpas) if mask_bias else ():
        mask = ops[at].args[3]
        if not isinstance(mask, Var) or (mask.reg in biases and not region.written_between(
                mask.reg, made_at[mask.reg], at)):
            continue
        biases[mask.reg], made_at[mask.reg] = next_reg, at
        for probe in probes:
            probe[next_reg] = torch.empty(probe[mask.reg].shape, dtype=torch.bfloat16,
                                          device="meta")
        before[at] = SpecOp(MASK_BIAS, (next_reg,), (mask,), ops[at].source_pc,
                            variant=PRECISION_VARIANT)
        next_reg += 1
    after: dict[int, SpecOp] = {}    # SDPA position -> the TO_FP32 that follows it
    out_casts = 0
    bias_of = {}                     # SDPA position -> the bias register it reads
    for at in sorted(sdpas):
        if at in before:
            bias_of[at] = before[at].dsts[0]
        elif isinstance(ops[at].args[3], Var) and ops[at].args[3].reg in biases:
            made = max(p for p in before if before[p].args[0] == ops[at].args[3] and p < at)
            bias_of[at] = before[made].dsts[0]
    for at in sorted(sdpas):
        sdpa, result = ops[at], ops[at].dsts[0]
        if at in bias_of:
            sdpa = dataclasses.replace(sdpa, args=(*sdpa.args[:3], Var(bias_of[at]),
                                                   *sdpa.args[4:]))
            ops[at] = sdpa
        fp32 = [probe[result] for probe in probes]
        shape_fn = OPCODES[_SDPA].custom_shape_fn
        for probe in probes:
            args = [probe[renamed.get(a.reg, a.reg)] if isinstance(a, Var)
                    else a.value if isinstance(a, Literal) else a for a in sdpa.args]
            probe[result] = shape_fn(*args)
        tree = region.view_tree(result)
        if tree is not None and tree[1] and all(
                ops[p].opcode == TO_BF16 and ops[p].variant == PRECISION_VARIANT
                and ops[p].args[0] == Var(reg) for p, reg in tree[1]):
            for p, reg in tree[1]:     # the casts into bf16 GEMMs go
                renamed[ops[p].dsts[0]] = reg
                dropped.add(p)
                out_casts += 1
            for reg in tree[0][1:]:
                for probe in probes:
                    probe[reg] = _retyped(probe[reg])
            continue
        kept = next_reg
        next_reg += 1
        for probe, value in zip(probes, fp32):
            probe[kept] = value
        renamed[result] = kept       # its readers read the fp32 copy
        after[at] = SpecOp(TO_FP32, (kept,), (Var(result),), sdpa.source_pc,
                           variant=PRECISION_VARIANT)
    new_ops = []
    for position, op in enumerate(ops):
        if position in dropped:
            continue
        if position in before:
            new_ops.append(before[position])
        new_ops.append(dataclasses.replace(op, args=_renamed(op.args, renamed)))
        if position in after:
            new_ops.append(after[position])
    new_ops = add_frees(new_ops, region.leaving)
    note = (f"; attention in bf16: {len(sdpas)} SDPA(s) on their bf16 Q/K/V, "
            f"{len(trees)} cast(s) to fp32 and {out_casts} back to bf16 gone "
            "(Note [bf16 attention between bf16 GEMMs])"
            + (f"; {len(biases)} boolean mask(s) made a bf16 bias once ({_MASK_NOTE})"
               if len(before) == len(biases) else
               f"; {len(biases)} boolean mask(s) made bf16 biases {len(before)} times "
               f"({_MASK_NOTE})" if biases else ""))
    return dataclasses.replace(spec, ops=tuple(new_ops), abstract=tuple(probes)), note


def _renamed(args, renamed: dict[int, int]):
    def one(value):
        if isinstance(value, Var) and value.reg in renamed:
            return Var(renamed[value.reg])
        if isinstance(value, (list, tuple)):
            return type(value)(one(v) for v in value)
        return value
    return tuple(one(a) for a in args)


def _sdpa_takes_bf16(op: SpecOp, bf16_regs: set[int], probes) -> bool:
    """SDPA `op` reads q, k and v from `bf16_regs`, with a boolean mask or none."""
    if len(op.args) < 4 or len(op.dsts) != 1 or op.variant not in ("",):
        return False
    if not all(isinstance(a, Var) and a.reg in bf16_regs for a in op.args[:3]):
        return False
    mask = op.args[3]
    if mask == Literal(None):
        return True
    if not isinstance(mask, Var):
        return False
    values = probe_tensors(probes, mask.reg)
    return values is not None and all(v.dtype == torch.bool for v in values)
