"""Text form of programs: a disassembler (`disassemble`) and an assembler (`assemble`).

The listing reads like `luac -l`: a header of directives, then one instruction a line,

    .program "encoder"
    .regs 12
    .input "x" float32 [batch:1..64, seq:2..512, 256]
    .const "w" float32 [256, 256]
    .in_spec "..."
    .out_spec "..."
       0  SHAPE_ASSERT %0, "x", torch.float32, device("cpu"), ((1, 64, "batch"), ...)
       1  %1 = DIM %0, 0
       2  %2 = LINEAR %0, c0, None
       3  %3 = VIEW %2, [%1, 32, 8, 32]
       4  RETURN {%3}

Operands: `%n` register, `cN` constant, `@n` jump target, `[..]` int list (ints and
registers), `{..}` tensor list, and Python-style literals (None, True, 1, 1.5, inf, "s",
tuples) plus `torch.<dtype|layout|memory_format>` and `device("...")`. Comments start
with `;`. `assemble(disassemble(p), p.constants)` rebuilds `p` exactly.
"""

from __future__ import annotations

import ast
import math
import re

import torch

from dynvm.vm.errors import AssembleError, DvmFormatError, VerifyError
from dynvm.vm.instr import Instr
from dynvm.vm.operands import Const, Imm, IntList, Label, Operand, Reg, RegList
from dynvm.vm.serialize import dtype_named
from dynvm.vm.torch_literals import UnknownTorchLiteral, any_literal_named, literal_name

# ---------------------------------------------------------------- formatting --------


