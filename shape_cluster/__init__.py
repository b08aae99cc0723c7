"""Signatures -> code families: one kernel per family of similar shapes, its varying dims
bucketed geometrically (Note [Code families], Note [Geometric buckets])."""

from dynvm.shape_cluster.buckets import bucket_of
from dynvm.shape_cluster.families import (
    Family,
    FamilyStats,
    cluster,
    family_for,
    layout_class,
    structure_key,
    varying_dims,
)
from dynvm.shape_cluster.index import FamilyIndex

__all__ = [
    "Family",
    "FamilyIndex",
    "FamilyStats",
    "bucket_of",
    "cluster",
    "family_for",
    "layout_class",
    "structure_key",
    "varying_dims",
]
