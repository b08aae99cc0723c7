"""One process of the fleet simulator: many simulated replicas (bench/fleet_sim.py).

What is real: every simulated replica is a real `FleetLink` (its own artifact cache
with its own Redis connection pool, its own announcement subscription on Redis, its own
rate limit and observation table), reporting to the real compile service actors over
Ray (`RayServiceClient`), and fetching and verifying (HMAC) every artifact it installs
from the real redis-server itself.

What is simulated:
* no model runs. A request is a shape drawn from the trace; if the replica holds the
  artifacts serving the shape's region signatures the call counts as specialized, else
  the link hears the observation the interpreter would have made (the JIT's `leave`);
* decoding and installing an artifact (about a millisecond of replica-local CPU each,
  the same at any fleet size) happens once per process, in a reference Runtime per
  program, not once per replica: a thousand replicas sharing two cores would otherwise
  measure the simulator, not the fleet. The reference's JIT says which artifact serves
  which shape (its region tables, as `enter` looks them up); a replica serves a shape
  once it has fetched and verified those artifacts. The reference's install time is
  reported;
* threads are shared: the links are started with `threads=False`; a few tick threads
  call `tick()` on their slice of links, and one thread reads all of this process's
  subscriptions (a selector over their sockets), where a real replica has a link
  thread and a subscription thread of its own. A delivery thread hands a link every
  announcement read for it while it waited (SubscriberPool);
* the heap is shared: once its replicas are started, a host moves everything it holds
  then (its 500 Runtimes, programs, links, torch) out of the cyclic garbage collector's
  reach (`gc.freeze()`). Without it each full collection walked 500 replicas' objects
  with the GIL held, stopping all 500 (measured: a store read of 9 artifacts at once
  spent 0.52 ms per artifact against 0.19-0.28 frozen, in a process holding one
  Runtime; `gc_seconds` in the results says what collections still cost). A real
  replica's collections walk its own heap, on its own core.
"""

from __future__ import annotations

import gc
import pickle
import queue
import random
import selectors
import sys
import threading
import time
from collections import defaultdict

import psutil

from bench._fleet_trace import ShapeTrace, record_observations
from dynvm.cluster.fleet._announce import Announcement, channel_for
from dynvm.cluster.fleet._link import FleetLink
from dynvm.cluster.fleet._records import portable_from_fields
from dynvm.cluster.fleet.compile_service import RayServiceClient
from dynvm.cluster.store._redis import redis_client
from dynvm.jit.portable import PortableError


def _serving_key(runtime, observation) -> str | None:
    """The key of the specialization `runtime`'s JIT would run for `observation`'s
    region call (RegionJit.enter's lookups: exact signature, then family bounds)."""
    region_jit = runtime.jit.regions.get(observation.region)
    if region_jit is None:
        return None
    spec = region_jit.strong.get(observation.signature)
    if spec is None and region_jit.family_kernels:
        spec = region_jit._match_family(observation.signature)
    return spec.artifact.key if spec is not None else None


class Reference:
    """Per program, a real Runtime into which this process decodes and installs each
    artifact once, and which then says which artifacts serve each shape."""

    def __init__(self, programs: list, shapes: dict, jit_config) -> None:
        import dynvm

        self.runtimes = [dynvm.Runtime(p, "cpu", jit=jit_config) for p in programs]
        self.shapes = shapes
        self.serving: list[dict[tuple, frozenset[frozenset]]] = [{} for _ in programs]
        # (program, shape) -> the keys that first served it (bench/_fleet_timeline.py)
        self.first_keys: dict[tuple[int, tuple], list[str]] = {}
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self.install_seconds = 0.0
        self.installs = 0

    def install(self, program: int, key: str, fields: dict) -> None:
        """Decode and install `key` once (raises PortableError for a bad record)."""
        if key in self._done:
            # Installed already: without taking the lock, which the first replica to
            # install a key holds while the reference decodes it (100+ ms on a loaded
            # host) and every other replica installing that key would queue behind.
            return
        with self._lock:
            # Once per key: asking the JIT would miss a key its LRU evicted since, and
            # re-install it for every replica, holding this lock each time.
            if key in self._done:
                return
            runtime = self.runtimes[program]
            start = time.perf_counter()
            runtime.jit.install_portable(portable_from_fields(fields, runtime.program), key)
            self.install_seconds += time.perf_counter() - start
            self.installs += 1
            self._done.add(key)
            # A shape served by a family kernel stays served by it when an exact kernel
            # comes: each set of keys that ever served it is kept.
            serving = dict(self.serving[program])
            for shape, observations in self.shapes.items():
                keys = [_serving_key(runtime, o) for o in observations]
                if all(keys):
                    serving[shape] = serving.get(shape, frozenset()) | {frozenset(keys)}
                    self.first_keys.setdefault((program, shape), sorted(set(keys)))
            self.serving[program] = serving

    def serves(self, program: int, shape: tuple, installed: set) -> bool:
        return any(keys <= installed for keys in self.serving[program].get(shape, ()))