def format_literal(value: object) -> str:
    """An immediate as the listing writes it (the assembler reads it back)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int | str):
        return repr(value)
    if isinstance(value, torch.device):
        return f'device("{value}")'
    if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
        return f"torch.{literal_name(value)}"
    if isinstance(value, tuple):
        inner = ", ".join(format_literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    raise TypeError(f"no text form for {value!r}")


def format_operand(operand: Operand) -> str:
    """An operand as the listing writes it: `%3`, `c0`, `@12`, a literal, a list."""
    match operand:
        case Reg() | Const() | Label():
            return str(operand)
        case Imm(value):
            return format_literal(value)
        case IntList(items):
            return "[" + ", ".join(str(i) for i in items) + "]"
        case RegList(items):
            return "{" + ", ".join(str(i) for i in items) + "}"
    raise TypeError(f"not an operand: {operand!r}")


def format_instr(instr: Instr) -> str:
    """One instruction as a listing line without its index: `%2 = ADD %0, %1`."""
    args = ", ".join(format_operand(a) for a in instr.args)
    text = f"{instr.op} {args}" if args else instr.op
    if instr.dsts:
        text = ", ".join(str(d) for d in instr.dsts) + " = " + text
    return text


def disassemble(program) -> str:
    """The program's text listing (directives, then one numbered instruction a
    line, regions marked), which `assemble` reads back into the same program."""
    lines = [f".program {program.name!r}", f".regs {program.n_regs}"]
    for spec in program.inputs:
        dims = ", ".join(str(d) for d in spec.dims)
        lines.append(f".input {spec.name!r} {literal_name(spec.dtype)} [{dims}]")
    for spec in program.constant_specs:
        dims = ", ".join(str(d) for d in spec.shape)
        lines.append(f".const {spec.name!r} {literal_name(spec.dtype)} [{dims}]")
    lines.append(f".in_spec {program.in_spec!r}")
    lines.append(f".out_spec {program.out_spec!r}")
    starts = {r.start: r for r in program.regions}
    for pc, instr in enumerate(program.code):
        region = starts.get(pc)
        if region is not None:
            live_in = ", ".join(str(r) for r in region.live_in)
            lines.append(f"; region {region.index}: {len(region)} instructions, "
                         f"live-in [{live_in}]")
        lines.append(f"{pc:6d}  {format_instr(instr)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- parsing -----------

_TOKEN = re.compile(r"""
    \s*(?:
      (?P<reg>%\d+) | (?P<const>c\d+\b) | (?P<label>@\d+)
    | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<device>device\(\s*"[^"]*"\s*\))
    | (?P<torch>torch\.\w+)
    | (?P<special>-?inf\b|nan\b)
    | (?P<float>-?\d+\.\d*(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+)
    | (?P<int>-?\d+)
    | (?P<word>None\b|True\b|False\b)
    | (?P<punct>[\[\]{}(),=])
    )""", re.VERBOSE)


class _Tokens:
    def __init__(self, text: str, line_no: int) -> None:
        self.items: list[tuple[str, str]] = []
        self.line_no = line_no
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                raise self.error(f"cannot read {text[pos:].strip()[:20]!r}")
            self.items.append((match.lastgroup, match.group(match.lastgroup)))
            pos = match.end()
        self.pos = 0

    def error(self, message: str) -> AssembleError:
        return AssembleError(f"line {self.line_no}: {message}")

    def peek(self) -> tuple[str, str] | None:
        return self.items[self.pos] if self.pos < len(self.items) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise self.error("unexpected end of line")
        self.pos += 1
        return token

    def expect(self, value: str) -> None:
        kind, text = self.take()
        if text != value:
            raise self.error(f"expected {value!r}, got {text!r}")

    def at(self, value: str) -> bool:
        token = self.peek()
        return token is not None and token[1] == value


def _torch_literal(name: str, tokens: _Tokens) -> object:
    try:
        return any_literal_named(name.removeprefix("torch."))
    except UnknownTorchLiteral:
        raise tokens.error(f"unknown torch literal {name!r}") from None


def _parse_literal(tokens: _Tokens) -> object:
    kind, text = tokens.take()
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "special":
        return float(text)
    if kind == "str":
        return ast.literal_eval(text)  # safe: literals only
    if kind == "word":
        return {"None": None, "True": True, "False": False}[text]
    if kind == "torch":
        return _torch_literal(text, tokens)
    if kind == "device":
        inner = text[text.index("(") + 1:-1].strip()
        return torch.device(ast.literal_eval(inner))  # safe: literals only
    if text == "(":
        items = []
        while not tokens.at(")"):
            items.append(_parse_literal(tokens))
            if not tokens.at(")"):
                tokens.expect(",")
        tokens.expect(")")
        return tuple(items)
    raise tokens.error(f"expected a literal, got {text!r}")


def _parse_operand(tokens: _Tokens) -> Operand:
    kind, text = tokens.peek() or ("", "")
    if kind == "reg":
        tokens.take()
        return Reg(int(text[1:]))
    if kind == "const":
        tokens.take()
        return Const(int(text[1:]))
    if kind == "label":
        tokens.take()
        return Label(int(text[1:]))
    if text == "[":
        tokens.take()
        items: list[int | Reg] = []
        while not tokens.at("]"):
            item_kind, item = tokens.take()
            if item_kind == "int":
                items.append(int(item))
            elif item_kind == "reg":
                items.append(Reg(int(item[1:])))
            else:
                raise tokens.error(f"int list items are ints or registers, got {item!r}")
            if not tokens.at("]"):
                tokens.expect(",")
        tokens.expect("]")
        return IntList(tuple(items))
    if text == "{":
        tokens.take()
        regs: list[Reg | Const] = []
        while not tokens.at("}"):
            operand = _parse_operand(tokens)
            if not isinstance(operand, Reg | Const):
                raise tokens.error("tensor list items are registers or constants")
            regs.append(operand)
            if not tokens.at("}"):
                tokens.expect(",")
        tokens.expect("}")
        return RegList(tuple(regs))
    try:
        return Imm(_parse_literal(tokens))
    except VerifyError as exc:  # a literal of a type an immediate cannot hold
        raise tokens.error(str(exc)) from None


def parse_instr(text: str, line_no: int = 1) -> Instr:
    """Parse one instruction line (without its leading index)."""
    from dynvm.vm.opcodes import OPCODES

    head, _, rest = text.partition("=") if _has_results(text) else ("", "", text)
    dsts: list[Reg] = []
    if head:
        tokens = _Tokens(head, line_no)
        while tokens.peek() is not None:
            operand = _parse_operand(tokens)
            if not isinstance(operand, Reg):
                raise tokens.error("results must be registers")
            dsts.append(operand)
            if tokens.peek() is not None:
                tokens.expect(",")
    rest = rest.strip()
    name, _, operand_text = rest.partition(" ")
    if name not in OPCODES:
        raise AssembleError(f"line {line_no}: unknown opcode {name!r}")
    tokens = _Tokens(operand_text, line_no)
    args: list[Operand] = []
    while tokens.peek() is not None:
        args.append(_parse_operand(tokens))
        if tokens.peek() is not None:
            tokens.expect(",")
    return Instr(name, tuple(dsts), tuple(args))


def _has_results(text: str) -> bool:
    return re.match(r"\s*%\d+\s*(,\s*%\d+\s*)*=", text) is not None


def _parse_dims(text: str, line_no: int):
    from dynvm.vm.program import DimSpec

    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        raise AssembleError(f"line {line_no}: dims must be written [d0, d1, ...]")
    dims = []
    for item in filter(None, (p.strip() for p in body[1:-1].split(","))):
        # name:low..high, a derived 32*name+1:low..high (Note [Derived dims]), or a size
        match = re.fullmatch(r"(?:(\d+)\*)?(\w+)([+-]\d+)?:(\d+)\.\.(\d+)|(\d+)", item)
        if match is None:
            raise AssembleError(f"line {line_no}: bad dim {item!r}")
        if match.group(6) is not None:
            size = int(match.group(6))
            dims.append(DimSpec("", size, size))
        else:
            dims.append(DimSpec(match.group(2), int(match.group(4)), int(match.group(5)),
                                int(match.group(1) or 1), int(match.group(3) or 0)))
    return tuple(dims)


_DIRECTIVE = re.compile(r"\.(\w+)\s+(.*)")
_NAMED = re.compile(r"""("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')\s+(\w+)\s+(\[.*\])""")


def assemble(text: str, constants: tuple[torch.Tensor, ...] = ()):
    """Parse a listing into a verified Program, with `constants` as its constant data
    (checked against the `.const` directives)."""
    from dynvm.vm.program import InputSpec, Program

    header: dict[str, object] = {"inputs": [], "consts": []}
    code: list[Instr] = []
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(";"):
            continue
        if line.startswith("."):
            _directive(_strip_comment(line).strip(), line_no, header, InputSpec)
            continue
        index, _, body = line.partition(" ")
        if not index.isdigit() or int(index) != len(code):
            raise AssembleError(f"line {line_no}: expected instruction {len(code)}, "
                                f"got {index!r}")
        code.append(parse_instr(_strip_comment(body), line_no))
    for key in ("program", "regs", "in_spec", "out_spec"):
        if key not in header:
            raise AssembleError(f"listing has no .{key} directive")
    declared = header["consts"]
    if len(declared) != len(constants):
        raise AssembleError(f"listing declares {len(declared)} constants, "
                            f"{len(constants)} given")
    for (name, dtype, dims, const_line), tensor in zip(declared, constants):
        shape = tuple(d.low for d in dims)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise AssembleError(f"line {const_line}: constant {name!r}: declared {dtype} "
                                f"{list(shape)}, given {tensor.dtype} {list(tensor.shape)}")
    return Program(code=tuple(code), n_regs=header["regs"],
                   inputs=tuple(header["inputs"]), constants=tuple(constants),
                   constant_names=tuple(name for name, *_ in declared),
                   in_spec=header["in_spec"], out_spec=header["out_spec"],
                   name=header["program"])


def _strip_comment(body: str) -> str:
    # A ';' inside a string literal is not a comment.
    in_str = None
    escaped = False
    for i, ch in enumerate(body):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == in_str:
                in_str = None
        elif ch in "\"'":
            in_str = ch
        elif ch == ";":
            return body[:i]
    return body


def _directive(line: str, line_no: int, header: dict, input_spec) -> None:
    match = _DIRECTIVE.fullmatch(line)
    if match is None:
        raise AssembleError(f"line {line_no}: bad directive {line!r}")
    key, value = match.groups()
    try:
        if key in ("program", "in_spec", "out_spec"):
            header[key] = ast.literal_eval(value.strip())  # safe: literals only
        elif key == "regs":
            header["regs"] = int(value)
        elif key in ("input", "const"):
            named = _NAMED.fullmatch(value.strip())
            if named is None:
                raise AssembleError(f"line {line_no}: expected .{key} \"name\" dtype [dims]")
            name = ast.literal_eval(named.group(1))  # safe: literals only
            dtype = dtype_named(named.group(2))
            dims = _parse_dims(named.group(3), line_no)
            if key == "input":
                header["inputs"].append(input_spec(name, dtype, dims))
            else:
                header["consts"].append((name, dtype, dims, line_no))
        else:
            raise AssembleError(f"line {line_no}: unknown directive .{key}")
    except (ValueError, SyntaxError, DvmFormatError) as exc:
        raise AssembleError(f"line {line_no}: {exc}") from None
