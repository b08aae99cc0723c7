"""One local Ray + Serve shared by the test modules whose options agree (Note [Shared
Serve in tests]): `shared_serve()` for a module's fixture; `run_together` and
`close_unless_needed` for tests/conftest.py.

Not a conftest on purpose (as tests/cluster/_cluster_helpers.py): import what you need.
Ray is imported only when the stack starts, so that a session without such a test never
loads it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

# Note [Shared Serve in tests]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A local Ray + Serve takes 5-6 s to start and 2-3 s to shut down on a quiet 2-core host
# (ray.init 2.7-4.0 s, serve.start 2.4 s, serve.shutdown 0.8-1.2 s, ray.shutdown 1.5 s,
# measured 12:09 UTC, load 1.3), more on CI's loaded one; six modules each started one
# with the same options: dynvm's default proxy guard (ProxyLimits()), which the two with
# gRPC tests want with a gRPC port and the two fleet modules with 8 logical CPUs. They
# share one now, which has all of that. A module's fixture enters `shared_serve()`,
# deploys its applications and yields; on leaving, every Serve application is deleted
# (and the caller stops what else it started, a compile service), so the next module
# finds Serve empty, as a fresh one: each module still deploys, and tests, its own
# applications end to end through Serve's real proxy.
#
# Ray connects a driver process to one cluster at a time, and the modules with their own
# options (proxy limits, direct ingress, metrics export, several nodes) start their own:
# tests/conftest.py runs the tests marked `shared_serve` one after another, at the place
# of the first (`run_together`), and shuts the shared Ray down after the last of them,
# before any other test runs (`close_unless_needed`). A module is moved whole; a module
# with only some tests marked has those first. Modules that keep their own Ray:
# test_hostile_http (tight proxy limits), test_direct_ingress (direct ingress is the
# cluster's mode), test_metrics (metrics export port and interval), test_multinode.

MARK = "shared_serve"
"""The marker of a test that uses the shared stack (its module's fixture does)."""

NAMESPACE = "dynvm-test-shared"
NUM_CPUS = 8
"""Logical CPUs: the fleet modules' replicas and compile service need more than 2."""
DELETE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ServeStack:
    """The shared Ray + Serve: its HTTP proxy's port and its gRPC proxy's (the v2 gRPC
    protocol, dynvm.cluster.protocol.grpc_v2)."""

    port: int
    grpc_port: int


_stack: ServeStack | None = None
_saved_environment: dict[str, str | None] = {}


def _start() -> ServeStack:
    import ray
    from ray import serve

    from dynvm.cluster.protocol import grpc_v2
    from dynvm.cluster.protocol.proxy_guard import ProxyLimits
    from dynvm.cluster.store._local_redis import free_port

    global _stack
    limits = ProxyLimits()
    variables = {"RAY_USAGE_STATS_ENABLED": "0", **limits.environment()}
    _saved_environment.update({name: os.environ.get(name) for name in variables})
    os.environ.update(variables)  # Ray's processes (its proxy too) inherit them
    port, grpc_port = free_port(), free_port()
    ray.init(num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False,
             configure_logging=False, namespace=NAMESPACE)
    try:
        serve.start(http_options=limits.http_options("127.0.0.1", port),
                    grpc_options=grpc_v2.grpc_options(grpc_port))
    except BaseException:
        _shut_down()
        raise
    _stack = ServeStack(port, grpc_port)
    return _stack


def _shut_down() -> None:
    import ray
    from ray import serve

    global _stack
    _stack = None
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        for name, value in _saved_environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _saved_environment.clear()


def _delete_applications() -> None:
    """Delete every Serve application, all at once, and wait until they are gone."""
    from ray import serve

    names = list(serve.status().applications)
    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + DELETE_TIMEOUT_S
    while serve.status().applications:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve applications not deleted in {DELETE_TIMEOUT_S} s: "
                               f"{sorted(serve.status().applications)}")
        time.sleep(0.1)


@contextlib.contextmanager
def shared_serve() -> Iterator[ServeStack]:
    """The shared local Ray + Serve (started if it is not running), on loopback, usage
    reporting off. Every Serve application is deleted on exit; if that fails, the stack
    is shut down, so that the next user starts a fresh one."""
    stack = _stack if _stack is not None else _start()
    try:
        yield stack
    finally:
        try:
            _delete_applications()
        except BaseException:
            _shut_down()
            raise


def close() -> None:
    """Shut the shared stack down, if it runs."""
    if _stack is not None:
        _shut_down()


def close_unless_needed(next_item) -> None:
    """After a test: shut the stack down unless the next test is marked (a test that
    starts its own Ray may follow)."""
    if next_item is None or next_item.get_closest_marker(MARK) is None:
        close()


def run_together(items: list) -> None:
    """Reorder `items` (in place) so that the marked tests run one after another, at the
    place of the first: whole modules in their order, then the modules with only some
    tests marked, each one's marked tests first; every other order is kept."""
    def module(item) -> str:
        return item.nodeid.split("::")[0]

    def marked(item) -> bool:
        return item.get_closest_marker(MARK) is not None

    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(module(item), []).append(item)
    users = [name for name, its in by_module.items() if any(marked(i) for i in its)]
    if not users:
        return
    whole = [name for name in users if all(marked(i) for i in by_module[name])]
    mixed = [name for name in users if name not in whole]
    block = [i for name in whole for i in by_module[name]]
    for name in mixed:
        block += sorted(by_module[name], key=lambda i: not marked(i))  # stable
    first = next(n for n, item in enumerate(items) if module(item) in users)
    others = [item for item in items if module(item) not in users]
    items[:] = others[:first] + block + others[first:]
