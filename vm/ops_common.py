"""What the `ops_*` tables share: declaring a tensor opcode from its ATen overload.

What the ATen schema already says is read from it, not restated: the operand kinds
(`args_from_schema`), the result kinds (`outs_from_schema`) and whether the result is a
view of operand 0 (`schema_is_view`). Most entries are then one line:
`tensor_op("FLIP", aten.flip.default, "reverse the order along dims", impl=torch.flip)`.

Operands follow the ATen schema's argument order (keyword-only arguments included), cut
after the last argument the opcode carries; the frontend checks that every argument past
the cut has its default value. `impl` is the fastest Python entry to the same kernel (a
method or `torch._C` binding, not the `torch.ops` overload, which parses keyword
arguments in Python and costs about 1 us more per call); where no such entry takes the
arguments positionally, `aten_call` adapts the ATen overload itself.
"""

from __future__ import annotations

from dynvm.vm.isa import OpClass, OpSpec, op

# ATen argument types (their `real_type` spelling) -> operand codes of `ArgKind`. Every
# other type (bool, str, ScalarType, Layout, Device, MemoryFormat, float lists, and the
# optional forms of those) is a literal immediate, "K".
_ARG_CODES = {
    "Tensor": "T", "Optional[Tensor]": "T?", "List[Tensor]": "TL",
    "int": "S", "SymInt": "S", "float": "S", "number": "S",
    "Optional[int]": "S?", "Optional[SymInt]": "S?", "Optional[float]": "S?",
    "Optional[number]": "S?",
    "List[int]": "L", "List[SymInt]": "L", "Optional[List[int]]": "L?",
    "Optional[List[SymInt]]": "L?",
}
_LITERAL_ONLY = ("bool", "str", "ScalarType", "Layout", "Device", "MemoryFormat",
                 "List[float]", "List[bool]")


def args_from_schema(overload, n_args: int | None = None) -> str:
    """The operand codes of `overload`'s first `n_args` schema arguments (all of them by
    default). Raises for an argument type no operand kind holds (a list of optional
    tensors: such an opcode declares its own operand layout)."""
    arguments = overload._schema.arguments
    codes = []
    for argument in arguments[:len(arguments) if n_args is None else n_args]:
        spelled = str(argument.real_type)
        code = _ARG_CODES.get(spelled)
        if code is None:
            inner = spelled.removeprefix("Optional[").removesuffix("]")
            if not any(inner == name for name in _LITERAL_ONLY):
                raise TypeError(f"{overload}: no operand kind for {argument.name}: {spelled}")
            code = "K"
        codes.append(code)
    return ",".join(codes)


def outs_from_schema(overload) -> str:
    """The result codes of `overload`: T per tensor, T* for a tensor list, S otherwise."""
    codes = []
    for ret in overload._schema.returns:
        spelled = str(ret.real_type)
        codes.append({"Tensor": "T", "List[Tensor]": "T*"}.get(spelled, "S"))
    return ",".join(codes)


def schema_is_view(overload) -> bool:
    """Whether `overload`'s first result aliases an input without writing it (a view:
    `Tensor(a)`, `Tensor(a)[]`), from the schema's alias annotations."""
    returns = overload._schema.returns
    if not returns:
        return False
    alias = returns[0].alias_info
    return alias is not None and not alias.is_write


def aten_call(overload, n_args: int):
    """Call `overload` with its first `n_args` schema arguments given positionally."""
    schema_args = overload._schema.arguments[:n_args]
    n_positional = sum(1 for a in schema_args if not a.kwarg_only)
    kw_names = tuple(a.name for a in schema_args[n_positional:])
    if not kw_names:
        return overload

    def call(*args):
        return overload(*args[:n_positional], **dict(zip(kw_names, args[n_positional:])))

    call.__name__ = f"aten_{overload.__name__.replace('.', '_')}"
    return call


def factory(fn):
    """A factory op (`fn(*positional, dtype, layout, device)`) through torch's own binding:
    the same ATen op as the overload, a third of its call cost (the overload parses its
    keyword arguments against the schema in Python on every call)."""

    def call(*args):
        *positional, dtype, layout, device = args
        return fn(*positional, dtype=dtype, layout=layout, device=device)

    call.__name__ = fn.__name__
    return call


def tensor_op(name: str, overloads, doc: str, args: str | None = None, impl=None,
              outs: str | None = None, n_args: int | None = None, **fields) -> OpSpec:
    """A tensor opcode standing for `overloads` (one overload or a tuple, the first one
    giving the schema). `args`/`outs` default to the schema's (cut after `n_args`
    arguments), `impl` to the overload itself, `is_view` to the schema's alias info."""
    overloads = overloads if isinstance(overloads, tuple) else (overloads,)
    first = overloads[0]
    if args is None:
        args = args_from_schema(first, n_args)
    if outs is None:
        outs = outs_from_schema(first)
    n_operands = len(args.split(",")) if args else 0
    fields.setdefault("is_view", schema_is_view(first))
    return op(name, OpClass.TENSOR, args, outs, doc,
              impl=impl if impl is not None else aten_call(first, n_operands),
              aten=overloads, **fields)
