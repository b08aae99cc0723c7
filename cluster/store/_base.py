"""The kernel store's interface: `get(keys) -> dict`, `put(key, bytes)`
(docs/ARCHITECTURE.md, Conventions 6).

A store holds opaque bytes under artifact cache keys. It is a cache: an entry may vanish
at any time (eviction, a restarted Redis, a wiped directory) and that only costs a
recompile. What the bytes mean, and whether they may be trusted, is not the store's
business: `dynvm.cluster.store._signed` seals and verifies them (Note [Signed artifacts]).

Two implementations: `RedisStore` for a cluster, `LocalDirStore` for one machine.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from dynvm.jit.artifact_keys import KEY_PATTERN, program_tag_of
from dynvm.vm.errors import DynvmError

_SHOWN = 80
"""How much of a rejected key an error message shows (keys can be attacker-sized)."""


class StoreError(DynvmError):
    """Base of the kernel store's errors."""


class InvalidKey(StoreError, ValueError):
    """A key that is not what `dynvm.jit.artifact.cache_key` returns: 64 lowercase hex
    digits, then (optionally) a program tag of 16 in braces (Note [Program hash tags])."""


class StoreUnavailable(StoreError):
    """The store cannot be reached or refused us (connection, timeout, auth, I/O).

    The message never contains a password or secret: callers may log it as is.
    """


def shorten(value: object, limit: int = _SHOWN) -> str:
    """`repr(value)`, cut to `limit` characters, for messages that echo outside input."""
    text = repr(value) if not isinstance(value, str | bytes) else repr(value[: limit + 1])
    if len(text) > limit:
        size = f", {len(value)} long" if isinstance(value, str | bytes) else ""
        return f"{text[:limit]}...(cut{size})"
    return text


def check_key(key: object) -> str:
    """Return `key` if it is a valid store key, else raise `InvalidKey` naming it (shortened)."""
    if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
        raise InvalidKey(
            f"invalid kernel store key {shorten(key)}: expected 64 lowercase hex characters "
            "and an optional {16 hex characters} program tag (dynvm.jit.artifact.cache_key)")
    return key


MAX_ENTRY_BYTES = 16 * 2**20
"""Default cap on one entry's size (Note [Entry size cap])."""

# Note [Entry size cap]
# ~~~~~~~~~~~~~~~~~~~~~
# An entry is read by every replica, before its signature can be checked; whoever can
# write to the store could otherwise make each replica download and decode a value as
# large as Redis allows (512 MB). So a store has a cap (an artifact is source text plus
# a few cubins, well under MAX_ENTRY_BYTES): `put` refuses a larger value, and `get`
# learns each size before it downloads (Redis: STRLEN; a directory: stat) and treats a
# larger entry as absent, counted in StoreStats.oversized.


class EntryTooLarge(StoreError, ValueError):
    """A value larger than the store's entry size cap (Note [Entry size cap])."""


