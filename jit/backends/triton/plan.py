"""The launch plan of a region: the steps that replace its operations, as plain data.

A step is a generated kernel's launch (`KernelLaunch`: which values it reads, which
registers it writes, which dims it takes and how each is read off its inputs) or one
torch call (`TorchCall`: the opcode's implementation, as the CPU backend runs it). The
plan is encoded into the artifact (`encode_plan` / `decode_plan`: msgpack-ready lists,
maps, numbers and strings, never pickle), so a process that loads an artifact launches
its kernels without partitioning or generating anything again.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynvm.jit import ir_codec
from dynvm.jit.backends.triton.errors import ArtifactFormatError
from dynvm.jit.ir import Var

ELEMENTWISE, ROW, MATMUL = "elementwise", "row", "matmul"


@dataclass(frozen=True)
class Dim:
    """A size a kernel depends on, and how to read it off the kernel's inputs."""

    name: str
    rule: tuple
    """("numel", i): input i's element count; ("rows", i): its element count over its
    last dim; ("dim", i, axis): one of its dims."""
    static: int | None
    """The value at every probe: a tl.constexpr, re-checked per call. None: it varies
    within the family, and is a runtime argument."""
    in_kernel: bool = True
    """False for a dim only the grid uses (a row kernel's row count)."""


@dataclass(frozen=True)
class KernelLaunch:
    """One generated kernel in a region plan: which values it reads and which
    registers it writes, its dims and block sizes, and the ops it computes."""

    kernel: str
    kind: str                            # ELEMENTWISE, ROW or MATMUL
    inputs: tuple[object, ...]           # Var / ConstRef per input pointer, in order
    full_inputs: tuple[int, ...]         # inputs of the domain's shape (checked per call)
    stores: tuple[int, ...]              # the register of each output pointer, in order
    dims: tuple[Dim, ...]
    blocks: tuple[tuple[str, int], ...]  # constexpr block sizes
    num_warps: int
    num_stages: int
    opcodes: tuple[str, ...]             # what the kernel computes, for explain/tests
    source_pcs: tuple[int, ...]

    def dim(self, name: str) -> Dim:
        for dim in self.dims:
            if dim.name == name:
                return dim
        raise KeyError(f"kernel {self.kernel} has no dim {name!r}")


@dataclass(frozen=True)
class TorchCall:
    """An op a region plan runs through torch (the vendor library), and why."""

    opcode: str
    dsts: tuple[int, ...]
    args: tuple[object, ...]
    source_pc: int
    reason: str                          # why it is not in a generated kernel


@dataclass(frozen=True)
class RegionPlan:
    """How a specialized region runs on the Triton backend: its steps (kernel launches
    and torch calls) in order, where each live-out comes from and which registers die when."""

    region_index: int
    live_in: tuple[int, ...]
    steps: tuple[KernelLaunch | TorchCall, ...]
    outputs: tuple[tuple[int, object], ...]     # live-out register -> its value
    dead_live_ins: tuple[int, ...]
    frees: tuple[tuple[int, ...], ...]          # per step: registers dead after it

    def kernels(self) -> tuple[KernelLaunch, ...]:
        return tuple(s for s in self.steps if isinstance(s, KernelLaunch))

    def vendor_calls(self) -> tuple[TorchCall, ...]:
        return tuple(s for s in self.steps if isinstance(s, TorchCall))


def step_frees(steps, outputs) -> tuple[tuple[int, ...], ...]:
    """Per step, the registers whose last reader it is (outputs are kept)."""
    keep = {v.reg for _, v in outputs if isinstance(v, Var)}
    last: dict[int, int] = {}
    for position, step in enumerate(steps):
        reads = step.inputs if isinstance(step, KernelLaunch) else step.args
        for value in _flat(reads):
            if isinstance(value, Var):
                last[value.reg] = position
    frees: list[list[int]] = [[] for _ in steps]
    for reg, position in last.items():
        if reg not in keep:
            frees[position].append(reg)
    return tuple(tuple(sorted(f)) for f in frees)


