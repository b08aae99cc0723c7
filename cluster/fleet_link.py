"""`FleetLink`: a replica's connection to the compile service and the kernel store.

It implements the JIT's fleet hooks (Note [Fleet hooks] in dynvm.jit.engine):

* every interpreted region call appends (region, signature, seconds) to a bounded
  buffer, a deque append on the request path; a link thread ships the buffer to the
  service every `flush_interval_s` (Note [Fleet promotion]). When the buffer is full
  the oldest observations are dropped and counted: statistics may be lost, requests
  never wait;
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
  dynvm.cluster.fleet_gpu).
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

from dynvm.cluster.announce import Announcement, RateLimit, Subscription
from dynvm.cluster.config import StoreConfig
from dynvm.cluster.fleet_compiler import TARGET
from dynvm.cluster.fleet_records import index_key, keys_from_index, portable_from_fields
from dynvm.cluster.signed import ArtifactCache
from dynvm.jit.artifact import toolchain_versions
from dynvm.jit.portable import PortableError, encode_signature

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
    """Name of the compile service actor (dynvm.cluster.compile_service)."""
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

    def __post_init__(self) -> None:
        for name in ("flush_interval_s", "poll_interval_s", "service_timeout_s",
                     "max_announced_fetches_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"FleetOptions.{name} must be > 0, got {getattr(self, name)}")
        if self.max_buffered < 1:
            raise ValueError(f"FleetOptions.max_buffered must be >= 1, got {self.max_buffered}")


class FleetLink:
    """A replica's connection to the compile service and the kernel store: reports its
    observations, installs what the fleet compiled (see the module docstring)."""

    def __init__(self, runtime, dvm_bytes: bytes, options: FleetOptions, client,
                 gpu_boundary=None) -> None:
        """`gpu_boundary`: where a GPU replica's kernels launch (default: a
        `run_binary.CudaBoundary` on a CUDA runtime's device); a test on a machine
        without a GPU gives a stand-in, and the link behaves as a CUDA replica's."""
        if runtime.jit is None:
            raise ValueError("a fleet link needs a Runtime with its JIT on")
        self.runtime = runtime
        self.jit = runtime.jit
        self.program = runtime.program
        self.program_hash = self.program.content_hash
        self.options = options
        self.client = client
        self.target = str(runtime.device)
        self.gpu = None
        if options.gpu_targets and (gpu_boundary is not None or runtime.device.type == "cuda"):
            from dynvm.cluster.fleet_gpu import GpuInstaller
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
        self._buffer: deque = deque()
        self._buffer_lock = threading.Lock()
        self._install_lock = threading.Lock()
        self._installed: set[str] = set()
        self._service_ok = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dynvm-fleet-link", daemon=True)
        self._subscription = None
        self._tracing = runtime.telemetry is not None
        self.counters = {"reported": 0, "dropped_observations": 0, "service_failures": 0,
                         "registrations": 0, "installed": 0, "install_rejected": 0,
                         "announcements": 0, "announcements_dropped": 0,
                         "warm_start_installs": 0}
        rate = options.max_announced_fetches_per_s
        self._announce_rate = RateLimit(rate, burst=max(1, round(rate)))
        self.warm_start_seconds = 0.0

    # -- life cycle ------------------------------------------------------------------

    def start(self) -> FleetLink:
        """Connect, install what the index lists (warm start), start the link thread."""
        if not self.shared:
            return self
        self.jit.connect(self)
        start = time.perf_counter()
        self.counters["warm_start_installs"] = self.install_indexed()
        self.warm_start_seconds = time.perf_counter() - start
        self.flush()  # learn whether the service is there before the first request
        if self.options.store.redis is not None:
            self._subscription = Subscription(self.options.store.redis,
                                              self._on_announcement).start()
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
            if len(self._buffer) >= self.options.max_buffered:
                self._buffer.popleft()
                self.counters["dropped_observations"] += 1
            self._buffer.append((region, signature, seconds, carrier or None))

    def compiles_locally(self) -> bool:
        return not self._service_ok or (self.gpu is not None and self.gpu.needs_local_compile)

    # -- the link thread -------------------------------------------------------------------

    def _run(self) -> None:
        next_poll = time.monotonic() + self.options.poll_interval_s
        while not self._stop.wait(self.options.flush_interval_s):
            self.flush()
            if time.monotonic() >= next_poll:
                self.install_indexed()
                next_poll = time.monotonic() + self.options.poll_interval_s

    def flush(self) -> None:
        """Ship the buffered observations now (the link thread calls this; so does
        `dynvm precompile`, which drives a link without starting its thread)."""
        with self._buffer_lock:
            items = list(self._buffer)
            self._buffer.clear()
        batch = [[region, encode_signature(signature), seconds, carrier]
                 for region, signature, seconds, carrier in items]
        if self.gpu is not None:
            # The service specializes on its own device (Note [GPU replicas in the fleet]).
            from dynvm.cluster.fleet_gpu import fleet_signature

            batch = [[r, fleet_signature(sig, TARGET), s, c] for r, sig, s, c in batch]
        answer = self.client.report(self.program_hash, batch)
        if answer is not None and not answer.get("known", True):
            self.counters["registrations"] += 1
            if self.client.register(self.program_hash, self._dvm_bytes):
                answer = self.client.report(self.program_hash, batch)
        if answer is None or not answer.get("known", False):
            if self._service_ok:
                logger.warning("compile service unreachable: compiling locally until it "
                               "answers again")
            self._service_ok = False
            self.counters["service_failures"] += 1
            self.counters["dropped_observations"] += len(batch)
            return
        self._service_ok = True
        self.counters["reported"] += len(batch)

    # -- installing ----------------------------------------------------------------------

    def install_indexed(self) -> int:
        """Install what the program's index lists and is not installed yet; returns how
        many were installed."""
        key = index_key(self.program_hash, self.target)
        fields = self._fetch([key]).get(key)
        if fields is None:
            return 0
        return self._install(keys_from_index(fields, self.program_hash))

    def _on_announcement(self, announcement: Announcement) -> None:
        if announcement.program != self.program_hash or announcement.target != self.target:
            return
        self.counters["announcements"] += 1
        if announcement.key in self._installed:
            return
        if not self._announce_rate.allow():
            self.counters["announcements_dropped"] += 1
            return
        token = None
        if self._tracing and announcement.trace:
            token = otel_context.attach(propagate.extract(announcement.trace))
        try:
            if self._tracing:
                with self.runtime.telemetry.tracer.start_as_current_span(
                        "dynvm.fleet_install", attributes={
                            "dynvm.cache_key": announcement.key,
                            "dynvm.program": self.program.name}):
                    self._install([announcement.key])
            else:
                self._install([announcement.key])
        finally:
            if token is not None:
                otel_context.detach(token)

    def _fetch(self, keys: list[str]) -> dict[str, dict]:
        """Verified entries among `keys`; traced as a store read when tracing is on."""
        if not self._tracing:
            return self.cache.fetch(keys)
        before = self.cache.stats()
        with self.runtime.telemetry.tracer.start_as_current_span(
                "dynvm.store_read", attributes={"dynvm.keys": len(keys)}) as span:
            found = self.cache.fetch(keys)
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
                    self.counters["install_rejected"] += 1
                    logger.warning("artifact %s not installed: %s", key[:16], error)
                    continue
                self._installed.add(key)
                if spec is not None:
                    installed += 1
        self.counters["installed"] += installed
        return installed

    def stats(self) -> dict:
        with self._buffer_lock:
            buffered = len(self._buffer)
        gpu = self.gpu.stats() if self.gpu is not None else {}
        return {**self.counters, **gpu, "buffered": buffered, "service_ok": self._service_ok,
                "shared": self.shared, "warm_start_seconds": self.warm_start_seconds,
                "store": self.cache.stats(),
                "announce_reconnects": self._subscription.reconnects
                if self._subscription is not None else 0}
