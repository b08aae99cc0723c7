"""The specializer and the CPU backend on real programs: shape instructions folded, no-op
views dropped, hand-written attention fused into SDPA, dying buffers reused in place only
where that is safe (Note [In-place reuse]), readable generated source.
"""

from __future__ import annotations

import ast
import importlib
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.ir import Literal, Var
from dynvm.jit.specialize import specialize
from dynvm.vm.isa import OpClass
from dynvm.vm.opcodes import OPCODES, opcode
from dynvm.vm.operands import IntList

h = importlib.import_module("tests.jit._jit_helpers")

SHAPE_OPCODES = {name for name, spec in OPCODES.items()
                 if spec.opclass is OpClass.SHAPE and name != "RESHAPE_IF"}


def spec_for(program, inputs, region_index: int = 0):
    """specialize() of a region for the values its live-ins take on `inputs` (region 0
    reads the program inputs directly)."""
    region = program.regions[region_index]
    values = {r.index: inputs[r.index] for r in region.live_in}
    return specialize(program, region, values)


def opcodes(spec) -> list[str]:
    return [op.opcode for op in spec.ops]


def run_jit(program, inputs, calls: int = 3, **config):
    """Outputs of `calls` calls (the first interpreted and compiling, the rest
    specialized), and the runtime's stats and artifacts."""
    with dynvm.Runtime(program, jit=h.eager_config(**config)) as rt:
        outs = [rt(*inputs) for _ in range(calls)]
        stats = rt.stats()
        artifacts = list(rt.jit.artifacts.values())
    assert stats["deopts"] == 0
    assert stats["specialized_region_calls"] >= calls - 1, stats
    return outs, stats, artifacts


def batch_dim(max_: int = 64):
    return Dim("b", min=1, max=max_)


# ---------------------------------------------------------------- folding --------------


@pytest.mark.parametrize("name", ["transformer", "gnn"])
def test_shape_instructions_are_folded_on_demo_programs(name):
    program = h.compiled(name)
    inputs = h.make_demo_inputs(name)
    bytecode = [instr.op for instr in program.code]
    assert "SHAPE_ASSERT" in bytecode and "DIM" in bytecode
    spec = spec_for(program, inputs)
    assert not SHAPE_OPCODES & set(opcodes(spec)), opcodes(spec)
    assert spec.assumes_shapes
    assert any("DIM folded" in note for note in spec.notes)
    assert any("SHAPE_ASSERT proven" in note for note in spec.notes)
    assert len(spec.ops) < len(program.regions[0])
    # Every shape operand (int list) of what is left is a literal now.
    for op in spec.ops:
        for arg, operand in zip(op.args, program.code[op.source_pc].args):
            if isinstance(operand, IntList):
                assert isinstance(arg, Literal), op


def test_specialized_demo_programs_match_the_interpreter():
    for name in ("transformer", "gnn"):
        program = h.compiled(name)
        inputs = h.make_demo_inputs(name)
        expected = dynvm.Runtime(program, jit=False)(*inputs)
        outs, _, _ = run_jit(program, inputs)
        for out in outs:
            h.assert_same(out, expected, what=name)


class ViewNoOp(nn.Module):
    def forward(self, x):
        return (x.view(x.shape[0], -1) * 2.0).relu()


class ReshapeNoOp(nn.Module):
    def forward(self, x):
        return torch.tanh(x + 1.0).reshape(x.shape).relu()


@pytest.mark.parametrize("module", [ViewNoOp(), ReshapeNoOp()], ids=["view", "reshape"])
def test_no_op_views_are_dropped(module):
    x = torch.randn(4, 8)
    program = h.compile_module(module, (x,), ({0: batch_dim()},))
    views = {"VIEW", "RESHAPE_IF"}
    assert views & {instr.op for instr in program.code}, "export dropped the view itself"
    spec = spec_for(program, (x,))
    assert not views & set(opcodes(spec)), opcodes(spec)
    assert any("dropped (no-op view" in note for note in spec.notes), spec.notes
    outs, _, _ = run_jit(program, (x,))
    for out in outs:
        h.assert_same(out, h.eager(module, (x,)), rtol=1e-6, atol=1e-6)


