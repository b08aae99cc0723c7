"""GEMMs below fp32 on the CPU backend (`JitConfig.precision`): a pass over the
specialized IR.

Note [Lower-precision GEMMs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
CPU serving runtimes run a model's GEMMs in bf16 (OpenVINO's INFERENCE_PRECISION_HINT,
on CPUs with AVX512-BF16 or AMX) or with int8 weights and activations quantized per
call (ONNX Runtime's quantize_dynamic, on VNNI); `JitConfig.precision` asks the same of
the CPU backend. The interpreter stays fp32: it is the reference every specialization is
checked against, and the rest of a model (layer norm, softmax/SDPA, GELU outside a GEMM,
the embedding) stays fp32 in the kernels too. Only GEMMs with a constant fp32 weight are
lowered: LINEAR, ADDMM, MM and MATMUL with a 2-D constant (the ops `fusion` matches,
`_as_gemm`); convolutions stay fp32 here.

"bf16": the weight is cast to bf16 and packed for oneDNN once per engine
(`PrepackCache`, Note [Prepacked weights]; key `linear-bf16`); the bias stays fp32
(oneDNN adds it in fp32 before rounding). Each GEMM runs as `mkldnn._linear_pointwise`
on bf16 operands with its activation epilogue (the unary post-ops of Note [CPU fusion])
as a post-op, and returns bf16. Casts sit at the boundaries, each made once:
- into bf16: a `TO_BF16` before the first GEMM that reads a value; later GEMMs reading
  the same value (Q, K and V read one layer-norm output) share it, and a GEMM reading
  another bf16 GEMM's result (the FFN's second linear) reads it with no cast at all;
- out of bf16: a `TO_FP32` after the GEMM, unless every reader is a bf16 GEMM or an
  ADD/SUB/MUL with a dimensioned fp32 tensor (the residual add): torch's type promotion
  computes that one in fp32 from the bf16 operand in the same pass, so the cast is free.
  An in-place residual add that would write into the bf16 result runs out of place.
The residual stream and layer norm thus stay fp32; what rounds to bf16 is the GEMMs'
inputs, weights and outputs (8 bits of mantissa: about 0.4% of each value). A layer
norm whose result a TO_BF16 reads writes its bf16 copy in the same pass (Note [Layer
norm writing bf16 too]), and ops over constants and literals alone run once, at compile
time (Note [Shape constants in kernels]). Attention
between bf16 GEMMs then runs in bf16 (Note [bf16 attention between bf16 GEMMs]). A
residual stream in bf16 too measured faster (BERT-base width, in one process 0.913-0.964
over 1x16..8x64) but 4-5x OpenVINO bf16's distance from fp32 (max |out - fp32| 0.042-0.076
against its 0.011-0.015 and this lowering's 0.011; 2026-12-05 20:49-20:55 UTC): not done.

Not measured per GEMM, unlike fp32 fusion (Note [CPU fusion]): asking for bf16 is asking
for the precision, as OpenVINO's hint does, and the speed is the hardware's (AMX-BF16 or
AVX512-BF16, where fp32 has neither). A family whose row count changes on every call pays
oneDNN's primitive build per call (Note [oneDNN at a new row count]); probation (Note
[Probation]) measures the kernel against the interpreter and drops it if that makes it
slower.

"int8-dynamic": the weight is quantized once per engine, per output channel and
symmetric (scale = max |w| / 127 per row), and packed by `quantized.linear_prepack`
(the `x86` engine: fbgemm's VNNI kernels on this CPU); each call runs
`quantized.linear_dynamic`, which quantizes the activation per tensor (its min and max on
that call, asymmetric uint8) and returns fp32 with the bias added: what
`torch.ao.quantization.quantize_dynamic` and ONNX Runtime's dynamic quantization do. No
casts are needed, and epilogues stay the fp32 ops they were. `reduce_range` (7-bit
activations) is on only on CPUs without VNNI, whose 16-bit accumulation could saturate.
An activation whose whole range is below the quantizer's smallest scale (~1e-7) becomes
zero: the zoo's random-weight mobilenet-v3, whose classifier input is ~1e-8, gives 0
where fp32 gives 1.6e-8 (relative error 1.0); real models' activations are far larger,
but a model with such a layer must stay fp32 or bf16.

The accuracy each mode gives per model is stated in docs/BENCHMARKS.md (measured by
bench/precision_accuracy.py) and held to a tolerance in tests/jit/test_cpu_precision.py.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu.fusion import (
    FUSED_VARIANT,
    LINEAR_UNARY,
    FusionResult,
    _as_gemm,
    onednn_available,
    pin_openmp_team,
)
from dynvm.jit.backends.cpu.huge_pages import to_huge_pages
from dynvm.jit.backends.cpu.ir_match import (
    probe_tensors,
    single_consumer,
    unary_post_op,
    untouched_between,
    use_counts,
)
from dynvm.jit.backends.cpu.norm_bf16 import LAYER_NORM_BF16, fuse_norm_casts, layer_norm_bf16
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.backends.cpu.shape_constants import (
    SHAPE_CONSTANT,
    fold_shape_constants,
    shape_constant,
)
from dynvm.jit.config import PRECISIONS
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, SpecOp, Var
from dynvm.jit.specialize import add_frees
from dynvm.vm.errors import ConfigError
from dynvm.vm.opcodes import OPCODES

# The variant of the ops this pass adds (casts, int8 GEMMs); the bf16 GEMM itself is a
# fused oneDNN linear (fusion's opcode and variant) on bf16 operands.
PRECISION_VARIANT = "precision"
TO_BF16, TO_FP32, INT8_LINEAR = "TO_BF16", "TO_FP32", "INT8_LINEAR_DYNAMIC"
# A boolean attention mask as the additive bf16 mask SDPA makes of it (Note [One bf16
# mask bias a call] in attention_bf16).
MASK_BIAS = "BF16_MASK_BIAS"
# A bf16 GEMM result's readers that compute in fp32 by type promotion, free of a cast:
# the binary epilogues (the residual add's kinds), from the opcode table.
_PROMOTING = frozenset(name for name, spec in OPCODES.items() if spec.onednn_binary is not None)


def _to_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16, memory_format=torch.contiguous_format)


def _to_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _int8_linear(x: torch.Tensor, packed, reduce_range: bool) -> torch.Tensor:
    # fbgemm reads a dense activation; a strided view is copied (once) here.
    return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, reduce_range)


def _bf16_mask_bias(mask: torch.Tensor) -> torch.Tensor:
    # What SDPA makes of a boolean mask for bf16 operands, on every call it is given one:
    # 0 where kept, -inf where masked (Note [One bf16 mask bias a call]).
    bias = torch.zeros(mask.shape, dtype=torch.bfloat16)
    return bias.masked_fill_(mask.logical_not(), float("-inf"))


PRECISION_KERNELS = {TO_BF16: _to_bf16, TO_FP32: _to_fp32, INT8_LINEAR: _int8_linear,
                     MASK_BIAS: _bf16_mask_bias, LAYER_NORM_BF16: layer_norm_bf16,
                     SHAPE_CONSTANT: shape_constant}


def cpu_flags() -> str:
    """/proc/cpuinfo's text ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


