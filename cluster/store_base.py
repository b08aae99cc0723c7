"""The kernel store's interface: `get(keys) -> dict`, `put(key, bytes)` (DESIGN.md, Conventions 6).

A store holds opaque bytes under artifact cache keys. It is a cache: an entry may vanish
at any time (eviction, a restarted Redis, a wiped directory) and that only costs a
recompile. What the bytes mean, and whether they may be trusted, is not the store's
business: `dynvm.cluster.signed` seals and verifies them (Note [Signed artifacts]).

Two implementations: `RedisStore` for a cluster, `LocalDirStore` for one machine.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from dynvm.vm.errors import DynvmError

KEY_PATTERN = re.compile(r"[0-9a-f]{64}")
"""A store key is what `dynvm.jit.artifact.cache_key` returns: a hex sha256 digest."""

_SHOWN = 80
"""How much of a rejected key an error message shows (keys can be attacker-sized)."""


class StoreError(DynvmError):
    """Base of the kernel store's errors."""


class InvalidKey(StoreError, ValueError):
    """A key that is not a lowercase hex sha256 digest (64 characters of [0-9a-f])."""


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
            "(a sha256 from dynvm.jit.artifact.cache_key)")
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

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "puts": self.puts,
                    "errors": self.errors, "oversized": self.oversized}
