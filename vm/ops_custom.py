"""Custom operators: any op registered with `torch.library`, called by name.

Note [Custom ops]
~~~~~~~~~~~~~~~~~
torch.export keeps a `torch.library` custom op whole (Hugging Face's MoE layers export
`transformers::grouped_mm_fallback`, a user's own op stays one node), with its schema
and its fake kernel. One opcode, CALL_CUSTOM, stands for all of them; its operands are

    name     the qualified overload, "transformers::grouped_mm_fallback.default"
    tensors  the tensor arguments, an operand list (registers and constants)
    layout   per schema argument, ("t", i): tensors[i]; ("tl", (i, j, ...)): a tensor
             list; ("v", literal): a literal (None, a number, a string, a dtype, ...)
    schema   the op's schema as torch prints it, so a file says what it calls
    module   the Python module that registered it ("" when torch.library has no record)

The interpreter and the JIT's CPU backend call the op through `torch.ops` (an opaque
call: no pass fuses across an opcode it does not know), and abstract evaluation calls it
on meta tensors, which runs the fake kernel the op registered (`register_fake` installs
it as the op's Meta kernel). An op whose schema says it mutates an argument runs only
as export functionalized it (`auto_functionalized_v2`, each written argument a whole
base tensor): CALL_CUSTOM_FUNCTIONAL copies what the op writes, calls it on the copies
and returns its results and then the copies, so the instruction is pure like every
other. A mutating op that export left mutating, one written through a view of a base,
and an op returning a view or anything but tensors are refused when compiling. A program is
checked when it is built or loaded (`check_registered`, from the verifier): an op that
is not registered in this process, or registered with another schema, is an
`UnregisteredOpError` naming the op and the module that usually provides it, at
`dynvm.load`, not at the first call. The module is a hint only: a name read from a file
is never imported.
"""

from __future__ import annotations

import torch

from dynvm.vm.errors import UnregisteredOpError, UnsupportedOpError
from dynvm.vm.isa import OpClass, op
from dynvm.vm.operands import Const, Reg

OPCODE = "CALL_CUSTOM"


def _split_name(name: str) -> tuple[str, str, str]:
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    return namespace, op_name, overload or "default"


def resolve(name: str):
    """The OpOverload called `name` ("ns::op.overload"), or None when this process has
    none registered."""
    namespace, op_name, overload = _split_name(name)
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None


def _build_args(tensors, layout) -> list:
    args = []
    for kind, value in layout:
        if kind == "t":
            args.append(tensors[value])
        elif kind == "tl":
            args.append([tensors[i] for i in value])
        else:
            args.append(list(value) if isinstance(value, tuple) else value)
    return args


def call_custom(name: str, tensors, layout: tuple, _schema: str, _module: str):
    """Run the custom op `name` on its operands (Note [Custom ops])."""
    overload = resolve(name)
    if overload is None:
        raise UnregisteredOpError(f"custom op {name} is not registered in this process")
    return overload(*_build_args(tensors, layout))


def call_custom_functional(name: str, tensors, layout: tuple, _schema: str, _module: str,
                           copied: tuple):
    """Run the mutating custom op `name` on copies of the tensors it writes (positions
    `copied` of `tensors`): its results, then those copies as it left them (Note
    [Custom ops]); the operands themselves are never written."""
    overload = resolve(name)
    if overload is None:
        raise UnregisteredOpError(f"custom op {name} is not registered in this process")
    tensors = list(tensors)
    for index in copied:
        tensors[index] = tensors[index].clone()
    result = overload(*_build_args(tensors, layout))
    results = () if result is None else result if isinstance(result, tuple) else (result,)
    out = (*results, *(tensors[i] for i in copied))
    return out[0] if len(out) == 1 else out


def providing_module(overload) -> str:
    """The module that registered `overload`'s Python implementation or fake kernel, as
    torch.library records it; "" when it records none."""
    from torch._library import custom_ops, simple_registry

    qualname = overload._schema.name
    definition = custom_ops.OPDEFS.get(qualname)
    if definition is not None:
        return getattr(definition._init_fn, "__module__", "") or ""
    entry = simple_registry.singleton.find(qualname)
    kernel = getattr(getattr(entry, "fake_impl", None), "kernel", None)
    return getattr(kernel, "__module__", "") or ""


