"""The CPU backend: a specialized region as straight-line Python source.

The source is generated readable (one line per operation, the original instruction in a
comment, `del` where a value dies), kept in the artifact, and shown by `dynvm explain`.
Operations are the opcode table's own implementations, bound as globals of the
generated module together with the program's constants, so a line of generated code
costs one call of the kernel. Compared with the interpreter, a specialization does no
register-file indexing per operand, no shape arithmetic (folded), no input checks
(proven by its guard) and no no-op views.

The source is built only from verified bytecode by this module; nothing from outside the
process is ever compiled here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass, field

import torch

from dynvm.arena import ArenaPool
from dynvm.jit.backends.cpu.arena_choice import out_form_pays, zeros_like_abstract
from dynvm.jit.backends.cpu.arena_layout import OUT_KERNELS, ArenaBinding, ArenaLayout, plan_layout
from dynvm.jit.backends.cpu.attention_bf16 import bf16_attention
from dynvm.jit.backends.cpu.attention_native import (
    ATTENTION_KERNELS,
    ATTENTION_VARIANT,
    native_attention,
)
from dynvm.jit.backends.cpu.attention_qkv import qkv_attention_calls
from dynvm.jit.backends.cpu.chain_bf16 import bf16_chains
from dynvm.jit.backends.cpu.channels_last import (
    LAYOUT_KERNELS,
    choose_channels_last,
    is_layout_op,
    layout_comment,
    plan_channels_last,
)
from dynvm.jit.backends.cpu.column_halves import kernel_halves
from dynvm.jit.backends.cpu.conv import PackedPerBatch, fuse_conv_epilogues
from dynvm.jit.backends.cpu.conv_residual import IN_PLACE_KERNELS, residuals_in_place
from dynvm.jit.backends.cpu.decode_fusion import DECODE_KERNELS, fuse_decode_ops
from dynvm.jit.backends.cpu.fusion import (
    FUSED_KERNELS,
    GATED_OPCODES,
    NATIVE_KERNELS,
    epilogue_pcs,
    fuse_gemm_epilogues,
    is_fused,
    is_native,
)
from dynvm.jit.backends.cpu.one_thread import (
    neutral,
    openmp_getter,
    openmp_setter,
    plan_one_thread,
)
from dynvm.jit.backends.cpu.onednn_conv import PRIMITIVE_KERNELS, conv_primitives
from dynvm.jit.backends.cpu.onednn_linear import LINEAR_PRIMITIVE_KERNELS, linear_primitives
from dynvm.jit.backends.cpu.precision import (
    PRECISION_KERNELS,
    PRECISION_VARIANT,
    lower_precision,
)
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.backends.cpu.shape_constants import fold_shape_constants
from dynvm.jit.calibration import Calibrator, calibrator_for, size_class
from dynvm.jit.guards import GuardStrength
from dynvm.jit.inplace import INPLACE
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, Var
from dynvm.vm.abstract import to_abstract
from dynvm.vm.opcodes import opcode


@dataclass(frozen=True)
class CpuKernel:
    """A compiled CPU specialization: its name, generated source, the function that
    runs it on a register file, its arena binding if any, and its rewrites' notes."""

    name: str
    source: str
    fn: object  # Callable[[list], None]
    arena: ArenaBinding | None = None
    notes: tuple[str, ...] = ()     # what the backend's own rewrites did (Note [CPU fusion])


class _Emitter:
    """Indented lines and the globals they need."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.bindings: dict[str, object] = {}
        self._by_identity: dict[int, str] = {}
        self.depth = 0      # added to every line's indent (a body inside `try:`)

    def line(self, text: str, indent: int = 1) -> None:
        self.lines.append("    " * (indent + self.depth) + text)

    def bind(self, prefix: str, value: object) -> str:
        name = self._by_identity.get(id(value))
        if name is None:
            name = f"{prefix}{len(self.bindings)}"
            self.bindings[name] = value
            self._by_identity[id(value)] = name
        return name


def _literal(value: object, emitter: _Emitter) -> str:
    if value is None or isinstance(value, bool | int | str):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else emitter.bind("k", value)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v, emitter) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(_literal(v, emitter) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return emitter.bind("k", value)


def _value(value, emitter: _Emitter, constants) -> str:
    if isinstance(value, Var):
        return f"v{value.reg}"
    if isinstance(value, ConstRef):
        return emitter.bind("c", constants[value.index])
    if isinstance(value, Literal):
        return _literal(value.value, emitter)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v, emitter, constants) for v in value) + "]"
    raise TypeError(f"unexpected value {value!r}")


def kernel_name(spec: SpecializedRegion, signature_text: str) -> str:
    """The kernel's name: its region and a digest of the signature it serves."""
    digest = hashlib.sha256(signature_text.encode()).hexdigest()[:10]
    return f"kernel_region{spec.region_index}_{digest}"


