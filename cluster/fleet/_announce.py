"""Announcing new artifacts: Redis pub/sub from the compile service to every replica.

An announcement says only "the artifact stored under KEY is new for PROGRAM on
TARGET" (plus, when tracing, the W3C trace context of the compile that made it). It is
a hint, never trusted content: a replica fetches KEY from the kernel store and verifies
it there (Note [Signed artifacts]) before anything is installed, so a forged
announcement can at worst make a replica look up a key. Pub/sub delivers at most once
and only to connected subscribers; what a replica misses (Redis restarting, the replica
starting later) it finds in the program's index entry (dynvm.cluster.fleet._records),
which it reads at start-up and polls.

Note [Announcement channels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each program has its own channel, `dynvm:announce:{<program tag>}`, and a replica
subscribes to its program's alone. With one channel for the whole cluster every PUBLISH
went to every replica of every program, and each replica read, decoded and dropped the
announcements of programs it does not serve: Redis's fan-out and the replicas' reading
grew as N x (announcements of all programs), where only N/P x (one program's) install
anything. Measured in the fleet simulator (bench/fleet_sim.py, 4 programs, N = 1000):
52,000 deliveries per run, three in four dropped on arrival. The target stays in the
message (a GPU replica and a CPU replica of one program share the channel and
filter by target, FleetLink.wants). In a Redis Cluster one channel per program is also
what sharded pub/sub (SPUBLISH, Redis 7) distributes over the shards by slot; the
program's tag in braces, as in its keys, keeps the channel on its program's slot (Note
[Program hash tags] in dynvm.jit.artifact_keys).

Note [Announcement bursts]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Announcements come in bursts: the shapes of a new traffic pattern are sighted together,
so their compiles finish and are published within a few hundred milliseconds of each
other, and a replica that was busy (its core taken by requests, or by installing the
previous one) finds several waiting on its subscription's socket. A `Subscription` with
`on_batch` reads every message already waiting (up to MAX_BATCH) before handing them
over, and FleetLink.on_announcements fetches their keys in one pipelined store read: one
round trip and one reply to parse for the burst instead of one each. A replica that
keeps up still gets each announcement alone, at once: nothing waits to fill a batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import redis

from dynvm.cluster.store._base import check_key
from dynvm.cluster.store._redis import RedisConfig, redis_client
from dynvm.jit.artifact_keys import program_tag
from dynvm.vm.bounded_decode import DecodeLimits, unpack_msgpack
from dynvm.vm.errors import ConfigError

CHANNEL_PREFIX = "dynvm:announce:"
MAX_BATCH = 64
"""Announcements read off the socket before they are handed over (Note [Announcement
bursts])."""


def channel_for(program_hash: str) -> str:
    """The announce channel of `program_hash` (Note [Announcement channels])."""
    return f"{CHANNEL_PREFIX}{{{program_tag(program_hash)}}}"


_MAX_MESSAGE_BYTES = 4096
_LIMITS = DecodeLimits(max_bytes=_MAX_MESSAGE_BYTES, max_str=_MAX_MESSAGE_BYTES,
                       max_bin=_MAX_MESSAGE_BYTES, max_map=8, max_containers=2, max_depth=2)
"""An announcement is a map of six fields, one of them (the trace carrier) a map of a few
strings (Note [Bounded decoding] in dynvm.vm.bounded_decode): anyone who can publish on
the channel chooses these bytes. Strings and stamps are checked after decoding (a bad
stamp is a hint ignored, not a message dropped)."""
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Announcement:
    """A message on the fleet's announce channel: a new specialization `key` for
    `program` on `target`, with the compile's trace context when it was traced."""

    program: str
    target: str
    key: str
    trace: dict | None = None   # W3C trace-context carrier of the compile, if traced
    stamp: bytes | None = None  # the index write listing `key` (Note [Index stamps])
    after: bytes | None = None  # the index write before it, when `stamp` only added `key`

    def encode(self) -> bytes:
        message = {"program": self.program, "target": self.target, "key": self.key,
                   "trace": self.trace}
        if self.stamp is not None and self.after is not None:
            message.update(stamp=self.stamp, after=self.after)
        return msgpack.packb(message, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Announcement | None:
        """The announcement in `data`, or None for anything malformed (ignored)."""
        if not isinstance(data, bytes) or len(data) > _MAX_MESSAGE_BYTES:
            return None
        try:
            raw = unpack_msgpack(data, _LIMITS, "announcement")
            program, target, key = raw["program"], raw["target"], check_key(raw["key"])
            trace = raw.get("trace")
            stamp, after = raw.get("stamp"), raw.get("after")
        except Exception:  # any malformed message is dropped, never raised into a replica
            return None
        if not isinstance(program, str) or not isinstance(target, str):
            return None
        if trace is not None and not (isinstance(trace, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in trace.items())):
            trace = None
        if not (_is_stamp(stamp) and _is_stamp(after)):
            stamp = after = None   # a hint only: anything else is as if there were none
        return cls(program, target, key, trace, stamp, after)


def _is_stamp(value: object) -> bool:
    return isinstance(value, bytes) and 0 < len(value) <= 64


class RateLimit:
    """A token bucket: at most `rate` events a second on average, `burst` at once.
    Thread-safe. Bounds what announcements (which anyone who can publish on the channel
    can send) make a replica fetch from the store each second."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic) -> None:
        if not rate > 0 or burst < 1:
            raise ConfigError(f"RateLimit needs rate > 0 and burst >= 1, got {rate}, {burst}")
        self.rate, self.burst, self._clock = float(rate), int(burst), clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False


class Announcer:
    """Publishes announcements; a Redis outage costs only the announcement (counted)."""

    def __init__(self, config: RedisConfig) -> None:
        self._redis = redis_client(config, "dynvm-announcer")
        self.sent = 0
        self.failed = 0

    def publish(self, announcement: Announcement) -> bool:
        try:
            self._redis.publish(channel_for(announcement.program), announcement.encode())
        except redis.RedisError as error:
            self.failed += 1
            logger.warning("announce failed (%s); replicas will find %s in the index",
                           type(error).__name__, announcement.key[:16])
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        self._redis.close()


class Subscription:
    """A thread that hands every well-formed announcement for `program_hash` to
    `on_message`, or with `on_batch` the announcements waiting on its socket together
    (Note [Announcement bursts]); reconnects with exponential backoff (capped) when Redis
    goes away, counting reconnects."""

    def __init__(self, config: RedisConfig, program_hash: str,
                 on_message: Callable[[Announcement], None] | None = None,
                 max_backoff_s: float = 2.0,
                 on_batch: Callable[[list[Announcement]], None] | None = None) -> None:
        if (on_message is None) == (on_batch is None):
            raise ConfigError("a Subscription needs exactly one of on_message, on_batch")
        self._config = config
        self.channel = channel_for(program_hash)
        self._on_message = on_message
        self._on_batch = on_batch
        self._max_backoff_s = max_backoff_s
        self._stop = threading.Event()
        self.connected = threading.Event()
        self.received = 0
        self.reconnects = 0
        self._thread = threading.Thread(target=self._run, name="dynvm-announce", daemon=True)

    def start(self) -> Subscription:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            client = redis_client(self._config, "dynvm-subscriber")
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                self.connected.set()
                backoff = 0.05
                while not self._stop.is_set():
                    batch = self._read(pubsub)
                    if not batch:
                        continue
                    self.received += len(batch)
                    if self._on_batch is not None:
                        self._deliver(self._on_batch, batch)
                    else:
                        for announcement in batch:
                            self._deliver(self._on_message, announcement)
            except (redis.RedisError, OSError) as error:
                if self.connected.is_set():
                    logger.warning("announcements lost their Redis connection (%s); "
                                   "reconnecting", type(error).__name__)
                self.connected.clear()
                self.reconnects += 1
                self._stop.wait(backoff)
                backoff = min(self._max_backoff_s, backoff * 2)
            finally:
                try:
                    pubsub.close()
                    client.close()
                except (redis.RedisError, OSError):
                    pass
        self.connected.clear()

    def _read(self, pubsub) -> list[Announcement]:
        """The well-formed announcements of the next message (waiting up to half a
        second for one) and, with `on_batch`, of those already waiting behind it."""
        batch: list[Announcement] = []
        timeout = 0.5
        while len(batch) < MAX_BATCH:
            message = pubsub.get_message(timeout=timeout)
            if message is None:
                break
            if message.get("type") == "message":
                announcement = Announcement.decode(message.get("data"))
                if announcement is not None:
                    batch.append(announcement)
            if self._on_batch is None and batch:
                break
            timeout = 0.0   # only what is already there: nothing waits to fill a batch
        return batch

    @staticmethod
    def _deliver(callback, item) -> None:
        try:
            callback(item)
        except Exception:  # a failing install must not stop the subscription
            logger.exception("installing announced artifacts failed")
