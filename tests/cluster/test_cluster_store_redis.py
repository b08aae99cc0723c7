"""RedisStore against a real redis-server: round trips, TTL, auth, outages, TLS, deploy config."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
import traceback
from pathlib import Path

import pytest
import redis

from dynvm.cluster import RedisConfig, RedisStore, StoreUnavailable
from dynvm.cluster.store._redis import HEAD_BYTES
from dynvm.jit.artifact import cache_key
from tests.cluster._redis_server import RedisServer, free_port, redis_config

REPO = Path(__file__).resolve().parents[2]


def key(n: int) -> str:
    return hashlib.sha256(f"redis-{n}".encode()).hexdigest()


def command_calls(server: RedisServer, command: str) -> int:
    with server.client() as client:
        stats = client.info("commandstats")
    return stats.get(f"cmdstat_{command}", {}).get("calls", 0)


def assert_secret_free(error: BaseException, *secrets: str) -> None:
    assert error.__cause__ is None and error.__context__ is None  # redis-py's text is gone
    shown = [str(error), repr(error), "".join(traceback.format_exception(error))]
    for secret in secrets:
        for text in shown:
            assert secret not in text


def command_counts(server: RedisServer, *commands: str) -> dict[str, int]:
    return {command: command_calls(server, command) for command in commands}


READS = ("exists", "getrange", "strlen", "mget", "get")


def test_get_of_entries_within_the_head_is_one_round_trip(redis_server, redis_store):
    for n in range(10):
        redis_store.put(key(n), f"v{n}".encode())
    redis_store.put(key(10), b"")   # empty, not absent
    before = command_counts(redis_server, *READS)
    wanted = [key(n) for n in range(13)]
    assert redis_store.get(wanted) == {**{key(n): f"v{n}".encode() for n in range(10)},
                                       key(10): b""}
    after = command_counts(redis_server, *READS)
    # One pipeline of GETRANGEs: no size query, no second read; EXISTS only for the
    # three that came back empty (one empty value, two absent).
    assert {c: after[c] - before[c] for c in READS} == {
        "exists": 3, "getrange": 13, "strlen": 0, "mget": 0, "get": 0}


def test_an_entry_longer_than_the_head_is_measured_then_read(redis_server, redis_store):
    long = bytes(range(256)) * (HEAD_BYTES // 256 + 3)
    redis_store.put(key(1), long)
    redis_store.put(key(2), b"short")
    before = command_counts(redis_server, *READS)
    assert redis_store.get([key(1), key(2)]) == {key(1): long, key(2): b"short"}
    after = command_counts(redis_server, *READS)
    assert {c: after[c] - before[c] for c in ("strlen", "mget")} == {"strlen": 1, "mget": 1}


@pytest.mark.parametrize("cap", [100, 2 * HEAD_BYTES])
def test_an_entry_over_the_cap_is_never_downloaded(redis_server, cap):
    with RedisStore(redis_config(redis_server), max_entry_bytes=cap) as store, \
            redis_server.client() as admin:
        admin.set(f"dynvm:k:{key(1)}", b"x" * (4 << 20))
        admin.set(f"dynvm:k:{key(2)}", b"y" * cap)
        before = int(admin.info("stats")["total_net_output_bytes"])
        assert store.get([key(1), key(2)]) == {key(2): b"y" * cap}
        sent = int(admin.info("stats")["total_net_output_bytes"]) - before
        assert store.stats.snapshot()["oversized"] == 1
    # The entry within the cap, at most a head of each (the first read), INFO's reply:
    # never the 4 MiB one.
    assert sent < cap + 2 * (min(cap, HEAD_BYTES) + 1) + 8192, sent


def test_a_user_without_getrange_reads_sizes_first(redis_server, caplog):
    with redis_server.client() as admin:
        admin.acl_setuser("old-acl", enabled=True, passwords=["+old-pw"],
                          keys=["dynvm:k:*"], commands=["+@connection", "+get", "+mget",
                                                        "+strlen", "+set", "+exists"])
        admin.set(f"dynvm:k:{key(1)}", b"v1")
        refused_before = len(admin.acl_log())
        with RedisStore(redis_config(redis_server, username="old-acl",
                                     password="old-pw")) as store:
            assert store.get([key(1), key(2)]) == {key(1): b"v1"}
            assert store.get([key(1)]) == {key(1): b"v1"}
        refused = len(admin.acl_log()) - refused_before
    assert refused == 1   # GETRANGE tried once, then never again
    warnings = [r for r in caplog.records if "GETRANGE" in r.getMessage()]
    assert len(warnings) == 1


def test_keys_live_under_the_namespace(redis_server):
    with RedisStore(redis_config(redis_server, namespace="test:ns:")) as store:
        store.put(key(1), b"v")
    with redis_server.client() as client:
        assert client.keys("*") == [f"test:ns:{key(1)}".encode()]


def test_ttl_is_applied_when_configured(redis_server):
    with RedisStore(redis_config(redis_server, ttl_seconds=30)) as with_ttl, \
            RedisStore(redis_config(redis_server)) as without_ttl:
        with_ttl.put(key(1), b"expires")
        without_ttl.put(key(2), b"stays")
        with redis_server.client() as client:
            assert 0 < client.ttl(f"dynvm:k:{key(1)}") <= 30
            assert client.ttl(f"dynvm:k:{key(2)}") == -1
            client.pexpire(f"dynvm:k:{key(1)}", 1)
        time.sleep(0.05)
        assert with_ttl.get([key(1), key(2)]) == {key(2): b"stays"}


@pytest.mark.parametrize("how", ["wrong password", "no password", "wrong user",
                                 "wrong password in url"])
def test_bad_credentials_raise_store_unavailable_without_passwords(redis_server, how):
    wrong = "WrongPassword-" + redis_server.password[:8][::-1]
    config = {
        "wrong password": redis_config(redis_server, password=wrong),
        "no password": redis_config(redis_server, password=None),
        "wrong user": redis_config(redis_server, username="nobody", password=wrong),
        "wrong password in url": RedisConfig(
            url=f"redis://nobody:{wrong}@127.0.0.1:{redis_server.port}/0",
            socket_timeout_s=1.0, connect_timeout_s=1.0),
    }[how]
    store = RedisStore(config)
    with pytest.raises(StoreUnavailable) as caught:
        store.get([key(1)])
    assert_secret_free(caught.value, wrong, redis_server.password)
    assert f"127.0.0.1:{redis_server.port}" in str(caught.value)
    for text in (repr(config), repr(store), config.location()):
        assert wrong not in text and redis_server.password not in text
    assert store.stats.snapshot()["errors"] == 1


def test_password_is_not_in_repr(redis_server):
    config = redis_config(redis_server)
    assert redis_server.password not in repr(config)
    assert "password='***'" in repr(config)
    url_config = RedisConfig(url=f"redis://u:{redis_server.password}@127.0.0.1:1/2")
    assert redis_server.password not in repr(url_config)
    assert url_config.location() == "redis://127.0.0.1:1/2"


def test_acl_user_is_supported(redis_server):
    with redis_server.client() as admin:
        admin.acl_setuser("kernels", enabled=True, passwords=["+kernel-pw"],
                          keys=["dynvm:k:*"], commands=["+@connection", "+get", "+mget",
                                                        "+strlen", "+set"])
    with RedisStore(redis_config(redis_server, username="kernels",
                                 password="kernel-pw")) as store:
        store.put(key(1), b"v")
        assert store.get([key(1)]) == {key(1): b"v"}
    url = f"redis://kernels:kernel-pw@127.0.0.1:{redis_server.port}/0"
    with RedisStore(RedisConfig(url=url)) as store:
        assert store.get([key(1)]) == {key(1): b"v"}


def test_server_down_then_back_on_the_same_port(redis_server, redis_store):
    redis_store.put(key(1), b"before")
    redis_server.stop()  # SIGKILL: a crash, not a clean shutdown
    with pytest.raises(StoreUnavailable) as caught:
        redis_store.get([key(1)])
    assert_secret_free(caught.value, redis_server.password)
    with pytest.raises(StoreUnavailable):
        redis_store.put(key(2), b"during")
    with pytest.raises(StoreUnavailable):
        redis_store.ping()
    redis_server.start()  # same port, empty: the store is a cache, nothing persisted
    assert redis_store.get([key(1)]) == {}
    redis_store.put(key(1), b"after")
    assert redis_store.get([key(1)]) == {key(1): b"after"}
    assert redis_store.stats.snapshot()["errors"] == 3


def test_hung_server_times_out(redis_server):
    with RedisStore(redis_config(redis_server, socket_timeout_s=0.3, retries=0)) as store:
        store.put(key(1), b"v")
        os.kill(redis_server.process.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnavailable, match="Timeout"):
                store.get([key(1)])
            assert time.monotonic() - start < 3
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        assert store.get([key(1)]) == {key(1): b"v"}


def test_config_is_validated():
    with pytest.raises(ValueError, match="scheme"):
        RedisConfig(url="http://127.0.0.1")
    with pytest.raises(ValueError, match="only db"):
        RedisConfig(url="redis://127.0.0.1/0?password=leaky")
    with pytest.raises(ValueError) as caught:
        RedisConfig(url="redis://127.0.0.1/0?password=leaky")
    assert "leaky" not in str(caught.value)
    with pytest.raises(ValueError, match="port"):
        RedisConfig(port=0)
    with pytest.raises(ValueError, match="ttl_seconds"):
        RedisConfig(ttl_seconds=0)
    with pytest.raises(ValueError, match="go together"):
        RedisConfig(tls_cert_path="cert.pem")


# --- TLS --------------------------------------------------------------------------------

def make_certificate(directory: Path) -> tuple[Path, Path]:
    cert, private_key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(private_key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, private_key


@pytest.fixture
def certificate(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_certificate(tmp_path)


@pytest.mark.parametrize("client_auth", [False, True])
def test_tls(tmp_path, certificate, client_auth):
    cert, private_key = certificate
    tls_args = ("--tls-cert-file", str(cert), "--tls-key-file", str(private_key),
                "--tls-ca-cert-file", str(cert),
                "--tls-auth-clients", "yes" if client_auth else "no")
    client_tls = {"ssl": True, "ssl_ca_certs": str(cert)}
    if client_auth:
        client_tls.update(ssl_certfile=str(cert), ssl_keyfile=str(private_key))
    server = RedisServer(tmp_path / "redis", tls=True, extra_args=tls_args,
                         client_options=client_tls)
    try:
        server.start()
    except RuntimeError as error:
        if "tls" in str(error).lower():
            pytest.skip(f"redis-server without TLS support: {error}")
        raise
    try:
        client_files = ({"tls_cert_path": str(cert), "tls_key_path": str(private_key)}
                        if client_auth else {})
        with RedisStore(redis_config(server, tls=True, tls_ca_path=str(cert),
                                     **client_files)) as store:
            store.put(key(1), b"over tls")
            assert store.get([key(1)]) == {key(1): b"over tls"}
        url = f"rediss://:{server.password}@127.0.0.1:{server.port}/0"
        with RedisStore(RedisConfig(url=url, tls_ca_path=str(cert), **client_files)) as store:
            assert store.get([key(1)]) == {key(1): b"over tls"}
        # Without the CA the server's self-signed certificate is refused.
        with RedisStore(redis_config(server, tls=True, **client_files)) as store, \
                pytest.raises(StoreUnavailable) as caught:
            store.get([key(1)])
        assert_secret_free(caught.value, server.password)
        if client_auth:  # no client certificate: the server refuses the handshake
            with RedisStore(redis_config(server, tls=True, tls_ca_path=str(cert))) as store, \
                    pytest.raises(StoreUnavailable):
                store.get([key(1)])
    finally:
        server.stop()


# --- deploy/redis.conf ------------------------------------------------------------------

def test_deploy_config_is_a_cache_config(tmp_path):
    conf = REPO / "deploy" / "redis.conf"
    with RedisServer(tmp_path / "redis", config_file=conf) as server:
        with server.client() as client:
            settings = client.config_get("*")
        assert settings["maxmemory"] == str(2 << 30)
        assert settings["maxmemory-policy"] == "allkeys-lru"
        assert settings["save"] == ""
        assert settings["appendonly"] == "no"
        assert settings["protected-mode"] == "yes"
        with RedisStore(redis_config(server)) as store:
            store.put(key(1), b"v")
            assert store.get([key(1)]) == {key(1): b"v"}


def test_deploy_config_acl_example_works(tmp_path):
    text = (REPO / "deploy" / "redis.conf").read_text()
    assert "\n# user dynvm on #<sha256-of-password>" in text
    password = "acl-example-pw"
    digest = hashlib.sha256(password.encode()).hexdigest()
    enabled = (text.replace("\n# user default off", "\nuser default off")
               .replace("\n# user dynvm on #<sha256-of-password>", f"\nuser dynvm on #{digest}"))
    conf = tmp_path / "redis.conf"
    conf.write_text(enabled)
    port = free_port()
    # requirepass would re-enable the default user; start without it for this check.
    process = subprocess.Popen(["redis-server", str(conf), "--port", str(port),
                                "--dir", str(tmp_path), "--logfile", ""],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        # A TTL, a bound of one entry per program and marks on every read: every command
        # of Note [Artifact lifetime] runs under the ACL below.
        config = RedisConfig(port=port, username="dynvm", password=password,
                             socket_timeout_s=1.0, connect_timeout_s=1.0, ttl_seconds=60,
                             max_entries_per_program=1, refresh_interval_s=0.001)
        with RedisStore(config) as store:
            deadline = time.monotonic() + 10
            while True:
                try:
                    store.ping()
                    break
                except StoreUnavailable:
                    assert process.poll() is None, "redis-server refused the ACL example"
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
            store.put(key(1), b"v")
            assert store.get([key(1)]) == {key(1): b"v"}
            tagged = [cache_key("acl", n, "fam", "cpu", "cpu") for n in range(2)]
            store.put(tagged[0], b"first")
            assert store.get([tagged[0]]) == {tagged[0]: b"first"}
            store.put(tagged[1], b"second")  # evicts the first
            assert store.contains(tagged) == {tagged[1]}
            assert store.stats.snapshot()["errors"] == 0
        with redis.Redis(port=port, username="dynvm", password=password) as client:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.set("elsewhere", b"v")
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.flushall()
    finally:
        process.kill()
        process.wait(timeout=10)
