"""Every opcode has every entry of the table, and every shape function agrees with the
real operation (see Note [Shape functions] in dynvm.vm.isa)."""

from __future__ import annotations

import pytest
import torch

from dynvm.vm.asm import format_instr, parse_instr
from dynvm.vm.instr import Instr
from dynvm.vm.isa import Flow, OpClass, Outs
from dynvm.vm.opcodes import ALL_OPS, BY_SOURCE, OPCODES
from dynvm.vm.operands import ArgKind, Const, Imm, IntList, Label, Reg, RegList
from dynvm.vm.serialize import decode_instr, encode_instr, pack, unpack

f32 = torch.float32
cpu = torch.device("cpu")


def rand(*shape):
    return torch.randn(*shape)


def idx(high, *shape):
    return torch.randint(0, high, shape)


# Concrete operands for each tensor and shape opcode, in operand order.
EXAMPLES = {
    "LINEAR": lambda: (rand(3, 5, 8), rand(4, 8), rand(4)),
    "MATMUL": lambda: (rand(2, 3, 4), rand(4, 5)),
    "MM": lambda: (rand(3, 4), rand(4, 5)),
    "BMM": lambda: (rand(2, 3, 4), rand(2, 4, 5)),
    "ADDMM": lambda: (rand(5), rand(3, 4), rand(4, 5)),
    "SDPA": lambda: (rand(2, 4, 6, 8), rand(2, 4, 6, 8), rand(2, 4, 6, 8), None, 0.0, False,
                     None),
    "LAYER_NORM": lambda: (rand(2, 3, 8), [8], rand(8), rand(8), 1e-5, False),
    "SOFTMAX": lambda: (rand(2, 7), -1, None),
    "SOFTMAX_": lambda: (rand(2, 7), -1, False),
    "LOG_SOFTMAX": lambda: (rand(2, 7), 1, None),
    "LOG_SOFTMAX_": lambda: (rand(2, 7), 1, False),
    "GELU": lambda: (rand(3, 4), "tanh"),
    "CLAMP": lambda: (rand(3, 4), -0.5, 0.5),
    "DIV_MODE": lambda: (rand(3, 4), 2.0, "floor"),
    "WHERE": lambda: (rand(3, 4) > 0, rand(3, 4), 0.0),
    "MASKED_FILL": lambda: (rand(3, 4), rand(3, 4) > 0, -1.0),
    "SUM": lambda: (rand(3, 4, 5), [1], True, None),
    "SUM_ALL": lambda: (rand(3, 4), None),
    "MEAN_ALL": lambda: (rand(3, 4), None),
    "MEAN": lambda: (rand(3, 4, 5), [0, 2], False, None),
    "AMAX": lambda: (rand(3, 4), [1], False),
    "AMIN": lambda: (rand(3, 4), [0], True),
    "ARGMAX": lambda: (rand(3, 4), 1, False),
    "CUMSUM": lambda: (rand(3, 4), 1, None),
    "VIEW": lambda: (rand(3, 4), [2, 6]),
    "PERMUTE": lambda: (rand(2, 3, 4), [2, 0, 1]),
    "TRANSPOSE": lambda: (rand(2, 3, 4), 0, 2),
    "T": lambda: (rand(3, 4),),
    "UNSQUEEZE": lambda: (rand(3, 4), 1),
    "SQUEEZE": lambda: (rand(3, 1, 4), 1),
    "SQUEEZE_DIMS": lambda: (rand(1, 3, 1), [0, 2]),
    "EXPAND": lambda: (rand(3, 1), [3, 5]),
    "SLICE": lambda: (rand(6, 4), 0, 1, 5, 2),
    "SELECT": lambda: (rand(6, 4), 1, 2),
    "ALIAS": lambda: (rand(3, 4),),
    "SPLIT": lambda: (rand(7, 4), 3, 0),
    "SPLIT_WITH_SIZES": lambda: (rand(3, 9), [2, 3, 4], 1),
    "UNBIND": lambda: (rand(3, 4), 0),
    "CLONE": lambda: (rand(3, 4).t(), torch.contiguous_format),
    "CAT": lambda: ([rand(2, 4), rand(3, 4)], 0),
    "STACK": lambda: ([rand(2, 4), rand(2, 4)], 1),
    "TO_COPY": lambda: (rand(3, 4), torch.float64, None, None),
    "EMBEDDING": lambda: (rand(10, 4), idx(10, 2, 3), -1),
    "INDEX_SELECT": lambda: (rand(10, 4), 0, idx(10, 6)),
    "INDEX_ADD": lambda: (torch.zeros(5, 4), 0, idx(5, 7), rand(7, 4)),
    "SCATTER_ADD": lambda: (torch.zeros(5, 4), 0, idx(5, 3, 4), rand(3, 4)),
    "SCATTER_REDUCE": lambda: (torch.zeros(5, 4), 0, idx(5, 3, 4), rand(3, 4), "amax", True),
    "GATHER": lambda: (rand(5, 4), 1, idx(4, 5, 2)),
    "FULL": lambda: ([2, 3], 1.5, None, None, cpu),
    "ZEROS": lambda: ([2, 3], torch.int64, None, cpu),
    "ONES": lambda: ([2, 3], f32, None, cpu),
    "FULL_LIKE": lambda: (rand(2, 3), 7.0, None, None, None),
    "ZEROS_LIKE": lambda: (rand(2, 3), None, None, None),
    "ONES_LIKE": lambda: (rand(2, 3), torch.int32, None, None),
    "ARANGE": lambda: (0, 10, 3, torch.int64, None, cpu),
    "SCALAR_TENSOR": lambda: (2.5, f32, None, cpu),
    "SHAPE_OF": lambda: (rand(2, 3),),
    "DIM": lambda: (rand(2, 3), 1),
    "NUMEL": lambda: (rand(2, 3),),
    "SHAPE_ASSERT": lambda: (rand(2, 3), "x", f32, cpu, ((1, 8, "batch"), (3, 3, ""))),
    "ASSERT_SCALAR": lambda: (True, "holds"),
    "DIMS_EQUAL": lambda: (3, 3, "a equals b"),
    "SHAPE_GUARD": lambda: (rand(2, 3), (-1, 3)),
    "RESHAPE_IF": lambda: (rand(2, 6), [3, 4]),
    "ITEM": lambda: (torch.tensor([2.5]),),
}
_UNARY = ("RELU", "SILU", "SIGMOID", "TANH", "EXP", "LOG", "SQRT", "RSQRT", "NEG", "ABS",
          "ERF", "RECIPROCAL", "SIN", "COS", "LOGICAL_NOT", "ROUND", "FLOOR", "CEIL")
