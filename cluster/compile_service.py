"""The compile service: one named Ray actor per cluster wrapping a `FleetCompiler`.

Ray restarts it if it dies (`max_restarts=-1`); the restarted actor reloads each
program when a replica re-registers it and resumes from the store's index (Note [Fleet
promotion]). Replicas talk to it through `RayServiceClient`, which never lets a slow or
dead service reach a request: calls run on the replica's link thread, with a timeout,
and an unreachable service only means "compile locally for now".
"""

from __future__ import annotations

import ray

from dynvm.cluster.config import StoreConfig
from dynvm.cluster.fleet_compiler import FleetCompiler
from dynvm.jit.config import JitConfig
from dynvm.telemetry import Telemetry

SERVICE_NAME = "dynvm-compile-service"
NAMESPACE = "dynvm"


class CompileService:
    """The actor's methods: FleetCompiler's, plus `ping`."""

    def __init__(self, store: StoreConfig, jit_config: JitConfig | None = None,
                 gpu_targets: tuple = ()) -> None:
        # Traced as configured by OTEL_* in the actor's environment (dynvm._env).
        self.compiler = FleetCompiler(store, jit_config, Telemetry.from_env(),
                                      gpu_targets=gpu_targets)

    def ping(self) -> bool:
        return True

    def knows(self, program_hash: str) -> bool:
        return self.compiler.knows(program_hash)

    def register(self, program_hash: str, dvm_bytes: bytes) -> bool:
        self.compiler.register(program_hash, dvm_bytes)
        return True

    def report(self, program_hash: str, batch: list) -> dict:
        return self.compiler.report(program_hash, batch)

    def index(self, program_hash: str) -> list[str]:
        return self.compiler.index(program_hash)

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        return self.compiler.wait_idle(timeout_s)

    def stats(self) -> dict:
        return self.compiler.stats()


def start_compile_service(store: StoreConfig, jit_config: JitConfig | None = None, *,
                          name: str = SERVICE_NAME, namespace: str = NAMESPACE,
                          num_cpus: float = 0.0, gpu_targets: tuple = ()):
    """The cluster's compile service actor, created if it does not exist yet (Ray must be
    initialized). Detached: it outlives the driver that started it, as Serve does.
    `gpu_targets` (e.g. [("cuda", 90, 32)]): also build Triton binaries for them."""
    actor = ray.remote(CompileService).options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_task_retries=0, num_cpus=num_cpus, max_concurrency=1)
    handle = actor.remote(store, jit_config, tuple(gpu_targets))
    ray.get(handle.ping.remote())
    return handle


def stop_compile_service(name: str = SERVICE_NAME, namespace: str = NAMESPACE) -> bool:
    """Kill the service for good (no restart); False if there was none."""
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    ray.kill(handle, no_restart=True)
    return True


class RayServiceClient:
    """What a replica's link calls: the named actor, looked up lazily, with timeouts.
    Every method returns None when the service cannot be reached in time."""

    def __init__(self, name: str = SERVICE_NAME, namespace: str = NAMESPACE,
                 timeout_s: float = 2.0) -> None:
        self.name = name
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._handle = None

    def _call(self, method: str, *args):
        try:
            if self._handle is None:
                self._handle = ray.get_actor(self.name, namespace=self.namespace)
            return ray.get(getattr(self._handle, method).remote(*args),
                           timeout=self.timeout_s)
        except ValueError:  # no such actor (not started, or killed for good)
            self._handle = None
            return None
        except (ray.exceptions.RayError, TimeoutError):
            # Dead, restarting or slow: the link compiles locally until it answers again.
            return None

    def report(self, program_hash: str, batch: list) -> dict | None:
        return self._call("report", program_hash, batch)

    def register(self, program_hash: str, dvm_bytes: bytes) -> bool:
        """True once the service holds the program (False: unreachable or refused)."""
        return bool(self._call("register", program_hash, dvm_bytes))


class LocalServiceClient:
    """The same calls on an in-process `FleetCompiler` (one machine, tests)."""

    def __init__(self, compiler: FleetCompiler) -> None:
        self.compiler = compiler

    def report(self, program_hash: str, batch: list) -> dict | None:
        return self.compiler.report(program_hash, batch)

    def register(self, program_hash: str, dvm_bytes: bytes) -> bool:
        self.compiler.register(program_hash, dvm_bytes)
        return True
