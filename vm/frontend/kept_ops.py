"""The op set dynvm keeps whole, and the decomposition table that follows from it.

Note [Kept ops]
~~~~~~~~~~~~~~~
torch.export can decompose a graph down to core ATen, but going all the way hurts a
VM: an encoder layer becomes dozens of views, expands and `mm`s, and each of them costs
an interpreter step and a dispatcher round trip (measured on this project's machine: a
fully decomposed 6-layer encoder ran about 40% slower than eager at batch 1). dynvm
therefore decomposes to core ATen *except* for the composite ops below, which it keeps
whole: each is one instruction in the VM, one kernel call in the interpreter, and one
pattern the JIT can fuse or specialize.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

KEPT_OPS = (
    aten.linear.default,
    aten.matmul.default,
    aten.layer_norm.default,
    aten.gelu.default,
    aten.silu.default,
    aten.softmax.int,
    aten.log_softmax.int,
    aten.scaled_dot_product_attention.default,
    aten.embedding.default,
    aten.reshape.default,
    aten.index_add.default,
)


def decomposition_table() -> dict:
    """torch.export's default decompositions minus the composite ops the
    bytecode keeps whole (KEPT_OPS)."""
    table = torch.export.default_decompositions()
    for kept in KEPT_OPS:
        table.pop(kept, None)
    return table
