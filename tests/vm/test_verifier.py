"""The verifier rejects each kind of malformed program with a VerifyError that names the
instruction (index and opcode), and accepts well-formed ones, loops included."""

from __future__ import annotations

import re

import pytest
import torch

import dynvm
from dynvm.vm.instr import Instr
from dynvm.vm.operands import Imm, Reg, RegList
from dynvm.vm.program import DimSpec, InputSpec, Program
from tests.vm._programs import LEAF_SPEC, build, tree_spec

X = '"x" float32 [n:1..64]'


def rejects(body: str, index: int, op: str, fragment: str, constants=(), **kwargs) -> str:
    """Assemble `body`; expect VerifyError naming instruction `index` and opcode `op`."""
    with pytest.raises(dynvm.VerifyError) as info:
        build(body, constants, **kwargs)
    message = str(info.value)
    assert re.match(rf"instruction {index} \((%\d+(, %\d+)* = )?{op}\b", message), message
    assert fragment in message, message
    return message


def test_well_formed_straight_line_program_passes():
    program = build("""
        0  %1 = DIM %0, 0
        1  %2 = VIEW %0, [%1, 1]
        2  %3 = RELU %2
        3  RETURN {%3, %0}
    """, regs=4, outputs=2)
    assert len(program.code) == 4


def test_well_formed_loop_with_back_edge_passes():
    # h = x; i = 0; while i < n: h = h * 2; i = i + 1; return h
    program = build("""
        0  %1 = DIM %0, 0
        1  %2 = MOVE 0
        2  %3 = MOVE %0
        3  %4 = SLT %2, %1
        4  JUMP_IF_FALSE %4, @9
        5  %5 = MUL %3, 2.0
        6  %3 = MOVE %5
        7  %2 = SADD %2, 1
        8  JUMP @3
        9  RETURN {%3}
    """, regs=6)
    assert [(r.start, r.stop) for r in program.regions] == [(0, 3), (3, 4), (5, 8)]


def test_register_read_before_any_write():
    rejects("""
        0  %1 = RELU %2
        1  RETURN {%1}
    """, 0, "RELU", "reads %2 before it is written", regs=3)


def test_register_read_in_return_before_write():
    rejects("""
        0  %1 = RELU %0
        1  RETURN {%1, %2}
    """, 1, "RETURN", "reads %2", regs=3, outputs=2)


def test_register_defined_on_one_branch_only_then_read_after_merge():
    rejects("""
        0  %1 = MEAN_ALL %0, None
        1  %2 = GT %1, 0
        2  JUMP_IF_FALSE %2, @5
        3  %3 = RELU %0
        4  JUMP @6
        5  %4 = NEG %0
        6  RETURN {%3}
    """, 6, "RETURN", "reads %3 before it is written on every path", regs=5)


def test_register_defined_on_both_branches_is_fine():
    build("""
        0  %1 = MEAN_ALL %0, None
        1  %2 = GT %1, 0
        2  JUMP_IF_FALSE %2, @5
        3  %3 = RELU %0
        4  JUMP @6
        5  %3 = NEG %0
        6  RETURN {%3}
    """, regs=4)


def test_register_written_only_in_loop_body_read_at_header():
    # %3 is written by the body, but the header reads it on the first entry too.
    rejects("""
        0  %1 = DIM %0, 0
        1  %2 = SLT %3, %1
        2  JUMP_IF_FALSE %2, @5
        3  %3 = SADD %1, 1
        4  JUMP @1
        5  RETURN {%0}
    """, 1, "SLT", "reads %3", regs=4)


def test_register_index_out_of_range():
    rejects("""
        0  %1 = RELU %7
        1  RETURN {%1}
    """, 0, "RELU", "register %7 out of range (program has 2)", regs=2)


def test_result_register_out_of_range():
    rejects("""
        0  %9 = RELU %0
        1  RETURN {%0}
    """, 0, "RELU", "not a register below 2", regs=2)


def test_register_out_of_range_inside_int_list():
    rejects("""
        0  %1 = VIEW %0, [%5, -1]
        1  RETURN {%1}
    """, 0, "VIEW", "register %5 out of range", regs=2)


def test_constant_index_out_of_range():
    rejects("""
        0  %1 = LINEAR %0, c0, c1
        1  RETURN {%1}
    """, 0, "LINEAR", "constant c1 out of range (program has 1)",
        constants=(torch.ones(4, 4),), consts=('"w" float32 [4, 4]',), regs=2)


@pytest.mark.parametrize("target", [3, 99])
def test_bad_jump_target(target):
    rejects(f"""
        0  %1 = RELU %0
        1  JUMP @{target}
        2  RETURN {{%1}}
    """, 1, "JUMP", f"bad jump target @{target} (code has 3 instructions)", regs=2)


def test_bad_branch_target():
    rejects("""
        0  %1 = MEAN_ALL %0, None
        1  JUMP_IF_FALSE %1, @10
        2  RETURN {%1}
    """, 1, "JUMP_IF_FALSE", "bad jump target @10", regs=2)