def emit_source(spec: SpecializedRegion, program, constants, device: torch.device,
                name: str, header: str, options: CpuOptions,
                arena: ArenaBinding | None = None,
                one_thread: frozenset = frozenset(), halves=None) -> tuple[str, dict]:
    """The Python source of the kernel, and the globals it runs with.

    With an arena, two bodies are emitted: `<name>_arena` writes planned results into
    the leased buffer (Note [Arena layout]); `<name>_plain` allocates as the interpreter
    does and runs when the pool refuses a lease. `<name>` picks one per call. Ops at the
    positions in `one_thread` run on the calling thread alone (Note [Small ops on one
    thread]). With `halves` (a KernelHalves, Note [Column halves with a helper thread])
    `<name>` enters and leaves it around `<name>_run`."""
    emitter = _Emitter()
    for line in header.splitlines():
        emitter.lines.append(f"# {line}")
    if halves is not None:
        entry = emitter.bind("halves", halves)
        emitter.lines.append(f"def {name}(regs):")
        emitter.line(f"token = {entry}.enter()")
        emitter.line("try:")
        emitter.line(f"return {name}_run(regs)", 2)
        emitter.line("finally:")
        emitter.line(f"{entry}.leave(token)", 2)
        emitter.lines.append("")
        name = f"{name}_run"
    if arena is None:
        emitter.lines.append(f"def {name}(regs):")
        _emit_body(emitter, spec, program, constants, device, None, one_thread)
        return "\n".join(emitter.lines) + "\n", emitter.bindings
    binding = emitter.bind("arena", arena)
    emitter.lines.append(f"def {name}(regs):")
    emitter.line(f"lease = {binding}.acquire()")
    emitter.line("if lease is None:  # over the arena budget: allocate as usual")
    emitter.line(f"return {name}_plain(regs)", 2)
    emitter.line("try:")
    emitter.line(f"{name}_arena(regs, lease.outs)", 2)
    emitter.line("finally:")
    emitter.line(f"{binding}.release(lease)", 2)
    emitter.lines.append("")
    emitter.lines.append(f"def {name}_arena(regs, A):")
    _emit_body(emitter, spec, program, constants, device, arena.layout, one_thread)
    emitter.lines.append("")
    emitter.lines.append(f"def {name}_plain(regs):")
    _emit_body(emitter, spec, program, constants, device, None, one_thread)
    return "\n".join(emitter.lines) + "\n", emitter.bindings


def plan_arena_layout(spec: SpecializedRegion, constants, device, options):
    """Note [Arena layout]: which results of `spec` go to the arena, and where."""
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    meta_constants: dict[int, torch.Tensor] = {}

    def operand_values(op, probe):
        def one(arg):
            if isinstance(arg, Var):
                return probe.get(arg.reg)
            if isinstance(arg, ConstRef):
                if arg.index not in meta_constants:
                    meta_constants[arg.index] = to_abstract(constants[arg.index])
                return meta_constants[arg.index]
            if isinstance(arg, Literal):
                return torch.device("meta") if isinstance(arg.value, torch.device) \
                    else arg.value
            return [one(item) for item in arg]
        values = [one(arg) for arg in op.args]
        if any(isinstance(arg, Var) and value is None for arg, value in zip(op.args, values)):
            return None
        return values

    pays = None
    if options.arena_ops == "measured":  # Note [Arena by measurement]
        calibrator = options.calibrator or calibrator_for(device)
        planning = spec.abstract[0]

        def real(arg, probe):
            if isinstance(arg, Var):
                return zeros_like_abstract(probe.get(arg.reg), device)
            if isinstance(arg, ConstRef):
                return constants[arg.index]
            if isinstance(arg, Literal):
                return arg.value
            return [real(item, probe) for item in arg]

        def pays_at(op, form, probe) -> bool:
            return out_form_pays(op.opcode, form, operand_values(op, probe),
                                 probe[op.dsts[0]],
                                 lambda: [real(a, probe) for a in _device_args(op.args, device)],
                                 device, calibrator)

        def pays(op, form) -> bool:
            # A family's op is asked at both ends of its sizes: the planning probe (its
            # largest) and the probe where its result is smallest (Note [Arena by
            # measurement]); the out= form is planned only where it pays at both.
            sized = [p for p in spec.abstract if isinstance(p.get(op.dsts[0]), torch.Tensor)
                     and operand_values(op, p) is not None]
            smallest = min(sized, key=lambda p: p[op.dsts[0]].numel(), default=planning)
            ends = [planning] if smallest is planning else [planning, smallest]
            return all(pays_at(op, form, probe) for probe in ends)

    # A layout conversion returns its operand when it is already in the wanted layout
    # (Note [Channels-last chains]): to the planner, which must see every value that may
    # share a block's storage, it is a MOVE (an op that may return its operand).
    ops = [dataclasses.replace(op, opcode="MOVE") if is_layout_op(op) else op
           for op in spec.ops]
    return plan_layout(ops, spec.abstract, operand_values, leaving, pays)


