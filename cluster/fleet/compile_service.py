"""The compile service: named Ray actors wrapping a `FleetCompiler`, one per shard
(Note [Compile service shards] in dynvm.cluster.fleet._shards; one shard by default).

Ray restarts a shard if it dies (`max_restarts=-1`); the restarted actor reloads each
program when a replica re-registers it and resumes from the store's index (Note [Fleet
promotion]). Replicas talk to it through `RayServiceClient`, which never lets a slow or
dead service reach a request: calls run on the replica's link thread, with a timeout,
and an unreachable service only means "compile locally for now". A shard that spends
more than half of its time reading reports answers with `backoff_s`, the interval its
replicas should report at (back-pressure, Note [Pre-aggregated observations] in
dynvm.cluster.fleet._link).
"""

from __future__ import annotations

import os
import time

import ray

from dynvm.cluster.fleet._compiler import FleetCompiler
from dynvm.cluster.fleet._service_warmup import Warmup
from dynvm.cluster.fleet._shards import shard_actor_name, shard_names
from dynvm.cluster.store._store_config import StoreConfig
from dynvm.jit.config import JitConfig
from dynvm.telemetry import Telemetry

SERVICE_NAME = "dynvm-compile-service"
NAMESPACE = "dynvm"


class ReportLoad:
    """How busy reading reports keeps a shard, and the back-pressure that follows: each
    `period_s` the fraction of it spent in `report` is measured; above `high` the
    suggested report interval doubles (from `start_s`, up to `max_s`), below `low` it
    halves, and under `start_s` it is 0 (report at the replicas' own pace)."""

    def __init__(self, period_s: float = 1.0, high: float = 0.5, low: float = 0.25,
                 start_s: float = 0.1, max_s: float = 2.0, clock=time.monotonic) -> None:
        self.period_s, self.high, self.low = period_s, high, low
        self.start_s, self.max_s, self._clock = start_s, max_s, clock
        self.backoff_s = 0.0
        self.busy_fraction = 0.0
        self._busy = 0.0
        self._since = clock()

    def add(self, seconds: float) -> float:
        """Count `seconds` spent in one report; returns the interval to suggest."""
        self._busy += seconds
        now = self._clock()
        elapsed = now - self._since
        if elapsed >= self.period_s:
            self.busy_fraction = self._busy / elapsed
            self._busy, self._since = 0.0, now
            if self.busy_fraction > self.high:
                self.backoff_s = min(self.max_s, max(self.start_s, self.backoff_s * 2))
            elif self.busy_fraction < self.low:
                halved = self.backoff_s / 2
                self.backoff_s = halved if halved >= self.start_s else 0.0
        return self.backoff_s


class CompileService:
    """The actor's methods: FleetCompiler's, plus `ping` and back-pressure on `report`."""

    def __init__(self, store: StoreConfig, jit_config: JitConfig | None = None,
                 gpu_targets: tuple = ()) -> None:
        # Before anything is constructed: the imports overlap the rest (Note [Warm
        # compile service] in dynvm.cluster.fleet._service_warmup).
        self.warmup = Warmup().start()
        # Traced as configured by OTEL_* in the actor's environment (dynvm._env).
        self.compiler = FleetCompiler(store, jit_config, Telemetry.from_env(),
                                      gpu_targets=gpu_targets)
        self.load = ReportLoad()
        self.reports = 0
        self.report_records = 0

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        """The actor's process id (the fleet simulator reads its CPU time and memory)."""
        return os.getpid()

    def knows(self, program_hash: str) -> bool:
        return self.compiler.knows(program_hash)

    def register(self, program_hash: str, dvm_bytes: bytes) -> bool:
        self.compiler.register(program_hash, dvm_bytes)
        return True

    def report(self, program_hash: str, batch: list) -> dict:
        start = time.perf_counter()
        answer = self.compiler.report(program_hash, batch)
        self.reports += 1
        self.report_records += len(batch)
        backoff = self.load.add(time.perf_counter() - start)
        return {**answer, "backoff_s": backoff} if backoff else answer

    def index(self, program_hash: str) -> list[str]:
        return self.compiler.index(program_hash)

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        return self.compiler.wait_idle(timeout_s)

    def stats(self) -> dict:
        return {**self.compiler.stats(), "reports": self.reports,
                "report_records": self.report_records, "backoff_s": self.load.backoff_s,
                "busy_fraction": self.load.busy_fraction,
                "warmup_seconds": self.warmup.seconds}


