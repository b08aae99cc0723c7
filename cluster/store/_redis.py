"""`RedisStore`: the cluster's kernel store, one Redis string per artifact key.

Redis is run as a cache (deploy/redis.conf: maxmemory + allkeys-lru, no persistence):
an evicted or lost entry only costs a recompile. `get` is one pipelined round trip for
any number of entries of up to HEAD_BYTES, and two more for a longer one (Note [Reading
within the cap]); `put` is one transaction: the SET
(with EX when a TTL is configured) and the program's use record. Expiry and the size
bound per program follow Note [Artifact lifetime] (dynvm.cluster.store._base): a program's
use record is the sorted set `<namespace>{<tag>}:used` (member: key, score: last use in
Unix seconds), and `<namespace>{<tag>}:renewed` (SET NX, lives half a TTL) elects the
one reader that renews the program's TTLs; both share the entries' hash tag and so
their Redis Cluster slot.

Credentials never reach a message: redis-py's errors can quote the connection URL, so
every error text is scrubbed of the password (raw and URL-decoded) and of any URL
userinfo before it becomes a `StoreUnavailable`, which is raised outside the handler so
it carries no `__context__`: the original exception is neither printed nor reachable.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.connection import parse_url
from redis.retry import Retry

from dynvm.cluster.store._base import (
    DEFAULT_MAX_ENTRIES_PER_PROGRAM,
    DEFAULT_REFRESH_INTERVAL_S,
    MAX_ENTRY_BYTES,
    StoreStats,
    StoreUnavailable,
    UseMarks,
    check_key,
    check_value,
)
from dynvm.jit.artifact_keys import program_tag_of
from dynvm.vm.errors import ConfigError

logger = logging.getLogger(__name__)

HEAD_BYTES = 16 * 1024
"""What `get` reads of each entry in its first round trip (Note [Reading within the cap])."""

# Note [Reading within the cap]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Note [Entry size cap] wants an entry's size known before it is downloaded. Asking for
# the sizes first (STRLEN) and then the values (MGET) is two round trips on every read,
# and every replica's install is one read: at a thousand replicas the fleet simulator's
# hosts spent two thirds of their active time in store reads. So `get` asks in one
# pipeline for each entry's first HEAD_BYTES + 1 bytes (GETRANGE): an entry that came
# back shorter is whole (a CPU artifact is a few KB), and only a longer one (Triton
# binaries) is measured and read as before, if within the cap. A hostile huge entry
# costs HEAD_BYTES + 1 bytes, never the entry. GETRANGE answers "" both for an empty
# value and for an absent one: only for those is EXISTS asked, in a second round trip
# (a sealed artifact is never empty, so that is a miss). Asking EXISTS beside every
# GETRANGE cost every read a second command: 50 us of client CPU against 35 (redis-py,
# one 6 KB entry), on every install and on every 2 s index poll of every replica. A
# Redis ACL without GETRANGE answers NOPERM: the store says so once in the log and reads
# sizes first from then on (deploy/redis.conf's example ACL wants +getrange for the
# one-trip read).

PIECE_BYTES = 1 << 20
"""Entries longer than this are read in pieces of this size (Note [Reading in pieces])."""

# Note [Reading in pieces]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# redis-py's parser holds a reply three times while it reads it (its socket buffer, the
# bytes it reads out of it, and that without its CRLF), so one MGET of a 16 MiB entry
# peaked at +50 MiB: an entry that anyone who can write to Redis chose cost every replica
# that read it three times its size before a byte of it was checked. An entry longer
# than PIECE_BYTES is read in GETRANGE pieces into one buffer instead (one round trip
# per MiB; artifacts are a few KB, Triton binaries rarely past a MiB): +35 MiB for 16,
# the value itself and its final copy included. A piece shorter than asked means the
# entry shrank or went away meanwhile: a miss. One that changed in place between pieces
# reads as a value its MAC refuses (Note [Signed artifacts]), counted, never used. A
# user without GETRANGE reads with MGET as before.

_LONGER = object()      # longer than the head: measure, then read if within the cap
_TOO_LARGE = object()   # larger than the cap: counted as oversized, treated as absent

_URL_USERINFO = re.compile(r"(?i)\b((?:rediss?|unix)://)[^@/\s]*@")
_REDACTED = "***"


@dataclass(frozen=True, repr=False)
class RedisConfig:
    """How to reach the Redis that holds the kernel store. Build it with
    `dynvm.cluster.store._store_config.StoreConfig.from_env` or by hand; never logs its password."""

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
    """Expire entries after this many seconds without a use of their program (Note
    [Artifact lifetime]); None: keep them until the size bound or Redis's LRU evicts them."""
    max_entries_per_program: int = DEFAULT_MAX_ENTRIES_PER_PROGRAM
    """Entries one program may hold; a write past it deletes the program's least recently
    used ones (Note [Artifact lifetime])."""
    refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S
    """Mark a program in use (renew its TTLs, update its use times) at most this often,
    and at most every ttl_seconds / 4."""

    def __post_init__(self) -> None:
        if self.url is not None:
            scheme = urlsplit(self.url).scheme
            if scheme not in ("redis", "rediss", "unix"):
                raise ConfigError(f"RedisConfig.url must start with redis://, rediss:// or "
                                 f"unix://, got scheme {scheme!r}")
            try:
                _url_options(self.url)
            except ValueError as error:
                raise ConfigError(f"RedisConfig.url {self.location()!r} is invalid: "
                                 f"{scrub(str(error), self._password_forms())}") from None
        if not 0 < self.port < 65536:
            raise ConfigError(f"RedisConfig.port must be in 1..65535, got {self.port}")
        if self.db < 0:
            raise ConfigError(f"RedisConfig.db must be >= 0, got {self.db}")
        if not self.namespace:
            raise ConfigError("RedisConfig.namespace must not be empty")
        if "{" in self.namespace or "}" in self.namespace:
            # Redis Cluster would hash the namespace's braces instead of the program tag.
            raise ConfigError(f"RedisConfig.namespace must not contain braces, "
                             f"got {self.namespace!r} (Note [Program hash tags])")
        if type(self.max_entries_per_program) is not int or self.max_entries_per_program < 1:
            raise ConfigError(f"RedisConfig.max_entries_per_program must be an int >= 1, "
                             f"got {self.max_entries_per_program!r}")
        if not self.refresh_interval_s > 0:
            raise ConfigError(f"RedisConfig.refresh_interval_s must be > 0, "
                             f"got {self.refresh_interval_s!r}")
        for name in ("socket_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"RedisConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0:
            raise ConfigError(f"RedisConfig.retries must be >= 0, got {self.retries}")
        if self.ttl_seconds is not None and (not isinstance(self.ttl_seconds, int)
                                             or self.ttl_seconds <= 0):
            raise ConfigError(f"RedisConfig.ttl_seconds must be a positive int or None, "
                             f"got {self.ttl_seconds!r}")
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ConfigError("RedisConfig.tls_cert_path and tls_key_path go together")

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
        raise ConfigError(f"unsupported query options {unknown}; only db is accepted, "
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
        self._marks = UseMarks(config.refresh_interval_s, config.ttl_seconds)
        self._head_reads = True   # False once the Redis ACL refused GETRANGE

    def __repr__(self) -> str:
        return f"RedisStore({self.config.location()!r}, namespace={self.config.namespace!r})"

    def get(self, keys: Sequence[str]) -> dict[str, bytes]:
        keys = [check_key(key) for key in keys]
        if not keys:
            return {}
        names = [self.config.namespace + key for key in keys]
        values = self._read_heads(names)
        longer = [i for i, value in enumerate(values) if value is _LONGER]
        if longer:
            read = self._read_sized([names[i] for i in longer])
            for i, value in zip(longer, read, strict=True):
                values[i] = value
        found = {key: value for key, value in zip(keys, values, strict=True)
                 if isinstance(value, bytes)}
        oversized = sum(1 for value in values if value is _TOO_LARGE)
        if oversized:
            self.stats.record_oversized(oversized)
        self.stats.record_get(len(found), len(keys) - len(found))
        self._mark_used(found)
        return found

    def _read_heads(self, names: list[str]) -> list:
        """Per entry in one round trip (Note [Reading within the cap]; a second one only
        for entries that came back empty): its bytes if it is at most a head long
        (HEAD_BYTES, or the cap if smaller), None if absent, else _LONGER."""
        if not self._head_reads:
            return [_LONGER] * len(names)
        head_bytes = min(HEAD_BYTES, self.max_entry_bytes)
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, head_bytes)   # one byte past the head: tells a longer one
        heads = self._call("get", self._execute_unless_refused, pipe)
        if heads is None:
            self._head_reads = False
            logger.warning("kernel store at %s: the Redis user may not run GETRANGE; "
                           "reading entry sizes first (one more round trip per read)",
                           self.config.location())
            return [_LONGER] * len(names)
        values = [_LONGER if len(head) > head_bytes else bytes(head) for head in heads]
        empty = [i for i, value in enumerate(values) if value == b""]
        if empty:   # empty or absent: GETRANGE cannot tell them apart
            pipe = self._redis.pipeline(transaction=False)
            for i in empty:
                pipe.exists(names[i])
            for i, exists in zip(empty, self._call("get", pipe.execute), strict=True):
                values[i] = b"" if exists else None
        return values

    @staticmethod
    def _execute_unless_refused(pipe):
        try:
            return pipe.execute()
        except redis.exceptions.NoPermissionError:
            return None

    def _read_sized(self, names: list[str]) -> list:
        """Per entry: its size first (one pipelined round trip), then the entries within
        the cap (one MGET); None if absent, _TOO_LARGE if over the cap (a value that grew
        in between is dropped after all)."""
        cap = self.max_entry_bytes
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
        sizes = self._call("get", pipe.execute)
        whole = cap if not self._head_reads else min(cap, PIECE_BYTES)
        small = [name for name, size in zip(names, sizes, strict=True) if size <= whole]
        values = dict(zip(small, self._call("get", self._redis.mget, small), strict=True)) \
            if small else {}
        for name, size in zip(names, sizes, strict=True):
            if whole < size <= cap:
                values[name] = self._read_pieces(name, size)
        read = []
        for name in names:
            value = values.get(name, _TOO_LARGE)
            if isinstance(value, bytes | bytearray):
                value = bytes(value) if len(value) <= cap else _TOO_LARGE
            read.append(value)
        return read

    def _read_pieces(self, name: str, size: int) -> bytes | None:
        """The `size` bytes of entry `name`, read in pieces (Note [Reading in pieces]);
        None if it is shorter by now."""
        buffer = bytearray(size)
        for start in range(0, size, PIECE_BYTES):
            end = min(start + PIECE_BYTES, size)
            piece = self._call("get", self._redis.getrange, name, start, end - 1)
            if len(piece) != end - start:
                return None
            buffer[start:end] = piece
            del piece
        return bytes(buffer)

    def put(self, key: str, value: bytes) -> None:
        key = check_key(key)
        value = check_value(key, value, self.max_entry_bytes)
        namespace, ttl = self.config.namespace, self.config.ttl_seconds
        tag = program_tag_of(key)
        if tag is None:
            self._call("put", self._redis.set, namespace + key, value, ex=ttl)
            self.stats.record_put()
            return
        used = self._used_key(tag)
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(namespace + key, value, ex=ttl)
        pipe.zadd(used, {key: time.time()})
        if ttl is not None:
            pipe.expire(used, ttl)  # the record lives as long as the newest entry
        pipe.zcard(used)
        held = self._call("put", pipe.execute)[-1]
        self.stats.record_put()
        if held > self.config.max_entries_per_program:
            self._evict(used, held - self.config.max_entries_per_program)

    def contains(self, keys: Sequence[str]) -> set[str]:
        keys = [check_key(key) for key in keys]
        if not keys:
            return set()
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.config.namespace + key)
        found = self._call("contains", pipe.execute)
        return {key for key, count in zip(keys, found, strict=True) if count}

    def _used_key(self, tag: str) -> str:
        return f"{self.config.namespace}{{{tag}}}:used"

    def _evict(self, used: str, count: int) -> None:
        """Delete a program's `count` least recently used entries and their records."""
        oldest = [member.decode() for member in
                  self._call("put", self._redis.zrange, used, 0, count - 1)]
        if not oldest:
            return
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(*(self.config.namespace + key for key in oldest))
        pipe.zrem(used, *oldest)
        self._call("put", pipe.execute)
        self.stats.record_evicted(len(oldest))

    def _mark_used(self, found: Sequence[str]) -> None:
        """Mark the programs of the entries just read as in use (Note [Artifact lifetime]):
        the entries read get a new use time, and with a TTL every entry of those programs
        a fresh one, renewed by one reader of the fleet per half TTL (whoever sets the
        program's renewal marker). Best effort: the values are already read, so a failure
        is counted and logged, not raised."""
        due = self._marks.due(found)
        if not due:
            return
        namespace, ttl, now = self.config.namespace, self.config.ttl_seconds, time.time()
        try:
            pipe = self._redis.pipeline(transaction=False)
            for tag, keys in due.items():
                pipe.zadd(self._used_key(tag), dict.fromkeys(keys, now))
                if ttl is not None:
                    pipe.set(f"{namespace}{{{tag}}}:renewed", b"", nx=True, px=ttl * 500)
            answers = self._call("mark", pipe.execute)
            if ttl is None:
                return
            renew = [tag for tag, won in zip(due, answers[1::2], strict=True) if won]
            if not renew:
                return
            pipe = self._redis.pipeline(transaction=False)
            for tag in renew:
                pipe.zrange(self._used_key(tag), 0, -1)
            listed = self._call("mark", pipe.execute)
            pipe = self._redis.pipeline(transaction=False)
            for tag, members in zip(renew, listed, strict=True):
                for member in members:
                    pipe.expire(namespace + member.decode(), ttl)
                pipe.expire(self._used_key(tag), ttl)
            self._call("mark", pipe.execute)
        except StoreUnavailable as error:
            logger.warning("%s", error)

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