def _emit_body(emitter, spec, program, constants, device,
               layout: ArenaLayout | None, one_thread: frozenset = frozenset()) -> None:
    for reg in spec.live_in:
        emitter.line(f"v{reg} = regs[{reg}]")
    threads = None
    if one_thread:  # Note [Small ops on one thread]: the caller's count back in `finally`
        threads = emitter.bind("set_threads", openmp_setter())
        emitter.line(f"threads = {emitter.bind('get_threads', openmp_getter())}()")
        emitter.line("try:")
        emitter.depth += 1
    alone = False
    for position, op in enumerate(spec.ops):
        if threads is not None and (position in one_thread) != alone and not (
                alone and neutral(op)):
            alone = not alone
            emitter.line(f"{threads}(1)" if alone else f"{threads}(threads)")
        if is_layout_op(op):  # Note [Channels-last chains]
            fn = emitter.bind(op.opcode.lower(), LAYOUT_KERNELS[op.opcode])
            emitter.line(f"# {layout_comment(op)}")
            emitter.line(f"v{op.dsts[0]} = {fn}(v{op.args[0].reg})")
            if op.frees:
                emitter.line("del " + ", ".join(f"v{r}" for r in op.frees))
            continue
        emitter.line(f"# {program.code[op.source_pc]}")
        for pc in epilogue_pcs(op) if op.variant else ():  # Note [CPU fusion]
            emitter.line(f"# {program.code[pc]}")
        if op.opcode in GATED_OPCODES:  # Note [oneDNN at a new row count]
            emitter.bind("row_gate", op.args[0].value)   # named so before args bind it
        args = [_value(a, emitter, constants) for a in _device_args(op.args, device)]
        comment = ""
        if op.opcode in GATED_OPCODES:
            fn, args = args[0], args[1:]       # the gate (a global) is the callee
        elif layout is not None and position in layout.outs:
            fn = emitter.bind(op.opcode + "_out", OUT_KERNELS[op.opcode].fn)
            args += [f"A[{k}]" for k in layout.outs[position]]
            comment = "  # into the arena"
        elif op.variant == "inplace":
            fn = emitter.bind(op.opcode.lower() + "_", INPLACE[op.opcode])
        elif is_fused(op):  # Note [CPU fusion]
            fn = emitter.bind(op.opcode.lower(),
                              IN_PLACE_KERNELS.get(op.opcode) or PRIMITIVE_KERNELS.get(op.opcode)
                              or LINEAR_PRIMITIVE_KERNELS.get(op.opcode)
                              or FUSED_KERNELS[op.opcode])
            # Note [Conv weights for one row or many]: the weight by the input's batch
            args = [f"{emitter.bind('k', a.value.packs)}[{args[0]}.shape[0]]"
                    if isinstance(a, Literal) and isinstance(a.value, PackedPerBatch) else text
                    for a, text in zip(op.args, args)]
        elif is_native(op):
            # Note [A small-M GEMM of our own], Note [A decode step's small ops in C]
            fn = emitter.bind(op.opcode.lower(),
                              NATIVE_KERNELS.get(op.opcode) or DECODE_KERNELS[op.opcode])
        elif op.variant == PRECISION_VARIANT:  # Note [Lower-precision GEMMs]
            fn = emitter.bind(op.opcode.lower(), PRECISION_KERNELS[op.opcode])
        elif op.variant == ATTENTION_VARIANT:  # Note [Masked attention of our own]
            fn = emitter.bind(op.opcode.lower(), ATTENTION_KERNELS[op.opcode])
        else:
            fn = emitter.bind(op.opcode, opcode(op.opcode).impl)
        call = f"{fn}({', '.join(args)})"
        if not op.dsts:
            emitter.line(call)
        elif len(op.dsts) == 1:
            emitter.line(f"v{op.dsts[0]} = {call}{comment}")
        else:
            emitter.line(", ".join(f"v{d}" for d in op.dsts) + f", = {call}")
        if op.frees:
            emitter.line("del " + ", ".join(f"v{r}" for r in op.frees))
    if threads is not None:
        emitter.depth -= 1
        emitter.line("finally:")
        emitter.line(f"{threads}(threads)", 2)
    # The register file changes only here, after every operation succeeded: a kernel
    # that raises leaves it as it was, and the interpreter can rerun the region.
    for reg in spec.dead_live_ins:
        emitter.line(f"regs[{reg}] = None")
    for reg, value in spec.outputs:
        emitter.line(f"regs[{reg}] = {_value(value, emitter, constants)}")
    if emitter.lines[-1].endswith(":"):
        emitter.line("pass")


