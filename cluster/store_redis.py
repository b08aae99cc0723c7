"""`RedisStore`: the cluster's kernel store, one Redis string per artifact key.

Redis is run as a cache (deploy/redis.conf: maxmemory + allkeys-lru, no persistence):
an evicted or lost entry only costs a recompile. `get` is one MGET round trip for any
number of keys; `put` is one SET (with EX when a TTL is configured).

Credentials never reach a message: redis-py's errors can quote the connection URL, so
every error text is scrubbed of the password (raw and URL-decoded) and of any URL
userinfo before it becomes a `StoreUnavailable`, which is raised outside the handler so
it carries no `__context__`: the original exception is neither printed nor reachable.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.connection import parse_url
from redis.retry import Retry

from dynvm.cluster.store_base import (
    MAX_ENTRY_BYTES,
    StoreStats,
    StoreUnavailable,
    check_key,
    check_value,
)

_URL_USERINFO = re.compile(r"(?i)\b((?:rediss?|unix)://)[^@/\s]*@")
_REDACTED = "***"


@dataclass(frozen=True, repr=False)
class RedisConfig:
    """How to reach the Redis that holds the kernel store. Build it with
    `dynvm.cluster.config.StoreConfig.from_env` or by hand; never logs its password."""

    url: str | None = None
    """A redis://, rediss:// (TLS) or unix:// URL. When set it gives host, port and db
    (and user/password if it has them: the URL wins over the fields below)."""
    host: str = "127.0.0.1"
    """Server host name or address, used when `url` is None."""
    port: int = 6379
    """Server TCP port, used when `url` is None."""
    db: int = 0
    """Logical database number, used when `url` is None."""
    username: str | None = None
    """ACL user name (Redis 6+); None means the "default" user."""
    password: str | None = field(default=None, repr=False)
    """Password of `username` (or of `requirepass`); never shown by repr or in errors."""
    tls: bool = False
    """Connect with TLS (implied by a rediss:// URL)."""
    tls_ca_path: str | None = None
    """PEM file of the CA that signed the server's certificate (None: system CAs)."""
    tls_cert_path: str | None = None
    """PEM client certificate, when the server requires client authentication."""
    tls_key_path: str | None = None
    """PEM private key of `tls_cert_path`."""
    tls_verify: bool = True
    """Verify the server certificate and host name; switch off only for tests."""
    namespace: str = "dynvm:k:"
    """Prefix of every Redis key this store writes, so it can share a server."""
    socket_timeout_s: float = 2.0
    """Seconds a read or write on an open connection may take."""
    connect_timeout_s: float = 2.0
    """Seconds a TCP (and TLS) connect may take."""
    retries: int = 1
    """Extra attempts after a connection error or timeout (short backoff between them);
    a broken connection is replaced on the next call, so the store recovers by itself
    once Redis is back."""
    ttl_seconds: int | None = None
    """Expire entries after this many seconds (None: keep until evicted by LRU)."""

    def __post_init__(self) -> None:
        if self.url is not None:
            scheme = urlsplit(self.url).scheme
            if scheme not in ("redis", "rediss", "unix"):
                raise ValueError(f"RedisConfig.url must start with redis://, rediss:// or "
                                 f"unix://, got scheme {scheme!r}")
            try:
                _url_options(self.url)
            except ValueError as error:
                raise ValueError(f"RedisConfig.url {self.location()!r} is invalid: "
                                 f"{scrub(str(error), self._password_forms())}") from None
        if not 0 < self.port < 65536:
            raise ValueError(f"RedisConfig.port must be in 1..65535, got {self.port}")
        if self.db < 0:
            raise ValueError(f"RedisConfig.db must be >= 0, got {self.db}")
        if not self.namespace:
            raise ValueError("RedisConfig.namespace must not be empty")
        for name in ("socket_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RedisConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0:
            raise ValueError(f"RedisConfig.retries must be >= 0, got {self.retries}")
        if self.ttl_seconds is not None and (not isinstance(self.ttl_seconds, int)
                                             or self.ttl_seconds <= 0):
            raise ValueError(f"RedisConfig.ttl_seconds must be a positive int or None, "
                             f"got {self.ttl_seconds!r}")
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("RedisConfig.tls_cert_path and tls_key_path go together")

    def __repr__(self) -> str:
        shown = []
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "password":
                value = None if value is None else _REDACTED
            elif item.name == "url" and value is not None:
                value = _URL_USERINFO.sub(rf"\1{_REDACTED}@", value)
            shown.append(f"{item.name}={value!r}")
        return f"RedisConfig({', '.join(shown)})"

    def location(self) -> str:
        """Where the store lives, for messages: the URL without credentials, or host:port/db."""
        if self.url is not None:
            # Scheme, host, port and path only: userinfo and query may carry credentials.
            parts = urlsplit(self.url)
            return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{self.host}:{self.port}/{self.db}"

    def _password_forms(self) -> tuple[str, ...]:
        """Every form of the password that an error text could contain."""
        found = set()
        candidates = [self.password]
        if self.url is not None:
            with contextlib.suppress(ValueError):
                candidates.append(urlsplit(self.url).password)
        for candidate in candidates:
            if candidate:
                found.update({candidate, unquote(candidate)})
        return tuple(sorted(found, key=len, reverse=True))


def scrub(text: str, secrets: Sequence[str]) -> str:
    """`text` with every secret and any URL userinfo replaced by ***."""
    text = _URL_USERINFO.sub(rf"\1{_REDACTED}@", text)
    for secret in secrets:
        text = text.replace(secret, _REDACTED)
    return text


def _url_options(url: str) -> dict:
    """host/port/db/username/password/path of a Redis URL. The only query option allowed
    is db: credentials belong in the userinfo (where they are known to be redacted) and
    every other setting in a RedisConfig field."""
    unknown = sorted(set(parse_qs(urlsplit(url).query)) - {"db"})
    if unknown:
        raise ValueError(f"unsupported query options {unknown}; only db is accepted, "
                         "the rest are RedisConfig fields")
    return parse_url(url)


def redis_client(config: RedisConfig, name: str = "dynvm-kernel-store") -> redis.Redis:
    """A redis-py client for `config` (timeouts, bounded retries with backoff, TLS,
    ACL user), named `name` in CLIENT LIST."""
    options: dict = {
        "host": config.host,
        "port": config.port,
        "db": config.db,
        "username": config.username,
        "password": config.password,
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "retry": Retry(ExponentialBackoff(cap=0.25, base=0.02), config.retries),
        "client_name": name,
    }
    tls = config.tls
    if config.url is not None:
        parts = _url_options(config.url)
        tls = tls or urlsplit(config.url).scheme == "rediss"
        if "path" in parts:
            options["unix_socket_path"] = parts["path"]
        for name in ("host", "port", "db", "username", "password"):
            if name in parts:
                options[name] = parts[name]
    if tls:
        options.update(
            ssl=True,
            ssl_ca_certs=config.tls_ca_path,
            ssl_certfile=config.tls_cert_path,
            ssl_keyfile=config.tls_key_path,
            ssl_cert_reqs="required" if config.tls_verify else "none",
            ssl_check_hostname=config.tls_verify,
        )
    return redis.Redis(**options)


class RedisStore:
    """A `KernelStore` in Redis (see the module docstring)."""

    def __init__(self, config: RedisConfig, max_entry_bytes: int = MAX_ENTRY_BYTES):
        self.config = config
        self.max_entry_bytes = max_entry_bytes
        self.stats = StoreStats()
        self._secrets = config._password_forms()
        self._redis = redis_client(config)

    def __repr__(self) -> str:
        return f"RedisStore({self.config.location()!r}, namespace={self.config.namespace!r})"

    def get(self, keys: Sequence[str]) -> dict[str, bytes]:
        keys = [check_key(key) for key in keys]
        if not keys:
            return {}
        namespace = self.config.namespace
        # Note [Entry size cap]: sizes first (one pipelined round trip), then only the
        # entries within the cap; a value that grew in between is dropped after all.
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(namespace + key)
        sizes = self._call("get", pipe.execute)
        small = [key for key, size in zip(keys, sizes, strict=True)
                 if size <= self.max_entry_bytes]
        values = self._call("get", self._redis.mget, [namespace + key for key in small]) \
            if small else []
        found = {key: bytes(value) for key, value in zip(small, values, strict=True)
                 if value is not None and len(value) <= self.max_entry_bytes}
        oversized = (len(keys) - len(small)) + sum(
            1 for value in values if value is not None and len(value) > self.max_entry_bytes)
        if oversized:
            self.stats.record_oversized(oversized)
        self.stats.record_get(len(found), len(keys) - len(found))
        return found

    def put(self, key: str, value: bytes) -> None:
        key = check_key(key)
        value = check_value(key, value, self.max_entry_bytes)
        self._call("put", self._redis.set, self.config.namespace + key, value,
                   ex=self.config.ttl_seconds)
        self.stats.record_put()

    def ping(self) -> None:
        """Raise `StoreUnavailable` unless Redis answers."""
        self._call("ping", self._redis.ping)

    def close(self) -> None:
        self._redis.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _call(self, action: str, command, *args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (redis.RedisError, OSError) as error:
            failure = self._unavailable(action, error)
        # Raised outside the except block: the scrubbed error has no __context__ that
        # could carry redis-py's original text (and with it a URL or password).
        raise failure

    def _unavailable(self, action: str, error: BaseException) -> StoreUnavailable:
        self.stats.record_error()
        detail = scrub(str(error), self._secrets) or "no detail"
        return StoreUnavailable(f"kernel store at {self.config.location()} unavailable "
                                f"({action}): {type(error).__name__}: {detail}")
