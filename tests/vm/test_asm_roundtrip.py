"""The text form: `assemble(disassemble(p), p.constants)` rebuilds every demo program
exactly, hand-written listings with comments and awkward literals assemble to what they
say, and malformed listings raise AssembleError naming the line."""

from __future__ import annotations

import math

import pytest
import torch

import dynvm
from dynvm.vm.asm import assemble, disassemble, format_instr, parse_instr
from dynvm.vm.instr import Instr
from dynvm.vm.interpreter import Interpreter
from dynvm.vm.operands import Const, Imm, IntList, Label, Reg, RegList
from tests.vm._programs import NAMES, build, compiled, listing

# ---------------------------------------------------------------- demo programs --------


@pytest.mark.parametrize("name", NAMES)
def test_demo_program_round_trips_through_text(name):
    program = compiled(name)
    text = disassemble(program)
    again = assemble(text, program.constants)
    assert again.code == program.code
    assert all(type(a) is type(b) for a, b in zip(again.code, program.code))
    assert again.inputs == program.inputs
    assert again.n_regs == program.n_regs
    assert again.constant_names == program.constant_names
    assert again.in_spec == program.in_spec
    assert again.out_spec == program.out_spec
    assert again.name == program.name
    assert again.content_hash == program.content_hash
    assert disassemble(again) == text


@pytest.mark.parametrize("name", NAMES)
def test_every_instruction_line_round_trips(name):
    # Imm equality includes the literal's type: an int that came back as a float, or a
    # bool that came back as an int, would fail here even where == on values would not.
    program = compiled(name)
    code_lines = [line for line in disassemble(program).splitlines()
                  if line and line.lstrip()[0].isdigit()]
    assert len(code_lines) == len(program.code)
    for pc, (instr, line) in enumerate(zip(program.code, code_lines)):
        index, _, body = line.strip().partition(" ")
        assert int(index) == pc
        assert parse_instr(body.strip()) == instr
        assert format_instr(instr) == body.strip()


# ---------------------------------------------------------------- hand-written ---------


def test_comments_and_blank_lines_are_ignored():
    text = listing("""
        ; a full-line comment
            ; an indented one

        0  %1 = RELU %0      ; trailing comment with "quotes" and ; more
        1  RETURN {%1};no space before it
    """, regs=2)
    text = text.replace(".regs 2", ".regs 2   ; registers")  # comment after a directive
    program = assemble(text)
    assert program.code == (Instr("RELU", (Reg(1),), (Reg(0),)),
                            Instr("RETURN", (), (RegList((Reg(1),)),)))
    assert program.n_regs == 2
    x = torch.randn(5)
    (out,) = Interpreter(program).run([x])
    assert torch.equal(out, torch.relu(x))


def test_strings_containing_semicolons_and_quotes():
    messages = ["a; b", "it's; fine", 'say "hi"; then', "both ' and \"; ok", "; leading",
                "back\\slash;", "ends in a backslash\\"]
    body = "0  %1 = DIM %0, 0\n"
    for i, message in enumerate(messages, start=1):
        body += f"{i}  DIMS_EQUAL %1, %1, {message!r}   ; comment\n"
    body += f"{len(messages) + 1}  RETURN {{%0}}\n"
    program = build(body, regs=2, name="semi;colon")
    assert program.name == "semi;colon"
    assert [instr.args[2] for instr in program.code[1:-1]] == [Imm(m) for m in messages]
    text = disassemble(program)
    assert assemble(text).code == program.code
    assert disassemble(assemble(text)) == text


def test_inf_nan_and_typed_literals():
    program = build("""
        0  %1 = CLAMP %0, -inf, inf
        1  %2 = FULL [2, 3], nan, torch.float32, torch.strided, device("cpu")
        2  %3 = CLAMP %0, -1.5, 1e-05
        3  %4 = MUL %0, 2
        4  %5 = MUL %0, 2.0
        5  %6 = MUL %0, True
        6  RETURN {%1, %2, %3, %4, %5, %6}
    """, regs=7, outputs=6)
    clamp, full, small, by_int, by_float, by_bool = program.code[:6]
    assert clamp.args[1] == Imm(-math.inf) and clamp.args[2] == Imm(math.inf)
    assert math.isnan(full.args[1].value) and full.args[1] == Imm(math.nan)
    assert small.args[2] == Imm(1e-05)
    assert type(by_int.args[1].value) is int
    assert type(by_float.args[1].value) is float
    assert type(by_bool.args[1].value) is bool
    assert by_int.args[1] != by_float.args[1] != by_bool.args[1]
    x = torch.tensor([-3.0, 0.25, 4.0])
    out = Interpreter(program).run([x])
    assert torch.equal(out[0], x)
    assert out[1].shape == (2, 3) and out[1].isnan().all()
    assert torch.equal(out[2], x.clamp(-1.5, 1e-05))
    text = disassemble(program)
    assert "-inf, inf" in text and "nan" in text
    assert assemble(text).code == program.code


