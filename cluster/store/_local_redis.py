"""A private `redis-server` for one machine: `dynvm serve` starts one when no Redis is
configured, so the embedded default has the same kernel store and announcements as a
cluster.

The server listens on loopback only, on a free port, with a random password, keeps
nothing on disk (the store is a cache: deploy/redis.conf says why) and evicts LRU under
a memory cap. Its configuration, password included, goes to redis-server on stdin
(`redis-server -`), never on the command line, where `ps` would show it to every user.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from dynvm.cluster.store._redis import RedisConfig
from dynvm.vm.errors import DynvmError


class LocalRedisError(DynvmError, RuntimeError):
    """redis-server is missing, or did not start (the message says which, and why)."""


@dataclass(frozen=True)
class LocalRedisOptions:
    """How the private redis-server is started."""

    executable: str = "redis-server"
    """Program to run: a name looked up on PATH, or a path."""
    maxmemory: str = "512mb"
    """Memory cap (redis.conf syntax); past it, least recently used kernels are evicted."""
    start_timeout_s: float = 10.0
    """How long redis-server may take to answer PING before start() gives up."""
    password: str = field(default_factory=lambda: secrets.token_hex(24), repr=False)
    """requirepass; random per run by default, never shown by repr."""
    die_with_parent: bool = True
    """On Linux, the server gets SIGTERM when the thread that started it exits (its
    parent-death signal, prctl(PR_SET_PDEATHSIG)), so even a SIGKILL of `dynvm serve`
    leaves no redis-server behind (Note [Stopping dynvm serve] in dynvm._serve_cmd).
    Start it from a thread that lives as long as the server should: the main thread,
    not a pool's."""


def _parent_death_signal():
    """A preexec_fn that gives the child SIGTERM when its parent (thread) dies. prctl is
    looked up here, in the parent: between fork and exec the child only calls it."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def preexec() -> None:
        if prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")

    return preexec


# Note [Ports outside the ephemeral range]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A port that bind(0) hands out comes from the kernel's ephemeral range (32768-60999 on
# Linux by default), the same range every outgoing TCP connection takes its local port
# from. Between choosing a port and binding it, a process that opens connections (Ray's
# raylet, GCS and workers open many while `ray.init` and `serve.start` run) may be given
# it as a connection's local port, and the bind then fails: "Failed to bind to address
# '127.0.0.1:35099'" for Serve's proxy in a suite rehearsal on 2026-12-05, and a readiness
# probe that read HTTP/2 frames from one of Ray's gRPC servers in another. So the port
# is drawn at random from below the ephemeral range and above Ray's worker ports
# (10002-19999), where nothing is handed out implicitly; bind(0) is the fallback where
# the kernel's range leaves no such room.
_LOW_PORTS = range(20000, 32000)


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (0 where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError), \
            open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        return int(ports.read().split()[0])
    return 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the kernel's
    ephemeral range where it has room (Note [Ports outside the ephemeral range])."""
    if _ephemeral_low() > _LOW_PORTS.stop:
        for port in random.sample(_LOW_PORTS, 64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalRedis:
    """One redis-server child process: `start()`, `config()`, `stop()` (or `with`)."""

    def __init__(self, options: LocalRedisOptions | None = None) -> None:
        self.options = options or LocalRedisOptions()
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def _executable(self) -> str:
        found = shutil.which(self.options.executable)
        if found is None:
            raise LocalRedisError(
                f"{self.options.executable} is not on PATH (nor an executable file): install "
                f"Redis (e.g. `apt-get install redis-server`, or scripts/setup) or point "
                f"DYNVM_REDIS_URL at a running one")
        return found

    def _log_path(self) -> str:
        assert self._workdir is not None
        return f"{self._workdir.name}/redis.log"

    def _config_text(self) -> str:
        assert self._workdir is not None and self.port is not None
        return "\n".join([
            "bind 127.0.0.1", f"port {self.port}", "protected-mode yes",
            f"requirepass {self.options.password}",
            f"maxmemory {self.options.maxmemory}", "maxmemory-policy allkeys-lru",
            'save ""', "appendonly no", f"dir {self._workdir.name}",
            "daemonize no", 'logfile ""', ""])

    def start(self) -> LocalRedis:
        executable = self._executable()
        self._workdir = tempfile.TemporaryDirectory(prefix="dynvm-redis-")
        self.port = free_port()
        # Its log goes to a file: a pipe nobody reads would block the server once full.
        with open(self._log_path(), "wb") as log:
            tie = self.options.die_with_parent and sys.platform.startswith("linux")
            try:
                self.process = subprocess.Popen(
                    [executable, "-"], stdin=subprocess.PIPE, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_parent_death_signal() if tie else None)
            except subprocess.SubprocessError as exc:  # the preexec_fn failed in the child
                raise LocalRedisError(f"could not start {executable}: {exc} (tying it to "
                                      "this process with PR_SET_PDEATHSIG)") from None
        # start_new_session: Ctrl-C in the terminal reaches `dynvm serve` only, which then
        # stops this server itself, in order, after the replicas that use it.
        self.process.stdin.write(self._config_text().encode())
        self.process.stdin.close()
        try:
            self._wait_for_ping()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_ping(self) -> None:
        import redis

        deadline = time.monotonic() + self.options.start_timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.options.password,
                             socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    with open(self._log_path(), "rb") as log:
                        output = log.read().decode(errors="replace")[-2000:]
                    raise LocalRedisError(f"redis-server exited with "
                                          f"{self.process.returncode}: {output.strip()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise LocalRedisError(f"redis-server did not answer PING on port "
                                          f"{self.port} within {self.options.start_timeout_s} s")
                time.sleep(0.02)
        finally:
            client.close()

    def config(self, **overrides) -> RedisConfig:
        """A RedisConfig for this server (the kernel store, announcements)."""
        if self.process is None:
            raise LocalRedisError("the local redis-server is not running")
        return RedisConfig(host="127.0.0.1", port=self.port, password=self.options.password,
                           **overrides)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it lingers; safe to call twice."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout_s)
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def kill(self) -> None:
        """SIGKILL now, without waiting (a forced stop, from any thread)."""
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
