"""GEMMs with their epilogues as one oneDNN call: a pass over the specialized IR.

Note [CPU fusion]
~~~~~~~~~~~~~~~~~
Eager PyTorch runs `gelu(linear(x, w, b))` as two kernels, the second a full pass over
the GEMM's result in memory. oneDNN computes the activation (or a residual add) as a
post-op while the result is still in registers, and its GEMM beat torch's own on this
project's 2-core AVX-512 machine (one thread, N=1024, K=256: M=512 2.2 vs 4.0 ms with
GELU; the GEMM alone 2.3 vs 3.1 ms). Torch exposes that path as
`torch.ops.mkldnn._linear_pointwise` (unary post-op) and its `.binary` overload (add,
sub, mul with a second tensor), which is what Inductor's CPU freezing passes call.

What is rewritten (`fuse_gemm_epilogues`):
- a GEMM with a constant weight: LINEAR(x, w, b), ADDMM(b, x, w^T), MM(x, w^T) and
  MATMUL(x, w^T) with a 2-D constant `w^T` become oneDNN's linear on a packed copy of
  the weight (Note [Prepacked weights]); fp32 only (oneDNN has no fp64 path here);
- with its only consumer when that is an activation oneDNN fuses (RELU, GELU both
  modes, SILU, SIGMOID, TANH, HARDSWISH, HARDSIGMOID) or an ADD/SUB/MUL with a tensor of
  exactly the result's shape and dtype at every probe (the binary post-op does not
  broadcast the GEMM's result). Binary fusion needs the shapes the guard proves, so a
  weak-guarded specialization gets only unary fusion;
- the fused call takes the GEMM's place in the sequence (its inputs are read where they
  were read before, so nothing rewritten in place in between can have clobbered them);
  the second operand of a binary post-op must already exist there, and no op between
  may write a register the fused call reads or defines. Frees are recomputed.

Not taken: MKL's packed GEMM (`mkl._mkl_linear` on `_mkl_reorder_linear_weight`)
measured slower than oneDNN at every size tried (N=1024 K=256: M=512 3.8 vs 2.3 ms,
M=2048 24 vs 9.8 ms), and an earlier attempt found that packing through MKL on the
compile thread started a second OpenMP team that slowed the whole process about 2x; the
same check with oneDNN (eager timed before and after a background compile that
calibrated and packed, one thread) showed no slowdown. BMM of two run-time tensors has
no oneDNN pointwise op; attention goes through SDPA (jit/specialize.py) instead.

Note [OpenMP team of the compile thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
OpenMP's thread count is per thread, and torch.set_num_threads sets it for the calling
thread only. Measured here: in a process where oneDNN first ran with two threads and
torch was then set to one, a oneDNN call on a new Python thread started a second OpenMP
team of its own that outlived the call, so a calibration there would have timed oneDNN
on two threads against torch on one (in a process set to one thread from the start, no
team appeared). Both passes therefore first set the current thread's count to torch's
(`pin_openmp_team`): the measurement then runs as the serving thread will, and no second
team is started (tested in a fresh process, tests/jit/test_cpu_fusion.py).

Note [oneDNN holds the GIL]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Unlike torch's own ops, a `torch.ops.mkldnn` call did not release the GIL here (a thread
looping a 2048x1024x1024 oneDNN GEMM left the main thread's Python 15% of its solo
progress; looping F.linear, 54%, on the same loaded 2 cores). A specialized kernel runs
on the request thread anyway; what matters is the compile thread's calibration, whose
calls are kept to a few milliseconds each (`calibration_max_m` in calibration_rows)
so that a request waits at most that long for the GIL.

Note [Dense weights only]
~~~~~~~~~~~~~~~~~~~~~~~~~
oneDNN's linear reads a packed copy of its weight, made once per engine (Note [Prepacked
weights]); the program keeps its own copy, which the interpreter reads. Where one copy
matters more than oneDNN's margin (a generator: one copy of the weights + the planned
cache, issue 32), `cpu_fusion="dense"` packs nothing: GEMMs of 2..16 rows over streamed
weights go to dynvm's small-M kernel on the weight as stored (Note [A small-M GEMM of our
own]), every other GEMM stays on torch (whose BLAS packs panels per call, into scratch),
without a calibration question, and convolutions are left alone.

Every rewrite must measure faster: the pass asks the device's `Calibrator` (Note
[Calibration]) to time the eager pair against the fused call on operands of the op's
shapes, per (epilogue, M size class, N, K, threads). Where M is the same at every probe
(an exact specialization, or a family whose varying dims leave the GEMM's rows alone) it
is one question at that M (capped, see `_CALIBRATION_MAX_M`), and the rewrite is made
where oneDNN wins. Where M varies, oneDNN's first call at each new M builds a primitive
that costs more than the whole GEMM at small sizes (Note [oneDNN at a new row count] in
row_gate): the question is asked per size class of M over the family's range, with
oneDNN also timed at a new M on every call, and the kernel runs oneDNN only in the
classes where it pays, for an M seen often enough to pay back the build. The choice and
the timings become notes in the kernel's source header, which `dynvm explain` prints.

oneDNN's linear reads strided and offset views correctly (it copies what it cannot
read; checked in tests/jit/test_cpu_fusion.py), so no view reaches a kernel that assumes
contiguity. The fused result is a fresh tensor: it is not an arena `out=` op, so arena
planning leaves it out (Note [Arena layout]); in-place reuse (Note [In-place reuse]) has
already run on the IR and stays valid because the fused call reads nothing later than
the GEMM did.

Note [CPU fusion groups without a vendor op]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Elementwise chains and layer norm with its neighbours have no vendor op that fuses them;
the alternative is generated C++ (vectorized, OpenMP) built by a compiler. It is left out,
measured: in the demo Transformer's specialized kernel after the GEMM rewrite, all
elementwise and layer-norm ops together take the share of the time given in
docs/BENCHMARKS.md ("CPU backend: oneDNN GEMM epilogues"), which bounds what fusing them
could save, below the 10% threshold this backend sets for taking on a compiler. Were it
done, the compile would run in the compile service or at precompile time only, cached by
source hash: a fleet replica must never run a C++ compiler on the request path (nor on
its own compile thread, which competes with requests for the same cores).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from dynvm.jit.backends.cpu.calibration_rows import (
    CALIBRATION_MAX_M as _CALIBRATION_MAX_M,
)
from dynvm.jit.backends.cpu.calibration_rows import calibration_max_m
from dynvm.jit.backends.cpu.huge_pages import to_huge_pages
from dynvm.jit.backends.cpu.ir_match import (
    BINARY_POST_OPS,
    UNARY_POST_OPS,
    probe_tensors,
    single_consumer,
    unary_post_op,
    untouched_between,
    use_counts,
)
from dynvm.jit.backends.cpu.native_linear import NATIVE, as_stored, small_m_linear
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.backends.cpu.row_gate import (
    ONEDNN,
    ONEDNN_NEW_ROWS,
    TORCH,
    BinaryRowGate,
    UnaryRowGate,
    sightings_before_onednn,
)
from dynvm.jit.backends.cpu.streamed_gemv import streamed_decision
from dynvm.jit.calibration import Calibrator, Choice, size_class
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, SpecOp, Var
from dynvm.jit.specialize import add_frees
from dynvm.vm.opcodes import OPCODES

_mkldnn = torch.ops.mkldnn

# The variant of fused SpecOps ("onednn", or "onednn+<pc>" naming the epilogue's
# instruction for the source listing) and the callables their opcodes name.
FUSED_VARIANT = "onednn"
LINEAR_UNARY = "ONEDNN_LINEAR"
LINEAR_BINARY = "ONEDNN_LINEAR_BINARY"
CONV_UNARY = "ONEDNN_CONV"            # Note [CPU conv fusion]
CONV_BINARY = "ONEDNN_CONV_BINARY"
# With a packed weight oneDNN returns its result channels-last even for an NCHW input,
# while the program's CONVOLUTION gives NCHW there (and its shape function, which the
# specializer trusts, says so): a later VIEW of the result would then fail. Where the
# original result is NCHW-contiguous the fused call converts back (the calibration
# times the conversion too).
CONV_UNARY_NCHW = "ONEDNN_CONV_NCHW"
CONV_BINARY_NCHW = "ONEDNN_CONV_BINARY_NCHW"


def _nchw(kernel):
    def call(*args):
        return kernel(*args).contiguous()

    call.__name__ = f"{kernel.__name__}_nchw"
    return call


CONV_KERNELS = {
    CONV_UNARY: _mkldnn._convolution_pointwise.default,
    CONV_BINARY: _mkldnn._convolution_pointwise.binary,
    CONV_UNARY_NCHW: _nchw(_mkldnn._convolution_pointwise.default),
    CONV_BINARY_NCHW: _nchw(_mkldnn._convolution_pointwise.binary),
}
# A fused linear behind a RowGate (Note [oneDNN at a new row count]): the gate is the
# first operand, the rest are the plain fused call's.
# The generated code calls the gate itself.
GATED = {LINEAR_UNARY: "ONEDNN_LINEAR_GATED", LINEAR_BINARY: "ONEDNN_LINEAR_BINARY_GATED"}
GATED_OPCODES = frozenset(GATED.values())
# A GEMM on dynvm's own small-M kernel (Note [A small-M GEMM of our own]): operands x,
# the constant weight as stored, bias, the residual to add (or None), input-major.
NATIVE_VARIANT = "native"
NATIVE_LINEAR = "NATIVE_LINEAR"
NATIVE_KERNELS = {NATIVE_LINEAR: small_m_linear}
FUSED_KERNELS = {
    LINEAR_UNARY: _mkldnn._linear_pointwise.default,
    LINEAR_BINARY: _mkldnn._linear_pointwise.binary,
    **CONV_KERNELS,
}

@dataclass(frozen=True)
class FusionResult:
    """A region after a fusion rewrite, with notes on what was fused or why not."""

    spec: SpecializedRegion
    notes: tuple[str, ...]


@dataclass(frozen=True)
class _Gemm:
    """A GEMM with a constant weight, in linear's terms."""

    x: object                    # the activation operand (Var)
    weight: int                  # constant index
    transpose: bool              # the constant is [K, N]
    bias: object                 # ConstRef or Literal(None)