@functools.cache
def precision_available(precision: str) -> str | None:
    """None when this CPU and torch build can run `precision`, else why not."""
    if precision == "fp32":
        return None
    if not onednn_available(torch.device("cpu")):
        return "this torch build has no oneDNN"
    if precision == "bf16":
        flags = cpu_flags()
        if "avx512_bf16" not in flags and "amx_bf16" not in flags:
            return "this CPU has neither avx512_bf16 nor amx_bf16"
        return None
    if "x86" not in torch.backends.quantized.supported_engines \
            and "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no fbgemm/x86 quantized engine"
    return None


def lower_precision(spec: SpecializedRegion, constants, device: torch.device, *,
                    precision: str, prepacked: PrepackCache) -> FusionResult:
    """`spec` with its constant-weight GEMMs in `precision` (Note [Lower-precision
    GEMMs]); fp32, another device or no GEMM: `spec` unchanged."""
    if precision == "fp32" or not onednn_available(device) or not spec.abstract:
        return FusionResult(spec, ())
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    why_not = precision_available(precision)
    if why_not is not None:
        return FusionResult(spec, (f"GEMMs stay fp32, not {precision}: {why_not}",))
    ops = list(spec.ops)
    gemms = {i: g for i, op in enumerate(ops)
             if (g := _as_gemm(op, constants, spec.abstract)) is not None}
    if not gemms:
        return FusionResult(spec, ())
    pin_openmp_team()  # Note [OpenMP team of the compile thread]
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    if precision == "int8-dynamic":
        return _int8(spec, ops, gemms, constants, prepacked, leaving)
    lowered = _Bf16Lowering(spec, ops, gemms, constants, prepacked, leaving).run()
    # Note [Layer norm writing bf16 too]: the casts of layer norms' results into the norm
    fused, note = fuse_norm_casts(lowered.spec, constants, cast=TO_BF16,
                                  variant=PRECISION_VARIANT)
    # Note [Shape constants in kernels]: what the shapes alone give, once
    folded, fold_note = fold_shape_constants(fused, constants, device,
                                             variant=PRECISION_VARIANT)
    notes = tuple(n.removeprefix("; ") for n in (note, fold_note) if n)
    return FusionResult(folded, lowered.notes + notes)