def test_a_view_that_changes_the_shape_is_kept():
    module = ViewNoOp()
    x = torch.randn(4, 2, 4)
    program = h.compile_module(module, (x,), ({0: batch_dim()},))
    spec = spec_for(program, (x,))
    assert "VIEW" in opcodes(spec)
    outs, _, _ = run_jit(program, (x,))
    h.assert_same(outs[-1], h.eager(module, (x,)), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- attention ------------


class Attention(nn.Module):
    """Attention as users write it by hand (no F.scaled_dot_product_attention)."""

    def __init__(self, divide: bool = False, also_probs: bool = False) -> None:
        super().__init__()
        self.divide = divide
        self.also_probs = also_probs

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1)
        scores = scores / math.sqrt(q.shape[-1]) if self.divide else scores * 0.125
        probs = torch.softmax(scores, -1)
        out = probs @ v
        return (out, probs) if self.also_probs else out


def attention_case(rank: int, seq: int = 10):
    gen = torch.Generator().manual_seed(seq)
    shape = (2, 4, seq, 16) if rank == 4 else (3, seq, 16)
    qkv = tuple(torch.randn(*shape, generator=gen) for _ in range(3))
    s = Dim("s", min=2, max=64)
    dyn = tuple({rank - 2: s} for _ in range(3))
    return qkv, dyn


@pytest.mark.parametrize("rank", [4, 3])
@pytest.mark.parametrize("divide", [False, True], ids=["mul", "div"])
def test_hand_written_attention_becomes_one_sdpa(rank, divide):
    module = Attention(divide=divide)
    qkv, dyn = attention_case(rank)
    program = h.compile_module(module, qkv, dyn)
    bytecode = [instr.op for instr in program.code]
    assert "SDPA" not in bytecode and "SOFTMAX" in bytecode
    spec = spec_for(program, qkv)
    ops = opcodes(spec)
    assert ops.count("SDPA") == 1, ops
    assert not {"MATMUL", "SOFTMAX", "SOFTMAX_", "PERMUTE", "TRANSPOSE"} & set(ops), ops
    assert any("fused into one SDPA call" in note for note in spec.notes), spec.notes
    expected = h.eager(module, qkv)
    outs, _, artifacts = run_jit(program, qkv)
    assert "SDPA" in artifacts[0].source
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Another sequence length: another specialization, still right.
    qkv2, _ = attention_case(rank, seq=17)
    outs, _, _ = run_jit(program, qkv2)
    torch.testing.assert_close(outs[-1], h.eager(module, qkv2), rtol=1e-5, atol=1e-5)


def test_attention_whose_probabilities_leave_the_region_is_not_fused_away():
    module = Attention(also_probs=True)
    qkv, dyn = attention_case(4)
    program = h.compile_module(module, qkv, dyn)
    spec = spec_for(program, qkv)
    produced = {dst for op in spec.ops for dst in op.dsts} | set(spec.live_in)
    for _, value in spec.outputs:
        assert not isinstance(value, Var) or value.reg in produced, (value, opcodes(spec))
    expected = h.eager(module, qkv)
    outs, _, _ = run_jit(program, qkv)
    for out in outs:
        h.assert_same(out, expected, rtol=1e-5, atol=1e-5)


TRANSPOSED_ATTENTION = """
   0  %3 = TRANSPOSE %1, -2, -1
   1  %4 = MATMUL %0, %3
   2  %5 = MUL %4, 0.25
   3  %6 = SOFTMAX %5, -1, None
   4  %7 = MATMUL %6, %2
   5  RETURN {%7, %6}
"""
QKV_INPUTS = tuple(f'"{n}" float32 [2, 4, s:2..64, 16]' for n in "qkv")


