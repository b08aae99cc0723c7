"""Export a module with torch.export and decompose it to the op set dynvm keeps
(Note [Kept ops] in dynvm.vm.frontend.kept_ops)."""

from __future__ import annotations

import warnings

import torch

from dynvm.vm.frontend.decompose import decompose_in_place
from dynvm.vm.frontend.kept_ops import KEPT_OPS, decomposition_table

__all__ = ["KEPT_OPS", "decomposition_table", "export_module"]


def export_module(module: torch.nn.Module, example_inputs: tuple, dynamic_shapes=None):
    """torch.export the module in eval mode and decompose all but the kept ops, without
    torch's retrace where the graph allows it (Note [Decomposing without a retrace])."""
    module = module.eval()  # safe: nn.Module.eval, not Python's eval
    with warnings.catch_warnings():
        # torch.export's own deep copies trip a deprecation warning inside torch
        # (LeafSpec); it says nothing about the user's model.
        warnings.simplefilter("ignore", FutureWarning)
        exported = torch.export.export(module, tuple(example_inputs),
                                       dynamic_shapes=dynamic_shapes, strict=False)
        if decompose_in_place(exported):
            return exported
        return exported.run_decompositions(decomposition_table())
