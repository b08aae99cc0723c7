"""The assembled opcode table: every `OpSpec`, by name and by the ATen overload it
stands for. Opcode numbers are the table's order; they are not stored in files (names
are), so adding an opcode never invalidates a saved program."""

from __future__ import annotations

from types import MappingProxyType

from dynvm.vm.isa import OpSpec
from dynvm.vm.ops_attention import ATTENTION_OPS
from dynvm.vm.ops_control import CONTROL_OPS
from dynvm.vm.ops_custom import CUSTOM_OPS
from dynvm.vm.ops_elementwise import ELEMENTWISE_OPS
from dynvm.vm.ops_fused import FUSED_OPS
from dynvm.vm.ops_index import INDEX_OPS
from dynvm.vm.ops_kv import KV_OPS
from dynvm.vm.ops_nn import NN_OPS
from dynvm.vm.ops_shape import SHAPE_OPS
from dynvm.vm.ops_tensor import TENSOR_OPS


def _by_name(specs: tuple[OpSpec, ...]) -> MappingProxyType:
    table: dict[str, OpSpec] = {}
    for spec in specs:
        if spec.name in table:
            raise RuntimeError(f"opcode {spec.name} is declared twice")
        table[spec.name] = spec
    return MappingProxyType(table)


def _by_source(specs: tuple[OpSpec, ...]) -> MappingProxyType:
    table: dict[object, OpSpec] = {}
    for spec in specs:
        for source in spec.aten:
            if source in table:
                raise RuntimeError(f"{source} lowers to both {table[source].name} and "
                                   f"{spec.name}")
            table[source] = spec
    return MappingProxyType(table)


ALL_OPS: tuple[OpSpec, ...] = (TENSOR_OPS + ATTENTION_OPS + KV_OPS + ELEMENTWISE_OPS + NN_OPS
                               + INDEX_OPS + SHAPE_OPS + CONTROL_OPS + CUSTOM_OPS + FUSED_OPS)
OPCODES = _by_name(ALL_OPS)
"""name -> OpSpec for every opcode."""
BY_SOURCE = _by_source(ALL_OPS)
"""ATen overload (or Python operator on sizes) -> the OpSpec it lowers to."""


def opcode(name: str) -> OpSpec:
    """The OpSpec called `name`; KeyError names the unknown opcode."""
    try:
        return OPCODES[name]
    except KeyError:
        raise KeyError(f"unknown opcode {name!r}") from None