def test_live_out_softmax_of_a_transpose_attention_stays_computed():
    program = h.build(TRANSPOSED_ATTENTION, regs=8, inputs=QKV_INPUTS, outputs=2)
    qkv = tuple(torch.randn(2, 4, 6, 16) for _ in range(3))
    probs = torch.softmax(qkv[0] @ qkv[1].transpose(-2, -1) * 0.25, -1)
    outs, _, _ = run_jit(program, qkv)
    for out, p in outs:
        torch.testing.assert_close(p, probs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, probs @ qkv[2], rtol=1e-5, atol=1e-5)


def test_softmax_over_another_dim_is_not_attention():
    class NotAttention(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1) * 0.125, -2) @ v

    qkv, dyn = attention_case(4)
    program = h.compile_module(NotAttention(), qkv, dyn)
    spec = spec_for(program, qkv)
    assert "SDPA" not in opcodes(spec)
    outs, _, _ = run_jit(program, qkv)
    h.assert_same(outs[-1], h.eager(NotAttention(), qkv), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- in-place reuse -------


def base_of(spec) -> dict[int, int]:
    """Var -> the Var whose storage it shares (views, moves), as eager would alias."""
    base: dict[int, int] = {}
    for op in spec.ops:
        is_view = op.opcode in ("MOVE", "RESHAPE_IF") or (
            op.opcode in OPCODES and opcode(op.opcode).is_view)
        first = op.args[0] if op.args else None
        for dst in op.dsts:
            if is_view:
                base[dst] = base.get(first.reg, first.reg) if isinstance(first, Var) else -1
            else:
                base[dst] = dst
    return base


def assert_inplace_is_safe(spec) -> None:
    """Note [In-place reuse]: never over a live-in, a live-out, a view (of anything, a
    constant included) or a buffer one of whose views is used later or leaves."""
    base = base_of(spec)
    outputs = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    out_bases = {base.get(r, r) for r in outputs}
    for position, op in enumerate(spec.ops):
        if op.variant != "inplace":
            continue
        target = op.args[0]
        assert isinstance(target, Var), op
        reg = target.reg
        assert reg not in spec.live_in, f"in place over live-in %{reg}: {op}"
        assert reg not in outputs, f"in place over live-out %{reg}: {op}"
        assert base.get(reg) == reg, f"in place over a view %{reg}: {op}"
        assert reg not in out_bases, f"in place over %{reg}, a view of which leaves: {op}"
        for later in spec.ops[position + 1:]:
            for arg in later.args:
                items = arg if isinstance(arg, list) else [arg]
                for item in items:
                    if isinstance(item, Var):
                        assert base.get(item.reg, item.reg) != reg, (
                            f"in place over %{reg}, still used through %{item.reg}: {op}")


def inplace_ops(spec) -> list[str]:
    return [op.opcode for op in spec.ops if op.variant == "inplace"]


class ViewUsedLater(nn.Module):
    def forward(self, a):
        y = a.relu()
        z = y.view(-1)
        w = y.exp()
        return w + z.sum()


class ViewLeaves(nn.Module):
    def forward(self, a):
        y = (a * 2.0).relu()
        z = y.view(-1)
        w = y.exp()
        return w, z


class BufferLeaves(nn.Module):
    def forward(self, a):
        y = a * 2.0
        return y, y.relu()


class ConstantView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 8), requires_grad=False)

    def forward(self, x):
        return (x + self.w.view(1, 8) * 2.0).relu()


class Chain(nn.Module):
    def forward(self, x):
        return torch.sigmoid((x * 2.0).relu() + 1.0)


INPLACE_CASES = {
    "view-used-later": (ViewUsedLater, set()),
    "view-leaves": (ViewLeaves, set()),
    "buffer-leaves": (BufferLeaves, set()),
    "constant-view": (ConstantView, set()),
    "chain": (Chain, {"RELU", "ADD", "SIGMOID"}),
}


