"""Lowering: an exported FX graph to dynvm bytecode.

One pass over the graph in topological order. Every ATen node becomes the instruction
the opcode table maps it to (`BY_SOURCE`), with operands normalised to the ATen schema
order; symbolic sizes (`sym_size`, arithmetic on SymInts) become shape instructions on
scalar registers; `torch.cond` and `torch.while_loop` are inlined into branches and a
loop (see `dynvm.vm.ops_control`); the declared input ranges become SHAPE_ASSERTs at the
program's entry.
"""

from __future__ import annotations

import operator
import re

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from dynvm.vm.errors import UnsupportedOpError
from dynvm.vm.frontend.dims import input_specs
from dynvm.vm.frontend.parallel_linears import fuse_parallel_linears
from dynvm.vm.frontend.rms_norm import fuse_rms_norms
from dynvm.vm.frontend.rotary import FUSED_CALLS, fuse_rotary
from dynvm.vm.instr import Instr
from dynvm.vm.isa import OpSpec
from dynvm.vm.opcodes import BY_SOURCE, OPCODES
from dynvm.vm.operands import ArgKind, Const, Imm, IntList, Label, Operand, Reg, RegList
from dynvm.vm.ops_custom import (
    FUNCTIONAL_OPCODE,
    check_lowerable,
    is_custom,
    lower_layout,
    mutated_arguments,
    providing_module,
)
from dynvm.vm.ops_custom import OPCODE as CUSTOM_OPCODE
from dynvm.vm.ops_kv import KV_CACHE_OPERANDS
from dynvm.vm.program import Program

aten = torch.ops.aten

# Nodes that check what the exporter already proved, or that only carry metadata.
DROPPED_OPS = {
    aten._assert_tensor_metadata.default,
    aten.sym_constrain_range_for_size.default,
    aten.sym_constrain_range.default,
    aten._assert_async.msg,
}
_ALPHA_OPS = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar}
# An overload whose keyword argument, past the opcode's operands, has this value lowers to
# another opcode with the same operands (Note [Grouped heads without copies]).
_KEYWORD_VARIANTS = {(aten.scaled_dot_product_attention.default, "enable_gqa", True): "SDPA_GQA"}
_HOP_COND = torch.ops.higher_order.cond
_HOP_WHILE = torch.ops.higher_order.while_loop
_FUNCTIONALIZED_V1 = torch.ops.higher_order.auto_functionalized
_FUNCTIONALIZED_V2 = torch.ops.higher_order.auto_functionalized_v2


