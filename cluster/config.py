"""Kernel store configuration. The one module of dynvm.cluster that reads the environment.

Environment variables (`StoreConfig.from_env`):

    DYNVM_STORE_SECRET     required, non-empty: the HMAC-SHA256 key that seals artifacts
                           (Note [Signed artifacts] in dynvm.cluster.signed). The same
                           value on every process of a cluster; e.g. `openssl rand -hex 32`.
    DYNVM_REDIS_URL        redis://, rediss:// or unix:// URL: use Redis (a cluster).
    DYNVM_STORE_DIR        a directory: use a local store (one machine). Without either,
                           $XDG_CACHE_HOME/dynvm/kernels (default ~/.cache/dynvm/kernels).
    DYNVM_REDIS_USERNAME   ACL user.
    DYNVM_REDIS_PASSWORD   password of that user (or requirepass).
    DYNVM_REDIS_TLS        "1"/"true" to use TLS with a redis:// URL.
    DYNVM_REDIS_TLS_CA     CA certificate (PEM) of the server.
    DYNVM_REDIS_TLS_CERT   client certificate (PEM), with DYNVM_REDIS_TLS_KEY.
    DYNVM_REDIS_TLS_KEY    client private key (PEM).
    DYNVM_REDIS_NAMESPACE  key prefix (default "dynvm:k:").
    DYNVM_STORE_TTL_S      expire Redis entries after this many seconds (default: never,
                           LRU eviction only).

Neither the secret nor the Redis password appears in a repr or an error message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dynvm.cluster.store_base import KernelStore
from dynvm.cluster.store_local import LocalDirStore
from dynvm.cluster.store_redis import RedisConfig, RedisStore

SECRET_VARIABLE = "DYNVM_STORE_SECRET"


class StoreConfigError(ValueError):
    """The environment does not describe a usable kernel store (names the variable)."""


def _flag(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("", "0", "false", "no", "off"):
        return False
    raise StoreConfigError(f"{name} must be a boolean (1/0, true/false), got {text!r}")


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise StoreConfigError(f"{name} must be a positive integer, got {text!r}")
    return value


def _default_dir(environ: Mapping[str, str]) -> str:
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "dynvm" / "kernels")


@dataclass(frozen=True)
class StoreConfig:
    """Which kernel store to open and the secret that seals its entries."""

    secret: bytes = field(repr=False)
    """HMAC-SHA256 key of Note [Signed artifacts]; never shown by repr or in messages."""
    redis: RedisConfig | None = None
    """Use this Redis (a cluster); exclusive with `local_dir`."""
    local_dir: str | None = None
    """Use this directory (one machine); exclusive with `redis`."""

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes):
            raise StoreConfigError(f"StoreConfig.secret must be bytes, "
                                   f"got {type(self.secret).__name__}")
        if not self.secret:
            raise StoreConfigError(f"the kernel store secret is empty: set {SECRET_VARIABLE} "
                                   "to the same random value on every process "
                                   "(e.g. `openssl rand -hex 32`)")
        if (self.redis is None) == (self.local_dir is None):
            raise StoreConfigError("StoreConfig needs exactly one of redis and local_dir")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreConfig:
        """Read the variables of the module docstring from `environ` (default os.environ)."""
        env = os.environ if environ is None else environ
        secret = env.get(SECRET_VARIABLE, "")
        if not secret.strip():
            state = "empty" if SECRET_VARIABLE in env else "not set"
            raise StoreConfigError(
                f"{SECRET_VARIABLE} is {state}: the kernel store signs and verifies compiled "
                f"kernels with it. Set it to the same random value on every process of "
                f"the cluster (e.g. `openssl rand -hex 32`).")
        url, directory = env.get("DYNVM_REDIS_URL") or None, env.get("DYNVM_STORE_DIR") or None
        if url is not None and directory is not None:
            raise StoreConfigError("set DYNVM_REDIS_URL or DYNVM_STORE_DIR, not both")
        if url is None:
            return cls(secret=secret.encode(), local_dir=directory or _default_dir(env))
        ttl = env.get("DYNVM_STORE_TTL_S")
        try:
            redis = RedisConfig(
                url=url,
                username=env.get("DYNVM_REDIS_USERNAME") or None,
                password=env.get("DYNVM_REDIS_PASSWORD") or None,
                tls=_flag("DYNVM_REDIS_TLS", env.get("DYNVM_REDIS_TLS", "")),
                tls_ca_path=env.get("DYNVM_REDIS_TLS_CA") or None,
                tls_cert_path=env.get("DYNVM_REDIS_TLS_CERT") or None,
                tls_key_path=env.get("DYNVM_REDIS_TLS_KEY") or None,
                namespace=env.get("DYNVM_REDIS_NAMESPACE") or "dynvm:k:",
                ttl_seconds=_positive_int("DYNVM_STORE_TTL_S", ttl) if ttl else None,
            )
        except StoreConfigError:
            raise
        except ValueError as error:  # RedisConfig's messages are already scrubbed
            raise StoreConfigError(f"DYNVM_REDIS_*: {error}") from None
        return cls(secret=secret.encode(), redis=redis)

    def open_store(self) -> KernelStore:
        """The configured store (a Redis client connects lazily, on first use)."""
        if self.redis is not None:
            return RedisStore(self.redis)
        assert self.local_dir is not None
        return LocalDirStore(self.local_dir)