@pytest.mark.parametrize("case", sorted(INPLACE_CASES))
def test_in_place_reuse_only_where_safe(case):
    cls, expected_inplace = INPLACE_CASES[case]
    module = cls().eval()
    x = torch.randn(4, 8)
    program = h.compile_module(module, (x,), ({0: batch_dim()},))
    constants = [c.clone() for c in program.constants]
    spec = spec_for(program, (x,))
    assert_inplace_is_safe(spec)
    if case == "view-used-later":
        assert "EXP" not in inplace_ops(spec)
        assert "ADD" in inplace_ops(spec)   # w dies into the sum: that one is allowed
    if case == "view-leaves":
        assert "EXP" not in inplace_ops(spec)
    if case == "buffer-leaves":
        assert "RELU" not in inplace_ops(spec)
    if case == "constant-view":
        assert "MUL" not in inplace_ops(spec)
    assert expected_inplace <= set(inplace_ops(spec)), inplace_ops(spec)
    x_before = x.clone()
    expected = h.eager(module, (x,))
    outs, _, _ = run_jit(program, (x,), calls=4)
    for out in outs:
        h.assert_same(out, expected, rtol=1e-6, atol=1e-6, what=case)
    assert torch.equal(x, x_before), "the input was overwritten"
    for before, after in zip(constants, program.constants):
        assert torch.equal(before, after), "a program constant was overwritten"


@pytest.mark.parametrize("name", ["transformer", "gnn", "recommender", "branchy", "looping"])
def test_in_place_reuse_on_demo_programs_is_safe(name):
    program = h.compiled(name)
    inputs = h.make_demo_inputs(name)
    spec = spec_for(program, inputs)
    assert_inplace_is_safe(spec)
    if name in ("transformer", "recommender"):
        assert inplace_ops(spec), "no buffer was reused at all"


# A fuzzer for in-place reuse: random straight-line programs over registers of four
# shape classes (A = [4, 8] contiguous, B = [32] (views of A), C = [8, 4] (transposes of
# A), D = [8] (sums of A, broadcast against A)), mixing elementwise ops, views of
# registers and of a constant, returning a random subset of registers (views included).
# The JIT must agree with the first, interpreted call on every later call, and leave the
# input and the constant untouched.

UNARY = ("RELU", "TANH", "SIGMOID", "NEG", "ABS", "SIN")
BINARY = ("ADD", "SUB", "MUL")


