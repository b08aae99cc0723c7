"""A Ray cluster of several nodes on this machine, for the multi-node tests: a head and
worker nodes, each started by its own `ray start` on loopback, as KubeRay starts one per
pod (deploy/rayservice.yaml).

Everything is stopped by pid, never with `ray stop`: that stops every Ray on the machine,
other tests' clusters included. A node's processes are its raylet (found by the node
manager port it was given) and the raylet's descendants (agents, workers); the cluster's
are every process whose command line names its private temp dir, and their descendants.
Processes are read from /proc (Linux, as the CI; no psutil dependency). Not a conftest
on purpose (as tests/vm/_programs.py): import what you need.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dynvm.cluster.store._local_redis import free_port

START_TIMEOUT_S = 120.0
"""A `ray start` on a loaded 2-core machine can take half a minute; this is the bound."""

FAST_FAILURE_DETECTION = {
    # The head declares a silent node dead after period x threshold (3 s, default 15 s):
    # the test kills a node and waits for that. Timeouts stay generous for a busy machine.
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 5000,
    "health_check_failure_threshold": 3,
}


@dataclass(frozen=True)
class RayNode:
    """One node: its name (a custom resource of the same name is its only one besides
    CPUs) and its raylet's port, which tells its processes apart from the other nodes'."""

    name: str
    node_manager_port: int
    temp_dir: str

    def processes(self) -> set[int]:
        """This node's processes now: its raylet and the raylet's descendants (the node's
        log monitor is left to `RayNodes.stop`: it serves no request)."""
        table = _process_table()
        flag = f"--node_manager_port={self.node_manager_port}"
        raylets = {pid for pid, (_, cmdline) in table.items()
                   if flag in cmdline.split() and self.temp_dir in cmdline}
        return _with_descendants(raylets, table)


class RayNodes:
    """A multi-node Ray cluster on loopback in a private temp dir (see the module)."""

    def __init__(self, environment: dict[str, str] | None = None) -> None:
        # Short: Ray's unix sockets live under it, and a socket path has ~107 characters.
        self.temp_dir = tempfile.mkdtemp(prefix="dynvm-rn-", dir="/tmp")
        self.port = free_port()
        # `ray start --head` turns token auth on by itself when ~/.ray/auth_token exists
        # (another tool may have written it), while a worker's `ray start --address` and
        # a driver's `ray.init(address=...)` never do: say it once for all. The cluster
        # listens on loopback only.
        self.environment = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                            **(environment or {})}
        self.nodes: dict[str, RayNode] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_head(self, num_cpus: int, system_config: dict | None = None) -> RayNode:
        return self._start("head", num_cpus, [
            "--head", f"--port={self.port}", "--include-dashboard=false",
            f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
            f"--system-config={json.dumps(system_config or {})}"])

    def add_worker(self, name: str, num_cpus: int, attempts: int = 3) -> RayNode:
        """A worker node with `num_cpus` CPUs and one custom resource `name` (amount 1).

        `ray start` gives its raylet a fixed 30 s to register with the head, which a
        loaded 2-core machine can exceed: a failed start is cleaned up (its raylet may
        still be starting) and tried again."""
        for _ in range(attempts - 1):
            with contextlib.suppress(RuntimeError):
                return self._start(name, num_cpus, [f"--address={self.address}"])
        return self._start(name, num_cpus, [f"--address={self.address}"])

    def _start(self, name: str, num_cpus: int, role_args: list[str]) -> RayNode:
        node = RayNode(name, free_port(), self.temp_dir)
        # Every port is chosen free: Ray's defaults (agents on 52365, ...) would be
        # shared by the nodes here and by other tests' clusters on this machine.
        ports = [f"--{option}-port={free_port()}" for option in (
            "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc",
            "runtime-env-agent", "metrics-export")]
        command = ["ray", "start", *role_args, "--node-ip-address=127.0.0.1",
                   f"--num-cpus={num_cpus}", f"--resources={json.dumps({name: 1})}",
                   f"--node-manager-port={node.node_manager_port}", *ports,
                   f"--temp-dir={self.temp_dir}", "--disable-usage-stats"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S,
                              env={**os.environ, **self.environment})
        if done.returncode != 0:
            _kill(node.processes())
            raise RuntimeError(f"`ray start` of node {name} failed ({done.returncode}): "
                               f"{(done.stdout + done.stderr)[-3000:]}")
        self.nodes[name] = node
        return node

    def kill(self, name: str) -> int:
        """SIGKILL every process of node `name` (a lost machine: nothing is told);
        returns how many there were."""
        pids = self.nodes.pop(name).processes()
        _kill(pids)
        return len(pids)

    def own_processes(self) -> set[int]:
        """Every process of this cluster: its command line names the temp dir, or it is a
        descendant of one that does."""
        table = _process_table()
        marked = {pid for pid, (_, cmdline) in table.items() if self.temp_dir in cmdline}
        return _with_descendants(marked, table)

    def stop(self) -> None:
        """Kill every process of the cluster (by pid) and remove its temp dir."""
        for _ in range(3):  # a worker starting while we kill is caught by the next pass
            pids = self.own_processes()
            if not pids:
                break
            _kill(pids)
        self.nodes.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    @contextlib.contextmanager
    def driver(self, namespace: str) -> Iterator[None]:
        """This process connected to the cluster as a Ray driver (the environment the
        nodes share is set while connected)."""
        import ray

        saved = {name: os.environ.get(name) for name in self.environment}
        os.environ.update(self.environment)
        try:
            ray.init(address=self.address, namespace=namespace, log_to_driver=False,
                     configure_logging=False)
            try:
                yield
            finally:
                ray.shutdown()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            # Ray reads RAY_AUTH_MODE into a process-wide config when it connects and
            # keeps it: restoring the variable alone left this pytest process in
            # "disabled" mode, and every later local ray.init() (whose new cluster takes
            # token auth by default) failed with InvalidAuthToken. Re-read it.
            from ray._raylet import Config

            Config.initialize("")


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process now."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:  # it exited meanwhile
            continue
        # The command name in stat is in parentheses and may hold spaces: split after it.
        parent = int(stat.rpartition(")")[2].split()[1])
        table[int(entry.name)] = (parent, cmdline)
    return table


def _with_descendants(pids: Iterable[int], table: dict[int, tuple[int, str]]) -> set[int]:
    found = set(pids)
    grew = True
    while grew:
        more = {pid for pid, (parent, _) in table.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found


def _kill(pids: Iterable[int], timeout_s: float = 10.0) -> None:
    """SIGKILL `pids` and wait (bounded) until they are gone."""
    pids = set(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reaps only our own children; others: init
            if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
                pids.discard(pid)
        time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True
