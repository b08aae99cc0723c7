"""Readable @triton.jit source for each fusion group kind (Note [Fusion groups]).

A kernel's source names no register and no program position: two groups that compute
the same thing over the same static dims (the same layer norm in every layer) get the
same source and name, and are compiled once. Its name is `kernel_<ops>_<hash>`, the
hash taken over the source and its constexpr values. Everything is fp32; indices are
32-bit (the launcher refuses larger tensors, `LaunchError`).

Note [Block sizes]
~~~~~~~~~~~~~~~~~~
Dims that are the same at every probe of the family are `tl.constexpr` parameters; dims
that vary are runtime `i32` arguments, so one compiled kernel serves the whole family.
Block sizes are constexprs chosen from the family's bounds (the largest value a dim
takes at the probes, which include the bucket's upper bounds):

- elementwise: BLOCK = the next power of two of the largest element count, capped at
  `TritonOptions.elementwise_block` (1024); one program per BLOCK elements; 4 warps.
- row (softmax, layer norm): BLOCK_N = the next power of two of the longest row, so a
  row is one block and one program; 4 warps up to 1024, 8 up to 4096, then 16.
- matmul: (BLOCK_M, BLOCK_N, BLOCK_K) = (64, 64, 32) (`TritonOptions.matmul_tiles`),
  each cut to the next power of two of its dim's largest value and never below 16
  (tl.dot's minimum); a K loop of BLOCK_K steps, `num_stages` deep; 4 warps.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from dynvm.jit.backends.triton import _elementwise as ew
from dynvm.jit.backends.triton._facts import (
    Facts,
    Shapes,
    is_number,
    next_power_of_two,
    static_or_none,
)
from dynvm.jit.backends.triton.emitter import CodeEmitter
from dynvm.jit.backends.triton.options import TritonOptions
from dynvm.jit.backends.triton.partition import (
    ELEMENTWISE_GROUP,
    MATMUL_GROUP,
    ROW_GROUP,
    FusionGroup,
    gemm_of,
    matmul_operands,
    operand_role,
    row_of,
)
from dynvm.jit.backends.triton.plan import Dim, KernelLaunch
from dynvm.jit.ir import Literal, SpecOp, Var
from dynvm.vm.isa import RowKind
from dynvm.vm.opcodes import OPCODES

_NAME = "__DYNVM_KERNEL_NAME__"


@dataclass(frozen=True)
class GeneratedKernel:
    """One kernel's source and what compiling and launching it needs."""

    name: str
    kind: str
    source: str
    arg_names: tuple[str, ...]
    """Every parameter in order: input pointers, output pointers, runtime dims, then
    constexprs."""
    signature: dict[str, str]
    """Parameter -> Triton type ("*fp32", "i32", "constexpr"), for ASTSource."""
    constexprs: dict[str, int]
    num_warps: int
    num_stages: int


def generate_kernel(group: FusionGroup, facts: Facts,
                    options: TritonOptions) -> tuple[GeneratedKernel, KernelLaunch]:
    """The kernel of a non-torch group, and its launch step."""
    if group.kind == ELEMENTWISE_GROUP:
        builder = _elementwise(group, facts, options)
    elif group.kind == ROW_GROUP:
        builder = _row(group, facts)
    elif group.kind == MATMUL_GROUP:
        builder = _matmul(group, facts, options)
    else:
        raise ValueError(f"no kernel for a {group.kind!r} group")
    return builder.finish(group)


def _shape_text(shapes: Shapes) -> str:
    axes = []
    for values in zip(*shapes):
        low, high = min(values), max(values)
        axes.append(str(low) if low == high else f"{low}..{high}")
    return "[" + ", ".join(axes) + "]"


def _range_text(values) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}..{high}"


