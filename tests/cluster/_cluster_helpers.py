"""What the cluster and reliability tests share: a local Ray + Serve on a free port, a
saved demo program, and polling until a condition holds.

Not a conftest on purpose (as tests/vm/_programs.py): import what you need.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import dynvm
from dynvm.models import recommender
from tests.cluster._redis_server import RedisServer, free_port, redis_config


def saved_recommender(directory: Path, filename: str = "recommender.dvm",
                      max_batch: int = 64):
    """(demo, program as loaded back, path) of the recommender demo saved in `directory`."""
    demo, program = _compiled_recommender(max_batch)
    path = Path(directory) / filename
    dynvm.save(program, path)
    return demo, dynvm.load(path), path


@functools.cache
def _compiled_recommender(max_batch: int):
    """The demo (seeded: every build has the same weights) and its compiled program, once
    per session and batch bound: 16 fixtures save it, and a build + compile costs ~0.7 s
    after the session's first (12:30 UTC, load 2.5). Each caller gets its own file and
    program loaded back from it."""
    demo = recommender(max_batch=max_batch)
    program = dynvm.compile(demo.module.eval(), demo.example_inputs, demo.dynamic_shapes,
                            name="recommender")
    return demo, program


def process_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited but not reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate: Callable[[], object], timeout_s: float = 30.0,
               interval_s: float = 0.05) -> float | None:
    """Seconds until `predicate()` was true, or None if it never was within `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval_s)
    return None


@contextlib.contextmanager
def local_serve(namespace: str, num_cpus: int = 2, proxy_limits=None,
                grpc_options: dict | None = None, **ray_options) -> Iterator[int]:
    """A local Ray cluster with Serve on a free loopback port (yielded); everything is
    shut down on exit, usage reporting off while it runs. The proxy runs dynvm's guard
    (dynvm.cluster.protocol.proxy_guard) with `proxy_limits` (default ProxyLimits()), as `dynvm
    serve` does; `grpc_options` (dynvm.cluster.protocol.grpc_v2.grpc_options) adds the gRPC one."""
    import ray
    from ray import serve

    from dynvm.cluster.protocol.proxy_guard import ProxyLimits

    limits = proxy_limits if proxy_limits is not None else ProxyLimits()
    variables = {"RAY_USAGE_STATS_ENABLED": "0", **limits.environment()}
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)  # Ray's processes (its proxy too) inherit them
    port = free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False, namespace=namespace, **ray_options)
    try:
        serve.start(http_options=limits.http_options("127.0.0.1", port),
                    grpc_options=grpc_options)
        yield port
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@contextlib.contextmanager
def serve_fleet(directory: Path, namespace: str, jit_config, **fleet_options):
    """A private redis-server, the shared local Ray + Serve (tests/cluster/_shared_serve.py:
    a test using this is marked `shared_serve`) and a compile service with a unique name;
    yields (port, the RedisServer, the replicas' FleetOptions). On exit the applications
    are deleted, then the service is stopped, then the redis-server."""
    from dynvm.cluster import StoreConfig
    from dynvm.cluster.fleet._link import FleetOptions
    from dynvm.cluster.fleet.compile_service import start_compile_service
    from tests.cluster._shared_serve import shared_serve

    redis_server = RedisServer(Path(directory) / "redis").start()
    store = StoreConfig(secret=secrets.token_bytes(32), redis=redis_config(redis_server))
    options = FleetOptions(store, service_name=f"{namespace}-{uuid.uuid4().hex[:8]}",
                           **fleet_options)
    with contextlib.ExitStack() as stack:  # unwound last to first
        stack.callback(redis_server.stop)
        stack.callback(_stop_service, options.service_name)
        serve_stack = stack.enter_context(shared_serve())
        start_compile_service(store, jit_config, name=options.service_name)
        yield serve_stack.port, redis_server, options


def _stop_service(name: str) -> None:
    """Stop the compile service `name`, if Ray still runs (a stack that failed to start
    or to clean up is shut down, the service with it)."""
    import ray

    from dynvm.cluster.fleet.compile_service import stop_compile_service

    if ray.is_initialized():
        stop_compile_service(name)


# The spin program's runaway call (tests.vm._programs.DATA_LOOP: a loop that runs to the
# call budget), as a v2 JSON body.
SPIN_BODY = json.dumps({"inputs": [
    {"name": "n", "datatype": "INT64", "shape": [], "data": [2**62]},
    {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, -1.0]}]}).encode()


def assert_overloaded(post: Callable[[bytes], tuple[int, dict, bytes]],
                      clients: int = 5) -> None:
    """`clients` runaway calls, 50 ms apart, to a replica with max_queued=1 and a 0.5 s
    call budget (Retry-After 2): two run to their budget (500), the rest are answered
    503 + Retry-After at once. `post(body)` -> (status, headers, raw body)."""
    replies: list = []

    def runaway() -> None:
        status, headers, raw = post(SPIN_BODY)
        replies.append((status, {k.lower(): v for k, v in headers.items()}, json.loads(raw)))

    threads = [threading.Thread(target=runaway) for _ in range(clients)]
    for thread in threads:
        thread.start()
        threading.Event().wait(0.05)
    for thread in threads:
        thread.join(30)
    assert sorted(r[0] for r in replies) == [500, 500] + [503] * (clients - 2), replies
    for status, headers, doc in replies:
        if status == 503:
            assert headers["retry-after"] == "2"
            assert "requests are waiting for the model" in doc["error"]