def _device_args(args, device: torch.device):
    # Device operands mean "the runtime's device" (as in the interpreter).
    out = []
    for arg in args:
        if isinstance(arg, Literal) and isinstance(arg.value, torch.device):
            out.append(Literal(device))
        elif isinstance(arg, Literal) and isinstance(arg.value, tuple):
            out.append(Literal(tuple(device if isinstance(v, torch.device) else v
                                     for v in arg.value)))
        else:
            out.append(arg)
    return out


@dataclass(frozen=True)
class CpuOptions:
    """Backend options (part of the cache key through `as_key`)."""

    arena_pool: ArenaPool | None = None    # None: no arenas
    fusion: str = "measured"
    """GEMM + epilogue on oneDNN (Note [CPU fusion]): "measured" where it measures faster
    on this device, "always" wherever it applies (tests, debugging), "dense" no packed
    weight copy (Note [Dense weights only]), "off"."""
    calibrator: Calibrator | None = None
    """Who measures for "measured"; None: the device's process-wide calibrator."""
    prepacked: PrepackCache = field(default_factory=PrepackCache, compare=False, repr=False)
    """This engine's packed weights (Note [Prepacked weights]); one per CpuOptions, and
    an engine makes one CpuOptions."""

    channels_last: str = "measured"
    """Convolution chains channels-last (Note [Channels-last chains] in channels_last):
    "measured" where the region measures faster so on this device, "always" wherever a
    chain has a convolution (tests, debugging), "off"."""

    arena_ops: str = "measured"
    """Which ops write into the arena: "measured" where their out= form measures faster
    on this device (Note [Arena by measurement]), "all" wherever one applies (tests of
    the arena's mechanics). Not part of the key: under "measured" the choice is made by
    whoever emits the code, on its own device, from the same IR (a replica re-emits
    what it installs, Note [Portable specializations]), so no key could name it."""

    one_thread: str = "measured"
    """Small ops on the calling thread alone (Note [Small ops on one thread] in
    one_thread): "measured" where they measure faster so, "always" wherever one may be
    asked (tests, debugging), "off". Not part of the key, as `arena_ops`."""

    linear_primitives: str = "on"
    """Fused and small-M linears on oneDNN primitives built once (Note [oneDNN linear
    primitives built once] in onednn_linear): "on", or "off" (the in-process A/B). Not
    part of the key, as `arena_ops`: the same results, re-done by whoever emits."""

    column_halves: str = "on"
    """Linear primitives of exact kernels at a few rows also as column halves with a
    helper thread, chosen per kernel by its measured calls (Note [Column halves with a
    helper thread] in column_halves; on by default since Note [Column halves where the
    team's wake is the cost]): "on", "off", or "always" / "never" (the kernel's calls
    always / never run the halves: the in-process A/B's arms, tests). Not part of the
    key, as `arena_ops`."""

    panel_linear: str = "on"
    """fp32 linear primitives of exact kernels at panel_linear.PANEL_ROWS rows, over
    weights that stream, on dynvm's panel GEMM (Note [A panel GEMM of our own] in
    panel_linear): "on", or "off" (the in-process A/B's other arm). Not part of the key,
    as `arena_ops`."""

    bf16_attention: str = "on"
    """Under precision "bf16", SDPA on its bf16 Q/K/V between bf16 GEMMs (Note [bf16
    attention between bf16 GEMMs] in attention_bf16): "on", or "off" (the in-process
    A/B). Not part of the key, as `arena_ops`."""

    native_attention: str = "on"
    """SDPA on dynvm's masked attention kernel where it reads the operands (Note [Masked
    attention of our own] in attention_native): "on", or "off" (the in-process A/B). Not
    part of the key, as `arena_ops`."""

    qkv_attention: str = "on"
    """Native attention with BERT's views around it as one call from the Q/K/V result
    (Note [Attention without its views] in attention_qkv): "on", or "off" (the in-process
    A/B). Not part of the key, as `arena_ops`."""

    shape_constants: str = "on"
    """Under precision "fp32", ops over constants and literals alone run at compile time
    (Note [Shape constants in kernels] in shape_constants; the bf16 lowering folds its
    own): "on", or "off" (the in-process A/B). Not part of the key, as `arena_ops`."""

    precision: str = "fp32"
    """GEMMs with constant weights in "fp32", "bf16" or "int8-dynamic" (Note
    [Lower-precision GEMMs] in precision)."""

    def as_key(self) -> dict:
        key = {"arena": self.arena_pool is not None, "fusion": self.fusion,
               "channels_last": self.channels_last}
        # fp32 keys stay what they were (stored kernels keep their keys).
        return key if self.precision == "fp32" else {**key, "precision": self.precision}


