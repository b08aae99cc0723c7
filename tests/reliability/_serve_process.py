"""A real `dynvm serve` subprocess for the shutdown and listener tests: start it (the
CLI next to sys.executable), wait until it answers, list its process tree and the
sockets that tree listens on (from /proc), and drive a closed loop of real HTTP
requests at it while it is signalled.

Not a conftest on purpose (as tests/cluster/_cluster_helpers.py): import what you need.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dynvm.cluster.store._local_redis import free_port

# ------------------------------------------------------------------ processes


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def comm(pid: int) -> str:
    """The process's name ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it holds no socket, no memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> dict[int, str]:
    """{pid: name} of every process under `pid` (children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent_of(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            name = comm(child)
            if name:
                found[child] = name
                todo.append(child)
    return found


def survivors(pids: dict[int, str]) -> dict[int, str]:
    """Those of `pids` still running, with the names they had."""
    return {pid: name for pid, name in pids.items() if alive(pid)}


def wait_gone(pids: dict[int, str], timeout_s: float) -> tuple[dict[int, str], float]:
    """(the survivors after at most `timeout_s`, seconds waited)."""
    start = time.monotonic()
    while survivors(pids) and time.monotonic() - start < timeout_s:
        time.sleep(0.1)
    return survivors(pids), time.monotonic() - start


def kill_all(pids: dict[int, str]) -> None:
    """SIGKILL whatever of `pids` survived (a failed test's clean-up)."""
    for pid in survivors(pids):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ listening sockets


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def proc_address(hex_address: str) -> str:
    """The address of a /proc/net/tcp{,6} 'HEX:PORT' field, as text."""
    host_hex = hex_address.split(":")[0]
    raw = bytes.fromhex(host_hex)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening_sockets(pids: dict[int, str]) -> list[tuple[str, str, int, int, str]]:
    """(protocol, address, port, pid, name) of every TCP socket listening, and every
    UDP socket bound, in one of `pids`."""
    owner = {}
    for pid, name in pids.items():
        for inode in _socket_inodes(pid):
            owner[inode] = (pid, name)
    found = []
    for table, listening_state in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"),
                                   ("udp6", "07")):
        with contextlib.suppress(OSError), open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] != listening_state or parts[9] not in owner:
                    continue
                local = parts[1]
                pid, name = owner[parts[9]]
                found.append((table, proc_address(local), int(local.split(":")[1], 16), pid,
                              name))
    return found


def is_loopback_address(address: str) -> bool:
    """127.0.0.0/8, ::1 or an IPv4-mapped loopback address."""
    parsed = ipaddress.ip_address(address)
    mapped = getattr(parsed, "ipv4_mapped", None)
    return parsed.is_loopback or (mapped is not None and mapped.is_loopback)


# ------------------------------------------------------------------ the server


def get_json(url: str, timeout: float = 3.0):
    """(status, decoded body) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


@dataclass
class ServeRun:
    """One `dynvm serve` process and where its output goes."""

    process: subprocess.Popen
    port: int
    out: Path
    err: Path
    tree: dict[int, str] = field(default_factory=dict)
    """Its process tree, as listed once it was ready."""

    def output(self) -> str:
        return (self.out.read_text(errors="replace") + "\n--- stderr ---\n"
                + self.err.read_text(errors="replace")[-4000:])

    def direct_ports(self) -> list[int]:
        """The replicas' own ports (direct ingress) that the command printed."""
        for line in self.out.read_text().splitlines():
            if line.startswith("direct "):
                head = line.split("(every", 1)[0]
                return [int(url.rsplit(":", 1)[1]) for url in head.split("replicas at ", 1)[1]
                        .replace(",", " ").split()]
        return []


READY_POLL_S = 0.1
"""How often a starting `dynvm serve` is asked whether it is ready: a refused connect
or one request through its proxy, cheap beside the ~15 s start (every 0.5 s cost a
quarter of a second a start on average)."""