@st.composite
def random_program(draw):
    classes = {0: "A"}                 # %0 is the input
    lines = []
    const_used = False
    for _ in range(draw(st.integers(3, 12))):
        dst = len(classes)
        kind = draw(st.sampled_from(("unary", "binary", "binary", "view", "transpose",
                                     "const", "reduce")))
        regs = sorted(classes)
        if kind == "unary":
            src = draw(st.sampled_from(regs))
            lines.append(f"%{dst} = {draw(st.sampled_from(UNARY))} %{src}")
            classes[dst] = classes[src]
        elif kind == "binary":
            src = draw(st.sampled_from(regs))
            # D ([8]) broadcasts against A ([4, 8]), in either operand position.
            fits = {"A": "AD", "D": "AD"}.get(classes[src], classes[src])
            other = draw(st.sampled_from([r for r in regs if classes[r] in fits]))
            lines.append(f"%{dst} = {draw(st.sampled_from(BINARY))} %{src}, %{other}")
            both = {classes[src], classes[other]}
            classes[dst] = "A" if "A" in both else classes[src]
        elif kind == "reduce":
            src = draw(st.sampled_from([r for r in regs if classes[r] == "A"]))
            lines.append(f"%{dst} = SUM %{src}, [0], False, None")
            classes[dst] = "D"
        elif kind == "view":
            sources = [r for r in regs if classes[r] in "AB"]
            src = draw(st.sampled_from(sources))
            shape = "[32]" if classes[src] == "A" else "[4, 8]"
            lines.append(f"%{dst} = VIEW %{src}, {shape}")
            classes[dst] = "B" if classes[src] == "A" else "A"
        elif kind == "transpose":
            src = draw(st.sampled_from([r for r in regs if classes[r] == "A"]))
            lines.append(f"%{dst} = TRANSPOSE %{src}, 0, 1")
            classes[dst] = "C"
        else:
            const_used = True
            if draw(st.booleans()):
                lines.append(f"%{dst} = VIEW c0, [32]")
                classes[dst] = "B"
            else:
                src = draw(st.sampled_from([r for r in regs if classes[r] == "A"]))
                lines.append(f"%{dst} = MUL %{src}, c0")
                classes[dst] = "A"
    returned = draw(st.lists(st.sampled_from(sorted(classes)[1:]), min_size=1, max_size=3,
                             unique=True))
    body = "\n".join(f"{pc} {line}" for pc, line in enumerate(lines))
    body += f"\n{len(lines)} RETURN {{{', '.join(f'%{r}' for r in returned)}}}"
    return body, len(classes), len(returned), const_used


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(random_program())
def test_in_place_reuse_fuzz(case):
    body, n_regs, n_out, _ = case
    constant = torch.linspace(-1, 1, 32).reshape(4, 8)
    program = h.build(body, (constant.clone(),), regs=n_regs,
                      inputs=('"x" float32 [4, 8]',), consts=('"w" float32 [4, 8]',),
                      outputs=n_out)
    if not program.regions:
        return
    x = torch.randn(4, 8)
    x_before = x.clone()
    with dynvm.Runtime(program, jit=h.eager_config()) as rt:
        reference = rt(x)                      # interpreted (and compiles)
        reference = tuple(t.clone() for t in reference) if n_out > 1 else reference.clone()
        for _ in range(2):
            h.assert_same(rt(x), reference, rtol=0, atol=0, what=body)
        stats = rt.stats()
    assert stats["deopts"] == 0, body
    assert torch.equal(x, x_before), body
    assert torch.equal(program.constants[0], constant), body
    if stats["specialized_region_calls"]:
        region = program.regions[0]
        assert_inplace_is_safe(specialize(program, region, {0: x}))


# ---------------------------------------------------------------- generated source -----


def test_generated_source_is_readable_python():
    program = h.compiled("transformer")
    inputs = h.make_demo_inputs("transformer")
    _, _, artifacts = run_jit(program, inputs)
    (artifact,) = artifacts
    assert re.fullmatch(r"kernel_region\d+_[0-9a-f]{10}", artifact.kernel_name)
    source = artifact.source
    ast.parse(source)
    assert f"def {artifact.kernel_name}(regs):" in source
    assert "# signature: (2, 8, 64) float32 contiguous cpu" in source
    assert "# guard: strong" in source
    spec = spec_for(program, inputs)
    for op in spec.ops:
        assert f"    # {program.code[op.source_pc]}\n" in source, program.code[op.source_pc]
    assert "del " in source                      # values die where they die in eager
    assert all(len(line) < 160 for line in source.splitlines())
    assert "regs[" in source.splitlines()[-1]


# ---------------------------------------------------------------- copies ---------------


class CloneThenView(nn.Module):
    def forward(self, x):
        return x.clone().view(-1), x.relu()


class CloneThenCompute(nn.Module):
    def forward(self, x):
        return (x.clone() * 2.0).relu()


def test_a_copy_that_leaves_through_a_view_stays_a_copy():
    # Dropping the CLONE would return a view of the caller's input: a serving loop that
    # refills its input buffer would then change an output it already handed out.
    module = CloneThenView()
    x = torch.randn(4, 8)
    program = h.compile_module(module, (x,), ({0: batch_dim()},))
    assert "CLONE" in [instr.op for instr in program.code]
    spec = spec_for(program, (x,))
    assert "CLONE" in opcodes(spec), spec.notes
    outs, _, _ = run_jit(program, (x,))
    for flat, relu in outs:
        assert flat.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        torch.testing.assert_close(flat, x.reshape(-1), rtol=0, atol=0)
        torch.testing.assert_close(relu, x.relu(), rtol=0, atol=0)