@pytest.mark.parametrize("body, op, fragment", [
    ("%1 = RELU @0", "RELU", "operand 0 must be TENSOR, got Label"),          # label for tensor
    ("%1 = RELU 3", "RELU", "operand 0 must be TENSOR, got Imm"),             # literal for tensor
    ("%1 = VIEW %0, 5", "VIEW", "operand 1 must be INTS, got Imm"),           # imm for int list
    ("%1 = VIEW %0, %0", "VIEW", "operand 1 must be INTS, got Reg"),
    ("%1 = CAT %0, 0", "CAT", "operand 0 must be TENSORS, got Reg"),
    ("%1 = SOFTMAX %0, [1], False", "SOFTMAX", "operand 1 must be SCALAR, got IntList"),
    ("%1 = GELU %0, %0", "GELU", "operand 1 must be IMM, got Reg"),
    ("%1 = UNSQUEEZE %0, 'a'", "UNSQUEEZE", "operand 1 must be SCALAR, got Imm"),
])
def test_wrong_operand_kind(body, op, fragment):
    rejects(f"""
        0  {body}
        1  RETURN {{%1}}
    """, 0, op, fragment, regs=2)


def test_jump_operand_must_be_a_label():
    rejects("""
        0  JUMP 1
        1  RETURN {%0}
    """, 0, "JUMP", "operand 0 must be LABEL", regs=1)


def test_scalar_register_where_a_tensor_is_expected():
    rejects("""
        0  %1 = DIM %0, 0
        1  %2 = RELU %1
        2  RETURN {%2}
    """, 1, "RELU", "operand %1 holds a scalar, expected a tensor", regs=3)


def test_tensor_register_inside_int_list():
    rejects("""
        0  %1 = VIEW %0, [%0, -1]
        1  RETURN {%1}
    """, 0, "VIEW", "operand %0 holds a tensor, expected a scalar", regs=2)


@pytest.mark.parametrize("body, op, fragment", [
    ("%1 = RELU %0, %0", "RELU", "takes 1 operands, got 2"),
    ("%1 = RELU", "RELU", "takes 1 operands, got 0"),
    ("%1 = LINEAR %0, %0", "LINEAR", "takes 3 operands, got 2"),
])
def test_wrong_operand_count(body, op, fragment):
    rejects(f"""
        0  {body}
        1  RETURN {{%0}}
    """, 0, op, fragment, regs=2)


@pytest.mark.parametrize("body, op, fragment", [
    ("%1, %2 = RELU %0", "RELU", "has 1 results, got 2"),
    ("RELU %0", "RELU", "has 1 results, got 0"),
    ("%1 = SHAPE_ASSERT %0, 'x', torch.float32, None, ((1, 64, 'n'),)", "SHAPE_ASSERT",
     "has 0 results, got 1"),
    ("%1, %2 = MOVE %0", "MOVE", "has 1 result, got 2"),
    ("SPLIT %0, 2, 0", "SPLIT", "needs at least one result register"),
])
def test_wrong_result_count(body, op, fragment):
    rejects(f"""
        0  {body}
        1  RETURN {{%0}}
    """, 0, op, fragment, regs=3)


def test_scalar_written_into_a_register_that_holds_a_tensor_elsewhere():
    rejects("""
        0  %1 = RELU %0
        1  %1 = DIM %0, 0
        2  RETURN {%0}
    """, 1, "DIM", "writes a scalar to %1, which holds a tensor elsewhere", regs=2)


def test_scalar_written_into_an_input_register():
    rejects("""
        0  %0 = DIM %0, 0
        1  RETURN {%0}
    """, 0, "DIM", "writes a scalar to %0, which holds a tensor elsewhere", regs=1)


def test_move_of_a_scalar_into_a_tensor_register():
    rejects("""
        0  %1 = DIM %0, 0
        1  %2 = RELU %0
        2  %2 = MOVE %1
        3  RETURN {%2}
    """, 2, "MOVE", "writes a scalar to %2, which holds a tensor", regs=3)


@pytest.mark.parametrize("last", ["%1 = RELU %0", "JUMP_IF_FALSE %0, @0", "DIMS_EQUAL 1, 1, 'a'"])
def test_code_that_falls_off_the_end(last):
    rejects(f"""
        0  %1 = RELU %0
        1  {last}
    """, 1, last.split(" = ")[-1].split()[0], "control falls off the end", regs=2)


def test_empty_program():
    with pytest.raises(dynvm.VerifyError, match="no instructions"):
        build("", regs=1)


def _program(code, n_regs=2, **overrides) -> Program:
    fields = dict(code=tuple(code), n_regs=n_regs,
                  inputs=(InputSpec("x", torch.float32, (DimSpec("n", 1, 64),)),),
                  constants=(), constant_names=(), in_spec=tree_spec(1), out_spec=LEAF_SPEC)
    fields.update(overrides)
    return Program(**fields)


def test_program_built_directly_is_verified_too():
    ret = Instr("RETURN", (), (RegList((Reg(0),)),))
    assert _program([ret]).code == (ret,)
    with pytest.raises(dynvm.VerifyError, match=r"instruction 0: unknown opcode 'FROB'"):
        _program([Instr("FROB", (Reg(1),), (Reg(0),)), ret])
    with pytest.raises(dynvm.VerifyError, match="1 constants but 0 names"):
        _program([ret], constants=(torch.ones(1),))
    with pytest.raises(dynvm.VerifyError, match="1 inputs but only 0 registers"):
        _program([ret], n_regs=0)
    with pytest.raises(dynvm.VerifyError, match=r"instruction 0 \(RELU\): operand 0 must be"):
        _program([Instr("RELU", (Reg(1),), (Imm(None),)), ret])


def test_unreachable_code_is_not_checked_for_definedness():
    # Instruction 2 reads a never-written register, but no path reaches it.
    build("""
        0  %1 = RELU %0
        1  RETURN {%1}
        2  %2 = RELU %3
        3  RETURN {%2}
    """, regs=4)
