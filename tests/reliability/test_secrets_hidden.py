"""The kernel store's HMAC secret (DYNVM_STORE_SECRET) and the Redis password never
appear in a log record, a repr, an exception (its chain and traceback included) or an
OpenTelemetry span, whatever goes wrong.

The error paths are real: a real redis-server (requirepass, plus an ACL user) refusing
a wrong password, refusing a command the user may not run, and gone; forged entries;
bad configuration. Every text they produce, every log record (all loggers, DEBUG) and
every span exported while they ran (exceptions recorded on spans included) is searched
for every form of both secrets. `Leaks.assert_finds` first proves the search would see
a planted secret, so a search that looks at nothing cannot pass.
"""

from __future__ import annotations

import logging
import secrets
import traceback
from urllib.parse import quote

import msgpack
import pytest
import torch

import dynvm
from dynvm._env import store_settings
from dynvm.cluster import (
    ArtifactCache,
    LocalDirStore,
    RedisConfig,
    RedisStore,
    StoreConfig,
    StoreConfigError,
    StoreUnavailable,
)
from dynvm.cluster.store._signed import seal
from dynvm.telemetry import Telemetry

TARGET = "cpu"
TOOLCHAIN = {"torch": torch.__version__}
EXPECT = {"target": TARGET, "toolchain": TOOLCHAIN}
KEY = "ab" * 32
# Characters that URL quoting changes, so the quoted form is a form of its own.
STORE_SECRET = "hmac/" + secrets.token_hex(12) + "+key"
WRONG_PASSWORD = "wrong:pw@" + secrets.token_hex(8)
ACL_PASSWORD = "acl-" + secrets.token_hex(8)


def fields(**changes) -> dict:
    base = {"key": KEY, "backend": "cpu", "target": TARGET, "toolchain": TOOLCHAIN,
            "kernel_name": "k", "source": "def k(regs):\n    pass\n", "guard": "strong"}
    return {**base, **changes}


def forms(secret: str) -> set[str]:
    """Every way a secret could be written into a text."""
    raw = secret.encode()
    return {secret, quote(secret, safe=""), raw.hex(), repr(raw), repr(raw)[2:-1],
            repr(secret)[1:-1]}


def exception_texts(error: BaseException) -> list[str]:
    """str, repr and the formatted traceback of an exception and of its whole chain."""
    texts = ["".join(traceback.format_exception(error))]
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        texts += [str(error), repr(error), repr(getattr(error, "args", ()))]
        error = error.__cause__ or error.__context__
    return texts


class Leaks:
    """Collects everything a user or an operator could see, then searches it."""

    def __init__(self, secrets_: list[str]) -> None:
        self.forms = set().union(*(forms(s) for s in secrets_))
        self.texts: list[str] = []

    def add(self, *texts: str) -> None:
        self.texts.extend(texts)

    def raised(self, call, *args, expected=Exception, tracer=None, **kwargs):
        """Run `call`, which must raise `expected`; keep every text of the error. With a
        tracer, the call runs in a span that the error leaves (so the span records it)."""
        with pytest.raises(expected) as caught:
            if tracer is None:
                call(*args, **kwargs)
            else:
                with tracer.start_as_current_span(f"{getattr(call, '__name__', call)}"):
                    call(*args, **kwargs)
        self.add(*exception_texts(caught.value))
        return caught.value

    def spans(self, exporter) -> None:
        for span in exporter.get_finished_spans():
            self.add(span.to_json())

    def found(self) -> list[str]:
        return sorted({f for f in self.forms for text in self.texts if f in text})

    def assert_finds(self, secret: str) -> None:
        """The search works: a text holding `secret` is caught (then removed)."""
        self.texts.append(f"prefix {secret} suffix")
        assert self.found(), "the search does not see a planted secret"
        self.texts.pop()


@pytest.fixture
def all_logs(caplog):
    """Every log record of every logger, from DEBUG up."""
    caplog.set_level(logging.DEBUG)
    return caplog


