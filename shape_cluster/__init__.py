"""Signatures -> code families: one kernel per family of similar shapes, its varying dims
bucketed geometrically (Note [Code families], Note [Geometric buckets])."""

from dynvm.shape_cluster.buckets import bucket_of
from dynvm.shape_cluster.families import (
    SCALAR,
    TENSOR,
    Family,
    FamilyStats,
    ScalarPart,
    TensorPart,
    cluster,
    family_for,
    layout_class,
    structure_key,
    varying_dims,
)
from dynvm.shape_cluster.index import FamilyIndex

__all__ = [
    "SCALAR",
    "TENSOR",
    "Family",
    "FamilyIndex",
    "FamilyStats",
    "ScalarPart",
    "TensorPart",
    "bucket_of",
    "cluster",
    "family_for",
    "layout_class",
    "structure_key",
    "varying_dims",
]