def start_compile_service(store: StoreConfig, jit_config: JitConfig | None = None, *,
                          name: str = SERVICE_NAME, namespace: str = NAMESPACE,
                          num_cpus: float = 0.0, gpu_targets: tuple = (), shards: int = 1):
    """The cluster's compile service, created if it does not exist yet (Ray must be
    initialized): one actor named `name`, or with `shards` > 1 the actors `name-0` ..
    (Note [Compile service shards]); returns the first one's handle. Detached: it
    outlives the driver that started it, as Serve does. `gpu_targets` (e.g.
    [("cuda", 90, 32)]): also build Triton binaries for them."""
    handles = [ray.remote(CompileService).options(
        name=shard, namespace=namespace, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_task_retries=0, num_cpus=num_cpus, max_concurrency=1).remote(
        store, jit_config, tuple(gpu_targets)) for shard in shard_names(name, shards)]
    ray.get([handle.ping.remote() for handle in handles])
    return handles[0]


def stop_compile_service(name: str = SERVICE_NAME, namespace: str = NAMESPACE,
                         shards: int = 1) -> bool:
    """Kill the service (each of its `shards`) for good (no restart); False if there
    was none."""
    stopped = False
    for shard in shard_names(name, shards):
        try:
            handle = ray.get_actor(shard, namespace=namespace)
        except ValueError:
            continue
        ray.kill(handle, no_restart=True)
        stopped = True
    return stopped


class RayServiceClient:
    """What a replica's link calls: its program's shard of the service (a named actor,
    looked up lazily), with timeouts. Every method returns None when the service cannot
    be reached in time."""

    def __init__(self, name: str = SERVICE_NAME, namespace: str = NAMESPACE,
                 timeout_s: float = 2.0, shards: int = 1) -> None:
        self.name = name
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.shards = shards
        self._handles: dict[str, object] = {}

    @classmethod
    def for_fleet(cls, options) -> RayServiceClient:
        """The client a replica with these `FleetOptions` uses."""
        return cls(options.service_name, options.service_namespace,
                   options.service_timeout_s, options.service_shards)

    def _call(self, program_hash: str, method: str, *args):
        actor = shard_actor_name(self.name, program_hash, self.shards)
        try:
            handle = self._handles.get(actor)
            if handle is None:
                handle = self._handles[actor] = ray.get_actor(actor, namespace=self.namespace)
            return ray.get(getattr(handle, method).remote(*args), timeout=self.timeout_s)
        except ValueError:  # no such actor (not started, or killed for good)
            self._handles.pop(actor, None)
            return None
        except (ray.exceptions.RayError, TimeoutError):
            # Dead, restarting or slow: the link compiles locally until it answers again.
            return None

    def report(self, program_hash: str, batch: list) -> dict | None:
        return self._call(program_hash, "report", program_hash, batch)

    def register(self, program_hash: str, dvm_bytes: bytes) -> bool:
        """True once the service holds the program (False: unreachable or refused)."""
        return bool(self._call(program_hash, "register", program_hash, dvm_bytes))


class LocalServiceClient:
    """The same calls on an in-process `FleetCompiler` (one machine, tests)."""

    def __init__(self, compiler: FleetCompiler) -> None:
        self.compiler = compiler

    def report(self, program_hash: str, batch: list) -> dict | None:
        return self.compiler.report(program_hash, batch)

    def register(self, program_hash: str, dvm_bytes: bytes) -> bool:
        self.compiler.register(program_hash, dvm_bytes)
        return True
