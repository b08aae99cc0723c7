"""Linears as oneDNN matmul primitives built once, called through oneDNN's C API: a
pass over a region after GEMM fusion (and after the bf16 lowering).

Note [oneDNN linear primitives built once]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What Note [oneDNN primitives built once] (onednn_conv) did for convolutions, for the
linears: `mkldnn._linear_pointwise` (Note [CPU fusion]) runs oneDNN's brgemm kernels
on a weight packed once, but rebuilds the memory descriptors, the attribute with its
post-ops and the primitive (a cache lookup) on every call, about 60 us a call at
BERT-base's sizes on two threads. Here each linear of an exact kernel (one row count at
every probe) is one oneDNN matmul primitive, built when the kernel is compiled: x [M, K]
times the weight (format `any`: the layout the primitive chose, reordered ONCE from the
program's constant and shared by every kernel of the engine through PrepackCache, key
`onednn-linear`), the bias, then the activation as an eltwise post-op and a residual add
or product as a binary post-op. A call binds three data handles and executes, holding
the GIL as torch's calls do (Note [oneDNN primitives built once] says why).

Which linears: those fusion put on torch's oneDNN call (unary or binary post-op; fp32,
or bf16 from the bf16 lowering, Note [Lower-precision GEMMs]: AMX brgemm on the bf16
weight), and those on dynvm's small-M kernel (Note [A small-M GEMM of our own]), whose
GELU, left apart there, is folded in as a post-op. The kernels' choice stays fusion's
(calibrated); a linear fusion left on torch's own GEMM stays there.

Memory: one copy of each weight, torch's. A primitive chooses its weight layout (format
`any`); where torch's packed copy (PrepackCache key `linear` / `linear-bf16`, Note
[Prepacked weights]) holds the weight in that layout, the primitive reads it in place
(`LinearWeights.offer`; checked at build: same size, and reordered back it equals the
plain weight element for element), and fp32 families still on torch's calls share it.
On this host's AVX-512/AMX CPU that is every BERT-base weight: matmul chooses one
layout for every M (16-1024 tried), the one torch's reorder gives fp32 with a row hint
of 16 or more and bf16 with a hint of 1 (what fusion and the bf16 lowering use; the
small-M linears pack theirs with 16); elsewhere a reordered copy of its own, and torch's
is not held. BERT-base width (2 layers, kernels at 1x16, 2x32, 4x64): 54.0 MiB of packed
fp32 weights, 27.0 MiB bf16, one copy of each weight (4 layers, a first version with
copies of its own held 216 MiB with the pass on against 108 off). Linears on the
small-M kernel read the program's constant as stored; on a primitive they read the
shared packed copy, one weight's worth more where no fused kernel had packed it.

A bf16 family whose rows vary gets one primitive per linear built for any rows
(oneDNN's runtime dim: each call makes its rows' src and dst memory, a few us), AMX
brgemm sharing the exact kernels' copy. At any rows a binary post-op cannot name its
operand, so the residual add is a sum post-op over the result, filled with the residual
first; a product, or an add after an activation, keeps fusion's call. An fp32 family
whose rows vary keeps fusion's calls (row-gated or not, Note [oneDNN at a new row
count]) on torch's packed copy, the one the primitives read: at any rows oneDNN 3.2
has only `gemm:jit:f32` for fp32 (brgemm needs its rows when built), and BERT-base's
16 GEMMs took 16.7 ms there against 10.7 on torch's calls at M=16 and 24.9 against
18.7 at M=64 (isolated chain, two threads passive, 17:42 UTC, load 2.8-3.2).

Measured (two threads, the bench's passive OpenMP, 2026-12-05): BERT-base's 16 GEMMs
back to back with their post-ops at M=16 took 9.61 ms on the primitives against 10.68
on torch's fused calls and 10.88 on the small-M kernel (M=32 12.79 / 14.08, M=64 17.30 /
18.72; bf16 M=16 3.58 / 5.78, M=64 5.58 / 7.69, M=256 11.46 / 11.95; an inner-product
primitive 9.90, no better than matmul; 17:42 UTC, load 2.8-3.2). In one process, whole
BERT-base calls with the pass on against off (interleaved, an A/A beside): fp32
0.946-0.991 over 1x16..4x32, bf16 0.874-0.921 (18:10-18:15, load 2.3-3.1). What remains
at batch 1 is OpenMP's wake: each primitive's execute is one parallel region, and with
passive waiting the second thread sleeps between them; the 16 GEMMs take 7.93 ms with
OMP_WAIT_POLICY=ACTIVE against 9.61 passive (~105 us a GEMM), 15.15 on one thread (the
weights stream; one core moves them slower). Q, K and V are one GEMM already; fewer
regions would take one region around a layer's GEMMs and small ops (as the decode pass's
C layer call does), which oneDNN's per-call regions do not give.

Where the wake goes (H31L, 2026-12-05 22:50-23:32, load 1.6-2.3 beside other work,
timestamps from an LD_PRELOAD shim of libgomp's GOMP_parallel_start / _end, the entry
points oneDNN 3.2's wheel calls): each primitive is one region, 16 a batch-1 call and
nothing else in a region at 1x16; over the 16 bf16 GEMMs at M=16 the worker starts 45 us
after the caller enters a region and the caller leaves 38 us after the later body ends,
1.33 ms of the 3.05 ms the regions take (with OMP_WAIT_POLICY=ACTIVE 32 us in all,
1.55 ms). This guest's haltpoll cpuidle polls 0 ns (guest_halt_poll_ns), so an idle
core halts at once; but keeping both cores busy does not remove the wake: spinners of
SCHED_IDLE priority spinning only while a kernel call is inside (tried, not kept) left
it at 1.25 ms; whole BERT calls at 1x16 / 1x64 ran 0.98-1.05 of without (A/A
0.97-1.03), the fp32 chain 1.42x slower at load 1.9. The cost is the futex wake's trip
through the kernel to the other core, not the halted core. What removes it, measured on
the same 16 GEMMs (a prototype, not built in): each GEMM as two column halves on one-thread
primitives, the caller running one and a helper thread of its own, spinning at
SCHED_IDLE within the call, claiming the other (the caller runs it if not claimed): bf16
M=16 0.69-0.80 of the team, M=64 0.65-0.79, fp32 M=16 0.78-0.87 (A/A 0.99-1.01,
bit-exact); but with two busy processes beside it 1.16x (bf16) and 3.13x (fp32): a
helper preempted in the middle of its half kept the caller waiting. With the caller
sleeping on a futex once the helper is 100 us late, and the team of two (these
primitives, unchanged) for the next 8 chains whenever the helper claimed under half of a
chain's halves: 0.707 (bf16) / 0.839 (fp32) of the team (A/A 0.990 / 1.013, 23:52, load
1.9), beside two busy processes 1.000 / 0.937 (A/A 1.089 / 1.114; /tmp/h31lc/pair.c,
pairbench.py). In a busier window (23:56, load 2.1-2.4 beside other work) adaptive /
team ran bf16 M=32 1.006, M=64 0.820, M=128 1.099, fp32 M=64 0.992 (A/A 0.97-1.04), the
halves alone 0.91-4.07x: at M=128 the helper claimed and still lost, so the choice
should be by the chains' measured time, not by the helper's claims. Built in (this
pass, for exact kernels' linears at up to 64 rows, off by default): Note [Column halves
with a helper thread] in column_halves.

An exact kernel's call at rows not built (none: the guard proves the rows) would run
eager's linear on the plain weight, never a build. Where the library does not load the
pass changes nothing and the kernel's header says why; `CpuOptions.linear_primitives`
"off" skips it (the in-process A/B).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from dynvm.jit.backends.cpu import column_halves, panel_linear
from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.fusion import (
    FUSED_VARIANT,
    LINEAR_BINARY,
    LINEAR_UNARY,
    NATIVE_LINEAR,
    epilogue_pcs,
    is_fused,
    is_native,
)
from dynvm.jit.backends.cpu.huge_pages import to_huge_pages
from dynvm.jit.backends.cpu.ir_match import (
    probe_tensors,
    single_consumer,
    unary_post_op,
    untouched_between,
    use_counts,
)
from dynvm.jit.backends.cpu.onednn_conv import eltwise_of
from dynvm.jit.backends.cpu.onednn_matmul import (  # noqa: F401  (names tests use)
    ANY_ROWS,
    BINARY_ALGORITHMS,
    LinearSpec,
    LinearWeights,
    PrimitiveLinear,
)
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.background import checkpoint
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, Var
from dynvm.jit.specialize import add_frees


def linear_primitive(x, other, linear: PrimitiveLinear):
    """`ONEDNN_LINEAR_PRIMITIVE`: linear(x) with its post-ops (`other`: the binary
    post-op's operand, or None)."""
    return linear(x, other)


LINEAR_PRIMITIVE = "ONEDNN_LINEAR_PRIMITIVE"
LINEAR_PRIMITIVE_KERNELS = {LINEAR_PRIMITIVE: linear_primitive}


@dataclasses.dataclass(frozen=True)
class _Linear:
    """What a fused or native linear op reads, in the primitive's terms."""

    x: Var
    other: object            # Var / ConstRef of the binary post-op's operand, or None
    weight_key: tuple        # the PrepackCache key of the weight's reordered copies
    plain: object            # () -> the [N, K] weight in the op's dtype (exact)
    bias: torch.Tensor | None
    activation: tuple[str, list, str] | None
    binary: str | None
    torch_packed: object = None    # fusion's packed copy of the weight, if any


def _plain_of(constants, index: int, transpose: bool, dtype: torch.dtype):
    def plain():
        weight = constants[index]
        weight = weight.t() if transpose else weight
        return weight if dtype == torch.float32 else weight.to(dtype)
    return plain


def _match(op, constants, prepacked: PrepackCache, rows: int) -> _Linear | str:
    """The linear `op` computes, or why it keeps its call."""
    value = (lambda a: constants[a.index] if isinstance(a, ConstRef)
             else a.value if isinstance(a, Literal) else None)
    if op.opcode == NATIVE_LINEAR and is_native(op):
        x, weight, bias, other, input_major = op.args
        if not isinstance(weight, ConstRef):
            return "weight not a constant"
        # torch's packed copy as fusion would make it (the hint of at least 16 rows
        # gives the blocking the primitives choose; a fused kernel shares it)
        packed = prepacked.linear_weight(weight.index, constants[weight.index],
                                         max(rows, 16), input_major.value)
        to_huge_pages(packed)   # Note [Packed weights on huge pages]: it streams
        return _Linear(x, None if other == Literal(None) else other,
                       (weight.index, "onednn-linear", input_major.value, torch.float32),
                       _plain_of(constants, weight.index, input_major.value, torch.float32),
                       value(bias), None, None if other == Literal(None) else "add",
                       packed)
    if not is_fused(op) or op.opcode not in (LINEAR_UNARY, LINEAR_BINARY):
        return ""
    if op.opcode == LINEAR_UNARY:
        x, packed, bias, attr, scalars, algorithm = op.args
        other, binary = None, None
        activation = None if attr.value == "none" else (
            attr.value, list(scalars.value or []), algorithm.value or "")
    else:
        x, other, packed, bias, attr = op.args
        binary, activation = attr.value, None
        if binary not in BINARY_ALGORITHMS:
            return f"binary post-op {binary!r}"
    key = prepacked.key_of(packed.value)
    if key is None or len(key) != 3 or key[1] not in ("linear", "linear-bf16"):
        return "weight not from this engine's packed constants"
    dtype = torch.bfloat16 if key[1] == "linear-bf16" else torch.float32
    return _Linear(x, other, (key[0], "onednn-linear", key[2], dtype),
                   _plain_of(constants, key[0], key[2], dtype), value(bias), activation,
                   binary, packed.value)


def _weights_of(library: api.Library, plain) -> LinearWeights:
    return LinearWeights(library, plain())


def linear_primitives(spec: SpecializedRegion, constants, prepacked: PrepackCache,
                      halves: bool = False, panels: bool = False
                      ) -> tuple[SpecializedRegion, str]:
    """`spec` with its fused and native linears on oneDNN matmul primitives built once
    (Note [oneDNN linear primitives built once]), and a note saying how many or why none.
    With `halves`, those at a few rows in an exact kernel (column_halves.takes) also
    get column halves (Note [Column halves with a helper thread]); with `panels`, fp32
    ones at panel_linear.PANEL_ROWS rows run dynvm's panel GEMM (Note [A panel GEMM of
    our own])."""
    candidates = [i for i, op in enumerate(spec.ops)
                  if (op.opcode in (LINEAR_UNARY, LINEAR_BINARY) and is_fused(op))
                  or (op.opcode == NATIVE_LINEAR and is_native(op))]
    if not candidates:
        return spec, ""
    library = api.library()
    if library is None:
        return spec, f"; linears on torch's calls ({api.unavailable_reason()})"
    ops = list(spec.ops)
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    uses = use_counts(ops, leaving)
    kept: dict[str, int] = {}
    halved, paneled, halves_native, halves_note = 0, 0, None, ""
    if halves and column_halves.with_convolutions(spec.ops):
        halves_note = "; no column halves (a kernel with convolutions)"
    elif halves:
        halves_native, why = column_halves.native(library)
        halves_note = f"; no column halves ({why})" if halves_native is None else ""
    impls: set[str] = set()
    removed: set[int] = set()
    for position in candidates:
        # Each linear's primitives are built (and their weights packed) in a step of its
        # own (Note [Background work yields to calls] in jit.background).
        checkpoint()
        op = ops[position]
        xs = probe_tensors(spec.abstract, op.args[0].reg) if isinstance(op.args[0], Var) \
            else None
        found = _match(op, constants, prepacked,
                       xs[0].numel() // max(1, xs[0].shape[-1]) if xs else 16)
        folded = None
        if not isinstance(found, str) and found.activation is None and found.other is None:
            folded = _activation_after(ops, position, uses, removed)
            if folded is not None:
                found = dataclasses.replace(found, activation=folded[1])
        residual = None
        if not isinstance(found, str) and found.weight_key[3] == torch.bfloat16 \
                and found.other is None:
            residual = _fp32_residual_after(ops, position, uses, removed, spec.abstract)
            if residual is not None:
                found = dataclasses.replace(found, other=residual[1], binary="add")
        reason = found if isinstance(found, str) else ""
        xs = probe_tensors(spec.abstract, found.x.reg) if not reason else None
        if not reason and xs is None:
            reason = "input not a tensor at every probe"
        rows = sorted({t.numel() // t.shape[-1] for t in xs}) if not reason else []
        if len(rows) > 1:     # a family whose rows vary: one primitive for any rows
            rows = [ANY_ROWS]
            if found.weight_key[3] == torch.float32:
                # fp32 has only gemm:jit at any rows, far slower than torch's brgemm
                reason = "fp32 rows vary in the family"
        if reason:
            kept[reason] = kept.get(reason, 0) + 1
            continue
        dtype = found.weight_key[3]
        # Note [A panel GEMM of our own]: decided first, so that a linear it takes builds
        # no primitive and reorders no weight for one
        linear = None
        if panels and dtype == torch.float32 and rows[0] != ANY_ROWS \
                and panel_linear.PANEL_ROWS[0] <= rows[0] <= panel_linear.PANEL_ROWS[1]:
            linear = panel_linear.panel_of(found.plain, found.bias, found.activation,
                                           found.binary, prepacked, found.weight_key[0],
                                           found.weight_key[2])
            paneled += linear is not None
        if linear is None:
            try:
                weights = prepacked.get(found.weight_key, functools.partial(
                    _weights_of, library, found.plain))
                if found.torch_packed is not None:
                    weights.offer(found.torch_packed)
                eltwise = None
                if found.activation is not None:
                    eltwise = eltwise_of(*found.activation)
                    if eltwise == "":
                        raise api.OnednnError(f"activation {found.activation[0]!r}")
                n, k = weights.plain.shape
                linear_spec = LinearSpec(k, n, dtype, found.bias is not None, eltwise,
                                         found.binary,
                                         torch.float32 if residual is not None else None)
                linear = PrimitiveLinear(library, linear_spec, weights, found.bias, rows,
                                         found.activation)
            except api.OnednnError as exc:
                kept[str(exc)] = kept.get(str(exc), 0) + 1
                continue
            if halves_native is not None and rows[0] != ANY_ROWS \
                    and column_halves.takes(rows[0], k, n):
                try:   # Note [Column halves with a helper thread]
                    linear = column_halves.halves_of(linear, library, halves_native,
                                                     rows[0], found.plain, prepacked,
                                                     found.weight_key, found.bias)
                    halved += 1
                except api.OnednnError as exc:
                    halves_note += f"; no halves: {exc}"
        impls |= linear.impls()
        other = found.other if found.other is not None else Literal(None)
        pcs, dsts = epilogue_pcs(op), op.dsts
        for taken in (folded, residual):   # an activation the small-M kernel left
            if taken is not None:            # apart; a bf16 result's fp32 residual add
                removed.add(taken[0])
                pcs, dsts = (*pcs, ops[taken[0]].source_pc), ops[taken[0]].dsts
        variant = FUSED_VARIANT + "".join(f"+{pc}" for pc in pcs)
        ops[position] = dataclasses.replace(op, opcode=LINEAR_PRIMITIVE, dsts=dsts,
                                            args=(found.x, other, Literal(linear)),
                                            variant=variant)
    done = len(candidates) - sum(kept.values())
    note = (f"; {done} of {len(candidates)} linear(s) on oneDNN {library.version} "
            f"primitives built once ({', '.join(sorted(impls))})")
    if kept:
        note += "; kept: " + ", ".join(f"{n} {why}" for why, n in kept.items())
    if removed:
        note += f"; {len(removed)} activation(s) or fp32 residual add(s) folded in"
    if halved:
        note += f"; {halved} as column halves with a helper thread"
    if paneled:
        note += f"; {paneled} on dynvm's panel GEMM"
    note += halves_note
    if not done:
        return spec, note
    new_ops = add_frees([op for i, op in enumerate(ops) if i not in removed], leaving)
    return dataclasses.replace(spec, ops=tuple(new_ops)), note


def _fp32_residual_after(ops, position: int, uses, removed: set[int], probes):
    """(position, operand) of the ADD that alone reads bf16 op `position`'s result with
    an fp32 tensor of the sum's shape (computed in fp32 by type promotion, Note
    [Lower-precision GEMMs]): the primitive then writes fp32, adding it as a post-op."""
    consumer_at = single_consumer(ops, position, uses)
    if consumer_at is None or consumer_at in removed:
        return None
    consumer, mine = ops[consumer_at], Var(ops[position].dsts[0])
    if (consumer.opcode != "ADD" or consumer.variant not in ("", "inplace")
            or len(consumer.args) != 2 or len(consumer.dsts) != 1
            or not untouched_between(ops, position, consumer_at, consumer)):
        return None
    others = [a for a in consumer.args if a != mine]
    if len(others) != 1 or not isinstance(others[0], Var):
        return None
    other = others[0]
    if any(other.reg in op.dsts for op in ops[position:consumer_at]):
        return None      # made after the linear: not there when the primitive runs
    values, sums = probe_tensors(probes, other.reg), probe_tensors(probes, consumer.dsts[0])
    if values is None or sums is None or any(
            v.dtype != torch.float32 or v.shape != t.shape or t.dtype != torch.float32
            for v, t in zip(values, sums)):
        return None
    return consumer_at, other


def _activation_after(ops, position: int, uses, removed: set[int]):
    """(position, (attr, scalars, algorithm)) of the activation that alone reads op
    `position`'s result, where oneDNN computes it as a post-op; None otherwise (dynvm's
    small-M kernel leaves a GELU apart: Note [A small-M GEMM of our own])."""
    consumer_at = single_consumer(ops, position, uses)
    if consumer_at is None or consumer_at in removed:
        return None
    consumer = ops[consumer_at]
    if (len(consumer.dsts) != 1 or consumer.variant not in ("", "inplace")
            or not consumer.args or consumer.args[0] != Var(ops[position].dsts[0])
            or not untouched_between(ops, position, consumer_at, consumer)):
        return None
    post_op = unary_post_op(consumer)
    if post_op is None or eltwise_of(*post_op) in ("", None):
        return None
    return consumer_at, post_op
