"""A real `redis-server` on a free loopback port, for the kernel store tests (no mocks).

Not a conftest on purpose (as tests/vm/_programs.py): conftest.py holds the fixtures,
this module the process handling they share.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import time
from pathlib import Path

import redis

from dynvm.cluster import RedisConfig
from dynvm.cluster.store._local_redis import free_port

REDIS_SERVER = shutil.which("redis-server")




class RedisServer:
    """One redis-server process; `stop()` then `start()` restarts it on the same port."""

    def __init__(self, workdir: Path, *, password: str | None = None, port: int | None = None,
                 config_file: Path | None = None, extra_args: tuple[str, ...] = (),
                 client_options: dict | None = None, tls: bool = False):
        self.workdir = Path(workdir)
        self.password = password if password is not None else secrets.token_hex(16)
        self.port = port or free_port()
        self.config_file = config_file
        self.extra_args = tuple(extra_args)
        self.tls = tls
        self.client_options = dict(client_options or {})
        self.log_path = self.workdir / f"redis-{self.port}.log"
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        assert REDIS_SERVER is not None
        head = [REDIS_SERVER] + ([str(self.config_file)] if self.config_file else [])
        port_args = (["--port", "0", "--tls-port", str(self.port)] if self.tls
                     else ["--port", str(self.port)])
        return [*head, *port_args, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--requirepass", self.password, "--dir", str(self.workdir),
                "--daemonize", "no", "--logfile", "", *self.extra_args]

    def client(self, **options) -> redis.Redis:
        merged = {"host": "127.0.0.1", "port": self.port, "password": self.password,
                  "socket_timeout": 2, "socket_connect_timeout": 2, **self.client_options,
                  **options}
        return redis.Redis(**merged)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout_s
        probe = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}: "
                                       f"{self.log_path.read_text()[-2000:]}")
                try:
                    if probe.ping():
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer PING in {timeout_s}s: "
                                       f"{self.log_path.read_text()[-2000:]}")
                time.sleep(0.02)
        finally:
            probe.close()

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def redis_config(server: RedisServer, **overrides) -> RedisConfig:
    """A RedisConfig for `server` with short timeouts (tests fail fast when it is down)."""
    options = {"host": "127.0.0.1", "port": server.port, "password": server.password,
               "socket_timeout_s": 1.0, "connect_timeout_s": 1.0, **overrides}
    return RedisConfig(**options)
