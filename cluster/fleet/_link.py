"""`FleetLink`: a replica's connection to the compile service and the kernel store.

It implements the JIT's fleet hooks (Note [Fleet hooks] in dynvm.jit.engine):

* every interpreted region call is counted on the request path (a dict update under a
  lock): with `aggregate` (the default) one record per (region, signature) per report,
  with its count and total seconds (Note [Pre-aggregated observations]), else one
  record per call in a deque. A link thread ships them to the compile service (its
  program's shard, Note [Compile service shards] in dynvm.cluster.fleet._shards) every
  `flush_interval_s`, or later when the service asks for it (back-pressure). When the
  buffer is full new signatures (or the oldest observations) are dropped and counted:
  statistics may be lost, requests never wait;
* while the service answers, promotions do not compile here (the service compiles once
  for the fleet); when it stops answering they compile locally again, until it is back;
* new artifacts arrive by announcement (Redis pub/sub) and by polling the program's
  index; each is fetched, verified (Note [Signed artifacts]), decoded with validation
  (Note [Portable specializations]) and installed. A rejected entry is counted and
  never installed;
* `start()` installs everything the index lists before it returns: a replica that
  starts after a promotion serves that shape specialized from its first request;
* a CUDA replica (with `FleetOptions.gpu_targets`, the compile service's) installs the
  service's Triton artifacts from their stored binaries instead of CPU records, and
  compiles locally only when none fits its GPU (Note [GPU replicas in the fleet] in
  dynvm.cluster.fleet._gpu).

Note [Pre-aggregated observations]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A fleet of a thousand replicas each shipping every interpreted call is a stream the
compile service cannot read (bench/fleet_sim.py measures where it bends). Most of
those calls repeat a few hot signatures, so the replica counts them instead: between
two reports, K calls of one signature become one record [region, signature, total
seconds, carrier, K]. The service feeds that record to its JIT as K observations of
the mean time (dynvm.cluster.fleet._compiler), so a shape is promoted at exactly the
count it would have been promoted at unaggregated. The table is bounded by
`max_buffered` distinct signatures; beyond it a new signature is dropped and counted
(`dropped_observations`), a known one still counts. The service's answer may carry
`backoff_s` (dynvm.cluster.fleet.compile_service): while it is busy, replicas report no more
often than that; with aggregation, waiting loses nothing but latency. A report with
nothing to say is skipped, except one per `poll_interval_s` that keeps the service's
reachability known.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import propagate

from dynvm.cluster._counters import LinkCounters, as_dict
from dynvm.cluster.fleet._announce import Announcement, RateLimit, Subscription
from dynvm.cluster.fleet._compiler import TARGET
from dynvm.cluster.fleet._records import (
    MAX_STAMP_SKIPS,
    index_key,
    keys_from_index,
    portable_from_fields,
    read_index_stamp,
    store_counters,
)
from dynvm.cluster.fleet._shards import shard_actor_name
from dynvm.cluster.store._signed import ArtifactCache
from dynvm.cluster.store._store_config import StoreConfig
from dynvm.jit.artifact import toolchain_versions
from dynvm.jit.portable import PortableError, encode_signature
from dynvm.vm.errors import ConfigError

logger = logging.getLogger(__name__)


def _close_at_exit(link_ref) -> None:
    link = link_ref()
    if link is not None:
        link.close()


@dataclass(frozen=True)
class FleetOptions:
    """How a replica takes part in the fleet's compiling."""

    store: StoreConfig
    """The kernel store and its secret (the same on every process of the cluster)."""
    service_name: str = "dynvm-compile-service"
    """Name of the compile service actor (dynvm.cluster.fleet.compile_service)."""
    service_namespace: str = "dynvm"
    """Ray namespace of that actor."""
    flush_interval_s: float = 0.05
    """How often buffered observations are shipped to the service."""
    poll_interval_s: float = 2.0
    """How often the program's index is re-read (catches missed announcements)."""
    max_buffered: int = 8192
    """Observations kept while the service is slow or away; older ones are dropped."""
    service_timeout_s: float = 2.0
    """A service call slower than this counts as unreachable (compile locally)."""
    gpu_targets: tuple = ()
    """The cluster's GPU targets, as the compile service builds Triton binaries for them
    (("cuda", 90, 32) or "cuda:90"); a CUDA replica without them does not share."""

    max_announced_fetches_per_s: float = 20.0
    """Store lookups announcements may cause per second (a burst of as many); beyond it
    an announcement is dropped (counted) and the index poll finds the artifact."""

    service_shards: int = 1
    """Compile service shards: `start_compile_service(..., shards=n)` starts actors
    `<service_name>-0` .. `-<n-1>` and a program's replicas talk to shard
    hash(program) mod n (Note [Compile service shards] in dynvm.cluster.fleet._shards);
    1: the one actor named `service_name`."""

    aggregate: bool = True
    """Pre-aggregate observations: one record per (region, signature) per report, with
    its count (Note [Pre-aggregated observations]); False ships one record per call."""

    max_backoff_s: float = 2.0
    """The longest the service's back-pressure may stretch the time between reports."""

    def __post_init__(self) -> None:
        for name in ("flush_interval_s", "poll_interval_s", "service_timeout_s",
                     "max_announced_fetches_per_s", "max_backoff_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"FleetOptions.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_buffered", "service_shards"):
            if getattr(self, name) < 1:
                raise ConfigError(f"FleetOptions.{name} must be >= 1, "
                                 f"got {getattr(self, name)}")

    def service_actor(self, program_hash: str) -> str:
        """The name of the compile service actor that `program_hash`'s replicas talk to."""
        return shard_actor_name(self.service_name, program_hash, self.service_shards)


class FleetLink:
    """A replica's connection to the compile service and the kernel store: reports its
    observations, installs what the fleet compiled (see the module docstring)."""

    def __init__(self, runtime, dvm_bytes: bytes, options: FleetOptions, client,
                 gpu_boundary=None) -> None:
        """`gpu_boundary`: where a GPU replica's kernels launch (default: a
        `run_binary.CudaBoundary` on a CUDA runtime's device); a test on a machine
        without a GPU gives a stand-in, and the link behaves as a CUDA replica's."""
        if runtime.jit is None:
            raise ConfigError("a fleet link needs a Runtime with its JIT on")
        self.runtime = runtime
        self.jit = runtime.jit
        self.program = runtime.program
        self.program_hash = self.program.content_hash
        self.options = options
        self.client = client
        self.target = str(runtime.device)
        self.gpu = None
        if options.gpu_targets and (gpu_boundary is not None or runtime.device.type == "cuda"):
            from dynvm.cluster.fleet._gpu import GpuInstaller
            from dynvm.jit.backends.triton.run_binary import CudaBoundary

            boundary = gpu_boundary if gpu_boundary is not None else CudaBoundary(runtime.device)
            self.gpu = GpuInstaller(runtime, options.gpu_targets, boundary)
            self.target = self.gpu.target
        self._dvm_bytes = dvm_bytes
        self.cache = ArtifactCache(options.store.open_store(), options.store.secret,
                                   {"target": self.target, "toolchain": toolchain_versions()})
        # The service compiles for TARGET, and for its GPU targets when configured; other
        # devices keep their local JIT.
        self.shared = self.target == TARGET or self.gpu is not None
        self._buffer: deque = deque()        # unaggregated: one entry per call
        self._counts: dict[tuple, list] = {}  # aggregated: (region, sig) -> [n, s, carrier]
        self._buffer_lock = threading.Lock()
        self._install_lock = threading.Lock()
        self._installed: set[str] = set()
        self._index_stamp: bytes | None = None   # Note [Index stamps]
        self._stamp_skips = 0
        self._service_ok = False
        self._next_report = 0.0      # monotonic time before which the service asked for quiet
        self._next_heartbeat = 0.0   # an empty report is sent no more often than this
        self._next_poll = time.monotonic() + options.poll_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dynvm-fleet-link", daemon=True)
        self._subscription = None
        self._tracing = runtime.telemetry is not None
        self.counters = LinkCounters()
        rate = options.max_announced_fetches_per_s
        self._announce_rate = RateLimit(rate, burst=max(1, round(rate)))
        self.warm_start_seconds = 0.0

    # -- life cycle ------------------------------------------------------------------

    def start(self, threads: bool = True) -> FleetLink:
        """Connect, install what the index lists (warm start), start the link thread and
        the announcement subscription. `threads=False` starts neither: the owner then
        calls `tick()` and delivers announcements to `on_announcement` itself (the fleet
        simulator drives a thousand links from a few threads this way)."""
        if not self.shared:
            return self
        self.jit.connect(self)
        start = time.perf_counter()
        self.counters.warm_start_installs = self.install_indexed()
        self.warm_start_seconds = time.perf_counter() - start
        self.flush()  # learn whether the service is there before the first request
        if not threads:
            return self
        if self.options.store.redis is not None:
            self._subscription = Subscription(self.options.store.redis, self.program_hash,
                                              on_batch=self.on_announcements).start()
        self._thread.start()
        # An install builds meta tensors; one running while the interpreter finalizes
        # would abort the process (Note [Exit with a compile running] in dynvm.jit.queue).
        atexit.register(_close_at_exit, weakref.ref(self))
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._subscription is not None:
            self._subscription.close()

    # -- fleet hooks (called by the JIT) ---------------------------------------------------

    def observed(self, region: int, signature: tuple, seconds: float) -> None:
        carrier = None
        if self._tracing:
            carrier = {}
            propagate.inject(carrier)
        with self._buffer_lock:
            if self.options.aggregate:
                entry = self._counts.get((region, signature))
                if entry is not None:
                    entry[0] += 1
                    entry[1] += seconds
                elif len(self._counts) >= self.options.max_buffered:
                    self.counters.dropped_observations += 1
                else:
                    self._counts[(region, signature)] = [1, seconds, carrier or None]
                return
            if len(self._buffer) >= self.options.max_buffered:
                self._buffer.popleft()
                self.counters.dropped_observations += 1
            self._buffer.append((region, signature, seconds, carrier or None))

    def compiles_locally(self) -> bool:
        return not self._service_ok or (self.gpu is not None and self.gpu.needs_local_compile)

    # -- the link thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.options.flush_interval_s):
            self.tick()

    def tick(self) -> None:
        """One turn of the link thread: report when due (something to say and the
        service not asking for quiet, or a heartbeat), re-read the index when due."""
        now = time.monotonic()
        if now >= self._next_report and (self._has_observations()
                                         or now >= self._next_heartbeat):
            self.flush()
        if now >= self._next_poll:
            self.install_indexed()
            self._next_poll = time.monotonic() + self.options.poll_interval_s

    def _has_observations(self) -> bool:
        return bool(self._counts or self._buffer)

    def flush(self) -> None:
        """Ship the buffered observations now (the link thread calls this; so does
        `dynvm precompile`, which drives a link without starting its thread)."""
        batch = self._take_batch()
        if self.gpu is not None:
            # The service specializes on its own device (Note [GPU replicas in the fleet]).
            from dynvm.cluster.fleet._gpu import fleet_signature

            batch = [[r, fleet_signature(sig, TARGET), *rest] for r, sig, *rest in batch]
        observations = sum(item[4] if len(item) > 4 else 1 for item in batch)
        now = time.monotonic()
        self._next_heartbeat = now + self.options.poll_interval_s
        answer = self.client.report(self.program_hash, batch)
        self.counters.reports += 1
        if answer is not None and not answer.get("known", True):
            self.counters.registrations += 1
            if self.client.register(self.program_hash, self._dvm_bytes):
                answer = self.client.report(self.program_hash, batch)
        if answer is None or not answer.get("known", False):
            if self._service_ok:
                logger.warning("compile service unreachable: compiling locally until it "
                               "answers again")
            self._service_ok = False
            self.counters.service_failures += 1
            self.counters.dropped_observations += observations
            return
        self._service_ok = True
        self.counters.reported += observations
        self.counters.records += len(batch)
        backoff = answer.get("backoff_s", 0.0)
        if isinstance(backoff, int | float) and backoff > 0:
            self.counters.backoffs += 1
            self._next_report = now + min(float(backoff), self.options.max_backoff_s)

    def _take_batch(self) -> list[list]:
        """The wire records of what was observed since the last report (emptied)."""
        with self._buffer_lock:
            counts, self._counts = self._counts, {}
            items = list(self._buffer)
            self._buffer.clear()
        batch = [[region, encode_signature(signature), seconds, carrier]
                 for region, signature, seconds, carrier in items]
        batch.extend([region, encode_signature(signature), total, carrier, n]
                     if n > 1 else [region, encode_signature(signature), total, carrier]
                     for (region, signature), (n, total, carrier) in counts.items())
        return batch

    # -- installing ----------------------------------------------------------------------

    def install_indexed(self) -> int:
        """Install what the program's index lists and is not installed yet; returns how
        many were installed. The index is read only when its stamp changed since the
        last index this link installed in full, or every MAX_STAMP_SKIPS polls (Note
        [Index stamps] in dynvm.cluster.fleet._records)."""
        stamp = read_index_stamp(self.cache.store, self.program_hash, self.target)
        if stamp is not None and stamp == self._index_stamp \
                and self._stamp_skips < MAX_STAMP_SKIPS:
            self._stamp_skips += 1
            self.counters.index_reads_skipped += 1
            return 0
        key = index_key(self.program_hash, self.target)
        rejected: set[str] = set()
        fields = self._fetch([key], rejected).get(key)
        if fields is None:
            if key in rejected:
                # An index that was read and refused (forged, corrupt, a decode bomb) is
                # not read again, at every poll, until its stamp changes or
                # MAX_STAMP_SKIPS polls passed: the same bound as an unchanged one.
                self._index_stamp, self._stamp_skips = stamp, 0
                self.counters.index_rejected += 1
            return 0
        listed = keys_from_index(fields, self.program_hash)
        installed = self._install(listed)
        # Skipping needs everything listed installed: a key that failed (evicted, store
        # away, rejected) is retried at the next poll, as without stamps.
        complete = self._installed.issuperset(listed)
        self._index_stamp, self._stamp_skips = (stamp if complete else None), 0
        return installed

    def wants(self, announcement: Announcement) -> bool:
        """Whether `announcement` is for this replica's program and target."""
        return announcement.program == self.program_hash and announcement.target == self.target

    def on_announcement(self, announcement: Announcement) -> None:
        """Install what `announcement` names, if it is for this replica (rate-limited)."""
        self.on_announcements([announcement])

    def on_announcements(self, announcements: list[Announcement]) -> None:
        """Install what `announcements` name for this replica (rate-limited, each key
        counted once), fetched in one store read (Note [Announcement bursts] in
        dynvm.cluster.fleet._announce)."""
        keys: list[str] = []
        traced: list[Announcement] = []
        for announcement in announcements:
            if not self.wants(announcement):
                continue
            self.counters.announcements += 1
            if announcement.key in self._installed or announcement.key in keys:
                continue
            if not self._announce_rate.allow():
                self.counters.announcements_dropped += 1
                continue
            keys.append(announcement.key)
            traced.append(announcement)
        if keys and not self._tracing:
            self._install(keys)
        elif keys:
            for announcement in traced:   # each install in its compile's trace
                self._install_traced(announcement)
        self._follow_index_stamps(announcements)

    def _follow_index_stamps(self, announcements: list[Announcement]) -> None:
        """Take the stamp of each index write whose one new key is installed, when this
        link holds the index written before it (Note [Index stamps]): its next poll
        then reads the stamp alone, not the index it already holds."""
        with self._install_lock:
            for announcement in announcements:
                if announcement.after is not None and announcement.stamp is not None \
                        and announcement.after == self._index_stamp \
                        and announcement.key in self._installed and self.wants(announcement):
                    self._index_stamp = announcement.stamp
                    self.counters.index_stamps_followed += 1

    def _install_traced(self, announcement: Announcement) -> None:
        token = None
        if announcement.trace:
            token = otel_context.attach(propagate.extract(announcement.trace))
        try:
            with self.runtime.telemetry.tracer.start_as_current_span(
                    "dynvm.fleet_install", attributes={
                        "dynvm.cache_key": announcement.key,
                        "dynvm.program": self.program.name}):
                self._install([announcement.key])
        finally:
            if token is not None:
                otel_context.detach(token)

    _on_announcement = on_announcement  # the name tests/reliability use

    def _fetch(self, keys: list[str], rejected: set[str] | None = None) -> dict[str, dict]:
        """Verified entries among `keys` (rejected ones added to `rejected`, when given);
        traced as a store read when tracing is on."""
        if not self._tracing:
            return self.cache.fetch(keys, rejected)
        before = self.cache.stats()
        with self.runtime.telemetry.tracer.start_as_current_span(
                "dynvm.store_read", attributes={"dynvm.keys": len(keys)}) as span:
            found = self.cache.fetch(keys, rejected)
            after = self.cache.stats()
            span.set_attributes({name: after[name] - before[name] for name in
                                 ("valid", "missing", "rejected", "unavailable")})
            return found

    def _install(self, keys: list[str]) -> int:
        installed = 0
        with self._install_lock:
            wanted = [k for k in keys if k not in self._installed]
            if not wanted:
                return 0
            for key, fields in self._fetch(wanted).items():
                try:
                    if self.gpu is not None:
                        spec = self.gpu.install(key, fields)
                    else:
                        portable = portable_from_fields(fields, self.program)
                        spec = self.jit.install_portable(portable, key)
                except PortableError as error:
                    self.counters.install_rejected += 1
                    logger.warning("artifact %s not installed: %s", key[:16], error)
                    continue
                self._installed.add(key)
                if spec is not None:
                    installed += 1
        self.counters.installed += installed
        return installed

    def stats(self) -> dict:
        with self._buffer_lock:
            buffered = len(self._buffer) + len(self._counts)
        gpu = self.gpu.stats() if self.gpu is not None else {}
        return {**as_dict(self.counters), **gpu, "buffered": buffered,
                "service_ok": self._service_ok,
                "shared": self.shared, "warm_start_seconds": self.warm_start_seconds,
                "store": store_counters(self.cache),
                "announce_reconnects": self._subscription.reconnects
                if self._subscription is not None else 0}
