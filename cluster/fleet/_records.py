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

Note [Index stamps]
~~~~~~~~~~~~~~~~~~~
Every replica re-reads its program's index every poll interval to catch announcements
it missed, and almost always finds nothing new: at a thousand replicas that is 500
reads and HMAC checks of a ~1.5 KB index a second, and the fleet simulator's hosts spent 39%
of their active time in it. So each index write is followed by a stamp: a small
unsigned entry next to the index (same program tag), a fresh random token per write. A
poll reads the stamp (tens of bytes, no verification: it is only a hint) and reads the
index only when the stamp differs from the one seen with the last index it fully
installed, or when MAX_STAMP_SKIPS polls in a row were skipped. A stamp never
substitutes for the index: a forged or stale stamp can delay a poll by at most
MAX_STAMP_SKIPS intervals (announcements still arrive), and a missing one means every
poll reads the index, as before. The stamp is written after the index, so a replica
that read the new stamp reads at least that index.

An announcement carries the stamp of the index write that listed its key and the stamp
of the write before it (`after`), when the compile service wrote both and the new index
lists nothing but the old one's keys and this key. A link whose stamp is `after`, once
it has installed the key, holds everything the new index lists, and takes its stamp
without reading it: otherwise every announcement cost every replica two store reads
and MAC checks, the artifact and, at its next poll, the index that now lists it (in
the fleet simulator at N = 1000, 12,750 installs and about as many index reads per
run). The same bound holds: a forged announcement can make a link skip at most
MAX_STAMP_SKIPS polls, and it must name a key the link fetched and verified.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence

from dynvm.cluster.store._base import StoreStats, StoreUnavailable, check_key
from dynvm.cluster.store._signed import artifact_fields
from dynvm.jit.artifact import cache_key, toolchain_versions
from dynvm.jit.portable import PortableError, PortableSpecialization, decode, encode

INDEX_BACKEND = "dynvm-index"
SPECIALIZATION_BACKEND = "cpu"
logger = logging.getLogger(__name__)


def index_key(program_hash: str, target: str) -> str:
    """The store key of a program's index for one target (its list of entries)."""
    return cache_key(program_hash, -1, "index", INDEX_BACKEND, target)


MAX_STAMP_SKIPS = 10
"""Polls in a row a link may skip on an unchanged stamp (Note [Index stamps])."""


def index_stamp_key(program_hash: str, target: str) -> str:
    """The store key of the stamp of a program's index (Note [Index stamps])."""
    return cache_key(program_hash, -1, "index-stamp", INDEX_BACKEND, target)


def write_index(cache, program_hash: str, target: str, keys: Sequence[str]) -> bytes | None:
    """Seal a program's index listing `keys` into `cache`'s store, then a new stamp
    (Note [Index stamps]); the stamp, or None if either write failed (a stale stamp
    only delays polls)."""
    if not cache.publish(index_key(program_hash, target),
                         index_fields(program_hash, target, keys)):
        return None
    stamp = secrets.token_hex(16).encode()
    try:
        cache.store.put(index_stamp_key(program_hash, target), stamp)
    except StoreUnavailable as error:
        logger.warning("index stamp not written (replicas poll the index later): %s", error)
        return None
    return stamp


def read_index_stamp(store, program_hash: str, target: str) -> bytes | None:
    """The current stamp of a program's index, or None (none written, or the store is
    away: the caller then reads the index itself, which counts the failure)."""
    key = index_stamp_key(program_hash, target)
    try:
        return store.get([key]).get(key)
    except StoreUnavailable:
        return None


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