class _Builder:
    """Inputs, dims and body lines of one kernel as its group's operations are emitted."""

    def __init__(self, kind: str, facts: Facts, domain: Shapes, offs: str, mask: str,
                 other: str = "") -> None:
        self.kind = kind
        self.facts = facts
        self.domain = domain
        self.offs, self.mask, self.other = offs, mask, other
        self.body = CodeEmitter()
        self.inputs: list[object] = []
        self.input_notes: list[str] = []
        self.full_inputs: list[int] = []
        self._loaded: dict[object, int] = {}
        self.env: dict[object, str] = {}
        self.dims: list[Dim] = []
        self.dim_notes: dict[str, str] = {}
        self.blocks: list[tuple[str, int]] = []
        self.num_warps = 4
        self.num_stages = 1
        self.header: list[str] = []

    # -- parameters ----------------------------------------------------------------

    def add_input(self, value, note: str) -> int:
        self.inputs.append(value)
        self.input_notes.append(note)
        return len(self.inputs) - 1

    def add_dim(self, name: str, rule: tuple, values, in_kernel: bool = True) -> str:
        self.dims.append(Dim(name, rule, static_or_none(values), in_kernel))
        self.dim_notes[name] = _range_text(values)
        return name

    # -- values --------------------------------------------------------------------

    def operand(self, value) -> str:
        """Source text of an elementwise operand over the domain; loads an input on its
        first use."""
        if is_number(value):
            return ew.number(value.value)
        if value in self.env:
            return self.env[value]
        if value in self._loaded:
            return f"a{self._loaded[value]}"
        role = operand_role(value, self.domain, self.facts)
        shapes = self.facts.tensor(value).shapes
        index = self.add_input(value, f"{role} {_shape_text(shapes)}")
        self._loaded[value] = index
        other = f", other={self.other}" if self.other else ""
        if role == "full":
            self.full_inputs.append(index)
            where = self.offs
        else:
            numels = [math.prod(shape) for shape in shapes]
            modulus = self.add_dim(f"P{index}", ("numel", index), numels)
            where = f"{self.offs} % {modulus}"
        self.body.line(f"a{index} = tl.load(in{index}_ptr + {where}, mask={self.mask}"
                       f"{other})")
        return f"a{index}"

    def result(self, reg: int) -> str:
        name = f"t{sum(1 for v in self.env if isinstance(v, Var))}"
        self.env[Var(reg)] = name
        return name

    def elementwise(self, op: SpecOp) -> None:
        operands = [self.operand(a) for a in ew.value_operands(op)]
        if OPCODES[op.opcode].commutative:
            # IEEE + and * commute exactly: one spelling, so that x + f(x) and f(x) + x
            # share a kernel.
            operands.sort()
        dst = self.result(op.dsts[0])
        lines = ew.emit_lines(op, dst, operands)
        self.body.lines(lines[:-1])
        self.body.line(f"{lines[-1]}  # {op.opcode.lower()}")

    # -- assembling ------------------------------------------------------------------

    def finish(self, group: FusionGroup) -> tuple[GeneratedKernel, KernelLaunch]:
        outputs = [(f"out{j}_ptr", self.env[Var(reg)]) for j, reg in enumerate(group.stores)]
        for pointer, local in outputs:
            self.body.line(f"tl.store({pointer} + {self.offs}, {local}, mask={self.mask})")
        runtime = [d for d in self.dims if d.in_kernel and d.static is None]
        static = [d for d in self.dims if d.in_kernel and d.static is not None]
        params = [(f"in{i}_ptr", "*fp32", note) for i, note in enumerate(self.input_notes)]
        params += [(pointer, "*fp32", f"{local} {_shape_text(self.domain)}")
                   for pointer, local in outputs]
        params += [(d.name, "i32", f"runtime: {self.dim_notes[d.name]} in this family")
                   for d in runtime]
        params += [(d.name, "constexpr", f"static: {d.static} in this family")
                   for d in static]
        params += [(name, "constexpr", "block size") for name, _ in self.blocks]
        constexprs = {d.name: d.static for d in static} | dict(self.blocks)

        em = CodeEmitter()
        em.comment("dynvm Triton kernel (generated from verified bytecode; fp32, "
                   "contiguous tensors)")
        for text in self.header:
            em.comment(text)
        em.comment("constexprs: " + ", ".join(f"{k}={v}" for k, v in constexprs.items()))
        em.line("@triton.jit")
        args = [f"{name}: tl.constexpr  # {note}" if kind == "constexpr"
                else f"{name}  # {note}" for name, kind, note in params]
        em.call(f"def {_NAME}", args, "):")
        with em.indent():
            em.include(self.body)
        template = em.source()

        opcodes = tuple(op.opcode for op in group.ops)
        tags = list(dict.fromkeys(o.lower().rstrip("_") for o in opcodes))[:4]
        material = json.dumps([template, constexprs, self.num_warps, self.num_stages],
                              sort_keys=True)
        digest = hashlib.sha256(material.encode()).hexdigest()[:10]
        name = f"kernel_{'_'.join(tags)}_{digest}"
        kernel = GeneratedKernel(name, self.kind, template.replace(_NAME, name),
                                 tuple(p[0] for p in params), {p[0]: p[1] for p in params},
                                 constexprs, self.num_warps, self.num_stages)
        launch = KernelLaunch(name, self.kind, tuple(self.inputs), tuple(self.full_inputs),
                              group.stores, tuple(self.dims), tuple(self.blocks),
                              self.num_warps, self.num_stages, opcodes,
                              tuple(op.source_pc for op in group.ops))
        return kernel, launch