def test_a_copy_used_only_by_compute_is_dropped():
    module = CloneThenCompute()
    x = torch.randn(4, 8)
    program = h.compile_module(module, (x,), ({0: batch_dim()},))
    assert "CLONE" in [instr.op for instr in program.code]
    spec = spec_for(program, (x,))
    assert "CLONE" not in opcodes(spec)
    assert any("CLONE dropped" in note for note in spec.notes), spec.notes
    assert_inplace_is_safe(spec)
    x_before = x.clone()
    outs, _, _ = run_jit(program, (x,))
    for out in outs:
        torch.testing.assert_close(out, h.eager(module, (x,)), rtol=0, atol=0)
    assert torch.equal(x, x_before)


# ---------------------------------------------------------------- family kernels -------

SHAPE_BRANCH = """
   0  %1 = DIM %0, 0
   1  %2 = SEQ %1, 40
   2  %3 = RELU %0
   3  %4 = TANH %3
   4  JUMP_IF_FALSE %2, @7
   5  %5 = NEG %4
   6  RETURN {%5}
   7  RETURN {%4}
"""


def test_family_kernel_never_folds_a_relation_that_holds_only_at_its_probes():
    # n == 40 is False at every probe of the bucket n in [17, 64], not at n = 40: the
    # family kernel must compute it, or n = 40 takes the wrong branch.
    program = h.build(SHAPE_BRANCH, regs=6, inputs=('"x" float32 [n:1..64, 8]',))
    interp = dynvm.Runtime(program, jit=False)
    with dynvm.Runtime(program, jit=h.eager_config(families=True)) as rt:
        for n in (17, 63, 30, 50, 40, 40, 20, 40):
            x = torch.randn(n, 8)
            torch.testing.assert_close(rt(x), interp(x), rtol=0, atol=0, msg=f"n={n}")
        stats = rt.stats()
    assert stats["family_compiles"] >= 1
    assert stats["specialized_region_calls"] >= 4


class _Layers(nn.Module):
    """Four identical layer norms on the same shapes: one shape-function evaluation."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(4))

    def forward(self, x):
        for norm in self.norms:
            x = torch.relu(norm(x))
        return x


def test_repeated_layers_are_evaluated_once_per_shape(monkeypatch):
    """Note [Shape memo]: the same op on the same operand metadata runs its shape
    function once per specialize call, and the memoized results agree with it."""
    x = torch.randn(3, 8)
    program = dynvm.compile(_Layers().eval(), (x,), ({0: Dim("b", min=1, max=64)},))
    region = program.regions[0]
    name = next(n for n in ("NATIVE_LAYER_NORM", "LAYER_NORM")
                if any(i.op == n for i in program.code))
    calls = []
    original = type(OPCODES[name]).shape_fn

    def counting(self):
        fn = original.fget(self)
        if self.name != name:
            return fn

        def counted(*args):
            calls.append(1)
            return fn(*args)
        return counted

    monkeypatch.setattr(type(OPCODES[name]), "shape_fn", property(counting))
    values = {r.index: x for r in region.live_in}
    memoized = specialize(program, region, values)
    assert sum(i.op == name for i in program.code) == 4
    assert len(calls) == 1
    # the same abstract values as without the memo
    from dynvm.vm.abstract import evaluate_region
    plain = evaluate_region(program, region, values)
    for reg, value in memoized.abstract[0].items():
        if isinstance(value, torch.Tensor):
            assert (value.shape, value.stride(), value.dtype) == (
                plain[reg].shape, plain[reg].stride(), plain[reg].dtype)