def _source_line(node) -> str:
    """The user's source line a node came from, from the exporter's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)', trace)
    user = [f for f in frames if "/torch/" not in f[0]]
    if not user:
        return "unknown source line"
    path, line, func, text = user[-1]
    return f"{path}:{line} in {func}: {text.strip()}"


def _supported_names() -> str:
    return ", ".join(sorted({str(s) for spec in OPCODES.values() for s in spec.aten
                             if isinstance(s, torch._ops.OpOverload)}))


class _Lowering:
    def __init__(self, exported) -> None:
        self.exported = exported
        self.code: list[Instr] = []
        self.n_regs = 0
        self.constants: list[torch.Tensor] = []
        self.constant_names: list[str] = []

    # -- emission ----------------------------------------------------------------------

    def new_reg(self) -> Reg:
        self.n_regs += 1
        return Reg(self.n_regs - 1)

    def emit(self, name: str, dsts: tuple[Reg, ...], args: tuple[Operand, ...]) -> int:
        self.code.append(Instr(name, dsts, args))
        return len(self.code) - 1

    def patch_label(self, pc: int, target: int) -> None:
        instr = self.code[pc]
        args = tuple(Label(target) if isinstance(a, Label) else a for a in instr.args)
        self.code[pc] = Instr(instr.op, instr.dsts, args)

    def add_constant(self, name: str, tensor: torch.Tensor) -> Const:
        self.constants.append(tensor.detach().contiguous())
        self.constant_names.append(name)
        return Const(len(self.constants) - 1)

    # -- graphs ------------------------------------------------------------------------

    def lower_graph(self, graph_module, env: dict) -> list:
        """Lower every non-placeholder node of `graph_module`; returns the output values."""
        for node in graph_module.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outs = node.args[0]
                outs = list(outs) if isinstance(outs, tuple | list) else [outs]
                return [self.value(env, out) for out in outs]
            if node.op == "get_attr":
                env[node] = getattr(graph_module, node.target)
                continue
            if node.op != "call_function":
                raise UnsupportedOpError(f"graph node {node.name} of kind {node.op} is not "
                                         f"supported ({_source_line(node)})")
            env[node] = self.lower_call(node, env)
        raise UnsupportedOpError("graph has no output node")

    def value(self, env: dict, item):
        """The lowered value of a graph argument: operands for nodes, literals as is."""
        if isinstance(item, torch.fx.Node):
            return env[item]
        if isinstance(item, list | tuple):
            return type(item)(self.value(env, v) for v in item)
        return item

    def lower_call(self, node, env: dict):
        target = node.target
        if target is operator.getitem:
            container, index = node.args
            return env[container][index]
        if target in DROPPED_OPS:
            return None
        if target is _HOP_COND:
            return self.lower_cond(node, env)
        if target is _HOP_WHILE:
            return self.lower_while(node, env)
        if target is _FUNCTIONALIZED_V2:
            return self.lower_functionalized(node, env)
        if target is _FUNCTIONALIZED_V1:
            raise UnsupportedOpError(
                f"custom op {node.args[0]} mutates its inputs and export wrapped it in "
                f"auto_functionalized (v1; from {_source_line(node)}); dynvm runs mutating "
                "ops as auto_functionalized_v2 wraps them (Note [Custom ops])")
        spec = BY_SOURCE.get(target)
        if spec is None and target in FUSED_CALLS:   # Note [Rotary embedding as one op]
            spec = OPCODES[FUSED_CALLS[target]]
        if spec is None and is_custom(target):
            return self.lower_custom(node, env)
        if spec is None:
            raise UnsupportedOpError(
                f"operator {target} is not supported by dynvm (from {_source_line(node)}). "
                f"Supported ATen operators: {_supported_names()}")
        if isinstance(target, torch._ops.OpOverload):
            return self.lower_aten(spec, node, env)
        return self.lower_scalar(spec, node, env)

    # -- ATen and scalar nodes -------------------------------------------------------

    def schema_values(self, node, env: dict) -> list:
        schema = node.target._schema
        values = []
        positional = list(node.args)
        for i, argument in enumerate(schema.arguments):
            if not argument.kwarg_only and i < len(positional):
                values.append(self.value(env, positional[i]))
            elif argument.name in node.kwargs:
                values.append(self.value(env, node.kwargs[argument.name]))
            elif argument.has_default_value():
                values.append(argument.default_value)
            else:
                raise UnsupportedOpError(f"{node.target}: argument {argument.name} missing "
                                         f"({_source_line(node)})")
        return values

    def lower_aten(self, spec: OpSpec, node, env: dict):
        values = self.schema_values(node, env)
        arguments = node.target._schema.arguments
        if node.target in _ALPHA_OPS and values[2] != 1:
            values[1] = self.scale(values[1], values[2])
            values[2] = 1
        n = len(spec.args)
        for argument, extra in zip(arguments[n:], values[n:]):
            variant = _KEYWORD_VARIANTS.get((node.target, argument.name, extra))
            if variant is not None:
                spec = OPCODES[variant]
            elif not _is_neutral(extra, argument):
                raise UnsupportedOpError(
                    f"{node.target} with {argument.name}={extra!r} is not supported (dynvm "
                    f"keeps {spec.name} with its default {argument.name}; from "
                    f"{_source_line(node)})")
        if spec.lower_operands is not None:
            values = list(spec.lower_operands(*values[:len(arguments)]))
        operands = tuple(self.operand(kind, v, node) for kind, v in zip(spec.args, values))
        if spec.outs.__class__ is tuple:
            dsts = tuple(self.new_reg() for _ in spec.outs)
        else:  # variadic (SPLIT ...): as many results as the graph's value holds
            dsts = tuple(self.new_reg() for _ in node.meta["val"])
        self.emit(spec.name, dsts, operands)
        if not dsts:
            return None
        return dsts[0] if len(dsts) == 1 and spec.outs.__class__ is tuple else dsts

    def lower_custom(self, node, env: dict):
        """A torch.library op as one CALL_CUSTOM (Note [Custom ops])."""
        overload = node.target
        check_lowerable(overload, _source_line(node))
        values = [self.add_constant(f"_tensor_constant_{len(self.constants)}", v)
                  if isinstance(v, torch.Tensor) else v
                  for v in self.schema_values(node, env)]
        tensors, layout = lower_layout(overload, values)
        dsts = tuple(self.new_reg() for _ in overload._schema.returns)
        self.emit(CUSTOM_OPCODE, dsts, (Imm(f"{overload._schema.name}.{overload._overloadname}"),
                                        RegList(tuple(tensors)), Imm(layout),
                                        Imm(str(overload._schema)),
                                        Imm(providing_module(overload))))
        return dsts[0] if len(dsts) == 1 else dsts

    def lower_functionalized(self, node, env: dict):
        """auto_functionalized_v2(op, args..., _<arg>_base_index=i, _all_bases=[...]) as
        one CALL_CUSTOM_FUNCTIONAL (Note [Custom ops]): the op runs on copies of the
        bases it writes. Its value is (op results, or one None, then the new bases)."""
        overload = node.args[0]
        where = _source_line(node)
        check_lowerable(overload, where, functionalized=True)
        kwargs = dict(node.kwargs)
        bases = [self.value(env, b) for b in kwargs.pop("_all_bases")]
        mutated = set(mutated_arguments(overload))
        values = []
        for argument in overload._schema.arguments:
            if argument.name in mutated:
                extra = [k for k in kwargs if k.startswith(f"_{argument.name}_")
                         and k != f"_{argument.name}_base_index"]
                index = kwargs.get(f"_{argument.name}_base_index")
                if extra or index is None:
                    raise UnsupportedOpError(
                        f"custom op {overload} writes {argument.name} through a view "
                        f"({', '.join(extra) or 'no base'}; from {where}); dynvm runs "
                        "mutating custom ops that write whole tensors")
                values.append(bases[index])
            elif argument.name in kwargs:
                values.append(self.value(env, kwargs[argument.name]))
            elif argument.has_default_value():
                values.append(argument.default_value)
            else:
                raise UnsupportedOpError(f"{overload}: argument {argument.name} missing "
                                         f"({where})")
        values = [self.add_constant(f"_tensor_constant_{len(self.constants)}", v)
                  if isinstance(v, torch.Tensor) else v for v in values]
        tensors, layout = lower_layout(overload, values)
        # Each base written: its position among the tensor operands (one per base).
        copied = tuple(dict.fromkeys(
            layout[i][1] for i, a in enumerate(overload._schema.arguments)
            if a.name in mutated and layout[i][0] == "t"))
        n_results = len(overload._schema.returns)
        dsts = tuple(self.new_reg() for _ in range(n_results + len(copied)))
        self.emit(FUNCTIONAL_OPCODE, dsts, (
            Imm(f"{overload._schema.name}.{overload._overloadname}"), RegList(tuple(tensors)),
            Imm(layout), Imm(str(overload._schema)), Imm(providing_module(overload)),
            Imm(copied)))
        # The HOP's value: the op's results (one None when it returns nothing), then
        # every base, written or not (a base it does not write comes back as it was).
        written = {bases_index: dsts[n_results + k]
                   for k, bases_index in enumerate(
                       kwargs[f"_{a.name}_base_index"] for a in overload._schema.arguments
                       if a.name in mutated)}
        head = list(dsts[:n_results]) or [None]
        return (*head, *(written.get(i, base) for i, base in enumerate(bases)))

    def scale(self, value, alpha):
        if isinstance(value, Reg | Const):
            out = self.new_reg()
            self.emit("MUL", (out,), (value, Imm(alpha)))
            return out
        return value * alpha

    def lower_scalar(self, spec: OpSpec, node, env: dict):
        args = [self.value(env, a) for a in node.args]
        if node.kwargs:
            raise UnsupportedOpError(f"{node.target} with keyword arguments "
                                     f"({_source_line(node)})")
        if not any(isinstance(a, Reg | Const) for a in args):
            return spec.impl(*args)  # all literal: fold now
        if len(args) != len(spec.args):
            raise UnsupportedOpError(f"{node.target} with {len(args)} arguments "
                                     f"({_source_line(node)})")
        operands = tuple(self.operand(kind, v, node) for kind, v in zip(spec.args, args))
        dsts = tuple(self.new_reg() for _ in spec.outs)
        self.emit(spec.name, dsts, operands)
        return dsts[0] if dsts else None

    def operand(self, kind: ArgKind, value, node) -> Operand:
        if isinstance(value, torch.Tensor):
            value = self.add_constant(f"_tensor_constant_{len(self.constants)}", value)
        match kind:
            case ArgKind.TENSOR | ArgKind.ANY | ArgKind.SCALAR if isinstance(value, Reg | Const):
                return value
            case ArgKind.TENSOR_OPT | ArgKind.SCALAR_OPT if isinstance(value, Reg | Const):
                return value
            case ArgKind.INTS | ArgKind.INTS_OPT if isinstance(value, list | tuple):
                return IntList(tuple(v if isinstance(v, Reg) else int(v) for v in value))
            case ArgKind.INTS | ArgKind.INTS_OPT if isinstance(value, int | Reg):
                return IntList((value,))
            case ArgKind.TENSORS if isinstance(value, list | tuple):
                return RegList(tuple(self.operand(ArgKind.TENSOR, v, node) for v in value))
            case ArgKind.TENSOR | ArgKind.TENSORS | ArgKind.LABEL:
                pass
            case ArgKind.IMM if isinstance(value, list) and not any(
                    isinstance(v, Reg | Const | list) for v in value):
                return Imm(tuple(value))   # a literal list (float scale factors, ...)
            case _ if not isinstance(value, Reg | Const | list):
                return Imm(tuple(value) if isinstance(value, tuple) else value)
        raise UnsupportedOpError(f"{node.target}: cannot pass {value!r} as a {kind.name} "
                                 f"operand ({_source_line(node)})")

    # -- control flow ----------------------------------------------------------------

    def bind_subgraph(self, graph_module, operands) -> dict:
        placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(operands):
            raise UnsupportedOpError(f"subgraph takes {len(placeholders)} values, "
                                     f"{len(operands)} given")
        return dict(zip(placeholders, operands))

    def branch_value(self, value):
        return value if isinstance(value, Reg | Const) else Imm(value)

    def lower_cond(self, node, env: dict):
        pred, true_gm, false_gm, operands = node.args
        predicate = self.operand(ArgKind.ANY, self.value(env, pred), node)
        operands = [self.value(env, o) for o in operands]
        n_results = len(node.meta["val"])
        results = [self.new_reg() for _ in range(n_results)]
        branch = self.emit("JUMP_IF_FALSE", (), (predicate, Label(0)))
        self.lower_subgraph_into(env[true_gm], operands, results)
        skip = self.emit("JUMP", (), (Label(0),))
        self.patch_label(branch, len(self.code))
        self.lower_subgraph_into(env[false_gm], operands, results)
        self.patch_label(skip, len(self.code))
        return tuple(results)

    def lower_subgraph_into(self, graph_module, operands, results: list[Reg]) -> list:
        outs = self.lower_graph(graph_module, self.bind_subgraph(graph_module, operands))
        for dst, value in zip(results, outs, strict=True):
            self.emit("MOVE", (dst,), (self.branch_value(value),))
        return outs

    def lower_while(self, node, env: dict):
        cond_gm, body_gm, carried, additional = node.args
        cond_gm, body_gm = env[cond_gm], env[body_gm]
        initial = [self.value(env, c) for c in carried]
        extra = [self.value(env, a) for a in additional]
        state = [self.new_reg() for _ in initial]
        for dst, value in zip(state, initial):
            self.emit("MOVE", (dst,), (self.branch_value(value),))
        header = len(self.code)
        (predicate,) = self.lower_graph(cond_gm, self.bind_subgraph(cond_gm, state + extra))
        exit_branch = self.emit("JUMP_IF_FALSE", (),
                                (self.operand(ArgKind.ANY, predicate, node), Label(0)))
        updated = self.lower_graph(body_gm, self.bind_subgraph(body_gm, state + extra))
        # The body's results may be carried registers themselves (a value passed
        # through, or two swapped): move through fresh registers so no update reads a
        # register another update already overwrote.
        staged = []
        for value in updated:
            temp = self.new_reg()
            self.emit("MOVE", (temp,), (self.branch_value(value),))
            staged.append(temp)
        for dst, temp in zip(state, staged, strict=True):
            self.emit("MOVE", (dst,), (temp,))
        self.emit("JUMP", (), (Label(header),))
        self.patch_label(exit_branch, len(self.code))
        return tuple(state)


def _is_neutral(value, argument) -> bool:
    """True if an argument past an opcode's operands has no effect (its default, or an
    equivalent spelling of it)."""
    if argument.has_default_value() and value == argument.default_value:
        return True
    name = argument.name
    if name in ("pin_memory", "non_blocking", "sparse", "scale_grad_by_freq", "copy"):
        return value in (None, False)
    if name == "memory_format":
        return value in (None, torch.preserve_format, torch.contiguous_format)
    return name == "alpha" and value == 1


def _root_value(lowering: _Lowering, place: tuple[int, int], dim) -> Reg:
    """A register holding input dim `place`'s size, or with a derived `dim`, its root's
    value (Note [Derived dims]; SHAPE_ASSERT has already checked that it divides)."""
    out = lowering.new_reg()
    lowering.emit("DIM", (out,), (Reg(place[0]), Imm(place[1])))
    if dim is None or not dim.is_derived:
        return out
    shifted, root = lowering.new_reg(), lowering.new_reg()
    lowering.emit("SSUB", (shifted,), (out, Imm(dim.offset)))
    lowering.emit("SFLOORDIV", (root,), (shifted, Imm(dim.scale)))
    return root


def lower_exported(exported, user_names, name: str, example_inputs: tuple) -> Program:
    """Lower an ExportedProgram (already decomposed) to a verified Program. Its graph is
    rewritten in place first (Note [RMS norm as one op], Note [Rotary embedding as one
    op]); linears reading one input are fused after lowering (Note [Parallel linears as
    one])."""
    fuse_rms_norms(exported.graph_module)
    fuse_rotary(exported.graph_module)
    lowering = _Lowering(exported)
    signature = exported.graph_signature
    for spec in signature.output_specs:
        if spec.kind is not OutputKind.USER_OUTPUT:
            raise UnsupportedOpError(f"the model mutates {spec.target or spec.arg.name} "
                                     f"({spec.kind.name}); dynvm programs are pure functions")
    graph = exported.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    env: dict = {}
    sources: dict[int, torch.Tensor] = {}   # constant index -> the parameter it holds
    user_nodes = []
    for spec, node in zip(signature.input_specs, placeholders, strict=True):
        if spec.kind is InputKind.USER_INPUT:
            user_nodes.append(node)
    for node in user_nodes:
        env[node] = lowering.new_reg()
    for spec, node in zip(signature.input_specs, placeholders):
        if spec.kind is InputKind.USER_INPUT:
            continue
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            tensor = exported.state_dict.get(spec.target)
            if tensor is None:
                tensor = exported.constants[spec.target]
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            tensor = exported.constants[spec.target]
        else:
            raise UnsupportedOpError(f"input {node.name} of kind {spec.kind.name} "
                                     "is not supported")
        env[node] = lowering.add_constant(spec.target, tensor)
        sources[env[node].index] = tensor
    names = [node.name for node in user_nodes]
    inputs, repeats = input_specs(exported, user_nodes, names, user_names)
    device = Imm(torch.device("cpu"))  # the runtime replaces it with its own device
    for index, spec in enumerate(inputs):
        lowering.emit("SHAPE_ASSERT", (), (Reg(index), Imm(spec.name), Imm(spec.dtype),
                                           device, Imm(spec.as_assert_operand())))
    for (first, other) in repeats:
        dims = inputs[first[0]].dims[first[1]], inputs[other[0]].dims[other[1]]
        same = (dims[0].scale, dims[0].offset) == (dims[1].scale, dims[1].offset)
        a, b = (_root_value(lowering, place, None if same else dim)
                for place, dim in zip((first, other), dims))
        what = (f"input {names[other[0]]!r} dim {other[1]} must equal input "
                f"{names[first[0]]!r} dim {first[1]} ({dims[0].name})") if same else (
                f"input {names[other[0]]!r} dim {other[1]} ({dims[1].expression}) must "
                f"agree with input {names[first[0]]!r} dim {first[1]} "
                f"({dims[0].expression}) on {dims[0].name}")
        lowering.emit("DIMS_EQUAL", (), (a, b, Imm(what)))
    outs = lowering.lower_graph(exported.graph_module, env)
    returned = []
    for value in outs:
        if isinstance(value, Reg | Const):
            returned.append(value)
        else:
            raise UnsupportedOpError(f"the model returns {value!r}; dynvm programs return "
                                     "tensors")
    lowering.emit("RETURN", (), (RegList(tuple(returned)),))
    in_spec = pytree.treespec_dumps(pytree.tree_flatten(tuple(example_inputs))[1])
    out_spec = pytree.treespec_dumps(exported.call_spec.out_spec)
    # Note [KV cache as state]: the inputs a KV instruction takes as its cache are state.
    state = sorted({instr.args[i].index for instr in lowering.code
                    for i in KV_CACHE_OPERANDS.get(instr.op, ())
                    if isinstance(instr.args[i], Reg) and instr.args[i].index < len(inputs)})
    # Note [Parallel linears as one]
    code, constants, constant_names, n_regs = fuse_parallel_linears(
        lowering.code, lowering.constants, lowering.constant_names, lowering.n_regs,
        [sources.get(i) for i in range(len(lowering.constants))])
    return Program(code=code, n_regs=n_regs, inputs=inputs,
                   constants=constants, constant_names=constant_names,
                   in_spec=in_spec, out_spec=out_spec, name=name, state=tuple(state))
