"""Configuration of the cluster layer: the kernel store (`StoreConfig`) and request
batching (`BatchingOptions`, the one place its defaults live).

`StoreConfig.from_env()` builds it from the DYNVM_STORE_* and DYNVM_REDIS_* variables,
which `dynvm._env.store_settings` reads and checks (that module's docstring and the
README's "Environment variables" section list them). Neither the secret nor the Redis
password appears in a repr or an error message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from dynvm._env import STORE_SECRET, EnvVarError, store_settings
from dynvm.cluster.store_base import KernelStore
from dynvm.cluster.store_local import LocalDirStore
from dynvm.cluster.store_redis import RedisConfig, RedisStore
from dynvm.vm.errors import DynvmError

SECRET_VARIABLE = STORE_SECRET


class StoreConfigError(DynvmError, ValueError):
    """The environment does not describe a usable kernel store (names the variable)."""


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


@dataclass(frozen=True)
class BatchingOptions:
    """How a model replica batches requests (Note [Opportunistic batching] in
    dynvm.cluster.batcher). `serve_models`, the Serve config builder and `dynvm serve`'s
    flags all end here; nothing else holds batching defaults."""

    max_batch_size: int = 8
    """Requests in one batch at most."""
    max_batch_bytes: int = 16 * 1024 * 1024
    """Input bytes in one batch at most (a request larger than this runs alone)."""
    max_delay_s: float = 0.002
    """Longest a formed batch of two or more requests is held for one more request when
    that would reach a preferred size; a lone request is never held, and a request that
    finds the model idle runs at once. 0: never hold."""
    preferred_sizes: tuple[int, ...] = ()
    """Batch sizes (rows along dim 0) to aim for, besides those the JIT has specialized
    (`shape_aware`), e.g. the sizes `dynvm precompile` filled the store with."""
    shape_aware: bool = True
    """Prefer batches whose row count ran specialized before: take fewer requests (the
    rest form the next batch) rather than make a row count that would be interpreted."""
    max_queued: int = 64
    """Requests waiting for the model at most; one more is answered 503 + Retry-After."""

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_bytes", "max_queued"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"BatchingOptions.{name} must be an integer >= 1, "
                                 f"got {value!r}")
        if not (isinstance(self.max_delay_s, int | float) and math.isfinite(self.max_delay_s)
                and 0 <= self.max_delay_s <= 1):
            raise ValueError(f"BatchingOptions.max_delay_s must be between 0 and 1 s, "
                             f"got {self.max_delay_s!r}")
        sizes = tuple(self.preferred_sizes)
        if any(type(n) is not int or n < 1 for n in sizes):
            raise ValueError(f"BatchingOptions.preferred_sizes must be integers >= 1, "
                             f"got {self.preferred_sizes!r}")
        object.__setattr__(self, "preferred_sizes", tuple(sorted(set(sizes))))
