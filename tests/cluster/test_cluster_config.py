"""StoreConfig.from_env: the kernel store configured by environment variables (read by
dynvm._env, checked there and here); ServingConfig, the one serving config, and the
package's lazy serving API."""

from __future__ import annotations

from pathlib import Path

import pytest

import dynvm.cluster as cluster
from dynvm.cluster import LocalDirStore, RedisStore, StoreConfig, StoreConfigError
from dynvm.cluster.store import _store_config

SECRET = "from-env-secret-7f3a9c2e5b8d41f6a0c3e9b2d7"


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
    monkeypatch.setenv("DYNVM_STORE_SECRET", "process-secret-0123-" + "9f2c4e7a1b3d5f60")
    monkeypatch.setenv("DYNVM_STORE_DIR", str(tmp_path))
    with pytest.raises(StoreConfigError, match="DYNVM_STORE_SECRET is not set"):
        StoreConfig.from_env({})
    config = StoreConfig.from_env()
    assert config.secret == b"process-secret-0123-9f2c4e7a1b3d5f60"
    assert config.local_dir == str(tmp_path)
    assert "import os" not in Path(_store_config.__file__).read_text()


def test_the_serving_api_loads_lazily():
    # dynvm.cluster's serving names come from their modules on first use (PEP 562), so a
    # process that only needs the store (the compile service, `dynvm precompile`) never
    # imports Ray Serve or FastAPI through the package.
    import subprocess
    import sys

    code = ("import sys, dynvm.cluster.store._store_config; "
            "print('ray.serve' in sys.modules, 'fastapi' in sys.modules); "
            "from dynvm.cluster import ServingConfig, serve_models; "
            "print(callable(serve_models), ServingConfig.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0] == "False False"
    assert out[1] == "True dynvm.cluster.serving.serving_config"
    with pytest.raises(AttributeError, match="no attribute 'serve_everything'"):
        cluster.serve_everything  # noqa: B018


# The modules a user names directly: a Serve config's import_path (serve_app), its gRPC
# servicer (grpc_v2), the proxy callback (proxy_guard), README's ingress, compile service
# and precompile entry points, and ServingConfig's own module. Every other is internal.
PUBLIC_MODULES = {"serving_config", "serve_app", "grpc_v2", "proxy_guard", "ingress",
                  "compile_service", "precompile"}


def test_the_public_api_is_the_package_top_and_internals_are_underscored():
    import pkgutil

    for name in cluster.__all__:  # each resolves (the serving names on first use)
        assert getattr(cluster, name) is not None, name
    for internal in ("seal", "open_sealed", "check_key", "artifact_fields",
                     "artifact_from_fields", "FORMAT_VERSION"):
        assert internal not in cluster.__all__
        with pytest.raises(AttributeError):
            getattr(cluster, internal)
    floors, public = set(), set()
    for info in pkgutil.walk_packages(cluster.__path__, "dynvm.cluster."):
        leaf = info.name.rsplit(".", 1)[1]
        if info.ispkg:
            floors.add(leaf)
        elif not leaf.startswith("_"):
            public.add(leaf)
    assert floors == {"store", "fleet", "protocol", "serving"}
    assert public == PUBLIC_MODULES


def test_serving_config_is_checked_and_read_from_mappings():
    from dynvm.cluster import Autoscaling, BatchingOptions, ServingConfig, ServingLimits

    made = ServingConfig.from_mapping({
        "device": "cpu", "jit": {"online_compile": False}, "num_replicas": 2,
        "batching": {"max_batch_size": 4, "preferred_sizes": [8, 2, 8]},
        "limits": {"call_seconds": 5}, "autoscaling": {"max_replicas": 3}})
    assert made.batching == BatchingOptions(max_batch_size=4, preferred_sizes=(2, 8))
    assert made.limits == ServingLimits(call_seconds=5)
    assert made.autoscaling == Autoscaling(max_replicas=3)
    assert made.jit.online_compile is False and made.num_replicas == 2
    assert made.replace(device="cuda").device == "cuda" and made.device == "cpu"
    for bad, message in (({"batch_size": 4}, "unknown dynvm model app arg 'batch_size'"),
                         ({"fleet": {}}, "unknown dynvm model app arg 'fleet'"),
                         ({"limits": {"seconds": 1}}, "unknown limits key 'seconds'"),
                         ({"jit": {"fast": True}}, "unknown jit key 'fast'"),
                         ({"max_body_bytes": 0}, "max_body_bytes must be an integer")):
        with pytest.raises(ValueError, match=message):
            ServingConfig.from_mapping(bad)
    with pytest.raises(TypeError, match="batching must be a BatchingOptions"):
        ServingConfig(batching=False)
