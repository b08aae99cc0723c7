"""Every socket of a one-machine Ray + Serve on loopback (`dynvm serve` without --host).

Note [Loopback listeners]
~~~~~~~~~~~~~~~~~~~~~~~~~
`dynvm serve` says it serves on 127.0.0.1; by default Ray 2.60 and Serve open 20 of the
24 sockets of such a run on every interface (issue 28: GCS, raylet, every worker's and
replica's gRPC server, the dashboard agent, the metrics exporters). Ray's switches, read
in its source (2.60) and checked by tests/reliability/test_shutdown.py, which lists the
listening sockets of a running `dynvm serve`:

- Ray binds its gRPC servers, its agents and its Prometheus exporters to loopback when
  the node's address is loopback (`is_localhost(node ip)` in dashboard/agent.py,
  dashboard/head.py, autoscaler/monitor.py; the C++ servers likewise). `ray.init`
  refuses to take 127.0.0.1 as `_node_ip_address` (`resolve_ip_for_localhost` turns it
  into the host's address), but picks 127.0.0.1 itself when
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ("no multi-node cluster", the default on macOS
  and Windows): `loopback_environment()`, exported before `ray` is first imported (Ray
  reads it once, in ray._private.ray_constants) and inherited by every Ray process.
- Serve has no switch for three gRPC servers: every replica's inter-deployment server
  (`add_port_to_grpc_server(server, "[::]:0")` in serve/_private/replica.py), and, with
  a gRPC port, the gRPC proxy and each replica's direct-ingress gRPC server
  (`add_grpc_address(server, "[::]:<port>")`, serve/_private/grpc_util.py). In Serve's
  own processes `serve_grpc_on_loopback` (a Ray worker_process_setup_hook, run in
  every worker of the job before any task or actor: the controller, the proxies and
  the replicas are the job's actors) rewrites "[::]" to 127.0.0.1 in those two calls,
  only when the node's address is loopback. It patches the two modules when a worker
  imports them (an import hook), not before: a worker that never serves (the compile
  service, an idle worker) would pay 0.66 s and 47 MB to import them. It wraps two
  private Ray functions: Ray is pinned (2.60.0); a Ray whose functions moved fails the
  socket tests (here and tests/cluster/test_loopback.py), not the serving: the hook
  leaves anything it cannot find as it is.

With `--host` other than loopback none of this applies: Ray picks the host's address,
Serve's proxy and direct-ingress servers bind --host, and the ports README "Running on
a cluster" lists are open on every interface, to be firewalled.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys

LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
# Ray's own variable (ray._private.ray_constants.ENABLE_RAY_CLUSTER): Note [Loopback
# listeners].
RAY_CLUSTER_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
SETUP_HOOK = "dynvm.cluster.protocol._loopback.serve_grpc_on_loopback"

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface."""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def loopback_environment() -> dict[str, str]:
    """The variables that put a local Ray's every socket on loopback: export them
    before `ray` is first imported (Note [Loopback listeners])."""
    return {RAY_CLUSTER_VARIABLE: "0"}


def loopback_runtime_env() -> dict:
    """`ray.init(runtime_env=...)` of a loopback-only run: Serve's gRPC servers bind
    127.0.0.1 in the job's workers (Note [Loopback listeners])."""
    return {"worker_process_setup_hook": SETUP_HOOK}


def _on_loopback(address: str) -> str:
    """'[::]:PORT' -> '127.0.0.1:PORT'; any other address as it is."""
    return LOOPBACK + address[4:] if address.startswith("[::]:") else address


def _wrapped(function):
    @functools.wraps(function)
    def bind(server, address, *args, **kwargs):
        return function(server, _on_loopback(address), *args, **kwargs)

    bind.__dynvm_loopback__ = True
    return bind


# Serve's functions that bind a gRPC server, by module (Note [Loopback listeners]).
SERVE_BINDERS = {"ray.serve._private.replica": "add_port_to_grpc_server",
                 "ray.serve._private.default_impl": "add_grpc_address"}


def _patch(module) -> None:
    attribute = SERVE_BINDERS[module.__name__]
    function = getattr(module, attribute, None)
    if function is None:
        logger.warning("dynvm: %s.%s not found; Serve's gRPC servers keep Serve's address",
                       module.__name__, attribute)
    elif not getattr(function, "__dynvm_loopback__", False):
        setattr(module, attribute, _wrapped(function))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds SERVE_BINDERS' modules through the other finders, and patches each once
    it has run."""

    def find_spec(self, name, path, target=None):
        if name not in SERVE_BINDERS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    _patch(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def serve_grpc_on_loopback() -> None:
    """Ray worker_process_setup_hook: Serve's gRPC servers in this worker bind 127.0.0.1
    instead of every interface, when the node's address is loopback (Note [Loopback
    listeners]); otherwise, or where Ray's functions are not found, nothing changes."""
    import ray

    try:
        node_ip = ray.util.get_node_ip_address()
    except Exception:  # no address to judge by: leave Serve as it is
        return
    if not is_loopback(node_ip):
        return
    for name in SERVE_BINDERS:
        if name in sys.modules:
            _patch(sys.modules[name])
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