def _define(source: str, bindings: dict, name: str):
    """The kernel function `name` defined by `source` (emitted by emit_source)."""
    namespace = dict(bindings)
    code = compile(source, f"<dynvm {name}>", "exec")
    exec(code, namespace)  # safe: source generated from verified bytecode only
    return namespace[name]


def _load(spec: SpecializedRegion, program, constants, device, name: str, options):
    """`spec`'s kernel without an arena (the layout choice times it)."""
    return _define(*emit_source(spec, program, constants, device, name, "", options), name)


def _channels_last(spec: SpecializedRegion, program, constants, device, name: str,
                   options: CpuOptions) -> tuple[SpecializedRegion, str]:
    """Note [Channels-last chains]: `spec` rewritten channels-last where that is chosen,
    and the note saying what was chosen ("" when the region has no chain)."""
    plan = plan_channels_last(spec)
    if plan is None:
        return spec, ""
    # Note [Residual add in place]: only inside chains, so part of what is measured
    in_place, count = residuals_in_place(plan.spec)
    plan = dataclasses.replace(plan, spec=in_place)
    plan_note = f"; {count} residual add(s) written into the residual" if count else ""
    if options.precision == "bf16":  # Note [bf16 convolution chains]
        plan, bf16_note = bf16_chains(plan, options.prepacked)
        plan_note += bf16_note
    # Note [oneDNN primitives built once]: the chains' fused convolutions, fp32 or bf16
    primitives, primitives_note = conv_primitives(plan.spec)
    plan = dataclasses.replace(plan, spec=primitives)
    plan_note += primitives_note
    if options.channels_last == "always":
        return plan.spec, (f"channels-last: {plan.describe()}{plan_note} (not measured: "
                           "forced on)")
    calibrator = options.calibrator or calibrator_for(device)
    planning = spec.abstract[0]
    numel = sum(planning[reg].numel() for reg in spec.live_in
                if isinstance(planning.get(reg), torch.Tensor))
    key = (program.content_hash[:16], spec.region_index, size_class(numel),
           torch.get_num_threads())
    use, note = choose_channels_last(   # Note [Layout verdicts across batch sizes]
        spec, plan, lambda s: _load(s, program, constants, device, name, options),
        calibrator, key, device,
        related=lambda other: other != key and other[:2] == key[:2] and other[3:] == key[3:])
    return (plan.spec if use else spec), f"channels-last: {plan.describe()}{plan_note} {note}"


