"""Fixtures of the reliability tests. tests/cluster/_redis_server.py (a real redis-server
on a free loopback port) is shared with the kernel store tests: its folder goes on
sys.path here, as tests/conftest.py does for tests/vm and tests/jit."""

import sys
from pathlib import Path

import pytest

_CLUSTER = str(Path(__file__).resolve().parent.parent / "cluster")
if _CLUSTER not in sys.path:
    sys.path.insert(0, _CLUSTER)

from _redis_server import REDIS_SERVER, RedisServer  # noqa: E402


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