def check_value(key: str, value: object, max_bytes: int = MAX_ENTRY_BYTES) -> bytes:
    """`value` as bytes, if it is bytes-like and within `max_bytes` (Note [Entry size cap])."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"kernel store value for key {key} must be bytes, "
                        f"got {type(value).__name__}")
    if len(value) > max_bytes:
        raise EntryTooLarge(f"kernel store value for key {key} is {len(value)} bytes, "
                            f"the cap is {max_bytes}")
    return bytes(value)


DEFAULT_MAX_ENTRIES_PER_PROGRAM = 4096
"""Entries one program may hold in a store by default (Note [Artifact lifetime])."""

DEFAULT_REFRESH_INTERVAL_S = 60.0
"""How often, at most, a store instance marks a program it reads as in use."""

# Note [Artifact lifetime]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A fleet deploys programs and retires them (a model redeployed with new weights is a
# new program, with a new hash and new keys). The store must keep what live programs
# use and let the rest go, without anyone deciding which program is "live":
#
# * Every key names its program (Note [Program hash tags]); the store groups entries by
#   that tag. Keys without a tag belong to no program and only ever expire or get evicted
#   by Redis's LRU.
# * Time to live: with a TTL configured, an entry that nobody marks as in use expires
#   TTL seconds after it was written. Reading any entry of a program marks the whole
#   program in use: every entry of it gets a fresh TTL. Replicas read their program's
#   index every few seconds (dynvm.cluster.fleet._link), so a deployed program's entries,
#   those that no replica has fetched for days included, never expire; once no replica
#   of a program runs, its index is no longer read, and TTL seconds later the program is
#   gone, index and artifacts together. The marking is rate-limited per store instance
#   and program (at most every refresh interval, and at least four times per TTL): one
#   round trip per program per interval, not one per read. Renewing every entry's TTL is
#   done once per half TTL for the whole fleet, by the reader that sets the program's
#   renewal marker first (Redis: SET NX with a half-TTL expiry), not by every replica.
# * A presence check (`contains`) is not a use: the compile service checks that the
#   indexes of the programs it knows are still there (to republish a lost one), and must
#   not keep a retired program alive by looking at it. It does republish a known
#   program's index once that expired (Note [Fleet promotion]); it forgets a program
#   that no replica registered or reported for one TTL, or for an hour without a TTL
#   (FleetCompiler.forget_after_s), and from then on a retired program stays gone.
# * Size bound: a program holds at most `max_entries_per_program` entries. A write past
#   the bound deletes the program's least recently used entries (last written or marked
#   in use; Redis: a sorted set per program next to its entries, same hash tag; a
#   directory: the files' access times), counted in StoreStats.evicted. An evicted entry
#   that an index still lists is a miss for the replica that looks for it (it runs the
#   interpreter for that shape), never an error. The compile service already keeps each
#   region's index to the JIT's `max_specializations_per_region` newest entries; the
#   store's bound is the backstop for what falls out of indexes and for programs that
#   compile without end.
# * The bound and the TTL are per store, not global: Redis's own memory cap and LRU
#   (deploy/redis.conf) still decide across programs when memory is short.
# * The TTL is off by default (DYNVM_STORE_TTL_S unset). Without it garbage is still
#   bounded: a retired program's entries are never read again, so they are the first
#   that allkeys-lru evicts when Redis is full, and the service forgets the program
#   after an hour, so nothing writes them back. With a TTL they also go when memory is
#   not short, but so do the kernels of a program deployed and idle for longer than
#   the TTL (scaled to zero over a weekend): every shape is interpreted and compiled
#   again when it comes back. Which is worse depends on the fleet, so it is the
#   operator's setting; deploy/redis.conf's maxmemory is the bound either way.


@runtime_checkable
class KernelStore(Protocol):
    """Where compiled artifacts live between processes (Triton's `CacheManager` in spirit).

    Keys are checked with `check_key` (a bad key raises `InvalidKey`, a `ValueError`);
    failures to reach the backing store raise `StoreUnavailable`.
    """

    def get(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The stored values of `keys`; a key with no value is absent from the result."""
        ...

    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, replacing any previous value, atomically."""
        ...

    def contains(self, keys: Sequence[str]) -> set[str]:
        """Which of `keys` have a value; unlike `get`, not a use (Note [Artifact lifetime])."""
        ...


@dataclass
class StoreStats:
    """Counters of one store instance; thread-safe. `snapshot()` reads them consistently."""

    hits: int = 0
    """Keys asked for that had a value."""
    misses: int = 0
    """Keys asked for that had none."""
    puts: int = 0
    """Values written."""
    errors: int = 0
    """Operations that raised `StoreUnavailable`."""
    oversized: int = 0
    """Entries not downloaded because they were larger than the cap."""
    evicted: int = 0
    """Entries deleted to keep a program within its size bound (Note [Artifact lifetime])."""
    expired: int = 0
    """Entries this instance found past their TTL and deleted (a directory; Redis expires
    entries by itself and does not report them)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_get(self, hits: int, misses: int) -> None:
        with self._lock:
            self.hits += hits
            self.misses += misses

    def record_put(self) -> None:
        with self._lock:
            self.puts += 1

    def record_error(self) -> None:
        with self._lock:
            self.errors += 1

    def record_oversized(self, count: int) -> None:
        with self._lock:
            self.oversized += count

    def record_evicted(self, count: int) -> None:
        with self._lock:
            self.evicted += count

    def record_expired(self, count: int) -> None:
        with self._lock:
            self.expired += count

    def dropped(self) -> dict[str, int]:
        """The entries this store left out or deleted, by reason (what a fetch's own
        counters cannot show: an oversized entry reads as missing)."""
        with self._lock:
            return {"oversized": self.oversized, "evicted": self.evicted,
                    "expired": self.expired}

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "puts": self.puts,
                    "errors": self.errors, "oversized": self.oversized,
                    "evicted": self.evicted, "expired": self.expired}


class UseMarks:
    """When this store instance last marked each program in use (Note [Artifact
    lifetime]): `due` says which programs to mark now, at most every `interval_s`."""

    def __init__(self, interval_s: float, ttl_s: float | None) -> None:
        # At least four marks per TTL, so that a live program's entries never get close
        # to expiring between two of them.
        self.interval_s = interval_s if ttl_s is None else min(interval_s, ttl_s / 4)
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def due(self, keys: Iterable[str]) -> dict[str, list[str]]:
        """`keys` grouped by program tag, for the programs whose mark is due (and taken)."""
        groups: dict[str, list[str]] = {}
        for key in keys:
            tag = program_tag_of(key)
            if tag is not None:
                groups.setdefault(tag, []).append(key)
        now = time.monotonic()
        with self._lock:
            due = {tag: members for tag, members in groups.items()
                   if now - self._last.get(tag, -math.inf) >= self.interval_s}
            for tag in due:
                self._last[tag] = now
        return due
