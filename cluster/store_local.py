"""`LocalDirStore`: the kernel store of a single machine, one file per key in a directory.

A write goes to a temporary file in the same directory, is flushed and fsync'ed, then
`os.replace`d onto the key's file (atomic on POSIX and Windows), and the directory is
fsync'ed so the rename survives a crash. A reader therefore sees the old value, the new
value or none, never a partial one. Temporary files start with "." and can never be
mistaken for a key (keys are 64 hex characters); one left behind by a crash is garbage
that `LocalDirStore.sweep` removes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from dynvm.cluster.store_base import (
    MAX_ENTRY_BYTES,
    StoreStats,
    StoreUnavailable,
    check_key,
    check_value,
)

_TMP_PREFIX = ".tmp-"


class LocalDirStore:
    """A `KernelStore` over a directory (created if missing)."""

    def __init__(self, path: str | os.PathLike[str], max_entry_bytes: int = MAX_ENTRY_BYTES):
        self.path = Path(path)
        self.max_entry_bytes = max_entry_bytes
        self.stats = StoreStats()
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
        oversized = 0
        for key in keys:
            try:
                with open(self.path / key, "rb") as f:
                    # Note [Entry size cap]: the size before the bytes; read at most the
                    # cap plus one byte in case the file grew in between.
                    if os.fstat(f.fileno()).st_size > self.max_entry_bytes:
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
        self.stats.record_get(len(found), len(keys) - len(found))
        return found

    def put(self, key: str, value: bytes) -> None:
        key = check_key(key)
        value = check_value(key, value, self.max_entry_bytes)
        try:
            self._write_atomically(key, value)
        except OSError as error:
            self.stats.record_error()
            raise StoreUnavailable(self._describe("write", key, error)) from None
        self.stats.record_put()

    def sweep(self, older_than_s: float = 3600.0) -> int:
        """Remove temporary files older than `older_than_s` (left by crashed writers)."""
        removed = 0
        cutoff = time.time() - older_than_s
        for entry in self.path.glob(f"{_TMP_PREFIX}*"):
            with contextlib.suppress(OSError):
                if entry.stat().st_mtime < cutoff:
                    entry.unlink()
                    removed += 1
        return removed

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