def _flat(values):
    for value in values:
        if isinstance(value, list | tuple):
            yield from _flat(value)
        else:
            yield value


# -- encoding (msgpack-ready; the operand codec is dynvm.jit.ir_codec) -----------------

encode_literal = ir_codec.encode_literal
encode_value = ir_codec.encode_value


def decode_value(data):
    """`ir_codec.decode_value`, its error reported as an ArtifactFormatError."""
    try:
        return ir_codec.decode_value(data)
    except ir_codec.IrCodecError as error:
        raise ArtifactFormatError(str(error)) from None


def _pair(data, what: str):
    try:
        return ir_codec.pair(data, what)
    except ir_codec.IrCodecError as error:
        raise ArtifactFormatError(str(error)) from None


def encode_plan(plan: RegionPlan) -> dict:
    """A RegionPlan as msgpack-ready fields (the inverse of its decoder)."""
    steps = []
    for step in plan.steps:
        if isinstance(step, KernelLaunch):
            steps.append({
                "step": "kernel", "kernel": step.kernel, "kind": step.kind,
                "inputs": [encode_value(v) for v in step.inputs],
                "full_inputs": list(step.full_inputs), "stores": list(step.stores),
                "dims": [[d.name, list(d.rule), d.static, d.in_kernel] for d in step.dims],
                "blocks": [[name, size] for name, size in step.blocks],
                "num_warps": step.num_warps, "num_stages": step.num_stages,
                "opcodes": list(step.opcodes), "source_pcs": list(step.source_pcs)})
        else:
            steps.append({"step": "torch", "opcode": step.opcode, "dsts": list(step.dsts),
                          "args": [encode_value(a) for a in step.args],
                          "source_pc": step.source_pc, "reason": step.reason})
    return {"region_index": plan.region_index, "live_in": list(plan.live_in),
            "steps": steps,
            "outputs": [[reg, encode_value(v)] for reg, v in plan.outputs],
            "dead_live_ins": list(plan.dead_live_ins),
            "frees": [list(f) for f in plan.frees]}


def decode_plan(data) -> RegionPlan:
    """The plan in `data` (from `encode_plan`), validated; ArtifactFormatError names the
    first field that is missing or of the wrong type."""
    try:
        steps = tuple(_decode_step(s) for s in need(data, "plan", "steps", list))
        plan = RegionPlan(
            need(data, "plan", "region_index", int),
            tuple(_ints(need(data, "plan", "live_in", list), "plan.live_in")),
            steps,
            tuple((int(reg), decode_value(v)) for reg, v in
                  need(data, "plan", "outputs", list)),
            tuple(_ints(need(data, "plan", "dead_live_ins", list), "plan.dead_live_ins")),
            tuple(tuple(_ints(f, "plan.frees")) for f in need(data, "plan", "frees", list)))
    except (TypeError, ValueError) as exc:
        raise ArtifactFormatError(f"plan: malformed ({exc})") from exc
    if len(plan.frees) != len(plan.steps):
        raise ArtifactFormatError(f"plan.frees: {len(plan.frees)} entries for "
                                  f"{len(plan.steps)} steps")
    return plan


