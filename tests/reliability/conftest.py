"""Fixtures of the reliability tests. tests/cluster/_redis_server.py (a real redis-server
on a free loopback port) is shared with the kernel store tests."""

import pytest

from tests.cluster._redis_server import REDIS_SERVER, RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server with a random requirepass; a missing binary is a failure here
    (scripts/setup installs it), not a skip."""
    assert REDIS_SERVER is not None, "redis-server is not installed (run scripts/setup)"
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
