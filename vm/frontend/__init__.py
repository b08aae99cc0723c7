"""The frontend: nn.Module -> torch.export -> core ATen (minus kept ops) -> bytecode."""

from __future__ import annotations

from dynvm.vm.frontend.dims import user_dim_names
from dynvm.vm.frontend.export import KEPT_OPS, export_module
from dynvm.vm.frontend.lower import lower_exported


def lower_module(module, example_inputs, dynamic_shapes=None, name: str | None = None):
    """Export `module` on `example_inputs` with torch.export's `dynamic_shapes` and lower
    it to a verified `Program`."""
    example_inputs = tuple(example_inputs)
    exported = export_module(module, example_inputs, dynamic_shapes)
    names = user_dim_names(module, example_inputs, dynamic_shapes)
    return lower_exported(exported, names, name or type(module).__name__, example_inputs)


__all__ = ["KEPT_OPS", "lower_module"]
