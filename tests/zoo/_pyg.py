"""PyTorch Geometric entries of the zoo: the four classic graph networks from
torch_geometric.nn.models, hidden 32, two layers, dynamic node and edge counts
(x: [nodes, 16], edge_index: [2, edges]); and a batch of graphs pooled to one row per
graph, as PyG's DataLoader batches them (the graph count dynamic too)."""

from __future__ import annotations

import torch
import torch_geometric.nn as pyg_nn
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


class _PooledGin(torch.nn.Module):
    """GIN node embeddings mean-pooled per graph of a batch, then a linear head: the
    inputs are a PyG Batch's tensors (x, edge_index, batch, ptr), where `ptr` holds each
    graph's first node and the node count, so its length is the graph count + 1."""

    def __init__(self) -> None:
        super().__init__()
        self.gin = pyg.GIN(FEATURES, HIDDEN, 2, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x, edge_index, batch, ptr):
        nodes = self.gin(x, edge_index)
        return self.head(pyg_nn.global_mean_pool(nodes, batch, size=ptr.shape[0] - 1))


def _graph_batch(point, seed: int):
    gen = generator(seed)
    graphs, nodes, edges = point["graphs"], point["nodes"], point["edges"]
    x = torch.randn(nodes, FEATURES, generator=gen)
    # Sorted graph ids, every graph with a node; each edge stays inside its graph.
    batch = torch.sort(torch.cat([torch.arange(graphs),
                                  torch.randint(0, graphs, (nodes - graphs,), generator=gen)]))
    batch = batch.values
    first = torch.searchsorted(batch, torch.arange(graphs))
    sizes = torch.bincount(batch, minlength=graphs)
    src = torch.randint(0, nodes, (edges,), generator=gen)
    dst = first[batch[src]] + (torch.rand(edges, generator=gen) * sizes[batch[src]]).long()
    return x, torch.stack([src, dst]), batch, torch.cat([first, torch.tensor([nodes])])


def _pooled() -> ZooEntry:
    def build() -> Built:
        torch.manual_seed(0)
        nodes, graphs = dim("nodes", 2, 1024), dim("graphs", 1, 64)
        shapes = ({0: nodes}, {1: dim("edges", 2, 8192)}, {0: nodes}, {0: graphs + 1})
        return Built(_PooledGin().eval(), shapes, _graph_batch)

    points = ({"graphs": 3, "nodes": 20, "edges": 50}, {"graphs": 8, "nodes": 90, "edges": 300},
              {"graphs": 17, "nodes": 200, "edges": 900})
    return ZooEntry("gin-pooled", "torch_geometric", build,
                    {"graphs": 4, "nodes": 30, "edges": 80}, points,
                    note="a batch of graphs: ptr's length declared as graphs + 1")


ENTRIES = (*ENTRIES, _pooled())
