"""Demo models for dynvm: test fixtures and benchmark workloads.

Each builder returns a :class:`DemoModel` (module, example inputs, dynamic-shape
spec, input sampler) that exports cleanly with ``torch.export.export``. Look models
up by name through :data:`REGISTRY` or :func:`get`.
"""

from __future__ import annotations

from collections.abc import Callable

from dynvm.vm.errors import DynvmError

from ._base import DemoModel
from .control_flow import branchy, looping
from .gnn import gnn
from .recommender import recommender
from .transformer import transformer

# Builders, not instances: building allocates weights (the default transformer
# alone is ~19 MB), so nothing is built until someone asks for it.
REGISTRY: dict[str, Callable[[], DemoModel]] = {
    "transformer": transformer,
    "recommender": recommender,
    "gnn": gnn,
    "branchy": branchy,
    "looping": looping,
}


class UnknownDemoModel(DynvmError, KeyError):
    """No demo model has this name (the message lists the ones there are)."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0]) if self.args else ""


def get(name: str) -> DemoModel:
    """Build the registered model ``name`` with its default settings."""
    try:
        builder = REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise UnknownDemoModel(f"unknown demo model {name!r}; known models: {known}") from None
    return builder()


__all__ = [
    "REGISTRY",
    "DemoModel",
    "branchy",
    "get",
    "gnn",
    "looping",
    "recommender",
    "transformer",
]
