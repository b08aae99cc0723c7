"""Configuration of the kernel store (`StoreConfig`); how a model is served is
`ServingConfig` (dynvm.cluster.serving.serving_config).

`StoreConfig.from_env()` builds it from the DYNVM_STORE_* and DYNVM_REDIS_* variables,
which `dynvm._env.store_settings` reads and checks (that module's docstring and the
README's "Environment variables" section list them). Neither the secret nor the Redis
password appears in a repr or an error message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dynvm._env import STORE_SECRET, EnvVarError, store_settings
from dynvm.cluster.store._base import KernelStore
from dynvm.cluster.store._local import LocalDirStore
from dynvm.cluster.store._redis import RedisConfig, RedisStore
from dynvm.vm.errors import ConfigError

SECRET_VARIABLE = STORE_SECRET


class StoreConfigError(ConfigError):
    """The environment does not describe a usable kernel store (names the variable); a
    setting error like any other (Conventions 11)."""


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
        """From the variables `dynvm._env.store_settings` reads, in `environ` (a mapping,
        for tests) or the process environment."""
        try:
            env = store_settings(environ)
        except EnvVarError as error:
            raise StoreConfigError(str(error)) from None
        if env.redis_url is None:
            return cls(secret=env.secret.encode(), local_dir=env.local_dir)
        try:
            redis = RedisConfig(
                url=env.redis_url, username=env.redis_username,
                password=env.redis_password, tls=env.redis_tls,
                tls_ca_path=env.redis_tls_ca, tls_cert_path=env.redis_tls_cert,
                tls_key_path=env.redis_tls_key, namespace=env.redis_namespace,
                ttl_seconds=env.ttl_seconds)
        except ValueError as error:  # RedisConfig's messages are already scrubbed
            raise StoreConfigError(f"DYNVM_REDIS_*: {error}") from None
        return cls(secret=env.secret.encode(), redis=redis)

    def open_store(self) -> KernelStore:
        """The configured store (a Redis client connects lazily, on first use)."""
        if self.redis is not None:
            return RedisStore(self.redis)
        assert self.local_dir is not None
        return LocalDirStore(self.local_dir)
