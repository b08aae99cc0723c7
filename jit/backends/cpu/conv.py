"""Convolutions with batch norm folded in and their epilogue as one oneDNN call.

Note [CPU conv fusion]
~~~~~~~~~~~~~~~~~~~~~~
Inference batch norm after a convolution is an affine map per output channel, so it
folds into the convolution's weight and bias: with s = gamma / sqrt(var + eps),
w' = w * s (per output channel) and b' = (b - mean) * s + beta. The folded constants are
computed when the kernel is emitted and live in the specialization (bound in its
generated module, packed by oneDNN); the program's weights are never touched, and a
fleet replica folds its own (the IR that travels has the unfolded ops).

`fuse_conv_epilogues` rewrites a 2-d CONVOLUTION (not transposed, fp32, constant
weight and bias) on a 4-d input, optionally followed by:
- BATCH_NORM with constant statistics whose saved mean/invstd results are unused;
- then an activation oneDNN fuses (Note [CPU fusion]'s unary list), or an ADD with a
  tensor of the result's exact shape (a residual), itself optionally followed by one
  activation: ResNet's conv-bn-add-relu is one call of
  `mkldnn._convolution_pointwise.binary`.
Every intermediate must have that one use; the fused call runs at the convolution's
place (the same conditions as for GEMMs, Note [CPU fusion]); the residual must exist
there already. The weight is packed with `mkldnn._reorder_convolution_weight` for the
planning probe's input size (Note [Prepacked weights]), one copy per planned batch
(Note [Conv weights for one row or many]); other sizes run correctly on it.

Measured on this 2-core AVX-512 machine, one thread, NCHW input, conv + relu: 64->64
3x3 at 56x56, batch 8: torch 125 ms, oneDNN with a packed weight 93 ms; but a depthwise
3x3 (32 groups) took 11.1 ms packed against torch's 6.2 ms. So every rewrite goes
through the device's Calibrator as GEMMs do, per (channels, kernel, stride, groups,
input size class, threads), and the notes in the kernel header say what it chose.

Where oneDNN measures no faster, the batch norm is still folded, into torch's
convolution (`_torch_folded`): the fold removes a whole pass over the result and adds
nothing, so it is not a measured choice.

Note [Conv weights for one row or many]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`_reorder_convolution_weight` takes the input size as a hint, and for convolutions the
blocking it picks depends on the batch: handed a weight packed for another batch, the
call runs correctly but reorders (or takes a slow path) every time. ResNet-50's 256 ->
1024 1x1 convolution at 14x14 with its residual add (2 threads, 15:46 UTC, load ~8):
packed for batch 1 and run at batch 1 0.91 ms, at batch 2 28.8 ms, at 4 31.4 ms; packed
for batch 2 and run at batch 1 28.5 ms, at batch 4 10.1 ms where packed for 3, 4 or 8 it
took 6.2-6.4 ms. The cache key had no batch (Note [Prepacked weights]: the hint picks a
blocking, any batch runs on it), so whichever kernel packed first made the others slow:
ResNet-50's batch-2 kernel, sharing batch 1's weights, ran at 330 ms against 210 ms
with most of those convolutions left on torch. So the hint's batch is in the key: each
kernel packs for its planning probe's batch (a family's upper bound, which serves the
bucket's smaller batches within ~1.2x of their own packing in the figures above), and
kernels planned at the same batch share the copy. A CNN keeps one copy of its weights
per planned batch alive (ResNet-50: ~100 MB each), freed with the kernels that use it.

Within a family the planning batch is not every batch the kernel serves, and for a few
geometries the blocking changes inside a bucket. Asked per batch 1..16 on this host
(the packed copies' memory descriptors compared, `_get_mkldnn_serialized_md`), 21 of
ResNet-50's 23 convolution geometries want one blocking at every batch, but the 256 ->
1024 1x1 at 14x14 wants another at batch 1 than at 2..16, and the 1024 -> 512 1x1 at
14x14 one at batches 1 and 3, another at 2 and 4..16: the bucket [2, 4] kernel, packed
for 4, reordered that weight on every call at batch 3 (the reorder oneDNN then runs,
`simple:any`, took 10-36 ms for 2 MB under load, more than the convolution). So a
fused convolution is packed for every batch of its input's range at the probes
(`_packed_per_batch`, at most `_MAX_BATCHES_ASKED` of them; beyond, the bounds and the
powers of two between), copies with the same descriptor are one copy, and where more
than one blocking is left the kernel picks its weight by the input's batch at run time
(`PackedPerBatch`: the generated code indexes a tuple by `x.shape[0]`, one tuple index
per call). A batch not asked runs on the copy of the nearest asked batch below it:
correct, and at worst the reorder above.

Note [Conv choice in the chain's layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The calibration asks its question in the layout the convolution will run in. Under a
strong or family guard the layout pass that follows (Note [Channels-last chains]) puts
every convolution of a region in a channels-last chain, and the region runs so wherever
that measures faster, which on this host is every CNN of the zoo but ConvNeXt (a tie).
So there the candidates are timed on a channels-last input: torch's ops as the program
has them against the channels-last fused call (`CONV_UNARY`/`CONV_BINARY`, no conversion
back). Asked in NCHW (an NCHW input, the fused call converting its result back), it was
another question: oneDNN then pays two reorders that the chain never pays. ResNet-50's
convolutions, 2 threads, batch 1 and 4 (15:12 UTC, load 9-10, OMP_WAIT_POLICY=PASSIVE):
oneDNN-NCHW 0.50-1.54x torch-NCHW with the batch norm (the stem and the 56x56 ones
1.03-1.54x, so kept on torch: unfused inside what became a channels-last chain), where
oneDNN channels-last is 0.17-1.13x torch channels-last with the batch norm folded (over 1
at three of twenty, by 4-13%, within that load's noise).
Under a weak guard no layout pass runs and the question stays NCHW (with the pass
switched off, `cpu_channels_last="off"`, a debugging switch, it is still asked
channels-last). Where a region keeps NCHW after all (its own measurement), its fused
convolutions run in their NCHW form; the region's measurement, which times both layouts
with the fused calls in them, is what guards the whole.

Where the answer is known, the question is not asked: in a channels-last chain, a plain
(ungrouped) convolution that torch itself would run on oneDNN (`torch._C.
_select_conv_backend` says Mkldnn, at every probe) is the same oneDNN convolution either
way, torch's with its weight reordered and its epilogue run as separate passes on every
call. Asked anyway on a loaded host the answer was noise: a ResNet-50 batch-1 kernel
compiled at load 6-9 kept 4 of its 53 convolutions on torch, beside fused ones timed
"0.769 vs 6.510 ms" (docs/bench_log.md, 2026-12-03 17:14). It saves little calibration
time: ResNet-50's seconds of calibration are mostly the region's own layout question
(Note [Channels-last chains]), 5.3 s with this rule at load 5-7 against 2.0 s without
it at load 2-3. Grouped convolutions (oneDNN packed was slower for a depthwise one
above) and those torch runs on its own kernels (a small input at batch 1, `Slow2d`)
are still asked.

Channels-last is not an op rewrite: oneDNN and torch were both 1.5-2.3x faster on a
channels-last input, but that pays only when a whole chain of convolutions keeps the
layout (a conversion at each op costs what it saves). The pass that runs after this
one (Note [Channels-last chains] in channels_last) turns the fused calls' NCHW forms,
which convert their result back, into the channels-last ones inside such a chain.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu.fusion import (
    CONV_BINARY,
    CONV_BINARY_NCHW,
    CONV_KERNELS,
    CONV_UNARY,
    CONV_UNARY_NCHW,
    FUSED_VARIANT,
    FusionResult,
    onednn_available,
    pin_openmp_team,
)
from dynvm.jit.backends.cpu.ir_match import (
    probe_tensors,
    run_original,
    single_consumer,
    unary_post_op,
    use_counts,
)
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.calibration import Calibrator, size_class
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, SpecOp, Var
from dynvm.jit.specialize import add_frees
from dynvm.vm.isa import ChannelsLast
from dynvm.vm.opcodes import OPCODES

_mkldnn = torch.ops.mkldnn
# Calibration inputs are cut to at most this many batch rows (a family's upper bound
# would make one calibration cost seconds, and oneDNN holds the GIL while it runs: Note
# [oneDNN holds the GIL]).
_CALIBRATION_MAX_BATCH = 4
# Note [Conv weights for one row or many]: batches of a family asked for their blocking.
_MAX_BATCHES_ASKED = 16


class PackedPerBatch:
    """A convolution's packed weights by its input's batch (Note [Conv weights for one
    row or many]): `packs[b]` is the copy in the blocking oneDNN wants at batch b (None
    below the family's range); copies with the same blocking are one object."""

    __slots__ = ("packs",)

    def __init__(self, packs: tuple) -> None:
        self.packs = packs

    def distinct(self) -> int:
        """How many packed copies the table holds."""
        return len({id(p) for p in self.packs if p is not None})

    def __repr__(self) -> str:
        sizes = [b for b, p in enumerate(self.packs) if p is not None]
        return f"PackedPerBatch(batches {sizes[0]}..{sizes[-1]}, {self.distinct()} copies)"


@dataclasses.dataclass(frozen=True)
class _Chain:
    """A convolution and what folds or fuses into it."""

    conv: int                        # positions in the op list
    bn: int | None
    add: int | None
    unary: int | None
    other: object = None             # the residual operand of the ADD

    def positions(self) -> list[int]:
        return [p for p in (self.conv, self.bn, self.add, self.unary) if p is not None]


def fuse_conv_epilogues(spec: SpecializedRegion, constants, device: torch.device, *,
                        prepacked: PrepackCache, calibrator: Calibrator | None,
                        weak_guard: bool) -> FusionResult:
    """`spec` with its convolutions (+ batch norm, + epilogue) on oneDNN where that
    measures faster; `calibrator` None: wherever possible."""
    if not onednn_available(device) or not spec.abstract:
        return FusionResult(spec, ())
    pin_openmp_team()   # Note [OpenMP team of the compile thread]
    ops = list(spec.ops)
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    uses = use_counts(ops, leaving)
    producer_position = {dst: i for i, op in enumerate(ops) for dst in op.dsts}
    notes: list[str] = []
    replaced: dict[int, SpecOp] = {}
    removed: set[int] = set()
    for position, op in enumerate(ops):
        if not _is_plain_conv(op, constants, spec.abstract):
            continue
        chain = _chain(ops, position, uses, constants, spec.abstract, producer_position,
                       weak_guard)
        if any(p in removed for p in chain.positions()):
            continue
        label = " + ".join(ops[p].opcode for p in chain.positions())
        try:
            weight, bias = _folded(ops, chain, constants)
            verdict = _decide(ops, chain, weight, bias, constants, spec.abstract, calibrator,
                              channels_last=not weak_guard)
            fused = None if verdict is None else _fused(ops, chain, weight, bias,
                                                        spec.abstract, prepacked, constants)
        except RuntimeError as exc:   # oneDNN refused these operands: torch keeps them
            notes.append(f"{op.source_pc}: {label} stays on torch (oneDNN refused it: "
                         f"{str(exc)[:120]})")
            continue
        if verdict is None:
            folded_note = ""
            if chain.bn is not None:   # Note [CPU conv fusion]: the fold pays on torch too
                replaced[position] = _torch_folded(ops, chain, weight, bias)
                removed.add(chain.bn)
                folded_note = ", batch norm folded into its weight"
            notes.append(f"{op.source_pc}: {label} stays on torch (oneDNN measured no "
                         f"faster here){folded_note}")
            continue
        replaced[position] = fused
        removed.update(p for p in chain.positions() if p != position)
        folded = " (batch norm folded into the weight)" if chain.bn is not None else ""
        notes.append(f"{op.source_pc}: {label} -> oneDNN convolution{folded}{verdict}")
    if not replaced:
        return FusionResult(spec, tuple(notes))
    new_ops = [replaced.get(i, op) for i, op in enumerate(ops) if i not in removed]
    new_ops = add_frees(new_ops, leaving)
    return FusionResult(dataclasses.replace(spec, ops=tuple(new_ops)), tuple(notes))


def _const(constants, arg, rank: int | None = None) -> torch.Tensor | None:
    if not isinstance(arg, ConstRef):
        return None
    value = constants[arg.index]
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return None
    return value if rank is None or value.dim() == rank else None


def _is_a(op: SpecOp, role: str) -> bool:
    """What the ISA table says of `op` (convention 1): a convolution, an add oneDNN
    computes as its sum post-op (the residual), or a batch norm that folds into the
    convolution before it. A backend-made opcode (a fused call) is none of them."""
    spec = OPCODES.get(op.opcode)
    if spec is None:
        return False
    if role == "convolution":
        return spec.channels_last is ChannelsLast.CONVOLUTION
    if role == "sum":
        return spec.onednn_binary == "add"
    return spec.folds_into_conv


def _is_plain_conv(op: SpecOp, constants, probes) -> bool:
    if not _is_a(op, "convolution") or op.variant or len(op.args) != 9 or len(op.dsts) != 1:
        return False
    x, weight, bias, stride, padding, dilation, transposed, _out_pad, groups = op.args
    if _const(constants, weight, 4) is None or transposed != Literal(False):
        return False
    if not (bias == Literal(None) or _const(constants, bias, 1) is not None):
        return False
    if not all(isinstance(a, Literal) and isinstance(a.value, list) and len(a.value) == 2
               for a in (stride, padding, dilation)):
        return False
    if not (isinstance(groups, Literal) and isinstance(groups.value, int)):
        return False
    xs = probe_tensors(probes, x.reg) if isinstance(x, Var) else None
    return xs is not None and all(t.dim() == 4 and t.dtype == torch.float32 for t in xs)


def _chain(ops, position, uses, constants, probes, producer_position, weak_guard) -> _Chain:
    """The longest chain that folds or fuses into the convolution at `position` and can
    run there; shortened from its end until no op in between interferes."""
    chain = _longest_chain(ops, position, uses, constants, probes, producer_position,
                           weak_guard)
    for shorter in ({"unary": None}, {"add": None, "other": None}, {"bn": None}):
        if _runs_at_conv(ops, chain.positions()):
            return chain
        chain = dataclasses.replace(chain, **shorter)
        if chain.bn is None and chain.add is None and chain.unary is None:
            break
    return chain


def _longest_chain(ops, position, uses, constants, probes, producer_position,
                   weak_guard) -> _Chain:
    chain = _Chain(position, None, None, None)
    at = position
    nxt = single_consumer(ops, at, uses)
    if nxt is not None and _is_folding_bn(ops, at, nxt, uses, constants):
        chain = dataclasses.replace(chain, bn=nxt)
        at = nxt
        nxt = single_consumer(ops, at, uses)
    if nxt is None:
        return chain
    consumer, dst = ops[nxt], Var(ops[at].dsts[0])
    if _is_activation_of(consumer, dst):
        return dataclasses.replace(chain, unary=nxt)
    if not _is_a(consumer, "sum") or weak_guard or len(consumer.args) != 2 \
            or consumer.variant not in ("", "inplace"):
        return chain
    a, b = consumer.args
    other = b if a == dst else a if b == dst else None
    if not isinstance(other, Var) or other == dst \
            or producer_position.get(other.reg, -1) >= position:
        return chain
    results, others = probe_tensors(probes, dst.reg), probe_tensors(probes, other.reg)
    if results is None or others is None or any(
            o.shape != r.shape or o.dtype != r.dtype for o, r in zip(others, results)):
        return chain
    chain = dataclasses.replace(chain, add=nxt, other=other)
    after = single_consumer(ops, nxt, uses)
    if after is not None and _is_activation_of(ops[after], Var(consumer.dsts[0])):
        chain = dataclasses.replace(chain, unary=after)
    return chain


def _is_activation_of(op: SpecOp, value: Var) -> bool:
    return (bool(op.args) and op.args[0] == value and len(op.dsts) == 1
            and op.variant in ("", "inplace") and unary_post_op(op) is not None)


def _runs_at_conv(ops, positions: list[int]) -> bool:
    """Whether running the chain's ops all at the first one's place computes the same:
    no other op in between writes a register the chain reads or defines."""
    members = set(positions)
    defined = {d for p in positions for d in ops[p].dsts}
    read = {v.reg for p in positions for v in flat_values(ops[p].args)
            if isinstance(v, Var)} - defined
    for between in range(positions[0] + 1, positions[-1]):
        if between in members:
            continue
        op = ops[between]
        if set(op.dsts) & (read | defined):
            return False
        if any(isinstance(v, Var) and v.reg in defined for v in flat_values(op.args)):
            return False
    return True


def _is_folding_bn(ops, conv_at: int, bn_at: int, uses, constants) -> bool:
    bn = ops[bn_at]
    if not _is_a(bn, "folding") or len(bn.args) != 7 or bn.args[0] != Var(ops[conv_at].dsts[0]):
        return False
    _, gamma, beta, mean, var, _momentum, eps = bn.args
    if _const(constants, mean, 1) is None or _const(constants, var, 1) is None:
        return False
    if not all(a == Literal(None) or _const(constants, a, 1) is not None
               for a in (gamma, beta)):
        return False
    # the saved statistics (results 1, 2) must be unused: only the normalized result
    return isinstance(eps, Literal) and all(uses.get(d, 0) == 0 for d in bn.dsts[1:])


def _folded(ops, chain: _Chain, constants) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The convolution's weight and bias with the batch norm folded in (copies)."""
    conv = ops[chain.conv]
    weight = constants[conv.args[1].index]
    bias = constants[conv.args[2].index] if isinstance(conv.args[2], ConstRef) else None
    if chain.bn is None:
        return weight, bias
    _, gamma, beta, mean, var, _momentum, eps = ops[chain.bn].args
    mean, var = constants[mean.index], constants[var.index]
    scale = torch.rsqrt(var + eps.value)
    if isinstance(gamma, ConstRef):
        scale = scale * constants[gamma.index]
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias * scale
    if isinstance(beta, ConstRef):
        shift = shift + constants[beta.index]
    return (weight * scale.reshape(-1, 1, 1, 1)).contiguous(), shift.contiguous()


def _torch_folded(ops, chain: _Chain, weight, bias) -> SpecOp:
    """The chain's convolution on torch with the batch norm folded into `weight` and
    `bias` (the fold's copies), defining the batch norm's result; what follows the
    batch norm in the chain stays as it was."""
    conv = ops[chain.conv]
    args = (conv.args[0], Literal(weight), Literal(bias), *conv.args[3:])
    return SpecOp(conv.opcode, ops[chain.bn].dsts[:1], args, conv.source_pc)


def _geometry(conv: SpecOp) -> tuple[list, list, list, int]:
    _, _, _, stride, padding, dilation, _, _, groups = conv.args
    return padding.value, stride.value, dilation.value, groups.value


def _post_ops(ops, chain: _Chain) -> tuple[str, list, str]:
    if chain.unary is None:
        return "none", [], ""
    return unary_post_op(ops[chain.unary])


def _kernel_names(ops, chain: _Chain, probes) -> tuple[str, str] | None:
    """The (unary, binary) fused kernels that give the chain's result the layout the
    original ops give it at every probe (Note [CPU conv fusion]); None: neither does."""
    results = probe_tensors(probes, ops[chain.positions()[-1]].dsts[0])
    if results is None:
        return None
    if all(r.is_contiguous() for r in results):
        return CONV_UNARY_NCHW, CONV_BINARY_NCHW
    if all(r.is_contiguous(memory_format=torch.channels_last) for r in results):
        return CONV_UNARY, CONV_BINARY
    return None


def _call(ops, chain: _Chain, x, other, weight, bias, kernels: tuple[str, str]):
    padding, stride, dilation, groups = _geometry(ops[chain.conv])
    attr, scalars, algorithm = _post_ops(ops, chain)
    unary_kernel, binary_kernel = kernels
    if chain.add is None:
        return CONV_KERNELS[unary_kernel](x, weight, bias, padding, stride, dilation,
                                          groups, attr, scalars, algorithm)
    unary = None if attr == "none" else attr
    return CONV_KERNELS[binary_kernel](x, other, weight, bias, padding, stride, dilation,
                                       groups, "add", None, unary, scalars,
                                       algorithm if unary else None)


def _decide(ops, chain: _Chain, weight, bias, constants, probes,
            calibrator: Calibrator | None, *, channels_last: bool) -> str | None:
    """Whether the chain runs fused on oneDNN (a note saying how it was decided) or
    stays on torch (None); `channels_last`: ask in the layout of a channels-last chain
    (Note [Conv choice in the chain's layout])."""
    kernels = _kernel_names(ops, chain, probes)
    if kernels is None:
        return None
    if calibrator is None:
        return " (not measured: fusion forced on)"
    conv = ops[chain.conv]
    if channels_last and _torch_runs_onednn(conv, weight, probes):
        return (" (not measured: torch's own convolution is oneDNN's here, its weight "
                "reordered on every call)")
    x_probe = probe_tensors(probes, conv.args[0].reg)[0]
    shape = (min(x_probe.shape[0], _CALIBRATION_MAX_BATCH), *x_probe.shape[1:])
    padding, stride, dilation, groups = _geometry(conv)
    chain_ops = [ops[p] for p in chain.positions()]
    label = "+".join(op.opcode.lower() for op in chain_ops)
    # The layout is part of the question: the NCHW kernels convert back, the
    # channels-last ones run as they will in a chain.
    asked = (CONV_UNARY, CONV_BINARY) if channels_last else kernels
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    key = (size_class(math.prod(shape)), tuple(weight.shape), tuple(stride), groups,
           asked[0], torch.get_num_threads())

    def candidates():
        # Built only when this key was never measured (Note [Calibration]).
        x = torch.randn(shape).contiguous(memory_format=memory_format)
        packed = _mkldnn._reorder_convolution_weight(weight, padding, stride, dilation,
                                                     groups, list(shape))
        values = {conv.args[0].reg: x}
        other = None
        if chain.add is not None:
            result_shape = torch.nn.functional.conv2d(
                torch.empty(shape, device="meta"), weight.to("meta"), None, stride,
                padding, dilation, groups).shape
            other = torch.randn(result_shape).contiguous(memory_format=memory_format)
            values[chain.other.reg] = other
        return {"torch": lambda: run_original(chain_ops, values, constants),
                "onednn": lambda: _call(ops, chain, x, other, packed, bias, asked)}
    choice = calibrator.choose(f"onednn {label}", key, candidates)
    if choice.name != "onednn":
        return None
    where = "channels-last" if channels_last else "NCHW"
    return (f" (measured {where}, oneDNN vs torch: batch {shape[0]} "
            f"{choice.seconds['onednn'] * 1e3:.3f} vs {choice.seconds['torch'] * 1e3:.3f} ms)")


def _fused(ops, chain: _Chain, weight, bias, probes, prepacked: PrepackCache,
           constants) -> SpecOp:
    conv = ops[chain.conv]
    x = conv.args[0]
    padding, stride, dilation, groups = _geometry(conv)
    input_size = list(probe_tensors(probes, x.reg)[0].shape)
    folded_from = tuple(a.index for a in ops[chain.bn].args[1:5]
                        if isinstance(a, ConstRef)) if chain.bn is not None else ()
    # Note [Conv weights for one row or many]: the hint's batch is in the key.
    key = (conv.args[1].index, "conv", folded_from, tuple(padding), tuple(stride),
           tuple(dilation), groups)
    batches = {t.shape[0] for t in probe_tensors(probes, x.reg)}
    packed = _packed_per_batch(weight, key, padding, stride, dilation, groups, input_size,
                               batches, prepacked)
    attr, scalars, algorithm = _post_ops(ops, chain)
    # the last op's normalized result (a batch norm's saved statistics are unused)
    dsts = ops[chain.positions()[-1]].dsts[:1]
    variant = "+".join([FUSED_VARIANT, *(str(ops[p].source_pc)
                                         for p in chain.positions()[1:])])
    geometry = (Literal(padding), Literal(stride), Literal(dilation), Literal(groups))
    bias_value = Literal(bias)
    unary_kernel, binary_kernel = _kernel_names(ops, chain, probes)
    if chain.add is None:
        args = (x, Literal(packed), bias_value, *geometry, Literal(attr), Literal(scalars),
                Literal(algorithm))
        return SpecOp(unary_kernel, dsts, args, conv.source_pc, variant=variant)
    unary = None if attr == "none" else attr
    args = (x, chain.other, Literal(packed), bias_value, *geometry, Literal("add"),
            Literal(None), Literal(unary), Literal(scalars),
            Literal(algorithm if unary else None))
    return SpecOp(binary_kernel, dsts, args, conv.source_pc, variant=variant)


def _blocking(packed: torch.Tensor) -> bytes:
    """The packed weight's oneDNN memory descriptor, as bytes (its blocking)."""
    return _mkldnn._get_mkldnn_serialized_md(packed).numpy().tobytes()


def _batches_asked(batches: set[int]) -> list[int]:
    low, high = min(batches), max(batches)
    if high - low < _MAX_BATCHES_ASKED:
        return list(range(low, high + 1))
    powers = {1 << k for k in range(high.bit_length()) if low < 1 << k < high}
    return sorted(batches | powers | {low, high})


def _packed_per_batch(weight, key: tuple, padding, stride, dilation, groups,
                      input_size: list, batches: set[int], prepacked: PrepackCache):
    """The packed weight for the planning probe's input size, or a `PackedPerBatch`
    where the blocking oneDNN wants differs between the batches of `batches`' range
    (Note [Conv weights for one row or many])."""
    def pack(size):
        return prepacked.get((*key, tuple(size)), lambda: _mkldnn._reorder_convolution_weight(
            weight, padding, stride, dilation, groups, size))
    planned = pack(input_size)
    if len(batches) < 2 or 0 in batches:
        return planned
    by_blocking = {_blocking(planned): planned}
    table: list = [None] * (max(batches) + 1)
    table[input_size[0]] = planned
    for batch in _batches_asked(batches):
        if table[batch] is None:
            packed = pack([batch, *input_size[1:]])
            # the same blocking: the planned (or first) copy serves; this one is freed
            table[batch] = by_blocking.setdefault(_blocking(packed), packed)
    if len(by_blocking) == 1:
        return planned
    for batch in range(min(batches), len(table)):   # a batch not asked: the one below
        if table[batch] is None:
            table[batch] = table[batch - 1]
    return PackedPerBatch(tuple(table))


def _torch_runs_onednn(conv: SpecOp, weight, probes) -> bool:
    """Whether torch's own convolution runs oneDNN on this ungrouped convolution's input
    at every probe (Note [Conv choice in the chain's layout])."""
    padding, stride, dilation, groups = _geometry(conv)
    if groups != 1:
        return False
    try:
        mkldnn = torch._C._ConvBackend.Mkldnn
        for x in probe_tensors(probes, conv.args[0].reg):
            # uninitialized: only its sizes and strides are read
            real = torch.empty(x.shape, memory_format=torch.channels_last)
            if torch._C._select_conv_backend(real, weight, None, stride, padding, dilation,
                                             False, [0, 0], groups, None) != mkldnn:
                return False
    except (AttributeError, RuntimeError, TypeError):   # a private API: ask instead
        return False
    return True