def _result_shapes(op: SpecOp, facts: Facts) -> Shapes:
    return facts.tensor(Var(op.dsts[0])).shapes


# -- elementwise -------------------------------------------------------------------------


def _elementwise(group: FusionGroup, facts: Facts, options: TritonOptions) -> _Builder:
    domain = _result_shapes(group.ops[-1], facts)
    b = _Builder(ELEMENTWISE_GROUP, facts, domain, "offs", "mask")
    numels = [math.prod(shape) for shape in domain]
    block = min(options.elementwise_block, max(16, next_power_of_two(max(numels))))
    b.blocks = [("BLOCK", block)]
    b.header = [f"elementwise chain over {_shape_text(domain)}: "
                + ", ".join(op.opcode.lower() for op in group.ops),
                "one program per BLOCK elements"]
    for op in group.ops:
        b.elementwise(op)
    body = b.body
    b.body = CodeEmitter()
    b.body.lines(["pid = tl.program_id(0)", "offs = pid * BLOCK + tl.arange(0, BLOCK)",
                  "mask = offs < NUMEL"])
    b.body.include(body)
    b.dims.insert(0, Dim("NUMEL", ("numel", b.full_inputs[0]), static_or_none(numels)))
    b.dim_notes["NUMEL"] = _range_text(numels)
    return b


# -- row reductions ----------------------------------------------------------------------


def _row(group: FusionGroup, facts: Facts) -> _Builder:
    anchor = group.ops[group.anchor]
    domain = facts.tensor(anchor.args[0]).shapes
    b = _Builder(ROW_GROUP, facts, domain, "offs", "mask", other="0.0")
    lengths = [shape[-1] for shape in domain]
    block = max(16, next_power_of_two(max(lengths)))
    b.blocks = [("BLOCK_N", block)]
    b.num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    b.header = [f"row kernel over {_shape_text(domain)}: "
                + ", ".join(op.opcode.lower() for op in group.ops),
                "one program per row; the row (N elements) is one block"]
    for position, op in enumerate(group.ops):
        if position != group.anchor:
            b.elementwise(op)
        elif row_of(op).kind is RowKind.LAYER_NORM:
            _layer_norm(b, op)
        else:
            _softmax(b, op)
    body = b.body
    b.body = CodeEmitter()
    b.body.lines(["row = tl.program_id(0)", "cols = tl.arange(0, BLOCK_N)",
                  "mask = cols < N", "offs = row * N + cols"])
    b.body.include(body)
    reference = b.full_inputs[0]
    rows = [math.prod(s[:-1]) for s in domain]
    b.dims[:0] = [Dim("ROWS", ("rows", reference), static_or_none(rows), in_kernel=False),
                  Dim("N", ("dim", reference, -1), static_or_none(lengths))]
    b.dim_notes["ROWS"], b.dim_notes["N"] = _range_text(rows), _range_text(lengths)
    return b


def _row_vector(b: _Builder, value, what: str) -> str:
    index = b.add_input(value, f"{what} [N]")
    b.body.line(f"a{index} = tl.load(in{index}_ptr + cols, mask=mask, other=0.0)")
    return f"a{index}"


def _softmax(b: _Builder, op: SpecOp) -> None:
    x = b.operand(op.args[0])
    n = b.result(op.dsts[0])
    b.body.comment(f"{n} = softmax({x}) over the row")
    b.body.lines([f'{n}_x = tl.where(mask, {x}, -float("inf"))',
                  f"{n}_max = tl.max({n}_x, axis=0)",
                  f"{n}_num = tl.exp({n}_x - {n}_max)",
                  f"{n} = {n}_num / tl.sum({n}_num, axis=0)"])


