"""What the frontend's graph fusions share: replacing a matched chain of an FX graph by
one node, and erasing the chain's nodes that nothing reads any more."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def graph_modules(graph_module) -> Iterator:
    """`graph_module` and each of its subgraphs (a loop's or a branch's body)."""
    return (m for m in graph_module.modules() if isinstance(m, torch.fx.GraphModule))


def chains(graph, target, match) -> Iterator:
    """What `match(node)` finds (not None) at each call of `target` in `graph`, taken
    from a copy of the node list, so the caller may rewrite the graph as it goes."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is target:
            found = match(node)
            if found is not None:
                yield found


def replace_chain(graph, end, target, args: tuple, keep: Iterable) -> object:
    """Insert `target(*args)` before `end` (the chain's last node), give it `end`'s
    meta and users, then erase the chain backwards from `end`: a call node is erased
    once nothing reads it, except `keep` (the chain's inputs). Returns the new node."""
    with graph.inserting_before(end):
        fused = graph.call_function(target, args)
    fused.meta = dict(end.meta)
    end.replace_all_uses_with(fused)
    keep, erased, todo = set(keep), set(), [end]
    while todo:
        dead = todo.pop()
        if dead in keep or dead in erased or dead.op != "call_function" or dead.users:
            continue
        inputs = list(dead.all_input_nodes)   # erase_node clears them
        graph.erase_node(dead)
        erased.add(dead)
        todo.extend(inputs)
    return fused


def finish(module, fused: int) -> None:
    """Check and regenerate `module`'s code after `fused` rewrites of its graph."""
    if fused:
        module.graph.lint()
        module.recompile()