def compile_kernel(spec: SpecializedRegion, program, constants, device: torch.device,
                   signature_text: str, guard: str,
                   options: CpuOptions = CpuOptions(), owner: str = "") -> CpuKernel:
    """Generate and compile the CPU kernel of `spec` (fusion rewrites and the
    arena plan as `options` say) for `device`."""
    name = kernel_name(spec, signature_text)
    header = (f"dynvm CPU specialization of program {program.content_hash[:12]}, region "
              f"{spec.region_index} ({spec.instructions} instructions -> {len(spec.ops)} "
              f"operations)\nsignature: {signature_text}\nguard: {guard}")
    notes: tuple[str, ...] = ()
    if options.precision != "fp32":  # Note [Lower-precision GEMMs]: before fp32 fusion
        lowered = lower_precision(spec, constants, device, precision=options.precision,
                                  prepacked=options.prepacked)
        spec, notes = lowered.spec, lowered.notes
        if options.precision == "bf16" and options.bf16_attention == "on":
            # Note [bf16 attention between bf16 GEMMs]
            spec, note = bf16_attention(spec)
            notes += (note.removeprefix("; "),) if note else ()
    elif options.precision == "fp32" and options.shape_constants == "on":
        # Note [Shape constants in kernels]: what the shapes alone give, once
        spec, note = fold_shape_constants(spec, constants, device, variant=PRECISION_VARIANT)
        notes += (note.removeprefix("; "),) if note else ()
    if options.fusion != "off":
        calibrator = None if options.fusion == "always" else (
            options.calibrator or calibrator_for(device))
        # Note [Dense weights only]: the GEMM pass alone, packing nothing
        rewrites = ((functools.partial(fuse_gemm_epilogues, dense=True),)
                    if options.fusion == "dense" else (fuse_gemm_epilogues, fuse_conv_epilogues))
        for rewrite in rewrites:
            fused = rewrite(spec, constants, device, prepacked=options.prepacked,
                            calibrator=calibrator, weak_guard=guard == GuardStrength.WEAK.value)
            spec, notes = fused.spec, notes + fused.notes
        if options.fusion == "dense":   # Note [A decode step's small ops in C]
            fused = fuse_decode_ops(spec, constants, device)
            spec, notes = fused.spec, notes + fused.notes
        elif options.linear_primitives == "on" and device.type == "cpu":
            # Note [oneDNN linear primitives built once]: the linears fusion chose
            spec, note = linear_primitives(spec, constants, options.prepacked,
                                           halves=options.column_halves != "off",
                                           panels=options.panel_linear == "on")
            notes += (note.removeprefix("; "),) if note else ()
    if options.native_attention == "on" and device.type == "cpu":
        spec, note = native_attention(spec)   # Note [Masked attention of our own]
        notes += (note.removeprefix("; "),) if note else ()
        if options.qkv_attention == "on":   # Note [Attention without its views]
            spec, note = qkv_attention_calls(spec)
            notes += (note.removeprefix("; "),) if note else ()
    if options.channels_last != "off" and guard != GuardStrength.WEAK.value \
            and device.type == "cpu":
        spec, note = _channels_last(spec, program, constants, device, name, options)
        notes += (note,) if note else ()
    one_thread = frozenset()
    if options.one_thread != "off":  # Note [Small ops on one thread]
        one_thread, note = plan_one_thread(
            spec, constants, device, None if options.one_thread == "always"
            else options.calibrator or calibrator_for(device))
        notes += (note,) if note else ()
    header += "".join(f"\n{note}" for note in notes)
    arena = None
    # A weak guard admits other shapes of the same element count, whose intermediates
    # may outgrow blocks planned for this one (Note [Arena layout]): no arena for it.
    if options.arena_pool is not None and guard != GuardStrength.WEAK.value:
        layout = plan_arena_layout(spec, constants, device, options)
        if layout is not None:
            arena = ArenaBinding(options.arena_pool, owner or name, layout, device,
                                 shapes_vary=len(spec.abstract) > 1)
            header += (f"\narena: {layout.plan.size:,} bytes for {len(layout.blocks)} "
                       f"tensors (lower bound {layout.plan.lower_bound:,})")
    halves = kernel_halves(spec.ops, {"always": True, "never": False}.get(
        options.column_halves))   # Note [Column halves with a helper thread]
    source, bindings = emit_source(spec, program, constants, device, name, header, options,
                                   arena, one_thread, halves)
    return CpuKernel(name, source, _define(source, bindings, name), arena, notes)
