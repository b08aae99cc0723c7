"""LocalDirStore: atomic writes, temp files, I/O errors."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time

import pytest

from dynvm.cluster import LocalDirStore, StoreUnavailable

KEY = hashlib.sha256(b"atomic").hexdigest()


def test_creates_its_directory(tmp_path):
    store = LocalDirStore(tmp_path / "a" / "b")
    store.put(KEY, b"v")
    assert (tmp_path / "a" / "b" / KEY).read_bytes() == b"v"
    assert "LocalDirStore(" in repr(store)


def test_concurrent_writers_never_expose_a_partial_value(tmp_path):
    store = LocalDirStore(tmp_path)
    size = 4 << 20
    values = [bytes([fill]) * size for fill in (0x41, 0x42)]
    store.put(KEY, values[0])
    stop = threading.Event()
    failures: list[BaseException] = []

    def writer(value: bytes) -> None:
        try:
            while not stop.is_set():
                store.put(KEY, value)
        except BaseException as error:  # surfaced by the assertion below
            failures.append(error)

    threads = [threading.Thread(target=writer, args=(value,)) for value in values]
    for thread in threads:
        thread.start()
    reads = 0
    deadline = time.monotonic() + 1.0
    try:
        while time.monotonic() < deadline:
            got = store.get([KEY])[KEY]
            assert len(got) == size
            assert got in values  # all one fill byte: complete, never mixed
            reads += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not failures
    assert reads > 5
    assert [entry.name for entry in tmp_path.iterdir()] == [KEY]  # no temp file left


def test_sweep_removes_only_old_temp_files(tmp_path):
    store = LocalDirStore(tmp_path)
    store.put(KEY, b"v")
    old, fresh = tmp_path / ".tmp-old", tmp_path / ".tmp-fresh"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert store.sweep(older_than_s=3600) == 1
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [".tmp-fresh", KEY]
    assert store.get([KEY]) == {KEY: b"v"}


def test_unusable_directory_raises_store_unavailable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StoreUnavailable, match="cannot create kernel store directory"):
        LocalDirStore(blocker / "kernels")


def test_write_failure_raises_store_unavailable_and_counts(tmp_path):
    store = LocalDirStore(tmp_path / "kernels")
    shutil.rmtree(tmp_path / "kernels")
    with pytest.raises(StoreUnavailable, match=f"cannot write kernel store entry {KEY}"):
        store.put(KEY, b"v")
    assert store.stats.snapshot()["errors"] == 1


def test_read_failure_raises_store_unavailable(tmp_path):
    store = LocalDirStore(tmp_path)
    (tmp_path / KEY).mkdir()  # a directory where the entry's file should be
    with pytest.raises(StoreUnavailable, match=f"cannot read kernel store entry {KEY}"):
        store.get([KEY])