_BINARY = ("ADD", "SUB", "MUL", "DIV", "POW", "MAXIMUM", "MINIMUM", "EQ", "NE", "LT", "LE",
           "GT", "GE", "LOGICAL_AND", "LOGICAL_OR")
_SCALAR = ("SADD", "SSUB", "SMUL", "SFLOORDIV", "STRUEDIV", "SMOD", "SPOW", "SMIN", "SMAX",
           "SEQ", "SNE", "SLT", "SLE", "SGT", "SGE", "SAND", "SOR")
EXAMPLES.update({name: (lambda: (rand(3, 4).abs() + 0.1,)) for name in _UNARY})
EXAMPLES.update({name: (lambda: (rand(3, 1).abs() + 0.1, rand(4).abs() + 0.1))
                 for name in _BINARY})
EXAMPLES.update({name: (lambda: (7, 3)) for name in _SCALAR})
EXAMPLES.update({"SNEG": lambda: (4,), "SNOT": lambda: (0,)})

EXECUTABLE = [s for s in ALL_OPS if s.flow is Flow.NEXT and s.opclass is not OpClass.CONTROL]


def test_every_executable_opcode_has_an_example():
    missing = sorted(s.name for s in EXECUTABLE if s.name not in EXAMPLES)
    assert not missing, f"add EXAMPLES for {missing}"


@pytest.mark.parametrize("spec", ALL_OPS, ids=lambda s: s.name)
def test_opcode_has_every_entry(spec):
    assert spec.name.isupper() and spec.doc
    assert isinstance(spec.opclass, OpClass) and isinstance(spec.flow, Flow)
    assert callable(spec.shape_fn)
    if spec.flow is Flow.NEXT:
        assert callable(spec.impl), f"{spec.name} has no interpreter entry"
    for source in spec.aten:
        assert BY_SOURCE[source] is spec


def _sample_operand(kind: ArgKind, position: int):
    return {
        ArgKind.TENSOR: Reg(1) if position % 2 else Const(0),
        ArgKind.TENSOR_OPT: Imm(None),
        ArgKind.ANY: Imm(1.5),
        ArgKind.SCALAR: Reg(2),
        ArgKind.SCALAR_OPT: Imm(None),
        ArgKind.INTS: IntList((4, Reg(2), -1)),
        ArgKind.INTS_OPT: Imm(None),
        ArgKind.TENSORS: RegList((Reg(1), Const(0))),
        ArgKind.IMM: Imm((torch.float32, "a;b", 1, None, float("inf"), (True,))),
        ArgKind.LABEL: Label(0),
    }[kind]


def _sample_instr(spec) -> Instr:
    args = tuple(_sample_operand(kind, i) for i, kind in enumerate(spec.args))
    if spec.outs is Outs.VARIADIC_TENSORS:
        dsts = (Reg(3), Reg(4))
    elif spec.outs is Outs.SAME_AS_ARG0:
        dsts = (Reg(3),)
    else:
        dsts = tuple(Reg(3 + i) for i in range(len(spec.outs)))
    return Instr(spec.name, dsts, args)


@pytest.mark.parametrize("spec", ALL_OPS, ids=lambda s: s.name)
def test_serializer_and_text_round_trip(spec):
    instr = _sample_instr(spec)
    assert decode_instr(unpack(pack(encode_instr(instr)), "CODE"), 0) == instr
    assert parse_instr(format_instr(instr)) == instr


def _abstract(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device="meta")
    if isinstance(value, list):
        return [_abstract(v) for v in value]
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


def _as_tuple(value):
    return tuple(value) if isinstance(value, tuple | list) else (value,)


@pytest.mark.parametrize("spec", EXECUTABLE, ids=lambda s: s.name)
def test_shape_function_matches_real_result(spec):
    args = EXAMPLES[spec.name]()
    real = spec.impl(*args)
    abstract = spec.shape_fn(*[_abstract(a) for a in args])
    if spec.data_dependent:
        assert abstract is None
        return
    if real is None:
        assert abstract in (None, ())
        return
    for want, got in zip(_as_tuple(real), _as_tuple(abstract), strict=True):
        if isinstance(want, torch.Tensor):
            assert got.device.type == "meta"
            assert got.shape == want.shape and got.dtype == want.dtype
        else:
            assert got == want


def test_opcode_names_are_unique_and_sources_map_back():
    assert len(OPCODES) == len(ALL_OPS)
    for source, spec in BY_SOURCE.items():
        assert source in spec.aten