def is_fused(op: SpecOp) -> bool:
    """Whether `op` runs as a fused oneDNN kernel."""
    return op.variant.split("+")[0] == FUSED_VARIANT


def epilogue_pcs(op: SpecOp) -> tuple[int, ...]:
    """The instructions a fused op also stands for, after its GEMM's (`source_pc`)."""
    return tuple(int(pc) for pc in op.variant.split("+")[1:])


def pin_openmp_team() -> None:
    """Note [OpenMP team of the compile thread]: this thread's OpenMP team to torch's
    intra-op thread count (the value is process-wide; this makes it hold here too)."""
    torch.set_num_threads(torch.get_num_threads())


def onednn_available(device: torch.device) -> bool:
    """Whether oneDNN (mkldnn) kernels can run on `device`."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled)


def fuse_gemm_epilogues(spec: SpecializedRegion, constants, device: torch.device, *,
                        prepacked: PrepackCache, calibrator: Calibrator | None,
                        weak_guard: bool, dense: bool = False) -> FusionResult:
    """`spec` with its GEMMs (and their epilogues) on oneDNN where that measures faster;
    `calibrator` None: rewrite wherever possible (tests, debugging); `dense`: no packed
    copy of any weight (Note [Dense weights only]): dynvm's small-M kernel where it
    applies, torch elsewhere."""
    if not onednn_available(device) or not spec.abstract:
        return FusionResult(spec, ())
    pin_openmp_team()
    ops = list(spec.ops)
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    producer_position = {dst: i for i, op in enumerate(ops) for dst in op.dsts}
    uses = use_counts(ops, leaving)
    notes: list[str] = []
    replaced: dict[int, SpecOp] = {}
    removed: set[int] = set()
    for position, op in enumerate(ops):
        gemm = _as_gemm(op, constants, spec.abstract)
        if gemm is None:
            continue
        consumer_at = single_consumer(ops, position, uses)
        epilogue = None
        if consumer_at is not None and consumer_at not in removed:
            epilogue = _epilogue(ops, position, consumer_at, spec.abstract, constants,
                                 producer_position, weak_guard)
        try:
            decision = _decide(op, gemm, epilogue, ops, constants, spec.abstract, calibrator,
                               dense_only=dense)
            if not decision.fuse and epilogue is not None and not dense:
                # The fused form lost: try the GEMM alone (its own calibration).
                epilogue = None
                decision = _decide(op, gemm, None, ops, constants, spec.abstract,
                                   calibrator)
            if decision.native and epilogue is not None and not native_epilogue(epilogue):
                epilogue = None   # the consumer stays an op of its own
            if not decision.fuse:
                fused = None
            elif decision.native:
                fused = _native_op(op, gemm, epilogue, ops, constants)
            else:
                fused = _fused_op(op, gemm, epilogue, ops, constants, spec.abstract,
                                  prepacked, decision.after)
        except RuntimeError as exc:   # oneDNN refused these operands: torch keeps them
            notes.append(f"{op.source_pc}: {op.opcode} stays on torch (oneDNN refused "
                         f"it: {str(exc)[:120]})")
            continue
        if not decision.fuse:
            notes.append(f"{op.source_pc}: {op.opcode} stays on torch ({decision.note})")
            continue
        replaced[position] = fused
        if epilogue is not None:
            removed.add(epilogue[0])
        target = "dynvm's small-M" if decision.native else "oneDNN"
        notes.append(f"{op.source_pc}: {_describe(op, epilogue, ops)} -> {target} "
                     f"{_call_text(fused)}{decision.note}")
    if not replaced:
        return FusionResult(spec, tuple(notes))
    new_ops = [replaced.get(i, op) for i, op in enumerate(ops) if i not in removed]
    new_ops = add_frees(new_ops, leaving)
    return FusionResult(dataclasses.replace(spec, ops=tuple(new_ops)), tuple(notes))


# -- matching ---------------------------------------------------------------------------


def _fp32_const(constants, arg, rank: int) -> torch.Tensor | None:
    if not isinstance(arg, ConstRef):
        return None
    value = constants[arg.index]
    if (isinstance(value, torch.Tensor) and value.dtype == torch.float32
            and value.dim() == rank and value.device.type == "cpu"):
        return value
    return None


def _as_gemm(op: SpecOp, constants, probes) -> _Gemm | None:
    if op.variant or len(op.dsts) != 1:
        return None
    args, spec = op.args, OPCODES.get(op.opcode)
    gemm = spec.gemm if spec is not None else None   # OpSpec.gemm: the operands' roles
    if gemm is None or len(args) != len(spec.args):
        return None
    x, weight, transpose = args[gemm.a], args[gemm.b], not gemm.b_is_nk
    bias = args[gemm.bias] if gemm.bias is not None else Literal(None)
    if _fp32_const(constants, weight, 2) is None or not (
            bias == Literal(None) or _fp32_const(constants, bias, 1) is not None):
        return None
    if not isinstance(x, Var):
        return None
    xs = probe_tensors(probes, x.reg)
    results = probe_tensors(probes, op.dsts[0])
    if xs is None or results is None:
        return None
    if any(t.dtype != torch.float32 or t.dim() < 2 for t in xs):
        return None
    if gemm.a_2d and any(t.dim() != 2 for t in xs):
        return None
    return _Gemm(x, weight.index, transpose, bias)


def _bound_gemm(impl, gemm, weight, bias) -> tuple:
    """(`impl` as a partial of the builtin holding the operands before the rows,
    the operands after them): `run(x, *after)` is the GEMM (OpSpec.gemm's positions)."""
    fixed = {gemm.b: weight, **({} if gemm.bias is None else {gemm.bias: bias})}
    before = [fixed[i] for i in range(gemm.a)]
    return (functools.partial(impl, *before),
            tuple(fixed[i] for i in range(gemm.a + 1, len(fixed) + 1)))


def _epilogue(ops, position, consumer_at, probes, constants, producer_position,
              weak_guard: bool):
    """(consumer position, attr, scalars, algorithm, other operand or None), or None."""
    consumer = ops[consumer_at]
    dst = Var(ops[position].dsts[0])
    if len(consumer.dsts) != 1 or consumer.variant not in ("", "inplace"):
        return None
    if not untouched_between(ops, position, consumer_at, consumer):
        return None
    name = consumer.opcode
    if name in UNARY_POST_OPS and consumer.args and consumer.args[0] == dst:
        post_op = unary_post_op(consumer)
        if post_op is None:
            return None
        return consumer_at, *post_op, None
    if name not in BINARY_POST_OPS or weak_guard or len(consumer.args) != 2:
        return None
    a, b = consumer.args
    if a == dst:
        other = b
    elif b == dst and OPCODES[name].commutative:
        other = a
    else:
        return None
    if other == dst:
        return None
    result = probe_tensors(probes, dst.reg)
    if isinstance(other, Var):
        # It must exist where the fused call runs: the GEMM's place.
        if producer_position.get(other.reg, -1) >= position:
            return None
        others = probe_tensors(probes, other.reg)
    elif isinstance(other, ConstRef) and isinstance(constants[other.index], torch.Tensor):
        others = [constants[other.index]] * len(probes)
    else:
        return None
    if others is None or result is None:
        return None
    if any(o.shape != r.shape or o.dtype != r.dtype for o, r in zip(others, result)):
        return None
    return consumer_at, BINARY_POST_OPS[name], None, None, other


# -- calibration -------------------------------------------------------------------------


def _m_of(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


@dataclass(frozen=True)
class _Decision:
    """Whether a GEMM goes to oneDNN, the note saying why, and for a family whose M
    varies, when (Note [oneDNN at a new row count]): `after` per size class of M, or
    None for every call."""

    fuse: bool
    note: str
    after: tuple | None = None
    native: bool = False
    """Run on dynvm's small-M kernel instead (Note [A small-M GEMM of our own])."""


_NO_FASTER = "oneDNN measured no faster here"


_DENSE = "not asked: no packed weight copies (cpu_fusion='dense', Note [Dense weights only])"


def _decide(op, gemm: _Gemm, epilogue, ops, constants, probes,
            calibrator: Calibrator | None, dense_only: bool = False) -> _Decision:
    if calibrator is None and not dense_only:
        return _Decision(True, " (not measured: fusion forced on)")
    weight = constants[gemm.weight]
    bias = constants[gemm.bias.index] if isinstance(gemm.bias, ConstRef) else None
    k, n = weight.shape if gemm.transpose else weight.shape[::-1]
    label = _kind(op, epilogue, ops)
    threads = torch.get_num_threads()
    probe_ms = {_m_of(x) for x in probe_tensors(probes, gemm.x.reg)}
    # Note [Streamed GEMVs stay on torch], Note [Few rows over a streamed weight]
    streamed = streamed_decision(probe_ms, weight, ops, constants, gemm.transpose)
    if streamed is not None:
        where, note = streamed
        if dense_only and where == ONEDNN:
            where, note = TORCH, _DENSE
        if where != ONEDNN:   # the weight streams as stored: on huge pages too
            to_huge_pages(weight)   # Note [Packed weights on huge pages]
        return _Decision(where != TORCH, note, native=where == NATIVE)
    if dense_only:
        return _Decision(False, _DENSE)
    new_rows = len(probe_ms) > 1
    dense = weight.t() if gemm.transpose else weight
    eager, fused = _forms(op, epilogue, ops, weight, bias)

    def operands(m: int, at_new_rows: bool):
        def build():
            # Built only when this size class was never measured (Note [Calibration]);
            # rows past m give the new-M form a row count of its own on every call.
            spare = calibrator.rounds + 2 if at_new_rows else 0
            xs, others = torch.randn(m + spare, k), torch.randn(m + spare, n)
            packed = _mkldnn._reorder_linear_weight(dense.contiguous(), max(1, m))
            x, other = xs[:m], others[:m]
            warm = {ONEDNN: lambda: fused(x, other, packed)}
            if not at_new_rows:
                return {TORCH: lambda: eager(x, other), **warm}
            # Views made here, not in the timed call: slicing is a torch call that
            # releases the GIL, and on the compile thread each release let a request
            # thread in for up to the switch interval (5 ms), timed as the build.
            fresh = iter([(xs[:rows], others[:rows])
                          for rows in range(m + 1, m + spare + 1)])

            def at_new_rows_call():
                x_rows, other_rows = next(fresh)
                return fused(x_rows, other_rows, packed)
            return {**warm, ONEDNN_NEW_ROWS: at_new_rows_call}
        return build

    def ask(m: int) -> Choice:
        """torch against oneDNN at m; where M varies and oneDNN wins, its build too: a
        second question (oneDNN against itself at a new M on every call) that a 10x
        build decides in three rounds, and one a losing GEMM never pays for."""
        key = (size_class(m), n, k, threads)
        choice = calibrator.choose(f"onednn {label}", key, operands(m, False))
        if not new_rows or choice.name != ONEDNN:
            return choice
        build = calibrator.choose(f"onednn {label} at new M", key, operands(m, True))
        # oneDNN's warm figures from the first question (the one torch was timed in)
        both = choice.fastest and build.fastest
        return Choice(choice.name, {**build.seconds, **choice.seconds}, choice.default,
                      {**build.fastest, **choice.fastest} if both else {})

    cap = calibration_max_m(n, k)
    if not new_rows:
        m = min(probe_ms.pop(), cap)
        choice = ask(m)
        if choice.name != ONEDNN:
            # the figures too: under load this answer has flipped (docs/bench_log.md,
            # issue 31 at BERT-base width), and a note without them cannot say why
            return _Decision(False, f"{_NO_FASTER}: M={m} oneDNN {_ms(choice, ONEDNN)} "
                                    f"vs torch {_ms(choice, TORCH)} ms")
        return _Decision(True, f" (measured, oneDNN vs torch: M={m} "
                               f"{choice.seconds[ONEDNN] * 1e3:.3f} vs "
                               f"{choice.seconds[TORCH] * 1e3:.3f} ms)")
    return _decide_per_size_class(ask, probe_ms, calibrator.margin, cap)


def _decide_per_size_class(ask, probe_ms: set[int], margin: float,
                           cap: int = _CALIBRATION_MAX_M) -> _Decision:
    """Note [oneDNN at a new row count]: a verdict per size class of M over the family's
    range (capped at `cap` rows), each measured at the class's smallest M in that range."""
    low = min(min(probe_ms), cap)
    high = min(max(probe_ms), cap)
    first = size_class(low)
    after: list = [None] * first
    measured = []
    for c in range(first, size_class(high) + 1):
        m = max(low, 1 << c)
        choice = ask(m)
        verdict = sightings_before_onednn(choice, margin)
        after.append(verdict)
        measured.append(f"M={m} {_ms(choice, TORCH)} / {_ms(choice, ONEDNN)} / "
                        f"{_ms(choice, ONEDNN_NEW_ROWS)} ms: {_verdict_text(verdict)}")
    timings = ("torch / oneDNN / oneDNN at a new M, per size class of M: "
               + "; ".join(measured))
    verdicts = after[first:]
    if all(v is None for v in verdicts):
        return _Decision(False, f"{_NO_FASTER} at the family's row counts ({timings})")
    if all(v == 0 for v in verdicts):
        return _Decision(True, f" (measured, {timings})")
    return _Decision(True, f" (gated per row count, {timings})", tuple(after))


def _ms(choice: Choice, name: str) -> str:
    seconds = choice.seconds.get(name)
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _verdict_text(verdict: int | None) -> str:
    if verdict is None:
        return "torch"
    return "oneDNN" if verdict == 0 else f"oneDNN after {verdict} calls at one M"


def _forms(op, epilogue, ops, weight, bias):
    """The pair as the interpreter runs it, `eager(x, other=None, *ignored)`, and the
    fused call, `fused(x, other, packed)` (`other`: the binary post-op's second operand,
    unused by the unary forms). `eager` is also a gated kernel's torch form (Note [oneDNN
    at a new row count]), called with the fused call's operands: one Python frame over
    torch's own calls (the GEMM is a `functools.partial` of the builtin)."""
    spec = OPCODES[op.opcode]
    run_gemm, after = _bound_gemm(spec.impl, spec.gemm, weight, bias)
    if epilogue is None:
        def gemm_alone(x, other=None, *ignored):
            return run_gemm(x, *after)

        def fused_alone(x, other, packed):
            return FUSED_KERNELS[LINEAR_UNARY](x, packed, bias, "none", [], "")
        return gemm_alone, fused_alone
    consumer_at, attr, scalars, algorithm, second = epilogue
    consumer = ops[consumer_at]
    spec = OPCODES[consumer.opcode]
    step = spec.inplace if consumer.variant == "inplace" else spec.impl
    if second is None:
        extra = [a.value for a in consumer.args[1:]]

        def eager(x, other=None, *ignored):
            return step(run_gemm(x, *after), *extra)

        def fused(x, other, packed):
            return FUSED_KERNELS[LINEAR_UNARY](x, packed, bias, attr, scalars, algorithm)
        return eager, fused

    def eager_binary(x, other=None, *ignored):
        # ADD and MUL commute exactly; SUB is fused only with the GEMM's result first.
        return step(run_gemm(x, *after), other)

    def fused_binary(x, other, packed):
        return FUSED_KERNELS[LINEAR_BINARY](x, other, packed, bias, attr)
    return eager_binary, fused_binary


# -- the fused op ------------------------------------------------------------------------


def _fused_op(op, gemm: _Gemm, epilogue, ops, constants, probes,
              prepacked: PrepackCache, after: tuple | None = None) -> SpecOp:
    """The fused SpecOp; with `after`, a call through a `RowGate` (Note [oneDNN at a new
    row count]) whose torch form is the pair the op replaces."""
    xs = probe_tensors(probes, gemm.x.reg)
    packed = prepacked.linear_weight(gemm.weight, constants[gemm.weight], _m_of(xs[0]),
                                     gemm.transpose)
    to_huge_pages(packed)   # Note [Packed weights on huge pages]
    bias = constants[gemm.bias.index] if isinstance(gemm.bias, ConstRef) else None
    if epilogue is None:
        dsts, variant, attr, other = op.dsts, FUSED_VARIANT, "none", None
        args = (gemm.x, Literal(packed), gemm.bias, Literal("none"), Literal([]),
                Literal(""))
    else:
        consumer_at, attr, scalars, algorithm, other = epilogue
        consumer = ops[consumer_at]
        dsts, variant = consumer.dsts, f"{FUSED_VARIANT}+{consumer.source_pc}"
        args = ((gemm.x, Literal(packed), gemm.bias, Literal(attr), Literal(scalars),
                 Literal(algorithm)) if other is None
                else (gemm.x, other, Literal(packed), gemm.bias, Literal(attr)))
    opcode = LINEAR_UNARY if other is None else LINEAR_BINARY
    if after is None:
        return SpecOp(opcode, dsts, args, op.source_pc, variant=variant)
    eager, _ = _forms(op, epilogue, ops, constants[gemm.weight], bias)
    gate_type = UnaryRowGate if other is None else BinaryRowGate
    gate = gate_type(after, FUSED_KERNELS[opcode], eager)
    return SpecOp(GATED[opcode], dsts, (Literal(gate), *args), op.source_pc,
                  variant=variant)


def native_epilogue(epilogue) -> bool:
    """Whether dynvm's small-M kernel computes `epilogue` itself: a residual add (its
    other operand has the result's shape, as `_epilogue` checked)."""
    _, attr, _, _, other = epilogue
    return other is not None and attr == "add"


def _native_op(op, gemm: _Gemm, epilogue, ops, constants) -> SpecOp:
    """The GEMM (with its residual add) as a call of dynvm's small-M kernel on the
    constant weight as the program stores it (Note [A small-M GEMM of our own])."""
    stored, input_major = as_stored(constants[gemm.weight], gemm.transpose)
    weight = ConstRef(gemm.weight) if stored is constants[gemm.weight] else Literal(stored)
    bias = gemm.bias   # the kernel reads a bias as one contiguous row: made so once, here
    if isinstance(bias, ConstRef) and not constants[bias.index].is_contiguous():
        bias = Literal(constants[bias.index].contiguous())
    if epilogue is None:
        dsts, variant, other = op.dsts, NATIVE_VARIANT, Literal(None)
    else:
        consumer = ops[epilogue[0]]
        dsts, variant, other = consumer.dsts, f"{NATIVE_VARIANT}+{consumer.source_pc}", \
            epilogue[4]
    return SpecOp(NATIVE_LINEAR, dsts, (gemm.x, weight, bias, other,
                                        Literal(input_major)),
                  op.source_pc, variant=variant)


def is_native(op: SpecOp) -> bool:
    """Whether `op` runs on dynvm's small-M kernel."""
    return op.variant.split("+")[0] == NATIVE_VARIANT


def _kind(op, epilogue, ops) -> str:
    if epilogue is None:
        return op.opcode.lower()
    consumer = ops[epilogue[0]]
    post_op = UNARY_POST_OPS.get(consumer.opcode)
    mode = f"({epilogue[3]})" if post_op is not None and post_op.algorithm else ""
    return f"{op.opcode.lower()}+{consumer.opcode.lower()}{mode}"


def _describe(op, epilogue, ops) -> str:
    if epilogue is None:
        return op.opcode
    consumer = ops[epilogue[0]]
    return f"{op.opcode} + {consumer.opcode} (pc {consumer.source_pc})"


def _call_text(fused: SpecOp) -> str:
    if fused.opcode == NATIVE_LINEAR:
        return "linear" if fused.args[3] == Literal(None) else "linear with the add"
    gated_call = fused.opcode in GATED_OPCODES
    args = fused.args[1:] if gated_call else fused.args
    opcode = next((k for k, v in GATED.items() if v == fused.opcode), fused.opcode)
    prefix = "row-gated " if gated_call else ""
    if opcode == LINEAR_UNARY:
        attr = args[3].value
        return prefix + ("linear" if attr == "none" else f"linear with post-op {attr}")
    return prefix + f"linear with binary post-op {args[4].value}"
