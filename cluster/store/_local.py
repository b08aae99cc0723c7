"""`LocalDirStore`: the kernel store of a single machine, one file per key in a directory.

A write goes to a temporary file in the same directory, is flushed and fsync'ed, then
`os.replace`d onto the key's file (atomic on POSIX and Windows), and the directory is
fsync'ed so the rename survives a crash. A reader therefore sees the old value, the new
value or none, never a partial one. Temporary files start with "." and can never be
mistaken for a key (keys start with 64 hex characters); one left behind by a crash is
garbage that `LocalDirStore.sweep` removes.

Expiry and the size bound per program follow Note [Artifact lifetime] (dynvm.cluster.
store._base) with the files' times: the modification time is when the entry's program was
last marked in use (its TTL runs from there), the access time when the entry itself was
last written or read (the order in which the bound evicts). Both are set explicitly, so
a file system mounted noatime changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from dynvm.cluster.store._base import (
    DEFAULT_MAX_ENTRIES_PER_PROGRAM,
    DEFAULT_REFRESH_INTERVAL_S,
    MAX_ENTRY_BYTES,
    StoreStats,
    StoreUnavailable,
    UseMarks,
    check_key,
    check_value,
)
from dynvm.jit.artifact_keys import program_tag_of
from dynvm.vm.errors import ConfigError

_TMP_PREFIX = ".tmp-"


class LocalDirStore:
    """A `KernelStore` over a directory (created if missing). `ttl_seconds`,
    `max_entries_per_program` and `refresh_interval_s` mean what RedisConfig's fields
    of those names do (Note [Artifact lifetime])."""

    def __init__(self, path: str | os.PathLike[str], max_entry_bytes: int = MAX_ENTRY_BYTES,
                 *, ttl_seconds: float | None = None,
                 max_entries_per_program: int = DEFAULT_MAX_ENTRIES_PER_PROGRAM,
                 refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S):
        if ttl_seconds is not None and not ttl_seconds > 0:
            raise ConfigError(f"LocalDirStore ttl_seconds must be > 0 or None, "
                             f"got {ttl_seconds!r}")
        if type(max_entries_per_program) is not int or max_entries_per_program < 1:
            raise ConfigError(f"LocalDirStore max_entries_per_program must be an int >= 1, "
                             f"got {max_entries_per_program!r}")
        self.path = Path(path)
        self.max_entry_bytes = max_entry_bytes
        self.ttl_seconds = ttl_seconds
        self.max_entries_per_program = max_entries_per_program
        self.stats = StoreStats()
        self._marks = UseMarks(refresh_interval_s, ttl_seconds)
        self._next_sweep = 0.0
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreUnavailable(
                f"cannot create kernel store directory {str(self.path)!r}: "
                f"{error.strerror or type(error).__name__}") from None

    def __repr__(self) -> str:
        return f"LocalDirStore({str(self.path)!r})"

    def get(self, keys: Sequence[str]) -> dict[str, bytes]:
        keys = [check_key(key) for key in keys]
        found: dict[str, bytes] = {}
        oversized = expired = 0
        for key in keys:
            try:
                with open(self.path / key, "rb") as f:
                    status = os.fstat(f.fileno())
                    if self._expired(status):
                        expired += self._remove(key)
                        continue
                    # Note [Entry size cap]: the size before the bytes; read at most the
                    # cap plus one byte in case the file grew in between.
                    if status.st_size > self.max_entry_bytes:
                        oversized += 1
                        continue
                    value = f.read(self.max_entry_bytes + 1)
            except FileNotFoundError:
                continue
            except OSError as error:
                self.stats.record_error()
                raise StoreUnavailable(self._describe("read", key, error)) from None
            if len(value) > self.max_entry_bytes:
                oversized += 1
                continue
            found[key] = value
        if oversized:
            self.stats.record_oversized(oversized)
        if expired:
            self.stats.record_expired(expired)
        self.stats.record_get(len(found), len(keys) - len(found))
        self._mark_used(found)
        return found

    def contains(self, keys: Sequence[str]) -> set[str]:
        keys = [check_key(key) for key in keys]
        present = set()
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                if not self._expired((self.path / key).stat()):
                    present.add(key)
        return present

    def put(self, key: str, value: bytes) -> None:
        key = check_key(key)
        value = check_value(key, value, self.max_entry_bytes)
        try:
            self._write_atomically(key, value)
        except OSError as error:
            self.stats.record_error()
            raise StoreUnavailable(self._describe("write", key, error)) from None
        self.stats.record_put()
        tag = program_tag_of(key)
        if tag is not None:
            self._bound(tag)
        if self.ttl_seconds is not None and time.monotonic() >= self._next_sweep:
            # Retired programs are read by no one: their expired files go here.
            self._next_sweep = time.monotonic() + self._marks.interval_s
            self.sweep()

    def sweep(self, older_than_s: float = 3600.0) -> int:
        """Remove temporary files older than `older_than_s` (left by crashed writers) and,
        with a TTL, the entries past it (counted in StoreStats.expired)."""
        removed = 0
        cutoff = time.time() - older_than_s
        for entry in self.path.glob(f"{_TMP_PREFIX}*"):
            with contextlib.suppress(OSError):
                if entry.stat().st_mtime < cutoff:
                    entry.unlink()
                    removed += 1
        if self.ttl_seconds is None:
            return removed
        expired = 0
        for entry in self.path.iterdir():
            with contextlib.suppress(OSError):
                if not entry.name.startswith(".") and self._expired(entry.stat()):
                    expired += self._remove(entry.name)
        self.stats.record_expired(expired)
        return removed + expired

    def _program_files(self, tag: str) -> list[Path]:
        return list(self.path.glob(f"*{{{tag}}}"))

    def _bound(self, tag: str) -> None:
        """Keep the program of `tag` within `max_entries_per_program` entries: delete its
        least recently used ones (Note [Artifact lifetime])."""
        files = self._program_files(tag)
        excess = len(files) - self.max_entries_per_program
        if excess <= 0:
            return
        used = []
        for entry in files:
            with contextlib.suppress(OSError):
                used.append((entry.stat().st_atime, entry.name))
        evicted = sum(self._remove(name) for _, name in sorted(used)[:excess])
        self.stats.record_evicted(evicted)

    def _mark_used(self, found: Sequence[str]) -> None:
        """Mark the programs of the entries just read as in use (Note [Artifact
        lifetime]): every entry of them gets a fresh TTL, the ones read a new use time."""
        due = self._marks.due(found)
        now = time.time()
        for tag, keys in due.items():
            read = set(keys)
            for entry in self._program_files(tag):
                with contextlib.suppress(OSError):
                    used = now if entry.name in read else entry.stat().st_atime
                    os.utime(entry, (used, now))

    def _expired(self, status: os.stat_result) -> bool:
        return (self.ttl_seconds is not None
                and time.time() - status.st_mtime > self.ttl_seconds)

    def _remove(self, name: str) -> int:
        """Delete one entry; 1 if this call deleted it, 0 if it was already gone."""
        try:
            os.unlink(self.path / name)
        except OSError:
            return 0
        return 1

    def _write_atomically(self, key: str, value: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.path)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(value)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path / key)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._fsync_directory()

    def _fsync_directory(self) -> None:
        # Makes the rename durable; not every platform lets a directory be opened.
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            with contextlib.suppress(OSError):
                os.fsync(fd)
        finally:
            os.close(fd)

    def _describe(self, action: str, key: str, error: OSError) -> str:
        reason = error.strerror or type(error).__name__
        return f"cannot {action} kernel store entry {key} in {str(self.path)!r}: {reason}"
