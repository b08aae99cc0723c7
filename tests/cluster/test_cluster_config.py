"""StoreConfig.from_env: the kernel store configured by environment variables (read by
dynvm._env, checked there and here)."""

from __future__ import annotations

from pathlib import Path

import pytest

import dynvm.cluster as cluster
from dynvm.cluster import LocalDirStore, RedisStore, StoreConfig, StoreConfigError

SECRET = "from-env-secret-0123456789"


def test_secret_is_required():
    with pytest.raises(StoreConfigError, match="DYNVM_STORE_SECRET is not set"):
        StoreConfig.from_env({})
    with pytest.raises(StoreConfigError, match="DYNVM_STORE_SECRET is empty"):
        StoreConfig.from_env({"DYNVM_STORE_SECRET": ""})
    with pytest.raises(StoreConfigError, match="DYNVM_STORE_SECRET is empty"):
        StoreConfig.from_env({"DYNVM_STORE_SECRET": "  "})
    with pytest.raises(StoreConfigError, match="secret is empty"):
        StoreConfig(secret=b"", local_dir="x")


def test_local_directory(tmp_path):
    config = StoreConfig.from_env({"DYNVM_STORE_SECRET": SECRET,
                                   "DYNVM_STORE_DIR": str(tmp_path)})
    assert config.secret == SECRET.encode()
    assert config.local_dir == str(tmp_path) and config.redis is None
    assert isinstance(config.open_store(), LocalDirStore)
    assert SECRET not in repr(config)


def test_default_directory_follows_xdg_cache_home(tmp_path):
    config = StoreConfig.from_env({"DYNVM_STORE_SECRET": SECRET,
                                   "XDG_CACHE_HOME": str(tmp_path)})
    assert config.local_dir == str(tmp_path / "dynvm" / "kernels")


def test_redis_from_env():
    config = StoreConfig.from_env({
        "DYNVM_STORE_SECRET": SECRET,
        "DYNVM_REDIS_URL": "rediss://redis.internal:6380/2",
        "DYNVM_REDIS_USERNAME": "dynvm",
        "DYNVM_REDIS_PASSWORD": "redis-password-xyz",
        "DYNVM_REDIS_TLS_CA": "/etc/ca.pem",
        "DYNVM_STORE_TTL_S": "86400",
        "DYNVM_REDIS_NAMESPACE": "staging:k:",
    })
    redis = config.redis
    assert redis is not None and config.local_dir is None
    assert (redis.username, redis.password, redis.tls_ca_path, redis.ttl_seconds,
            redis.namespace) == ("dynvm", "redis-password-xyz", "/etc/ca.pem", 86400,
                                 "staging:k:")
    assert isinstance(config.open_store(), RedisStore)  # connects lazily
    for text in (repr(config), repr(redis), repr(config.open_store())):
        assert SECRET not in text and "redis-password-xyz" not in text


@pytest.mark.parametrize("env, message", [
    ({"DYNVM_REDIS_URL": "redis://h", "DYNVM_STORE_DIR": "/tmp/x"}, "not both"),
    ({"DYNVM_REDIS_URL": "redis://h", "DYNVM_STORE_TTL_S": "soon"}, "DYNVM_STORE_TTL_S"),
    ({"DYNVM_REDIS_URL": "redis://h", "DYNVM_REDIS_TLS": "maybe"}, "DYNVM_REDIS_TLS"),
    ({"DYNVM_REDIS_URL": "http://:pw-in-url@h"}, "scheme"),
])
def test_bad_environment_is_named(env, message):
    with pytest.raises(StoreConfigError, match=message) as caught:
        StoreConfig.from_env({"DYNVM_STORE_SECRET": SECRET, **env})
    assert SECRET not in str(caught.value)
    assert "pw-in-url" not in str(caught.value)


def test_config_reads_no_environment_itself(tmp_path, monkeypatch):
    # The mapping passed in is all it sees (dynvm._env reads the real one: see
    # tests/dynvm/test_env.py); with None it sees the process environment.
    monkeypatch.setenv("DYNVM_STORE_SECRET", "process-secret-0123")
    monkeypatch.setenv("DYNVM_STORE_DIR", str(tmp_path))
    with pytest.raises(StoreConfigError, match="DYNVM_STORE_SECRET is not set"):
        StoreConfig.from_env({})
    config = StoreConfig.from_env()
    assert config.secret == b"process-secret-0123" and config.local_dir == str(tmp_path)
    assert "import os" not in Path(cluster.config.__file__).read_text()