def check_launch(step: KernelLaunch, arg_names, constexprs: dict) -> None:
    """That a launch step and its kernel agree on every parameter (an artifact's plan and
    kernels are checked against each other before anything is launched)."""
    where = f"plan step for {step.kernel}"
    for dim in step.dims:
        rule = dim.rule
        shapes_ok = (len(rule) == 2 and rule[0] in ("numel", "rows")) or (
            len(rule) == 3 and rule[0] == "dim" and isinstance(rule[2], int))
        if not shapes_ok or not isinstance(rule[1], int) or \
                not 0 <= rule[1] < len(step.inputs):
            raise ArtifactFormatError(f"{where}: dim {dim.name} has a bad rule {rule!r}")
    if not all(0 <= i < len(step.inputs) for i in step.full_inputs) or (
            step.kind != MATMUL and not step.full_inputs):
        raise ArtifactFormatError(f"{where}: bad full_inputs {step.full_inputs!r}")
    names = {d.name for d in step.dims}
    required = {MATMUL: {"M", "N", "K"}, ROW: {"ROWS", "N"}, ELEMENTWISE: {"NUMEL"}}
    if not required[step.kind] <= names:
        raise ArtifactFormatError(f"{where}: a {step.kind} kernel needs dims "
                                  f"{sorted(required[step.kind])}, has {sorted(names)}")
    expected = [f"in{i}_ptr" for i in range(len(step.inputs))]
    expected += [f"out{j}_ptr" for j in range(len(step.stores))]
    expected += [d.name for d in step.dims if d.in_kernel and d.static is None]
    expected += [d.name for d in step.dims if d.in_kernel and d.static is not None]
    expected += [name for name, _ in step.blocks]
    if list(arg_names) != expected:
        raise ArtifactFormatError(f"{where}: parameters {list(arg_names)} do not match the "
                                  f"plan's {expected}")
    statics = {d.name: d.static for d in step.dims if d.in_kernel and d.static is not None}
    if dict(constexprs) != statics | dict(step.blocks):
        raise ArtifactFormatError(f"{where}: constexprs {dict(constexprs)} do not match the "
                                  f"plan's {statics | dict(step.blocks)}")


def _decode_step(data) -> KernelLaunch | TorchCall:
    kind = need(data, "plan step", "step", str)
    if kind == "torch":
        return TorchCall(need(data, "torch step", "opcode", str),
                         tuple(_ints(need(data, "torch step", "dsts", list), "dsts")),
                         tuple(decode_value(a) for a in need(data, "torch step", "args", list)),
                         need(data, "torch step", "source_pc", int),
                         need(data, "torch step", "reason", str))
    if kind != "kernel":
        raise ArtifactFormatError(f"plan step: unknown step kind {kind!r}")
    where = "kernel step"
    dims = []
    for entry in need(data, where, "dims", list):
        name, rule, static, in_kernel = entry
        if not isinstance(name, str) or not isinstance(rule, list) or not (
                static is None or isinstance(static, int)):
            raise ArtifactFormatError(f"{where}.dims: malformed entry {entry!r}")
        dims.append(Dim(name, tuple(rule), static, bool(in_kernel)))
    kind_name = need(data, where, "kind", str)
    if kind_name not in (ELEMENTWISE, ROW, MATMUL):
        raise ArtifactFormatError(f"{where}.kind: unknown kernel kind {kind_name!r}")
    return KernelLaunch(
        need(data, where, "kernel", str), kind_name,
        tuple(decode_value(v) for v in need(data, where, "inputs", list)),
        tuple(_ints(need(data, where, "full_inputs", list), "full_inputs")),
        tuple(_ints(need(data, where, "stores", list), "stores")),
        tuple(dims),
        tuple((str(n), int(s)) for n, s in need(data, where, "blocks", list)),
        need(data, where, "num_warps", int), need(data, where, "num_stages", int),
        tuple(str(o) for o in need(data, where, "opcodes", list)),
        tuple(_ints(need(data, where, "source_pcs", list), "source_pcs")))


def need(data, where: str, name: str, kind: type):
    """`data[name]`, checked to be a `kind`; ArtifactFormatError names the field."""
    if not isinstance(data, dict):
        raise ArtifactFormatError(f"{where}: expected a map, got {type(data).__name__}")
    if name not in data:
        raise ArtifactFormatError(f"{where}: missing field {name!r}")
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ArtifactFormatError(f"{where}.{name}: expected {kind.__name__}, got "
                                  f"{type(value).__name__}")
    return value


def _ints(values, where: str) -> list[int]:
    if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ArtifactFormatError(f"{where}: expected a list of ints, got {values!r}")
    return values
