"""dynvm.cluster.serving._local_stack without Ray: the store it picks and stops. The whole stack
(Ray, the compile service, Serve, a model answering) runs through `dynvm serve` in
tests/cluster/test_serve_cmd.py, which starts it with `start_local_stack`."""

from __future__ import annotations

import contextlib
import secrets

import pytest

from dynvm._env import REDIS_URL, STORE_SECRET
from dynvm.cluster import RedisStore
from dynvm.cluster.serving._local_stack import _store_config
from dynvm.vm.errors import ConfigError
from tests.cluster._cluster_helpers import process_alive
from tests.cluster._redis_server import REDIS_SERVER


def test_without_a_redis_url_the_stack_runs_a_private_redis_it_stops(monkeypatch):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    monkeypatch.delenv(REDIS_URL, raising=False)
    monkeypatch.delenv(STORE_SECRET, raising=False)
    lines, private = [], []
    with contextlib.ExitStack() as stack:
        store = _store_config(stack, lines.append, private)
        (server,) = private
        pid = server.pid
        assert lines == [f"store     private redis-server on 127.0.0.1:{server.port} "
                         f"(pid {pid})"]
        assert len(store.secret) == 64   # a random secret for this stack alone
        with RedisStore(store.redis) as redis:   # the store it hands out is that server
            redis.put("b" * 64, b"y")
            assert redis.get(["b" * 64]) == {"b" * 64: b"y"}
    assert not process_alive(pid)


def test_a_bad_redis_url_is_a_setting_error(monkeypatch):
    monkeypatch.setenv(REDIS_URL, "ftp://nowhere")
    monkeypatch.setenv(STORE_SECRET, secrets.token_hex(32))
    private = []
    with contextlib.ExitStack() as stack, pytest.raises(ConfigError, match="DYNVM_REDIS_.*redis://"):
        _store_config(stack, lambda line: None, private)
    assert private == []