def test_tuples_nested_empty_and_single():
    literal = ("(1, -2.5, 'a;b', (), (None,), (True, (inf, -inf, nan)), torch.int64, "
               'device("cpu"), torch.contiguous_format, torch.strided)')
    program = build(f"""
        0  %1 = SHAPE_GUARD %0, (-1, 4)
        1  DIMS_EQUAL 1, 1, {literal}
        2  RETURN {{%0}}
    """, regs=2, inputs=('"x" float32 [n:1..8, 4]',))
    assert program.code[0].args[1] == Imm((-1, 4))
    assert program.code[1].args[2] == Imm((
        1, -2.5, "a;b", (), (None,), (True, (math.inf, -math.inf, math.nan)), torch.int64,
        torch.device("cpu"), torch.contiguous_format, torch.strided))
    text = disassemble(program)
    assert assemble(text).code == program.code
    assert disassemble(assemble(text)) == text


def test_operand_forms():
    program = build("""
        0  %1 = DIM %0, 0
        1  %2 = VIEW %0, [%1, 2, -1]
        2  %3 = CAT {%2, c0}, 1
        3  JUMP @4
        4  RETURN {%3}
    """, constants=(torch.ones(3, 1, 1),), regs=4,
        inputs=('"x" float32 [n:1..8, 2, 2]',), consts=('"w" float32 [3, 1, 1]',))
    assert program.code[1].args[1] == IntList((Reg(1), 2, -1))
    assert program.code[2].args[0] == RegList((Reg(2), Const(0)))
    assert program.code[3].args[0] == Label(4)
    assert program.constant_names == ("w",)


# ---------------------------------------------------------------- errors ---------------

GOOD = listing("""
    0  %1 = RELU %0
    1  RETURN {%1}
""", regs=2)
# Line numbers in GOOD: 1 .program, 2 .regs, 3 .input, 4 .in_spec, 5 .out_spec, 6 and 7 code.


def _error(text: str, constants=()) -> str:
    with pytest.raises(dynvm.AssembleError) as info:
        assemble(text, constants)
    return str(info.value)


def test_good_listing_assembles():
    assert len(assemble(GOOD).code) == 2


def test_unknown_opcode():
    message = _error(GOOD.replace("RELU", "FROBNICATE"))
    assert "line 6" in message and "FROBNICATE" in message


@pytest.mark.parametrize("bad", ["%1 = RELU $0", "%1 = RELU %0 %0", "%1 = VIEW %0, [1.5]",
                                 "%1 = VIEW %0, [1, 2", "%1 = RELU (1, 2", "%x = RELU %0",
                                 "%1 = RELU torch.float99"])
def test_bad_operand_syntax(bad):
    message = _error(GOOD.replace("%1 = RELU %0", bad))
    assert message.startswith("line 6:"), message


@pytest.mark.parametrize("index", ["2", "0", "x", "-1"])
def test_wrong_instruction_number(index):
    message = _error(GOOD.replace("1  RETURN", f"{index}  RETURN"))
    assert message.startswith("line 7:"), message
    assert "expected instruction 1" in message and repr(index) in message


@pytest.mark.parametrize("directive", ["program", "regs", "in_spec", "out_spec"])
def test_missing_directive(directive):
    text = "\n".join(line for line in GOOD.splitlines()
                     if not line.startswith(f".{directive} "))
    message = _error(text)
    assert f".{directive}" in message


@pytest.mark.parametrize("line_no, old, new", [
    (2, ".regs 2", ".regs two"),
    (3, "float32 [n:1..64]", "float99 [n:1..64]"),
    (3, "[n:1..64]", "[n:1-64]"),
    (3, '.input "x" float32', ".input x float32"),
    (1, ".program 't'", ".frob 't'"),
])
def test_bad_directive(line_no, old, new):
    assert old in GOOD
    message = _error(GOOD.replace(old, new))
    assert message.startswith(f"line {line_no}:"), message


def test_constants_not_matching_const_directives():
    text = listing("""
        0  %1 = LINEAR %0, c0, c1
        1  RETURN {%1}
    """, regs=2, inputs=('"x" float32 [n:1..8, 4]',),
        consts=('"w" float32 [3, 4]', '"b" float32 [3]'))
    good = (torch.ones(3, 4), torch.ones(3))
    assert assemble(text, good).constant_names == ("w", "b")
    # .const "w" is line 4, .const "b" line 5.
    message = _error(text, (torch.ones(3, 5), torch.ones(3)))
    assert message.startswith("line 4:") and "'w'" in message and "[3, 5]" in message
    message = _error(text, (torch.ones(3, 4), torch.ones(3, dtype=torch.float64)))
    assert message.startswith("line 5:") and "'b'" in message and "float64" in message
    message = _error(text, good[:1])
    assert "declares 2 constants, 1 given" in message


def test_verifier_errors_are_not_assembler_errors():
    # Syntax is fine, semantics are not: the verifier's error, naming the instruction.
    with pytest.raises(dynvm.VerifyError, match=r"instruction 0 \(RELU\)"):
        assemble(GOOD.replace("RELU %0", "RELU %5"))
