"""A local serving stack, from Python: what `dynvm serve` starts, callable without the CLI.

    from dynvm.cluster.serving._local_stack import serve_local

    with serve_local({"rec": "/models/rec.dvm"}) as handles:   # ServingConfig.local_stack()
        ...   # http://127.0.0.1:8000/v2/models/rec/infer (serving_config.HTTP_PORT)

`start_local_stack` starts, in order, the kernel store (the environment's Redis, else a
private redis-server, dynvm.cluster.store._local_redis), a local Ray (no dashboard), and at once
the compile service and Serve's HTTP proxy on `host` (loopback by default: every socket
of the run, Ray's included, listens there, Note [Loopback listeners] in
dynvm.cluster.protocol._loopback). Everything it starts is stopped by the ExitStack it is given,
in reverse order. `serve_local` adds the models' deployments with their fleet links;
`dynvm serve` (dynvm._serve_cmd) runs the same two steps, with its signals and drain
around them (Note [Stopping dynvm serve]).

The kernel store's secret comes from DYNVM_STORE_SECRET when it is set; otherwise it is
random for this stack, and travels only inside the StoreConfig handed to the actors.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from dynvm._env import REDIS_URL, STORE_SECRET, child_environment, export, store_settings
from dynvm.cluster.serving.serving_config import HTTP_PORT, ServingConfig
from dynvm.vm.errors import DynvmError

if TYPE_CHECKING:
    from dynvm.cluster.fleet._link import FleetOptions
    from dynvm.cluster.store._local_redis import LocalRedis
    from dynvm.cluster.store._store_config import StoreConfig


class LocalStackError(DynvmError, RuntimeError):
    """The local stack could not start as asked (the message says what and why): e.g.
    Ray bound a non-loopback address on a loopback host. A bad setting raises the
    ConfigError that names it instead (DYNVM_REDIS_URL, DYNVM_STORE_SECRET)."""


def start_local_stack(serving: ServingConfig, stack: contextlib.ExitStack, *,
                      host: str = "127.0.0.1", port: int = HTTP_PORT,
                      grpc_port: int | None = None, service_shards: int = 1,
                      gpu_targets: tuple = (), say: Callable[[str], None] = lambda line: None,
                      after_ray_init: Callable[[], None] = lambda: None,
                      private: list[LocalRedis] | None = None) -> FleetOptions:
    """Start the store, Ray, the compile service and Serve (module docstring), each
    stopped by `stack`; returns the FleetOptions replicas join the fleet with. `say`
    gets one line per step; `after_ray_init` runs right after `ray.init` (which installs
    signal handlers of its own); a private redis-server is appended to `private`."""
    from dynvm.cluster.protocol._loopback import (
        is_loopback,
        loopback_environment,
        loopback_runtime_env,
    )

    loopback = is_loopback(host)
    if loopback:  # before Ray is first imported: Note [Loopback listeners]
        export(loopback_environment())
    import ray
    from ray import serve

    from dynvm.cluster.fleet._link import FleetOptions
    from dynvm.cluster.fleet.compile_service import (
        NAMESPACE,
        SERVICE_NAME,
        start_compile_service,
        stop_compile_service,
    )
    from dynvm.cluster.protocol.ingress import ingress_environment
    from dynvm.cluster.protocol.proxy_guard import ProxyLimits
    from dynvm.cluster.serving._deployment import start_serve

    store = _store_config(stack, say, [] if private is None else private)
    proxy = ProxyLimits()
    # Serve's proxy (or, in direct ingress, each replica's own HTTP server) takes
    # dynvm's guard only from its environment, and Serve its ingress mode: Ray's
    # processes inherit both from this one (Notes [Limits at the proxy], [Direct ingress]).
    export({**proxy.environment(), **ingress_environment(serving.ingress)})
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env=loopback_runtime_env() if loopback else None)
    stack.callback(ray.shutdown)
    after_ray_init()
    if loopback and not is_loopback(ray.util.get_node_ip_address()):
        raise LocalStackError(
            f"Ray took {ray.util.get_node_ip_address()} as this node's address, not "
            f"loopback: its sockets would listen on every interface "
            f"(Note [Loopback listeners]); give another host to serve on another address "
            f"on purpose")
    say(f"ray       local, {int(ray.cluster_resources().get('CPU', 0))} CPUs")
    # The compile service's actor and Serve's controller and proxies start at once (each
    # is a new worker process: seconds on a small host); replicas need both.
    stack.callback(stop_compile_service, SERVICE_NAME, NAMESPACE, service_shards)
    with ThreadPoolExecutor(1, thread_name_prefix="dynvm-serve-start") as pool:
        service = pool.submit(start_compile_service, store, name=SERVICE_NAME,
                              namespace=NAMESPACE, gpu_targets=gpu_targets,
                              shards=service_shards)
        stack.callback(serve.shutdown)
        start_serve(host, port, proxy, grpc_port=grpc_port)
        service.result()
    say("compile   service started")
    return FleetOptions(store, SERVICE_NAME, NAMESPACE, gpu_targets=gpu_targets,
                        service_shards=service_shards)


@contextlib.contextmanager
def serve_local(models: Mapping[str, str], serving: ServingConfig | None = None,
                **stack_options) -> Iterator[dict]:
    """Serve `models` ({name: .dvm path}) on a local stack (`start_local_stack`, whose
    keyword options it takes) with `serving` (default: ServingConfig.local_stack());
    yields serve_models' {name: handle}; everything stops when the block ends."""
    serving = ServingConfig.local_stack() if serving is None else serving
    with contextlib.ExitStack() as stack:
        fleet = start_local_stack(serving, stack, **stack_options)
        # Only now: Serve's module imports Ray, which must come after the loopback
        # environment (Note [Loopback listeners]).
        from dynvm.cluster.serving._deployment import serve_models

        yield serve_models(dict(models), serving, fleet=fleet)


def _store_config(stack: contextlib.ExitStack, say, private: list) -> StoreConfig:
    """The store: the environment's Redis, else a private redis-server (stopped by
    `stack`, and listed in `private` for a forced stop); the environment's secret, else
    a random one."""
    from dynvm.cluster.store._local_redis import LocalRedis
    from dynvm.cluster.store._store_config import StoreConfig

    env = child_environment()  # dynvm._env reads the environment; we fill in defaults
    if not env.get(STORE_SECRET, "").strip():
        env[STORE_SECRET] = secrets.token_hex(32)
    settings = store_settings(env)
    if settings.redis_url is not None:
        say(f"store     Redis from {REDIS_URL}")
        return StoreConfig.from_env(env)
    local = LocalRedis().start()
    private.append(local)
    stack.callback(local.stop)
    say(f"store     private redis-server on 127.0.0.1:{local.port} (pid {local.pid})")
    return StoreConfig(secret=settings.secret.encode(), redis=local.config())
