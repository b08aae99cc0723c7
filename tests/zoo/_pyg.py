"""PyTorch Geometric entries of the zoo: the four classic graph networks from
torch_geometric.nn.models, hidden 32, two layers, dynamic node and edge counts
(x: [nodes, 16], edge_index: [2, edges])."""

from __future__ import annotations

import torch
import torch_geometric.nn.models as pyg

from tests.zoo._zoo import Built, ZooEntry, dim, generator

FEATURES, HIDDEN, OUT = 16, 32, 8
POINTS = ({"nodes": 7, "edges": 20}, {"nodes": 50, "edges": 180}, {"nodes": 130, "edges": 700})
SELF_LOOPS_NOTE = ("self-loops come with the input graph (add_self_loops=False): the "
                   "model's own adds a data-dependent number of edges")


def _graph(point, seed: int, self_loops: bool):
    gen = generator(seed)
    nodes, edges = point["nodes"], point["edges"]
    x = torch.randn(nodes, FEATURES, generator=gen)
    if not self_loops:
        return x, torch.randint(0, nodes, (2, edges), generator=gen)
    loops = torch.arange(nodes).repeat(2, 1)
    rest = torch.randint(0, nodes, (2, edges - nodes), generator=gen)
    rest[1] = torch.where(rest[0] == rest[1], (rest[1] + 1) % nodes, rest[1])
    return x, torch.cat([loops, rest], dim=1)


def _gnn(name: str, make, self_loops: bool = False) -> ZooEntry:
    def build() -> Built:
        torch.manual_seed(0)
        module = make().eval()
        shapes = ({0: dim("nodes", 2, 1024)}, {1: dim("edges", 2, 8192)})
        return Built(module, shapes, lambda point, seed: _graph(point, seed, self_loops))

    return ZooEntry(name, "torch_geometric", build, {"nodes": 12, "edges": 40}, POINTS,
                    note=SELF_LOOPS_NOTE if self_loops else "")


ENTRIES = (
    _gnn("gcn", lambda: pyg.GCN(FEATURES, HIDDEN, 2, OUT, add_self_loops=False), True),
    _gnn("gat", lambda: pyg.GAT(FEATURES, HIDDEN, 2, OUT, heads=2, add_self_loops=False), True),
    _gnn("graphsage", lambda: pyg.GraphSAGE(FEATURES, HIDDEN, 2, OUT)),
    _gnn("gin", lambda: pyg.GIN(FEATURES, HIDDEN, 2, OUT)),
)
