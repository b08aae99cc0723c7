"""Note [Loopback listeners]: Serve's gRPC servers, which Serve binds on every interface,
listen on loopback in a worker whose node address is loopback (the setup hook, run in
a fresh interpreter as Ray runs it in a worker); elsewhere nothing changes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dynvm.cluster.protocol._loopback import (
    RAY_CLUSTER_VARIABLE,
    _on_loopback,
    is_loopback,
    loopback_environment,
)
from tests.reliability._serve_process import is_loopback_address, proc_address

# Bind a real gRPC server through Serve's own (patched) helper, then list this
# process's listening TCP sockets from /proc.
PROBE = """
import os
from concurrent.futures import ThreadPoolExecutor
import grpc
from dynvm.cluster.protocol._loopback import serve_grpc_on_loopback
serve_grpc_on_loopback()
import ray
print("node", ray.util.get_node_ip_address())
import ray.serve._private.replica as replica
server = grpc.server(ThreadPoolExecutor(1))
port = replica.add_port_to_grpc_server(server, "[::]:0")
server.start()
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
for table in ("tcp", "tcp6"):
    for line in open(f"/proc/net/{table}").readlines()[1:]:
        parts = line.split()
        if parts[3] == "0A" and parts[9] in inodes:
            print(table, parts[1])
server.stop(0)
"""


def _probe(extra_env: dict) -> tuple[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != RAY_CLUSTER_VARIABLE}
    env.update(extra_env)
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    node, *listening = result.stdout.split("\n")[:-1]
    return node.split()[1], listening


def test_serves_grpc_server_binds_loopback_when_the_node_is_loopback():
    node, listening = _probe(loopback_environment())
    assert is_loopback(node) and listening, (node, listening)
    assert all(is_loopback_address(proc_address(line.split()[1])) for line in listening), \
        listening


def test_elsewhere_serve_keeps_its_address():
    node, listening = _probe({RAY_CLUSTER_VARIABLE: "1"})
    if is_loopback(node):
        pytest.skip("this host has no address but loopback")
    assert listening and not any(is_loopback_address(proc_address(line.split()[1]))
                                 for line in listening), listening


def test_addresses():
    assert _on_loopback("[::]:9000") == "127.0.0.1:9000"
    assert _on_loopback("0.0.0.0:9000") == "0.0.0.0:9000"
    assert _on_loopback("10.0.0.1:0") == "10.0.0.1:0"
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
