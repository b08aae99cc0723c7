"""What the compile service writes to the kernel store, and how replicas read it back.

Two kinds of entries, both sealed by `ArtifactCache` (Note [Signed artifacts]):

* a specialization: the artifact's fields (generated source for `dynvm explain`, guard,
  notes, compile time) plus `metadata["portable"]`, the record of Note [Portable
  specializations] that replicas install from;
* a program's index: one entry per (program, target) listing the keys of its promoted
  specializations, newest last, at most `max_per_region` per region. A replica reads it
  to warm-start and polls it to catch announcements it missed. Only the compile service
  (and `dynvm precompile`, which merges) writes it; a lost update costs one replica a
  late install, never a wrong one, since every listed key is verified when fetched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dynvm.cluster.signed import artifact_fields
from dynvm.cluster.store_base import StoreStats, check_key
from dynvm.jit.artifact import cache_key, toolchain_versions
from dynvm.jit.portable import PortableError, PortableSpecialization, decode, encode

INDEX_BACKEND = "dynvm-index"
SPECIALIZATION_BACKEND = "cpu"


def index_key(program_hash: str, target: str) -> str:
    """The store key of a program's index for one target (its list of entries)."""
    return cache_key(program_hash, -1, "index", INDEX_BACKEND, target)


def index_fields(program_hash: str, target: str, keys: Sequence[str]) -> dict:
    """The fields of a program's index entry: the keys of every specialization
    published for it on `target`."""
    return {"backend": INDEX_BACKEND, "target": target, "toolchain": toolchain_versions(),
            "kernel_name": "index", "source": "", "guard": "",
            "metadata": {"program": program_hash, "keys": list(keys)}}


def keys_from_index(fields: Mapping, program_hash: str) -> list[str]:
    """The keys an opened index entry lists ([] for one that is not an index of this
    program: such an entry is ignored, not trusted)."""
    metadata = fields.get("metadata", {})
    if fields.get("backend") != INDEX_BACKEND or metadata.get("program") != program_hash:
        return []
    keys = metadata.get("keys")
    if not isinstance(keys, list):
        return []
    out = []
    for key in keys:
        try:
            out.append(check_key(key))
        except ValueError:
            continue
    return out


def specialization_fields(spec, program_hash: str) -> dict:
    """The sealable fields of a compiled `Specialization` (jit.region_jit)."""
    fields = artifact_fields(spec.artifact, toolchain_versions())
    fields["metadata"] = {"program": program_hash,
                          "portable": encode(spec.ir, spec.strength, spec.signature,
                                             spec.family)}
    return fields


def portable_from_fields(fields: Mapping, program) -> PortableSpecialization:
    """The installable specialization in opened artifact fields; PortableError otherwise."""
    if fields.get("backend") != SPECIALIZATION_BACKEND:
        raise PortableError(f"backend {fields.get('backend')!r} is not installable here")
    metadata = fields.get("metadata", {})
    if metadata.get("program") != program.content_hash:
        raise PortableError("artifact belongs to another program")
    return decode(metadata.get("portable"), program)


def store_counters(cache) -> dict[str, int]:
    """An `ArtifactCache`'s fetch counters with its store's dropped entries (oversized,
    evicted, expired: StoreStats.dropped), as /stats and the service's stats show them."""
    stats = getattr(cache.store, "stats", None)   # a KernelStore need not count
    dropped = stats.dropped() if isinstance(stats, StoreStats) else {}
    return {**cache.stats(), **dropped}
