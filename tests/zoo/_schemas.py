"""Declare the two torchvision operator schemas that its CPU-only wheel cannot load.

torchvision's compiled ops (`torchvision::nms`, `torchvision::qnms`) do not load against
the CPU build of torch used here, yet torchvision registers fake (meta) kernels for them
at import, which fails unless the schemas exist. transformers and timm import
torchvision, so this must run before any of them is imported. The zoo never calls these
ops; only their schemas are needed.
"""

from __future__ import annotations

import functools

import torch

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


def _defined(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


@functools.cache
def declare_torchvision_schemas() -> torch.library.Library | None:
    """Define the schemas once per process (a no-op when torchvision's own ops loaded).

    Returns the library handle; functools.cache keeps it alive, since a dropped
    `Library` object removes its definitions again."""
    if all(_defined(s.split("(")[0]) for s in _SCHEMAS):
        return None
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        if not _defined(schema.split("(")[0]):
            lib.define(schema)
    return lib