# -- bf16 ------------------------------------------------------------------------------


class _Bf16Lowering:
    """One region's bf16 rewrite (Note [Lower-precision GEMMs]): the ops in order, casts
    added where values cross between fp32 and bf16."""

    def __init__(self, spec, ops, gemms, constants, prepacked, leaving) -> None:
        self.spec, self.ops, self.gemms = spec, ops, gemms
        self.constants, self.prepacked, self.leaving = constants, prepacked, leaving
        self.probes = [dict(p) for p in spec.abstract]
        regs = set(spec.live_in) | {r for op in ops for r in op.dsts}
        regs |= {v.reg for op in ops for v in flat_values(op.args) if isinstance(v, Var)}
        self.next_reg = max(regs, default=0) + 1
        self.bf16_of: dict[int, int] = {}     # fp32 register -> its bf16 value's register
        self.promoted: dict[int, tuple] = {}  # op position -> (fp32 reg, bf16 reg) it reads
        self.notes: list[str] = []

    def fresh(self, like: int) -> int:
        """A new register holding a bf16 value of `like`'s shape at every probe."""
        reg, self.next_reg = self.next_reg, self.next_reg + 1
        for probe in self.probes:
            value = probe.get(like)
            if isinstance(value, torch.Tensor):
                probe[reg] = torch.empty(value.shape, dtype=torch.bfloat16, device="meta")
        return reg

    def run(self) -> FusionResult:
        ops, out = self.ops, []
        uses = use_counts(ops, self.leaving)
        removed: set[int] = set()
        for position, op in enumerate(ops):
            if position in removed:
                continue
            if position in self.promoted:
                op = self._promote(op, *self.promoted[position])
            gemm = self.gemms.get(position)
            if gemm is None:
                out.append(op)
                continue
            epilogue = self._unary_epilogue(position, uses, removed)
            x = gemm.x.reg
            cast_note = "reads its bf16 input"
            if x not in self.bf16_of:
                self.bf16_of[x] = self.fresh(x)
                out.append(SpecOp(TO_BF16, (self.bf16_of[x],), (Var(x),), op.source_pc,
                                  variant=PRECISION_VARIANT))
                cast_note = "input cast to bf16"
            out.extend(self._gemm(op, gemm, epilogue, position))
            dst = out[-1].dsts[0] if out[-1].opcode == TO_FP32 else None
            result_note = ("result cast to fp32" if dst is not None
                           else "result kept bf16 for its readers")
            if epilogue is not None:
                removed.add(epilogue[0])
            what = op.opcode if epilogue is None else \
                f"{op.opcode} + {ops[epilogue[0]].opcode} (pc {ops[epilogue[0]].source_pc})"
            self.notes.append(f"{op.source_pc}: {what} -> oneDNN bf16 linear ({cast_note}, "
                              f"{result_note})")
        probes = tuple(self.probes)
        new_ops = add_frees(out, self.leaving)
        return FusionResult(dataclasses.replace(self.spec, ops=tuple(new_ops),
                                                abstract=probes), tuple(self.notes))

    def _unary_epilogue(self, position, uses, removed):
        """(consumer position, attr, scalars, algorithm) of the GEMM's activation, or None."""
        consumer_at = single_consumer(self.ops, position, uses)
        if consumer_at is None or consumer_at in removed:
            return None
        consumer = self.ops[consumer_at]
        dst = Var(self.ops[position].dsts[0])
        if (len(consumer.dsts) != 1 or consumer.variant not in ("", "inplace")
                or not consumer.args or consumer.args[0] != dst
                or not untouched_between(self.ops, position, consumer_at, consumer)):
            return None
        post_op = unary_post_op(consumer)
        return None if post_op is None else (consumer_at, *post_op)

    def _gemm(self, op, gemm, epilogue, position) -> list[SpecOp]:
        """The bf16 GEMM, and the cast of its result to fp32 where a reader needs it."""
        weight = self.constants[gemm.weight]

        def build():
            dense = weight.t() if gemm.transpose else weight
            return torch.ops.mkldnn._reorder_linear_weight(
                dense.to(torch.bfloat16).contiguous(), 1)
        packed = self.prepacked.get((gemm.weight, "linear-bf16", gemm.transpose), build)
        to_huge_pages(packed)   # Note [Packed weights on huge pages]
        if epilogue is None:
            dst, variant, post = op.dsts[0], FUSED_VARIANT, ("none", [], "")
        else:
            consumer = self.ops[epilogue[0]]
            dst = consumer.dsts[0]
            variant = f"{FUSED_VARIANT}+{consumer.source_pc}"
            post = epilogue[1:]
        result = self.fresh(dst)
        self.bf16_of[dst] = result
        args = (Var(self.bf16_of[gemm.x.reg]), Literal(packed), gemm.bias,
                *(Literal(p) for p in post))
        emitted = [SpecOp(LINEAR_UNARY, (result,), args, op.source_pc, variant=variant)]
        if self._needs_fp32(dst, epilogue[0] if epilogue else position):
            emitted.append(SpecOp(TO_FP32, (dst,), (Var(result),), op.source_pc,
                                  variant=PRECISION_VARIANT))
        return emitted

    def _needs_fp32(self, dst: int, after: int) -> bool:
        """Whether any reader of `dst` (after position `after`) needs it in fp32; the
        readers that do not are noted to read the bf16 value (`promoted`)."""
        if dst in self.leaving:
            return True
        readers = [i for i in range(after + 1, len(self.ops))
                   if any(v == Var(dst) for v in flat_values(self.ops[i].args))]
        promoting = {}
        for i in readers:
            gemm = self.gemms.get(i)
            if gemm is not None and gemm.x.reg == dst and sum(
                    v == Var(dst) for v in flat_values(self.ops[i].args)) == 1:
                continue
            # One bf16 operand per op at most: two would give a bf16 result.
            if i in self.promoted or not self._promotes(self.ops[i], dst):
                return True
            promoting[i] = (dst, self.bf16_of[dst])
        self.promoted.update(promoting)
        return False

    def _promotes(self, op: SpecOp, dst: int) -> bool:
        """ADD/SUB/MUL of `dst` with a dimensioned fp32 tensor (never `dst` itself):
        fp32 by type promotion when `dst` is bf16."""
        if op.opcode not in _PROMOTING or op.variant not in ("", "inplace") \
                or len(op.args) != 2 or len(op.dsts) != 1:
            return False
        others = [a for a in op.args if a != Var(dst)]
        if len(others) != 1:
            return False
        other = others[0]
        if isinstance(other, Var):
            values = probe_tensors(self.probes, other.reg)
        elif isinstance(other, ConstRef) and isinstance(self.constants[other.index],
                                                          torch.Tensor):
            values = [self.constants[other.index]]
        else:
            return False
        return values is not None and all(v.dtype == torch.float32 and v.dim() >= 1
                                          for v in values)

    def _promote(self, op: SpecOp, source: int, bf16_reg: int) -> SpecOp:
        """`op` reading the bf16 value of `source`; an in-place form writing into it runs
        out of place (its result must be fp32)."""
        args = tuple(Var(bf16_reg) if a == Var(source) else a for a in op.args)
        variant = op.variant
        if variant == "inplace" and op.args[0] == Var(source):
            variant = ""
        return dataclasses.replace(op, args=args, variant=variant)