class MeasuringClient(RayServiceClient):
    """The replica's real client, counting what it sends (pickled size ~ Ray's payload)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.messages = 0
        self.bytes = 0
        self.seconds: list[float] = []   # each report's round trip, as the link waits it

    def report(self, program_hash: str, batch: list) -> dict | None:
        self.messages += 1
        self.bytes += len(pickle.dumps((program_hash, batch), protocol=5))
        start = time.perf_counter()
        try:
            return super().report(program_hash, batch)
        finally:
            self.seconds.append(time.perf_counter() - start)


class SimulatedLink(FleetLink):
    """A real FleetLink whose installs fetch and verify for real and decode once per
    process (`Reference`, see the module docstring); notes when each artifact was
    installed and when each shape became served."""

    installed_by_poll = 0   # artifacts the index poll installed (the base's init polls)

    def __init__(self, runtime, dvm_bytes, options, client, program: int,
                 reference: Reference) -> None:
        super().__init__(runtime, dvm_bytes, options, client)
        self.program_index = program
        self.reference = reference
        self.installed_at: dict[str, float] = {}
        self.served_at: dict[tuple, float] = {}

    def serves(self, shape: tuple) -> bool:
        return self.reference.serves(self.program_index, shape, self._installed)

    def install_indexed(self) -> int:
        installed = super().install_indexed()
        self.installed_by_poll += installed
        return installed

    def stats(self) -> dict:
        """The link's stats and the simulator's own count of poll installs."""
        return {**super().stats(), "installed_by_poll": self.installed_by_poll}

    def _install(self, keys: list[str]) -> int:
        with self._install_lock:
            wanted = [k for k in keys if k not in self._installed]
            if not wanted:
                return 0
            found = self._fetch(wanted)   # the real store read and HMAC verification
            now = time.time()
            for key, fields in found.items():
                try:
                    self.reference.install(self.program_index, key, fields)
                except PortableError:
                    self.counters.install_rejected += 1
                    continue
                self._installed.add(key)
                self.installed_at[key] = now
            self.counters.installed += len(found)
            for shape in self.reference.shapes:
                if shape not in self.served_at and self.serves(shape):
                    self.served_at[shape] = now
            return len(found)


class SubscriberPool:
    """Every link's own Redis subscription, read by one thread (a selector over the
    subscriptions' sockets); each message is decoded there and handed to its link on
    one of `workers` delivery threads, as the link's own subscription thread would.

    Several delivery threads, not one: a replica's install waits on a Redis round
    trip; a thousand replicas make them at once, each on its own machine. One thread
    making them one after another on a loaded machine took seconds per announcement
    (measured: announcement -> 50% installed 5 s at N = 1000, while the thread's CPU
    was 0.04 ms per message), which is the simulator's queue, not the fleet's. Only an
    announcement for the link's own program is queued for them: with four programs,
    queueing all of them made a read message wait 6.2 s on average for a delivery
    thread at N = 1000 (500 replicas per process), three in four only to be dropped.

    A link waits in the delivery queue once, with every announcement read for it
    meanwhile: a delivery thread hands them all to `on_announcements`, which fetches
    them in one store read, as a replica's own subscription thread does with the
    announcements waiting on its socket (Note [Announcement bursts] in
    dynvm.cluster.fleet._announce). Queued one task per announcement, a link whose
    announcements waited behind others' made one store round trip for each."""

    def __init__(self, redis_config, links: list[SimulatedLink], workers: int = 4) -> None:
        self._selector = selectors.DefaultSelector()
        self._pubsubs = []
        self.first_seen: dict[str, float] = {}
        self.received = 0
        self.deliveries = 0                     # on_announcements calls (batches)
        self.cpu_seconds = 0.0
        self.last_read: dict[str, float] = {}   # when the last subscription read each key
        self.queued_seconds = 0.0               # read -> handed to its link, summed
        self._cpu_lock = threading.Lock()
        self._pending: dict[int, list] = {}     # id(link) -> [(announcement, read at)]
        self._pending_lock = threading.Lock()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()   # links with pending ones
        for link in links:
            client = redis_client(redis_config, "dynvm-sim-subscriber")
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(channel_for(link.program_hash))
            # redis-py keeps the subscription's socket private; the pool waits on it.
            self._selector.register(pubsub.connection._sock, selectors.EVENT_READ,
                                    (pubsub, link))
            self._pubsubs.append((client, pubsub))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-subscribers",
                                        daemon=True)
        self._workers = [threading.Thread(target=self._deliver, name=f"sim-deliver-{i}",
                                          daemon=True) for i in range(workers)]

    def start(self) -> SubscriberPool:
        self._thread.start()
        for worker in self._workers:
            worker.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            for selected, _ in self._selector.select(timeout=0.2):
                pubsub, link = selected.data
                start = time.thread_time()
                while (message := pubsub.get_message(timeout=0)) is not None:
                    if message.get("type") != "message":
                        continue
                    announcement = Announcement.decode(message.get("data"))
                    if announcement is None:
                        continue
                    self.received += 1
                    now = time.time()
                    self.first_seen.setdefault(announcement.key, now)
                    self.last_read[announcement.key] = now
                    if link.wants(announcement):
                        self._queue(link, announcement, now)
                    else:
                        # Another program's: the link's subscription thread would drop
                        # it at on_announcement's first check, in microseconds; queued
                        # behind installs it would only delay them.
                        link.on_announcement(announcement)
                self._count_cpu(time.thread_time() - start)

    def _queue(self, link: SimulatedLink, announcement: Announcement, now: float) -> None:
        with self._pending_lock:
            pending = self._pending.get(id(link))
            if pending is not None:
                pending.append((announcement, now))
                return
            self._pending[id(link)] = [(announcement, now)]
        self._ready.put(link)

    def _deliver(self) -> None:
        while not self._stop.is_set():
            try:
                link = self._ready.get(timeout=0.2)
            except queue.Empty:
                continue
            with self._pending_lock:
                pending = self._pending.pop(id(link))
            now = time.time()
            start = time.thread_time()
            with self._cpu_lock:
                self.queued_seconds += sum(now - read_at for _, read_at in pending)
                self.deliveries += 1
            try:
                link.on_announcements([announcement for announcement, _ in pending])
            except Exception:  # noqa: BLE001 - as Subscription._deliver
                link.counters.install_rejected += 1
            self._count_cpu(time.thread_time() - start)

    def _count_cpu(self, seconds: float) -> None:
        # The CPU of reading, decoding and installing: what each replica's own
        # subscription thread would spend per announcement.
        with self._cpu_lock:
            self.cpu_seconds += seconds

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for worker in self._workers:
            worker.join(timeout=10)
        for client, pubsub in self._pubsubs:
            pubsub.close()
            client.close()


