"""Fixtures of the kernel store tests: a real redis-server per test, stores, a secret."""

from __future__ import annotations

import secrets
import threading

import pytest

from dynvm.cluster import LocalDirStore, RedisStore
from tests.cluster._redis_server import REDIS_SERVER, RedisServer, redis_config


@pytest.fixture(autouse=True, scope="module")
def _generation_modules_close_their_schedulers(request):
    """Note [Scheduler threads end before exit]: a generation serving test module closes
    every scheduler it started (its own, or its replica's), so none is left stepping
    when the test process exits."""
    yield
    if request.module.__name__.rpartition(".")[2].startswith("test_generate"):
        left = [t.name for t in threading.enumerate()
                if t.name == "dynvm-generate" and t.is_alive()]
        assert not left, f"{request.module.__name__} left {len(left)} scheduler(s) running"


@pytest.fixture
def redis_server(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_store(redis_server):
    with RedisStore(redis_config(redis_server)) as store:
        yield store


@pytest.fixture(params=["local", "redis"])
def store(request, tmp_path):
    """Each KernelStore implementation, for the tests of the shared contract."""
    if request.param == "local":
        return LocalDirStore(tmp_path / "kernels")
    return request.getfixturevalue("redis_store")


@pytest.fixture
def secret() -> bytes:
    return b"test-secret-" + secrets.token_hex(16).encode()