def test_store_errors_never_show_the_secret_or_a_password(redis_server, all_logs, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("DYNVM_STORE_SECRET", STORE_SECRET)
    leaks = Leaks([STORE_SECRET, redis_server.password, WRONG_PASSWORD, ACL_PASSWORD])
    leaks.assert_finds(redis_server.password)
    telemetry, exporter = Telemetry.in_memory()
    tracer = telemetry.tracer
    secret = STORE_SECRET.encode()
    port = redis_server.port
    admin = redis_server.client()
    # An ACL user that may read but not write the store's keys.
    admin.acl_setuser("reader", enabled=True, passwords=[f"+{ACL_PASSWORD}"],
                      keys=["dynvm:k:*"], commands=["+get", "+mget", "+strlen", "+ping",
                                                    "+hello", "+client"])

    configs = {
        "wrong password (fields)": RedisConfig(port=port, password=WRONG_PASSWORD,
                                               socket_timeout_s=1, connect_timeout_s=1),
        "wrong password (URL)": RedisConfig(url=f"redis://:{quote(WRONG_PASSWORD, safe='')}"
                                                f"@127.0.0.1:{port}/0",
                                            socket_timeout_s=1, connect_timeout_s=1),
        "ACL user, wrong password": RedisConfig(port=port, username="reader",
                                                password=WRONG_PASSWORD),
        "ACL user may not write": RedisConfig(
            url=f"redis://reader:{ACL_PASSWORD}@127.0.0.1:{port}/0"),
        "right password, then Redis is gone": RedisConfig(
            url=f"redis://:{redis_server.password}@127.0.0.1:{port}/0",
            socket_timeout_s=0.5, connect_timeout_s=0.5),
    }
    stores = {name: RedisStore(config) for name, config in configs.items()}
    good = seal(KEY, fields(), secret)
    stores["right password, then Redis is gone"].put(KEY, good)  # works while it is up

    def drive(name: str, store: RedisStore, ping_fails: bool = True) -> None:
        cache = ArtifactCache(store, secret, EXPECT)
        leaks.add(repr(store), repr(store.config), str(store.config), repr(cache),
                  store.config.location())
        with tracer.start_as_current_span(f"store: {name}"):
            cache.fetch([KEY])
            cache.publish(KEY, fields())
        if ping_fails:
            leaks.raised(store.ping, expected=StoreUnavailable, tracer=tracer)
        error = leaks.raised(store.put, KEY, good, expected=StoreUnavailable)
        assert error.__cause__ is None and error.__context__ is None
        assert cache.stats()["unavailable"] >= 1, (name, cache.stats())

    for name in ("wrong password (fields)", "wrong password (URL)",
                 "ACL user, wrong password"):
        drive(name, stores[name])
    # The reader can fetch (a valid entry) but not publish.
    reader = ArtifactCache(stores["ACL user may not write"], secret, EXPECT)
    assert reader.fetch([KEY]) == {KEY: fields()}
    drive("ACL user may not write", stores["ACL user may not write"], ping_fails=False)
    redis_server.stop()
    drive("right password, then Redis is gone", stores["right password, then Redis is gone"])

    # Forged and damaged entries, through a local store (the same ArtifactCache code).
    local = LocalDirStore(tmp_path / "kernels")
    forged = {
        "other secret": seal(KEY, fields(), b"not-the-secret"),
        "unsigned": msgpack.packb({k: v for k, v in msgpack.unpackb(good).items()
                                   if k != "mac"}),
        "bit flip": good[:40] + bytes([good[40] ^ 1]) + good[41:],
        "truncated": good[:-5],
        "other target": seal(KEY, fields(target="cuda:90"), secret),
    }
    cache = ArtifactCache(local, secret, EXPECT)
    for name, data in forged.items():
        local.put(KEY, data)
        with tracer.start_as_current_span(f"forged: {name}"):
            assert cache.fetch([KEY]) == {}
    assert cache.stats()["rejected"] == len(forged)

    # Bad configuration, with the secret and passwords in the environment it reads.
    bad_envs = {
        "bad TLS flag": {"DYNVM_REDIS_TLS": "maybe"},
        "bad TTL": {"DYNVM_STORE_TTL_S": "soon"},
        "bad scheme": {"DYNVM_REDIS_URL": f"http://:{ACL_PASSWORD}@127.0.0.1:1/0"},
        "password in the query": {"DYNVM_REDIS_URL":
                                  f"redis://127.0.0.1:1/0?password={ACL_PASSWORD}"},
        "cert without key": {"DYNVM_REDIS_TLS_CERT": "/nonexistent.pem"},
        "URL and directory": {"DYNVM_STORE_DIR": str(tmp_path)},
    }
    base = {"DYNVM_STORE_SECRET": STORE_SECRET, "DYNVM_REDIS_PASSWORD": WRONG_PASSWORD,
            "DYNVM_REDIS_URL": f"redis://u:{ACL_PASSWORD}@127.0.0.1:1/0"}
    for env in bad_envs.values():
        leaks.raised(StoreConfig.from_env, {**base, **env}, expected=StoreConfigError,
                     tracer=tracer)
    config = StoreConfig.from_env(base)
    leaks.add(repr(config), str(config), repr(config.redis), config.redis.location())
    leaks.raised(StoreConfig, secret=b"", local_dir="x", expected=StoreConfigError)
    leaks.raised(ArtifactCache, local, STORE_SECRET, EXPECT, expected=TypeError)

    leaks.add(all_logs.text, *(record.getMessage() for record in all_logs.records),
              *(repr(record.args) for record in all_logs.records))
    leaks.spans(exporter)
    assert any("unavailable" in r.getMessage() for r in all_logs.records)
    assert any("rejected (forged)" in r.getMessage() for r in all_logs.records)
    exceptions = [event for span in exporter.get_finished_spans()
                  for event in span.events if event.name == "exception"]
    assert len(exceptions) >= 4 + len(bad_envs)  # the searched spans hold the errors
    assert leaks.found() == []


def test_traced_runtime_with_the_secret_in_the_environment(monkeypatch):
    """A traced JIT runtime (promotions, compiles, installs, guard failures) in a process
    whose environment holds the store secret: no span carries it."""
    monkeypatch.setenv("DYNVM_STORE_SECRET", STORE_SECRET)
    telemetry, exporter = Telemetry.in_memory()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    program = dynvm.compile(model.eval(), (torch.randn(4, 8),),
                            dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    config = dynvm.JitConfig(sync=True, min_recurrence=1, max_recurrence=2,
                             horizon_calls=10**9, guard_failure_sample_rate=1)
    with dynvm.Runtime(program, jit=config, telemetry=telemetry) as runtime:
        for batch in (4, 4, 4, 5, 5, 5, 9, 4):
            runtime(torch.randn(batch, 8))
        with pytest.raises(dynvm.ShapeError), \
                telemetry.tracer.start_as_current_span("bad call"):
            runtime(torch.randn(100, 8))
    names = {span.name for span in exporter.get_finished_spans()}
    assert {"dynvm.call", "dynvm.promote", "dynvm.compile", "dynvm.install"} <= names
    leaks = Leaks([STORE_SECRET])
    leaks.spans(exporter)
    leaks.assert_finds(STORE_SECRET)
    assert leaks.found() == []


def test_store_settings_repr_hides_the_url_password():
    settings = store_settings({"DYNVM_STORE_SECRET": STORE_SECRET,
                               "DYNVM_REDIS_URL": f"redis://u:{ACL_PASSWORD}@127.0.0.1:1/0"})
    leaks = Leaks([STORE_SECRET, ACL_PASSWORD])
    leaks.add(repr(settings), str(settings))
    assert leaks.found() == []
