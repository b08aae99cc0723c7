"""A message-passing graph network with a dynamic node count and edge count.

Two independent dynamic dims (nodes, edges) and gather/scatter ops (index_select,
index_add) make this the workload whose intermediate shapes depend on both dims.
"""

from __future__ import annotations

import random
from itertools import pairwise

import torch
from torch import nn
from torch.export import Dim

from ._base import DemoModel, finish, generator, seeded

IN_FEATURES = 64
HIDDEN = 64
OUT_FEATURES = 16
LAYERS = 3


class MessagePassing(nn.Module):
    """One message-passing layer: messages from source nodes (index_select),
    summed at destination nodes (index_add), then a node update."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.message = nn.Linear(d_in, d_out)
        self.update = nn.Linear(d_in + d_out, d_out)

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        messages = self.message(x.index_select(0, src))
        # Sized by x.shape[0], which export keeps symbolic, so the zeros follow the node
        # dim; out-of-place index_add so no input or parameter is mutated.
        zeros = torch.zeros(x.shape[0], messages.shape[1], dtype=x.dtype, device=x.device)
        agg = zeros.index_add(0, dst, messages)
        return torch.relu(self.update(torch.cat([x, agg], dim=-1)))


class GNN(nn.Module):
    """Message-passing layers and a mean readout: [nodes, F] graph -> [OUT_FEATURES]."""

    def __init__(self) -> None:
        super().__init__()
        dims = [IN_FEATURES] + [HIDDEN] * LAYERS
        self.layers = nn.ModuleList(MessagePassing(a, b) for a, b in pairwise(dims))
        self.readout = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index[0], edge_index[1]
        for layer in self.layers:
            x = layer(x, src, dst)
        # Mean over nodes gives a graph embedding whose shape no longer depends on
        # the graph size; keepdim gives the [1, out] batch-of-one result.
        return self.readout(x.mean(dim=0, keepdim=True))


def gnn(max_nodes: int = 4096, max_edges: int = 16384) -> DemoModel:
    """Inputs: x float32 [num_nodes, 64], edge_index int64 [2, num_edges] (row 0 =
    source, row 1 = destination, all in [0, num_nodes)). Output: float32 [1, 16].

    Dims: num_nodes in [2, max_nodes], num_edges in [2, max_edges]; ``sample_inputs``
    draws num_nodes in [2, min(max_nodes, 200)] and num_edges in
    [2, min(max_edges, 800)].
    """
    with seeded(0):
        module = finish(GNN())
    nodes = Dim("num_nodes", min=2, max=max_nodes)
    edges = Dim("num_edges", min=2, max=max_edges)

    def make(n: int, e: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = torch.randn(n, IN_FEATURES, generator=gen)
        edge_index = torch.randint(0, n, (2, e), generator=gen)
        return (x, edge_index)

    def sample_inputs(rng: random.Random) -> tuple[torch.Tensor, ...]:
        n = rng.randint(2, min(max_nodes, 200))
        e = rng.randint(2, min(max_edges, 800))
        return make(n, e, generator(rng))

    return DemoModel(
        name="gnn",
        module=module,
        # Distinct example sizes (not equal, not 0/1) so export cannot unify the dims.
        example_inputs=make(10, 30, torch.Generator().manual_seed(1)),
        dynamic_shapes=({0: nodes}, {1: edges}),
        sample_inputs=sample_inputs,
        description=(
            f"{LAYERS}-layer message passing (index_select gather, index_add scatter), "
            f"mean readout -> [1, {OUT_FEATURES}]; dynamic node and edge counts"
        ),
    )