def start_serve(path: Path, directory: Path, *flags: str, ready_timeout_s: float = 120.0
                ) -> ServeRun:
    """`dynvm serve path --port P --name rec *flags` as a real process (its own Ray and
    private redis-server), once /v2/health/ready answers and it printed its URLs."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("DYNVM_REDIS_URL", "DYNVM_STORE_SECRET", "DYNVM_STORE_DIR")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    out, err = directory / "serve.out", directory / "serve.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "dynvm", "serve", str(path),
                                    "--port", str(port), "--name", "rec", *flags],
                                   stdout=stdout, stderr=stderr, env=env)
    run = ServeRun(process, port, out, err)
    deadline = time.monotonic() + ready_timeout_s
    try:
        while True:
            assert process.poll() is None, run.output()
            with contextlib.suppress(OSError, ValueError):
                if (get_json(f"http://127.0.0.1:{port}/v2/health/ready")[0] == 200
                        and "Ctrl-C" in out.read_text()):
                    break
            assert time.monotonic() < deadline, f"not ready in {ready_timeout_s} s: " \
                + run.output()
            time.sleep(READY_POLL_S)
    except BaseException:
        stop_hard(run)
        raise
    run.tree = descendants(process.pid)
    return run


def stop_hard(run: ServeRun) -> None:
    """A failed test's clean-up: SIGKILL the command and everything it started."""
    tree = {**run.tree, **descendants(run.process.pid)}
    if run.process.poll() is None:
        run.process.kill()
        run.process.wait(timeout=10)
    kill_all(tree)


# ------------------------------------------------------------------ the closed loop


@dataclass(frozen=True)
class Outcome:
    """One request of the closed loop."""

    sent: float
    """time.monotonic() when it was sent."""
    done: float
    """When its answer (or refusal, or failure) came."""
    kind: str
    """"ok" (200 with outputs), "refused" (connection refused, or 503) or "failed"."""
    detail: str
    """What was wrong (or the refusal), for a failure message."""
    port: int
    """The port it was sent to."""


class ClosedLoop:
    """`clients` threads, each sending the next infer request as soon as the last one
    was answered, until it is refused (as a client behind a load balancer would go
    elsewhere) or `stop()`."""

    def __init__(self, url: str, body: bytes, clients: int = 4,
                 timeout_s: float = 60.0) -> None:
        self.url, self.body, self.timeout_s = url, body, timeout_s
        self.port = int(url.split("/")[2].rsplit(":", 1)[1])
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(clients)]

    def start(self) -> ClosedLoop:
        for thread in self._threads:
            thread.start()
        return self

    def _one(self) -> tuple[str, str]:
        request = urllib.request.Request(self.url, data=self.body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
                if response.status == 200 and answer.get("outputs"):
                    return "ok", ""
                return "failed", f"{response.status} {str(answer)[:200]}"
        except urllib.error.HTTPError as error:
            text = error.read()[:200]
            return ("refused" if error.code == 503 else "failed"), f"{error.code} {text!r}"
        except urllib.error.URLError as error:
            if isinstance(error.reason, ConnectionRefusedError):
                return "refused", "connection refused"
            return "failed", repr(error.reason)
        except OSError as error:  # a reset or a dropped connection: not a clean refusal
            return "failed", repr(error)

    def _client(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            kind, detail = self._one()
            with self._lock:
                self.outcomes.append(Outcome(sent, time.monotonic(), kind, detail,
                                             self.port))
            if kind != "ok":
                return

    def count(self, kind: str) -> int:
        with self._lock:
            return sum(o.kind == kind for o in self.outcomes)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=timeout_s)


class HealthWatch:
    """A thread polling a health URL: `seen` is [(time.monotonic(), status)], the
    status an HTTP code, or "refused" / "failed" when nothing answered."""

    def __init__(self, url: str, interval_s: float = 0.05) -> None:
        self.url, self.interval_s = url, interval_s
        self.seen: list[tuple[float, int | str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> HealthWatch:
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                status = get_json(self.url, timeout=5.0)[0]
            except urllib.error.URLError as error:
                status = ("refused" if isinstance(error.reason, ConnectionRefusedError)
                          else "failed")
            except (OSError, ValueError):
                status = "failed"
            self.seen.append((time.monotonic(), status))
            if status == "refused":
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