def _cpu_seconds() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


class ReplicaHost:
    """A Ray actor holding `len(programs_of_replicas)` simulated replicas."""

    def __init__(self, host: int, dvm_files: list[bytes], programs_of_replicas: list[int],
                 options, jit_config, tick_threads: int = 4,
                 delivery_threads: int = 4, freeze_heap: bool = True) -> None:
        import dynvm
        from dynvm.vm import dvm_file

        # The subscriber thread releases the GIL on every socket read and waits up to
        # the switch interval (5 ms) to get it back while other threads run: 500
        # subscriptions per announcement make that seconds. A real replica pays it once.
        sys.setswitchinterval(2e-4)
        self.host = host
        self.options = options
        self.shapes = record_observations(dvm_files[0])   # same architecture for all
        programs = [dvm_file.loads(data) for data in dvm_files]
        self.reference = Reference(programs, self.shapes, jit_config)
        self.program_of = list(programs_of_replicas)
        self.links: list[SimulatedLink] = []
        start = time.perf_counter()
        for index in self.program_of:
            runtime = dynvm.Runtime(programs[index], "cpu", jit=jit_config)
            client = MeasuringClient.for_fleet(options)
            self.links.append(SimulatedLink(runtime, dvm_files[index], options, client,
                                            index, self.reference).start(threads=False))
        self.start_seconds = time.perf_counter() - start
        self._cpu_at_ready = _cpu_seconds()
        self.pool = SubscriberPool(options.store.redis, self.links,
                                   delivery_threads).start()
        if freeze_heap:
            gc.collect()
            gc.freeze()   # see the module docstring: the replicas' heaps are shared here
        self.gc_seconds = 0.0
        self._gc_started = 0.0
        gc.callbacks.append(self._time_gc)
        self._stop = threading.Event()
        self.first_sighting: dict[tuple, float] = {}
        self.requests = 0
        self.specialized = 0
        self.sweeps: list[float] = []
        slices = [self.links[i::tick_threads] for i in range(tick_threads)]
        self._threads = [threading.Thread(target=self._tick, args=(part,), daemon=True)
                         for part in slices if part]
        for thread in self._threads:
            thread.start()

    def ready(self) -> float:
        return self.start_seconds

    def _time_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_seconds += time.perf_counter() - self._gc_started

    def _tick(self, links: list[SimulatedLink]) -> None:
        interval = self.options.flush_interval_s
        while not self._stop.is_set():
            start = time.monotonic()
            for link in links:
                link.tick()
            took = time.monotonic() - start
            self.sweeps.append(took)
            self._stop.wait(max(0.0, interval - took))

    def run_traffic(self, start_at: float, duration_s: float, rate_per_replica: float,
                    seed: int) -> None:
        """Start drawing requests at wall time `start_at` for `duration_s` (returns now)."""
        traces = {p: ShapeTrace(seed=1000 + p) for p in set(self.program_of)}
        thread = threading.Thread(target=self._traffic, daemon=True, args=(
            traces, start_at, duration_s, rate_per_replica, random.Random(seed)))
        self._threads.append(thread)
        thread.start()

    def _traffic(self, traces, start_at, duration_s, rate, rng) -> None:
        step = 0.02
        per_step = rate * len(self.links) * step
        time.sleep(max(0.0, start_at - time.time()))
        while not self._stop.is_set():
            now = time.time()
            elapsed = now - start_at
            if elapsed >= duration_s:
                return
            for _ in range(int(per_step + rng.random())):
                replica = rng.randrange(len(self.links))
                program = self.program_of[replica]
                shape = traces[program].draw(rng, elapsed)
                self._request(self.links[replica], program, shape, now)
            time.sleep(max(0.0, step - (time.time() - now)))

    def _request(self, link: SimulatedLink, program: int, shape: tuple, now: float) -> None:
        self.requests += 1
        self.first_sighting.setdefault((program, shape), now)
        if link.serves(shape):
            self.specialized += 1
            return
        for observation in self.shapes[shape]:
            link.observed(observation.region, observation.signature, observation.seconds)

    def results(self) -> dict:
        """Stop everything and hand back what was measured."""
        cpu = _cpu_seconds() - self._cpu_at_ready
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self.pool.close()
        counters: dict[str, int] = defaultdict(int)
        replicas = []
        for program, link in zip(self.program_of, self.links):
            stats = link.stats()
            for name in ("reports", "records", "reported", "dropped_observations",
                         "installed_by_poll", "index_reads_skipped", "index_stamps_followed",
                         "service_failures", "backoffs", "installed", "install_rejected",
                         "announcements", "announcements_dropped", "registrations"):
                counters[name] += stats.get(name, 0)
            counters["messages"] += link.client.messages
            counters["bytes"] += link.client.bytes
            counters["local_compiles"] += link.runtime.stats()["compiles"]
            replicas.append({"program": program, "installed_at": link.installed_at,
                             "served_at": {f"{b}x{s}": t for (b, s), t
                                           in link.served_at.items()}})
            link.close()
        sweeps = sorted(self.sweeps) or [0.0]
        waits = sorted(t for link in self.links for t in link.client.seconds) or [0.0]
        return {"host": self.host, "replicas": replicas, "counters": dict(counters),
                "first_sighting": {f"{p}:{b}x{s}": t for (p, (b, s)), t
                                   in self.first_sighting.items()},
                "announced_first_seen": self.pool.first_seen,
                "first_keys": {f"{p}:{b}x{s}": keys for (p, (b, s)), keys
                               in self.reference.first_keys.items()},
                "announcements_received": self.pool.received,
                "announcement_deliveries": self.pool.deliveries,
                "announcement_cpu_s": self.pool.cpu_seconds,
                "announcement_read_spread_s": max(
                    (self.pool.last_read[k] - t for k, t in self.pool.first_seen.items()),
                    default=0.0),
                "announcement_queued_s": self.pool.queued_seconds
                / max(1, self.pool.received),
                "gc_seconds": self.gc_seconds,
                "requests": self.requests, "specialized_requests": self.specialized,
                "start_seconds": self.start_seconds, "host_cpu_s": cpu,
                "host_rss_bytes": psutil.Process().memory_info().rss,
                "reference_install_ms": 1e3 * self.reference.install_seconds
                / max(1, self.reference.installs),
                "reference_installs": self.reference.installs,
                "report_wait_s": {"p50": waits[len(waits) // 2],
                                  "p99": waits[int(0.99 * (len(waits) - 1))],
                                  "max": waits[-1]},
                "sweep_p50_s": sweeps[len(sweeps) // 2],
                "sweep_p99_s": sweeps[int(0.99 * (len(sweeps) - 1))],
                "sweep_max_s": sweeps[-1]}