def _layer_norm(b: _Builder, op: SpecOp) -> None:
    x = b.operand(op.args[0])
    weight, bias, eps = op.args[2], op.args[3], op.args[4]
    w = None if weight == Literal(None) else _row_vector(b, weight, "layer norm weight")
    c = None if bias == Literal(None) else _row_vector(b, bias, "layer norm bias")
    n = b.result(op.dsts[0])
    b.body.comment(f"{n} = layer_norm({x}) over the row, eps={eps.value!r}")
    b.body.lines([f"{n}_x = tl.where(mask, {x}, 0.0)",
                  f"{n}_mean = tl.sum({n}_x, axis=0) / N",
                  f"{n}_diff = tl.where(mask, {n}_x - {n}_mean, 0.0)",
                  f"{n}_var = tl.sum({n}_diff * {n}_diff, axis=0) / N",
                  f"{n} = {n}_diff * tl.rsqrt({n}_var + {ew.number(eps.value)})"])
    if w is not None:
        b.body.line(f"{n} = {n} * {w}")
    if c is not None:
        b.body.line(f"{n} = {n} + {c}")


# -- matmul + epilogue -------------------------------------------------------------------


def _matmul(group: FusionGroup, facts: Facts, options: TritonOptions) -> _Builder:
    anchor = group.ops[group.anchor]
    domain = _result_shapes(anchor, facts)
    b = _Builder(MATMUL_GROUP, facts, domain, "offs", "mask")
    a_value, b_value, bias_value = matmul_operands(anchor)
    a_shapes, b_shapes = facts.tensor(a_value).shapes, facts.tensor(b_value).shapes
    weight = gemm_of(anchor).b_is_nk               # b is [N, K]; otherwise [K, N]
    b.add_input(a_value, f"a {_shape_text(a_shapes)} as [M, K]")
    b.add_input(b_value, f"b {_shape_text(b_shapes)} as " + ("[N, K]" if weight else "[K, N]"))
    ms = [math.prod(s[:-1]) for s in a_shapes]
    ks = [s[-1] for s in a_shapes]
    ns = [s[0] if weight else s[1] for s in b_shapes]
    b.add_dim("M", ("rows", 0), ms)
    b.add_dim("N", ("dim", 1, 0 if weight else 1), ns)
    b.add_dim("K", ("dim", 0, -1), ks)
    tiles = options.matmul_tiles
    b.blocks = [(name, min(tile, max(16, next_power_of_two(max(values)))))
                for name, tile, values in zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), tiles,
                                              (ms, ns, ks))]
    b.num_warps, b.num_stages = options.matmul_num_warps, options.num_stages
    b.header = [f"matmul {_shape_text(a_shapes)} @ {_shape_text(b_shapes)}"
                + ("^T" if weight else "") + " with epilogue: "
                + (", ".join(op.opcode.lower() for op in group.ops[1:]) or "none"),
                "one program per BLOCK_M x BLOCK_N tile of the result"]
    b_offsets = "rn[None, :] * K + ks[:, None]" if weight else "ks[:, None] * N + rn[None, :]"
    body = b.body
    body.lines(["pid = tl.program_id(0)", "tiles_n = tl.cdiv(N, BLOCK_N)",
                "rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)",
                "rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)",
                "rk = tl.arange(0, BLOCK_K)",
                "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)"])
    with body.block("for k in range(0, K, BLOCK_K):"):
        body.lines(["ks = k + rk",
                    "a = tl.load(in0_ptr + rm[:, None] * K + ks[None, :],",
                    "            mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)",
                    f"b = tl.load(in1_ptr + {b_offsets},",
                    "            mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)",
                    f'acc += tl.dot(a, b, input_precision="{options.matmul_precision}")'])
    body.lines(["mask = (rm[:, None] < M) & (rn[None, :] < N)",
                "offs = rm[:, None] * N + rn[None, :]"])
    bias = facts.tensor(bias_value) if bias_value != Literal(None) else None
    if bias is None:
        expr, what = "acc", anchor.opcode.lower()
    elif all(shape == (n,) for shape, n in zip(bias.shapes, ns)):
        index = b.add_input(bias_value, "bias [N]")
        body.line(f"a{index} = tl.load(in{index}_ptr + rn, mask=rn < N, other=0.0)")
        expr, what = f"acc + a{index}[None, :]", f"{anchor.opcode.lower()} + bias"
    else:
        expr, what = f"acc + {b.operand(bias_value)}", f"{anchor.opcode.lower()} + bias"
    body.line(f"{b.result(anchor.dsts[0])} = {expr}  # {what}")
    for op in group.ops[1:]:
        b.elementwise(op)
    return b