def is_custom(target) -> bool:
    """True for an OpOverload outside torch's own namespaces: a `torch.library` op."""
    return isinstance(target, torch._ops.OpOverload) and \
        target.namespace not in ("aten", "prims", "prim", "quantized", "_quantized")


def lower_layout(overload, values: list) -> tuple[list, tuple]:
    """The tensor operands and the layout (Note [Custom ops]) of a custom op's lowered
    schema argument values (tensors as `Reg` or `Const`, the rest literals)."""
    tensors: list = []
    layout = []
    for argument, value in zip(overload._schema.arguments, values):
        kind = str(argument.type)
        if kind in ("Tensor", "Optional[Tensor]") and isinstance(value, Reg | Const):
            layout.append(("t", len(tensors)))
            tensors.append(value)
        elif kind == "List[Tensor]" and all(isinstance(v, Reg | Const) for v in value):
            layout.append(("tl", tuple(range(len(tensors), len(tensors) + len(value)))))
            tensors.extend(value)
        elif _is_literal(value):
            layout.append(("v", tuple(value) if isinstance(value, list) else value))
        else:
            raise UnsupportedOpError(
                f"custom op {overload}: argument {argument.name} ({kind}) is {value!r}, "
                "neither a tensor nor a literal (a size computed at run time is not "
                "supported)")
    return tensors, tuple(layout)


def _is_literal(value) -> bool:
    if isinstance(value, list | tuple):
        return all(_is_literal(v) for v in value)
    return isinstance(value, type(None) | bool | int | float | str | torch.dtype
                      | torch.device | torch.layout | torch.memory_format)


def mutated_arguments(overload) -> tuple[str, ...]:
    """The names of the arguments `overload`'s schema says it writes."""
    return tuple(a.name for a in overload._schema.arguments
                 if a.alias_info is not None and a.alias_info.is_write)


def check_lowerable(overload, where: str, functionalized: bool = False) -> None:
    """UnsupportedOpError unless dynvm can call `overload` as a pure function (a
    mutating op only as export functionalized it, on copies)."""
    schema = overload._schema
    if schema.is_mutable and not functionalized:
        mutated = [a.name for a in schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write]
        raise UnsupportedOpError(
            f"custom op {overload} mutates its argument(s) {', '.join(mutated) or '?'} "
            f"({where}); dynvm programs are pure: export it functionalized (torch.export "
            "does so for ops declared with torch.library.custom_op and mutates_args), or "
            "return a new tensor instead")
    for ret in schema.returns:
        if ret.alias_info is not None:
            raise UnsupportedOpError(f"custom op {overload} returns a view of an input "
                                     f"({where}); dynvm calls custom ops whose results are "
                                     "new tensors")
        if str(ret.type) != "Tensor":
            raise UnsupportedOpError(f"custom op {overload} returns {ret.type} ({where}); "
                                     "dynvm calls custom ops that return tensors")


def check_registered(name: str, schema: str, module: str) -> None:
    """UnregisteredOpError unless this process has `name` registered with `schema`
    (Note [Custom ops]). `module` only names where the op usually comes from: a module
    named in a file is never imported on the file's word."""
    overload = resolve(name)
    if overload is None:
        hint = (f"; import {module} (which registers it) before loading the program"
                if module else "; import the library that registers it first")
        raise UnregisteredOpError(f"custom op {name} is not registered in this process"
                                  f"{hint}")
    if str(overload._schema) != schema:
        raise UnregisteredOpError(f"custom op {name}: the program was built for schema "
                                  f"{schema!r}, this process registers "
                                  f"{str(overload._schema)!r}")


FUNCTIONAL_OPCODE = "CALL_CUSTOM_FUNCTIONAL"

CUSTOM_OPS = (
    op(OPCODE, OpClass.TENSOR, "K,TL,K,K,K", "T*",
       "call a torch.library custom op by name (Note [Custom ops])", impl=call_custom),
    op(FUNCTIONAL_OPCODE, OpClass.TENSOR, "K,TL,K,K,K,K", "T*",
       "call a mutating custom op on copies of what it writes; its results, then the "
       "copies (export's auto_functionalized; Note [Custom ops])",
       impl=call_custom_functional),
)