# -- int8 ------------------------------------------------------------------------------


def _int8_packed(weight: torch.Tensor, transpose: bool, bias):
    """Note [Lower-precision GEMMs]: `weight` ([N, K], or [K, N] with `transpose`)
    quantized per output channel, symmetric, and packed with `bias` for fbgemm."""
    dense = (weight.t() if transpose else weight).contiguous()
    scales = (dense.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
    zeros = torch.zeros(dense.shape[0], dtype=torch.long)
    with warnings.catch_warnings():   # quantized tensors are deprecated, not gone
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_channel(dense, scales, zeros, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(quantized, bias)


def _int8(spec, ops, gemms, constants, prepacked, leaving) -> FusionResult:
    reduce_range = "vnni" not in cpu_flags()
    notes, out = [], list(ops)
    for position, gemm in gemms.items():
        op = ops[position]
        bias = constants[gemm.bias.index] if isinstance(gemm.bias, ConstRef) else None
        key = (gemm.weight, "int8-dynamic", gemm.transpose,
               None if bias is None else gemm.bias.index)
        packed = prepacked.get(key, lambda w=constants[gemm.weight], g=gemm, b=bias:
                               _int8_packed(w, g.transpose, b))
        out[position] = SpecOp(INT8_LINEAR, op.dsts,
                               (gemm.x, Literal(packed), Literal(reduce_range)),
                               op.source_pc, variant=PRECISION_VARIANT)
        notes.append(f"{op.source_pc}: {op.opcode} -> int8 dynamic quantized linear "
                     f"(fbgemm, weight per channel, activation per call)")
    new_ops = add_frees(out, leaving)
    return FusionResult(dataclasses.replace(spec, ops=tuple(new_ops)), tuple(notes))

