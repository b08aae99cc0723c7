"""`FleetCompiler`: the compile service's work, without Ray (the actor wraps it; `dynvm
precompile` uses it directly).

Note [Fleet promotion]
~~~~~~~~~~~~~~~~~~~~~~
Replicas ship the signature of every interpreted region call (in batches, see
dynvm.cluster.fleet._link). The compiler feeds them, from all replicas alike, into one
JIT per program that never runs a model: its regions' profiles, windows, family index
and promotion policy are exactly a replica's (Note [Promotion], Note [Tiering]), so a
shape is promoted by the same rule, only counted over the whole fleet. A shape that
each of four replicas sees twice is seen eight times here, and is promoted although no
single replica would have. Each compile is published: the artifact (with its portable
record) is sealed into the kernel store, the program's index is rewritten, and an
announcement goes out on Redis pub/sub.

The store is a cache that may lose everything (Redis restarted, flushed, evicting).
What could not be published while it was away is kept and published again once it
answers; and every `store_check_s` the compiler checks that each program's index is
still there, republishing what its JIT holds when it is not, so replicas that start
after a flush still warm-start, without anything being compiled again.

The compiler interprets nothing itself and trusts nothing it is sent: observations are
decoded with the same validation as stored records, and one that does not describe a
watched region of a known program is counted and dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import propagate

from dynvm.cluster.fleet._announce import Announcement, Announcer
from dynvm.cluster.fleet._records import (
    index_key,
    keys_from_index,
    portable_from_fields,
    specialization_fields,
    store_counters,
    write_index,
)
from dynvm.cluster.store._signed import ArtifactCache
from dynvm.cluster.store._store_config import StoreConfig
from dynvm.jit.artifact import toolchain_versions
from dynvm.jit.config import JitConfig
from dynvm.jit.engine import Jit
from dynvm.jit.portable import PortableError, decode_signature
from dynvm.vm import dvm_file
from dynvm.vm.errors import DvmFormatError, DynvmError
from dynvm.vm.interpreter import Interpreter

logger = logging.getLogger(__name__)
TARGET = "cpu"
_MAX_COUNT = 1 << 30   # observations one aggregated record may stand for
DEFAULT_FORGET_AFTER_S = 3600.0
"""How long a program may go unreported before the service forgets it, when the store
has no TTL to go by (Note [Artifact lifetime])."""



class ProgramRejected(DynvmError, ValueError):
    """A replica registered program bytes that are not a valid .dvm file, or that do not
    hash to the program hash it named."""


@dataclass
class _ProgramState:
    program: object
    jit: Jit
    index: dict[int, OrderedDict] = field(default_factory=dict)   # region -> keys
    gpu_index: dict[int, OrderedDict] = field(default_factory=dict)   # Triton entries
    observations: int = 0
    rejected: int = 0
    last_report: float = field(default_factory=time.monotonic)   # registered or reported
    # The stamp and keys of this service's last index write (Note [Index stamps]), None
    # until one succeeded; index writes are made one at a time, under index_lock.
    written: tuple[bytes, frozenset] | None = None
    index_lock: threading.Lock = field(default_factory=threading.Lock)


class FleetCompiler:
    """Aggregates replicas' signature statistics, promotes, compiles and publishes."""

    def __init__(self, store: StoreConfig, jit_config: JitConfig | None = None,
                 telemetry=None, store_check_s: float = 5.0,
                 gpu_targets: tuple = (), forget_after_s: float | None = None) -> None:
        """`gpu_targets`: GPU targets such as ("cuda", 90, 32) to build Triton binaries
        for, next to each CPU artifact (dynvm.cluster.fleet._triton; no GPU needed).
        `forget_after_s`: a program that no replica registered or reported for this long
        is forgotten (default: the store's TTL, else DEFAULT_FORGET_AFTER_S), so the
        store check stops republishing a retired program and its artifacts expire or
        are evicted (Note [Artifact lifetime] in dynvm.cluster.store._base). Links report
        at least once per poll interval while they serve, so a deployed program is never
        forgotten; one forgotten by mistake is registered again at its next report and
        reloads what the store's index still lists."""
        self.store_check_s = store_check_s
        ttl = store.redis.ttl_seconds if store.redis is not None else None
        # Without a TTL too: a service that never forgot would hold every program ever
        # deployed, and rewrite a retired program's index each time Redis's LRU evicted it.
        self.forget_after_s = (forget_after_s if forget_after_s is not None
                               else ttl if ttl is not None else DEFAULT_FORGET_AFTER_S)
        self.forgotten = 0
        self.gpu_targets = tuple(gpu_targets)
        self.gpu_published = 0
        self.gpu_skipped = 0
        self._next_check = time.monotonic() + store_check_s
        self._unpublished: list[tuple[_ProgramState, object]] = []
        self.republished = 0
        self.jit_config = jit_config or JitConfig()
        # The service never runs a kernel, so no probation verdict (Note [Probation]) can
        # come here, and a region waits for the last family kernel's verdict before it
        # promotes the next: with probation on, one family per region fleet-wide. The
        # replicas judge what they install; probation is not in the cache key.
        self._service_jit_config = dataclasses.replace(self.jit_config, probation=False)
        self.telemetry = telemetry if telemetry is not None and telemetry.enabled else None
        self.cache = ArtifactCache(store.open_store(), store.secret,
                                   {"target": TARGET, "toolchain": toolchain_versions()})
        # The Triton entries and their index are sealed for the GPU targets' text (Note
        # [GPU replicas in the fleet]); reading them back needs that expectation.
        self.gpu_target = None
        self.gpu_cache = None
        if self.gpu_targets:
            from dynvm.cluster.fleet._gpu import gpu_fleet_target

            self.gpu_target = gpu_fleet_target(self.gpu_targets)
            self.gpu_cache = ArtifactCache(store.open_store(), store.secret, {
                "target": self.gpu_target, "toolchain": toolchain_versions()})
        self.announcer = Announcer(store.redis) if store.redis is not None else None
        self._programs: dict[str, _ProgramState] = {}
        self._lock = threading.RLock()
        self.published = 0
        self.publish_failures = 0
        self._handled = 0       # compiles whose publishing finished (either way)
        self._publishing = 0    # publishes in progress

    # -- programs ----------------------------------------------------------------------

    def knows(self, program_hash: str) -> bool:
        return program_hash in self._programs

    def register(self, program_hash: str, dvm_bytes: bytes) -> None:
        """Load a program (a .dvm file's bytes) so that its signatures can be compiled."""
        with self._lock:
            if program_hash in self._programs:
                return
            try:
                program = dvm_file.loads(dvm_bytes)
            except DvmFormatError as error:
                raise ProgramRejected(f"program {program_hash[:12]}: {error}") from None
            if program.content_hash != program_hash:
                raise ProgramRejected(f"program bytes hash to {program.content_hash[:12]}, "
                                 f"not {program_hash[:12]}")
            jit = Jit(program, Interpreter(program, TARGET), self._service_jit_config,
                      self.telemetry)
            jit.attach()
            state = _ProgramState(program, jit)
            jit.add_compile_listener(lambda region_jit, spec: self._publish(state, spec))
            self._programs[program_hash] = state
            self._load_index(state)

    def _load_index(self, state: _ProgramState) -> None:
        """Resume from the store's index: a restarted service installs what it published
        before into its own JIT (as a replica would), so it neither forgets nor recompiles."""
        program_hash = state.program.content_hash
        key = index_key(program_hash, TARGET)
        fields = self.cache.fetch([key]).get(key)
        if fields is None:
            return
        listed = keys_from_index(fields, program_hash)
        for artifact_key, artifact in self.cache.fetch(listed).items():
            try:
                portable = portable_from_fields(artifact, state.program)
                state.jit.install_portable(portable, artifact_key)
            except PortableError as error:
                logger.warning("indexed artifact %s skipped: %s", artifact_key[:16], error)
                continue
            state.index.setdefault(portable.region, OrderedDict())[artifact_key] = None
        if self.gpu_cache is not None:
            self._load_gpu_index(state)

    def _load_gpu_index(self, state: _ProgramState) -> None:
        """Resume the GPU index too, so that rewriting it keeps what was listed before."""
        program_hash = state.program.content_hash
        key = index_key(program_hash, self.gpu_target)
        fields = self.gpu_cache.fetch([key]).get(key)
        if fields is None:
            return
        for artifact_key, entry in self.gpu_cache.fetch(
                keys_from_index(fields, program_hash)).items():
            record = entry.get("metadata", {}).get("portable")
            region = record.get("region") if isinstance(record, dict) else None
            if type(region) is int:
                state.gpu_index.setdefault(region, OrderedDict())[artifact_key] = None

    # -- observations (Note [Fleet promotion]) ------------------------------------------

    def report(self, program_hash: str, batch: Sequence) -> dict:
        """Feed `batch` of observation records: [region, signature, seconds, trace
        carrier or None], or pre-aggregated [region, signature, total seconds, carrier,
        count] (Note [Pre-aggregated observations] in dynvm.cluster.fleet._link).
        Returns {"known": False} when the program must be registered first."""
        state = self._programs.get(program_hash)
        if state is None:
            return {"known": False}
        state.last_report = time.monotonic()
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + self.store_check_s
            self.repair_store()
        for item in batch:
            try:
                region, raw, seconds, carrier, *rest = item
                count = rest[0] if len(rest) == 1 else 1 if not rest else None
                region_jit = state.jit.regions.get(region) if type(region) is int else None
                if region_jit is None or not isinstance(seconds, int | float):
                    raise PortableError(f"region {region!r} is not watched")
                if type(count) is not int or not 1 <= count <= _MAX_COUNT:
                    raise PortableError(f"count {count!r} is not in 1..{_MAX_COUNT}")
                signature = decode_signature(raw, len(region_jit.live_in))
            except (PortableError, TypeError, ValueError):
                state.rejected += 1
                continue
            state.observations += count
            self._observe(region_jit, signature, float(seconds) / count, carrier,
                          min(count, self.jit_config.window))
        return {"known": True}

    def _observe(self, region_jit, signature, seconds: float, carrier, count: int) -> None:
        """`count` observations of `signature` taking `seconds` each. Promotion reads only
        a signature's recurrence in the window and its mean time, so more than `window`
        in a row decide nothing that `window` of them do not: the caller caps `count`."""
        token = None
        if carrier and self.telemetry is not None:
            # The request that caused the observation parents the promotion it may tip.
            token = otel_context.attach(propagate.extract(carrier))
        try:
            for _ in range(count):
                region_jit.leave(signature, seconds)
        finally:
            if token is not None:
                otel_context.detach(token)

    # -- publishing ----------------------------------------------------------------------

    def _publish(self, state: _ProgramState, spec) -> None:
        with self._lock:
            self._publishing += 1
        try:
            self._publish_one(state, spec)
        finally:
            with self._lock:
                self._publishing -= 1
                self._handled += 1

    def _publish_one(self, state: _ProgramState, spec) -> None:
        if self.telemetry is None:
            self._write(state, spec, None)
            return
        with self.telemetry.tracer.start_as_current_span("dynvm.publish", attributes={
                "dynvm.cache_key": spec.artifact.key,
                "dynvm.region": spec.ir.region_index,
                "dynvm.backend": spec.artifact.backend,
                "dynvm.target": TARGET}) as span:
            self._write(state, spec, span)

    def _write(self, state: _ProgramState, spec, span) -> None:
        """Seal the artifact into the store, rewrite the index, announce."""
        program_hash = state.program.content_hash
        fields = specialization_fields(spec, program_hash)
        stored = self.cache.publish(spec.artifact.key, fields)
        if span is not None:
            span.set_attributes({"dynvm.store_written": stored,
                                 "dynvm.artifact_bytes": len(spec.artifact.source.encode())})
        if not stored:
            self.publish_failures += 1
            with self._lock:
                self._unpublished.append((state, spec))
            return
        key = spec.artifact.key
        with state.index_lock:
            with self._lock:
                keys = state.index.setdefault(spec.ir.region_index, OrderedDict())
                keys[key] = None
                while len(keys) > self.jit_config.max_specializations_per_region:
                    keys.popitem(last=False)
                listed = [k for region_keys in state.index.values() for k in region_keys]
            stamp = write_index(self.cache, program_hash, TARGET, listed)
            # A link that held the last index holds this one once it has `key`, when
            # this one adds nothing else (Note [Index stamps]).
            previous, state.written = state.written, \
                (stamp, frozenset(listed)) if stamp is not None else None
        after = previous[0] if previous is not None and stamp is not None \
            and previous[1].union((key,)).issuperset(listed) else None
        self.published += 1
        carrier: dict[str, str] = {}
        if span is not None:
            propagate.inject(carrier)  # the announcement carries this publish's context
        if self.announcer is not None:
            sent = self.announcer.publish(Announcement(
                program_hash, TARGET, key, carrier or None, stamp, after))
            if span is not None:
                span.set_attribute("dynvm.announced", sent)
        if self.gpu_targets:
            self._write_gpu(state, spec)

    def _write_gpu(self, state: _ProgramState, spec) -> None:
        """The Triton binaries of `spec` for the cluster's GPU targets, after the CPU
        artifact is out (building them takes seconds: CPU replicas must not wait)."""
        from dynvm.cluster.fleet._triton import triton_fields
        from dynvm.jit.backends.triton import TritonBackendError

        try:
            key, fields = triton_fields(spec, state.program, self.gpu_targets)
        except TritonBackendError as error:
            self.gpu_skipped += 1
            logger.info("no Triton artifact for %s: %s", spec.artifact.key[:16], error)
            return
        if not self.cache.publish(key, fields):
            return
        self.gpu_published += 1
        # GPU replicas read their own index and announcements (Note [GPU replicas in the
        # fleet] in dynvm.cluster.fleet._gpu): the target is the configured targets' text.
        target = self.gpu_target
        program_hash = state.program.content_hash
        with self._lock:
            keys = state.gpu_index.setdefault(spec.ir.region_index, OrderedDict())
            keys[key] = None
            while len(keys) > self.jit_config.max_specializations_per_region:
                keys.popitem(last=False)
            listed = [k for region_keys in state.gpu_index.values() for k in region_keys]
        write_index(self.cache, program_hash, target, listed)
        if self.announcer is not None:
            self.announcer.publish(Announcement(program_hash, target, key, None))

    def repair_store(self) -> None:
        """Publish again what the store lost: first what failed to publish, then, for a
        program whose index is gone (flushed, evicted), everything its JIT holds.
        Programs no replica reports any more are forgotten first, never republished."""
        self._forget_unreported()
        with self._lock:
            retry, self._unpublished = self._unpublished, []
        for state, spec in retry:
            self._publish(state, spec)
        for state in list(self._programs.values()):
            if not self.index(state.program.content_hash):
                continue
            key = index_key(state.program.content_hash, TARGET)
            if key in self.cache.store_keys_present([key]):
                continue
            held = [s for region_jit in state.jit.regions.values()
                    for s in region_jit.installed() if s.ir is not None]
            if not held:
                continue
            logger.warning("the store lost program %s's index: republishing %d "
                           "specializations", state.program.content_hash[:12], len(held))
            for spec in held:
                self._publish(state, spec)
                self.republished += 1
        if self.gpu_cache is not None:
            self._repair_gpu_index()

    def _forget_unreported(self) -> None:
        """Drop the programs not registered or reported for `forget_after_s`."""
        cutoff = time.monotonic() - self.forget_after_s
        with self._lock:
            gone = {h: s for h, s in self._programs.items() if s.last_report < cutoff}
            for program_hash in gone:
                del self._programs[program_hash]
            kept = [(s, spec) for s, spec in self._unpublished
                    if not any(s is g for g in gone.values())]
            self._unpublished = kept
        for program_hash, state in gone.items():
            state.jit.close()
            self.forgotten += 1
            logger.info("program %s: no replica reported for %.0f s, forgotten (its "
                        "artifacts now expire)", program_hash[:12], self.forget_after_s)

    def _repair_gpu_index(self) -> None:
        """Rewrite a program's GPU index that the store lost on its own (evicted), listing
        the Triton entries still there; a flushed store loses the entries too, and the
        republishing above rebuilds them, index included."""
        for state in list(self._programs.values()):
            with self._lock:
                listed = [k for keys in state.gpu_index.values() for k in keys]
            key = index_key(state.program.content_hash, self.gpu_target)
            if not listed or key in self.cache.store_keys_present([key]):
                continue
            present = self.cache.store_keys_present(listed)
            kept = [k for k in listed if k in present]
            if kept:
                logger.warning("the store lost program %s's GPU index: relisting %d "
                               "entries", state.program.content_hash[:12], len(kept))
                write_index(self.cache, state.program.content_hash, self.gpu_target,
                            kept)

    # -- inspection -----------------------------------------------------------------------

    def index(self, program_hash: str) -> list[str]:
        state = self._programs.get(program_hash)
        if state is None:
            return []
        return [k for keys in state.index.values() for k in keys]

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until no compile is queued or running (tests, `dynvm precompile`)."""
        deadline = time.monotonic() + timeout_s
        quiet_since = None
        while time.monotonic() < deadline:
            # A compile leaves `pending` a moment before its publishing starts: idle means
            # nothing queued, pending or publishing, and no publish finished for 100 ms.
            states = list(self._programs.values())
            busy = self._publishing or any(
                len(s.jit.queue) or any(r.pending for r in s.jit.regions.values())
                for s in states)
            mark = (busy, self._handled)
            if busy or quiet_since is None or quiet_since[1] != mark:
                quiet_since = (time.monotonic(), mark)
            elif time.monotonic() - quiet_since[0] >= 0.1:
                return True
            time.sleep(0.02)
        return False

    def stats(self) -> dict:
        programs = {}
        for program_hash, state in self._programs.items():
            jit_stats = state.jit.stats()
            programs[program_hash[:12]] = {
                "name": state.program.name, "observations": state.observations,
                "rejected_observations": state.rejected, "compiles": jit_stats["compiles"],
                "family_compiles": jit_stats["family_compiles"],
                "compile_seconds": jit_stats["compile_seconds"],
                "compile_failures": jit_stats["compile_failures"],
                "queue_length": jit_stats["queue_length"],
                "indexed": len(self.index(program_hash))}
        return {"programs": programs, "published": self.published,
                "republished": self.republished, "unpublished": len(self._unpublished),
                "forgotten": self.forgotten,
                "gpu_published": self.gpu_published, "gpu_skipped": self.gpu_skipped,
                "gpu_indexed": sum(len(k) for s in self._programs.values()
                                   for k in s.gpu_index.values()),
                "publish_failures": self.publish_failures,
                "store": store_counters(self.cache),
                "announced": self.announcer.sent if self.announcer else 0,
                "announce_failures": self.announcer.failed if self.announcer else 0,
                "trace_enabled": self.telemetry is not None}

    def close(self) -> None:
        for state in self._programs.values():
            state.jit.close()
        if self.announcer is not None:
            self.announcer.close()
