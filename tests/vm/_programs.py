"""Helpers shared by the VM tests: the demo models, each built and compiled at most once
per test session, and hand-written listings with the boilerplate directives filled in.

Not a conftest on purpose: other suites may add their own; import what you need.
"""

from __future__ import annotations

import contextlib
import functools
import textwrap
from collections.abc import Iterator

import torch
from torch.utils import _pytree as pytree

import dynvm
from dynvm.models import REGISTRY, DemoModel
from dynvm.vm.asm import assemble

NAMES = tuple(sorted(REGISTRY))


@functools.lru_cache(maxsize=16)
def demo(name: str) -> DemoModel:
    """The registered demo model `name`, built once (weights are seeded, so every build
    is identical anyway)."""
    return REGISTRY[name]()


@functools.lru_cache(maxsize=16)
def compiled(name: str) -> dynvm.Program:
    """`dynvm.compile` of demo model `name`, lowered once per session."""
    dm = demo(name)
    return dynvm.compile(dm.module, dm.example_inputs, dm.dynamic_shapes, name=name)


def tree_spec(n_leaves: int) -> str:
    """Treespec JSON of `n_leaves` tensors: a tuple of them (inputs, or several outputs)."""
    return pytree.treespec_dumps(pytree.tree_flatten(tuple(range(n_leaves)))[1])


LEAF_SPEC = pytree.treespec_dumps(pytree.tree_flatten(0)[1])
"""Treespec JSON of a single output tensor."""


def listing(body: str, *, regs: int, inputs: tuple[str, ...] = ('"x" float32 [n:1..64]',),
            consts: tuple[str, ...] = (), outputs: int = 1, name: str = "t") -> str:
    """A complete listing: directives for `inputs` / `consts` (each `"name" dtype [dims]`),
    then `body` (numbered instruction lines, dedented)."""
    lines = [f".program {name!r}", f".regs {regs}"]
    lines += [f".input {spec}" for spec in inputs]
    lines += [f".const {spec}" for spec in consts]
    lines.append(f".in_spec {tree_spec(len(inputs))!r}")
    out_spec = LEAF_SPEC if outputs == 1 else tree_spec(outputs)
    lines.append(f".out_spec {out_spec!r}")
    return "\n".join(lines) + "\n" + textwrap.dedent(body).strip("\n") + "\n"



# trips = n.item(); h = x; i = 0; while i < trips: h = h * 2; i += 1
# returns (h, i as a tensor): a trip count that depends on tensor data, not on shapes.
DATA_LOOP = """
    0  %2 = ITEM %0
    1  %3 = MOVE 0
    2  %4 = MOVE %1
    3  %5 = SLT %3, %2
    4  JUMP_IF_FALSE %5, @9
    5  %6 = MUL %4, 2.0
    6  %4 = MOVE %6
    7  %3 = SADD %3, 1
    8  JUMP @3
    9  %7 = SCALAR_TENSOR %3, torch.int64, None, None
    10  RETURN {%4, %7}
"""
DATA_LOOP_INPUTS = ('"n" int64 []', '"x" float32 [m:1..64]')


def build(body: str, constants: tuple[torch.Tensor, ...] = (), **kwargs) -> dynvm.Program:
    """assemble(listing(body, **kwargs), constants): a verified Program."""
    return assemble(listing(body, **kwargs), constants)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` intra-op threads (restored after). Eager and VM calls in
    a test loop are small; on a two-core box shared with other processes, intra-op
    threading only adds oversubscription stalls."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
