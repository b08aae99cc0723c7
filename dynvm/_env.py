"""The one module that reads the process environment (docs/ARCHITECTURE.md, Conventions 8). A leaf
(docs/ARCHITECTURE.md, Layout): it imports nothing above dynvm.vm, so every layer may use it.

Everything else asks this module for parsed, frozen settings, and every parser takes an
optional mapping instead of the real environment, so tests never touch os.environ:

    runtime_settings(environ=None) -> RuntimeSettings   DYNVM_JIT
    trace_settings(environ=None)   -> TraceSettings     OTEL_* (what dynvm decides itself)
    store_settings(environ=None)   -> StoreSettings     DYNVM_STORE_*, DYNVM_REDIS_*
    proxy_settings(environ=None)   -> ProxySettings     DYNVM_PROXY_*
    child_environment(...)         -> dict              a copy for a subprocess
    export(variables)                                   set for processes started later

A bad value raises `EnvVarError`, whose message names the variable and never contains a
secret (DYNVM_STORE_SECRET, DYNVM_REDIS_PASSWORD).

Variables (the README's "Environment variables" section lists the same):

    DYNVM_JIT              "0"/"off"/"false"/"no": disable the JIT entirely, whatever a
                           Runtime was asked for (debugging: every call interpreted);
                           Runtime.stats() then says "jit_disabled_by". Default on.
    DYNVM_STORE_SECRET     required by the kernel store: the HMAC-SHA256 key that seals
                           artifacts (Note [Signed artifacts] in dynvm.cluster.store._signed);
                           the same value on every process; at least 32 bytes and not
                           guessable (Note [Store secret strength]).
    DYNVM_REDIS_URL        redis://, rediss:// or unix:// URL: the store is Redis.
    DYNVM_STORE_DIR        a directory: the store is local (one machine). Without it or
                           DYNVM_REDIS_URL: $XDG_CACHE_HOME/dynvm/kernels
                           (XDG_CACHE_HOME defaults to ~/.cache).
    DYNVM_REDIS_USERNAME   Redis ACL user.
    DYNVM_REDIS_PASSWORD   password of that user (or requirepass).
    DYNVM_REDIS_TLS        "1"/"true" to use TLS with a redis:// URL.
    DYNVM_REDIS_TLS_CA     CA certificate (PEM) of the Redis server.
    DYNVM_REDIS_TLS_CERT   client certificate (PEM), with DYNVM_REDIS_TLS_KEY.
    DYNVM_REDIS_TLS_KEY    client private key (PEM).
    DYNVM_REDIS_NAMESPACE  key prefix in Redis (default "dynvm:k:").
    DYNVM_STORE_TTL_S      expire Redis entries after this many seconds (default: never,
                           LRU eviction only).
    DYNVM_PROXY_MAX_BODY_BYTES, DYNVM_PROXY_BODY_TIMEOUT_S
                           limits of dynvm's guard in Ray Serve's HTTP proxy (Note
                           [Limits at the proxy] in dynvm.cluster.protocol.proxy_guard): largest
                           body (default 64 MiB), seconds for the whole body to arrive
                           (default 30). Launchers set them for the proxy process.
    OTEL_SDK_DISABLED      "true": no tracing, whatever else is set.
    OTEL_TRACES_EXPORTER   comma-separated exporters ("otlp", "console", "none", or any
                           installed opentelemetry_traces_exporter entry point).
    OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
                           set alone (without OTEL_TRACES_EXPORTER), they mean "otlp".
    OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
                           "grpc" (default), "http/protobuf" or "http/json": which OTLP
                           exporter package "otlp" loads.

dynvm reads the OTEL_* variables above only to decide whether tracing is on and which
exporter to load; the OpenTelemetry SDK and the exporter then read the rest of their
standard OTEL_* settings (endpoint, headers, sampler, resource attributes) themselves.
Without OTEL_TRACES_EXPORTER or an OTLP endpoint, tracing is off (a no-op tracer).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dynvm.vm.errors import ConfigError

JIT = "DYNVM_JIT"
STORE_SECRET = "DYNVM_STORE_SECRET"
REDIS_URL = "DYNVM_REDIS_URL"
STORE_DIR = "DYNVM_STORE_DIR"
REDIS_USERNAME = "DYNVM_REDIS_USERNAME"
REDIS_PASSWORD = "DYNVM_REDIS_PASSWORD"
REDIS_TLS = "DYNVM_REDIS_TLS"
REDIS_TLS_CA = "DYNVM_REDIS_TLS_CA"
REDIS_TLS_CERT = "DYNVM_REDIS_TLS_CERT"
REDIS_TLS_KEY = "DYNVM_REDIS_TLS_KEY"
REDIS_NAMESPACE = "DYNVM_REDIS_NAMESPACE"
STORE_TTL_S = "DYNVM_STORE_TTL_S"
PROXY_MAX_BODY_BYTES = "DYNVM_PROXY_MAX_BODY_BYTES"
PROXY_BODY_TIMEOUT_S = "DYNVM_PROXY_BODY_TIMEOUT_S"
OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
OTEL_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
OTEL_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTEL_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTEL_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
OTEL_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
XDG_CACHE_HOME = "XDG_CACHE_HOME"

DEFAULT_REDIS_NAMESPACE = "dynvm:k:"

# OTEL_TRACES_EXPORTER "otlp" resolves by protocol, as the SDK's auto-configuration does.
_OTLP_ENTRY_POINTS = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http",
                      "http/json": "otlp_proto_http"}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvVarError(ConfigError):
    """An environment variable has a value dynvm cannot use; the message names it (and
    quotes the value unless the variable holds a secret)."""


MIN_SECRET_BYTES = 32
"""Shortest DYNVM_STORE_SECRET accepted, in UTF-8 bytes (Note [Store secret strength])."""
MIN_SECRET_BITS = 80
"""Least empirical entropy of DYNVM_STORE_SECRET's characters, in bits."""

# Note [Store secret strength]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The store secret is the only thing that keeps anyone who can write to Redis from
# running code in every replica (Note [Signed artifacts] in dynvm.cluster.store._signed): an
# HMAC key of one character can be guessed offline from one sealed entry in
# microseconds. So a secret must be at least MIN_SECRET_BYTES long (HMAC-SHA256's own
# key size; `openssl rand -hex 32` gives 64 characters) and must not look made by hand:
# its characters carry at least MIN_SECRET_BITS of empirical entropy (length times the
# Shannon entropy of their frequencies: one repeated character carries none, "ab" * 16
# 32 bits, a random 32-character hex string about 110), it is not a shorter string
# repeated, and no single step between neighbouring characters (0 for "aaaa", 1 for
# "abcd...") makes up half of them. These refuse the secrets people type; they cannot
# prove a secret random, and the message never shows the value.


def _secret_weakness(secret: str) -> str | None:
    """Why `secret` is too weak for DYNVM_STORE_SECRET, or None (Note [Store secret
    strength]); the answer never quotes the secret."""
    size = len(secret.encode("utf-8", "surrogatepass"))
    if size < MIN_SECRET_BYTES:
        return f"is {size} bytes long, at least {MIN_SECRET_BYTES} are required"
    n = len(secret)
    bits = sum(c * math.log2(n / c) for c in Counter(secret).values())
    if bits < MIN_SECRET_BITS:
        return (f"has {len(set(secret))} distinct characters ({bits:.0f} bits of "
                f"entropy, at least {MIN_SECRET_BITS} are required)")
    for period in range(1, n // 2 + 1):
        if secret == (secret[:period] * (n // period + 1))[:n]:
            return f"is a {period}-character string repeated"
    steps = Counter(ord(b) - ord(a) for a, b in zip(secret, secret[1:], strict=False))
    step, count = steps.most_common(1)[0]
    if 2 * count >= n - 1:
        return (f"is a run: {count} of its {n - 1} neighbouring characters differ by "
                f"{step}")
    return None


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    text = environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise EnvVarError(f"{name} must be a boolean (1/0, true/false, on/off, yes/no), "
                      f"got {environ[name]!r}")


def _optional(environ: Mapping[str, str], name: str) -> str | None:
    return environ.get(name) or None


# -- the runtime -----------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeSettings:
    """What the environment says about every Runtime made in this process."""

    jit: bool = True
    """False when DYNVM_JIT switches the JIT off: Runtimes then interpret every call,
    whatever `jit=` they were given."""
    jit_text: str = ""
    """DYNVM_JIT as written, for messages ("" when unset)."""


def runtime_settings(environ: Mapping[str, str] | None = None) -> RuntimeSettings:
    """The Runtime's settings (DYNVM_JIT) from `environ` or the process."""
    env = _environ(environ)
    return RuntimeSettings(jit=_flag(env, JIT, True), jit_text=env.get(JIT, ""))


# -- tracing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ExporterChoice:
    """One span exporter the environment asks for."""

    name: str
    """As written in OTEL_TRACES_EXPORTER ("otlp" also when only an endpoint is set)."""
    entry_point: str
    """The opentelemetry_traces_exporter entry point that provides it."""


@dataclass(frozen=True)
class TraceSettings:
    """Whether tracing is configured, and through which exporters."""

    exporters: tuple[ExporterChoice, ...] = ()
    """Empty: tracing is off (no provider, a no-op tracer)."""


def trace_settings(environ: Mapping[str, str] | None = None) -> TraceSettings:
    """Tracing is on only when OTEL_TRACES_EXPORTER or an OTLP endpoint is set and
    OTEL_SDK_DISABLED is not "true"; "none" entries are skipped."""
    env = _environ(environ)
    if env.get(OTEL_SDK_DISABLED, "").strip().lower() == "true":
        return TraceSettings()
    names = env.get(OTEL_TRACES_EXPORTER, "").strip()
    endpoint = env.get(OTEL_TRACES_ENDPOINT) or env.get(OTEL_ENDPOINT)
    if not names and not endpoint:
        return TraceSettings()
    protocol = (env.get(OTEL_TRACES_PROTOCOL) or env.get(OTEL_PROTOCOL) or "grpc").strip()
    choices = []
    for name in (n.strip() for n in (names or "otlp").split(",")):
        if not name or name == "none":
            continue
        entry = _OTLP_ENTRY_POINTS.get(protocol, "otlp_proto_grpc") if name == "otlp" \
            else name
        choices.append(ExporterChoice(name=name, entry_point=entry))
    return TraceSettings(exporters=tuple(choices))


# -- the kernel store ------------------------------------------------------------------


@dataclass(frozen=True)
class StoreSettings:
    """The kernel store's variables, checked and typed; dynvm.cluster.store._store_config turns them
    into a StoreConfig. Exactly one of `redis_url` and `local_dir` is set."""

    secret: str = field(repr=False)
    """DYNVM_STORE_SECRET; never shown by repr or in messages."""
    redis_url: str | None = field(default=None, repr=False)
    """DYNVM_REDIS_URL; not shown by repr (its userinfo may hold a password)."""
    local_dir: str | None = None
    """DYNVM_STORE_DIR, or the default under XDG_CACHE_HOME when no Redis URL is set."""
    redis_username: str | None = None
    """DYNVM_REDIS_USERNAME."""
    redis_password: str | None = field(default=None, repr=False)
    """DYNVM_REDIS_PASSWORD; never shown by repr or in messages."""
    redis_tls: bool = False
    """DYNVM_REDIS_TLS."""
    redis_tls_ca: str | None = None
    """DYNVM_REDIS_TLS_CA."""
    redis_tls_cert: str | None = None
    """DYNVM_REDIS_TLS_CERT."""
    redis_tls_key: str | None = None
    """DYNVM_REDIS_TLS_KEY."""
    redis_namespace: str = DEFAULT_REDIS_NAMESPACE
    """DYNVM_REDIS_NAMESPACE."""
    ttl_seconds: int | None = None
    """DYNVM_STORE_TTL_S (None: entries never expire)."""


def default_store_dir(environ: Mapping[str, str] | None = None) -> str:
    """$XDG_CACHE_HOME/dynvm/kernels, XDG_CACHE_HOME defaulting to ~/.cache."""
    base = _environ(environ).get(XDG_CACHE_HOME) or str(Path.home() / ".cache")
    return str(Path(base) / "dynvm" / "kernels")


def _positive_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise EnvVarError(f"{name} must be a positive integer, got {text!r}")
    return value


def store_settings(environ: Mapping[str, str] | None = None) -> StoreSettings:
    """The kernel store's settings (DYNVM_STORE_*, DYNVM_REDIS_*) from `environ` or
    the process; EnvVarError names a missing or bad variable, never a secret."""
    env = _environ(environ)
    secret = env.get(STORE_SECRET, "")
    if not secret.strip():
        state = "empty" if STORE_SECRET in env else "not set"
        raise EnvVarError(
            f"{STORE_SECRET} is {state}: the kernel store signs and verifies compiled "
            f"kernels with it. Set it to the same random value on every process of "
            f"the cluster (e.g. `openssl rand -hex 32`).")
    weakness = _secret_weakness(secret)
    if weakness is not None:
        raise EnvVarError(
            f"{STORE_SECRET} {weakness}: anyone who guesses it can make every replica "
            f"run their code. Set it to a random value, the same on every process of "
            f"the cluster (e.g. `openssl rand -hex 32`).")
    url, directory = _optional(env, REDIS_URL), _optional(env, STORE_DIR)
    if url is not None and directory is not None:
        raise EnvVarError(f"set {REDIS_URL} or {STORE_DIR}, not both")
    if url is None:
        return StoreSettings(secret=secret, local_dir=directory or default_store_dir(env))
    return StoreSettings(
        secret=secret, redis_url=url,
        redis_username=_optional(env, REDIS_USERNAME),
        redis_password=_optional(env, REDIS_PASSWORD),
        redis_tls=_flag(env, REDIS_TLS, False),
        redis_tls_ca=_optional(env, REDIS_TLS_CA),
        redis_tls_cert=_optional(env, REDIS_TLS_CERT),
        redis_tls_key=_optional(env, REDIS_TLS_KEY),
        redis_namespace=env.get(REDIS_NAMESPACE) or DEFAULT_REDIS_NAMESPACE,
        ttl_seconds=_positive_int(env, STORE_TTL_S),
    )


# -- the HTTP proxy --------------------------------------------------------------------


@dataclass(frozen=True)
class ProxySettings:
    """What the environment says about the HTTP proxy's guard (None: its default)."""

    max_body_bytes: int | None = None
    body_timeout_s: float | None = None


def proxy_settings(environ: Mapping[str, str] | None = None) -> ProxySettings:
    """The HTTP proxy guard's limits (DYNVM_PROXY_*) from `environ` or the
    process; EnvVarError names a bad variable."""
    env = _environ(environ)
    timeout = None
    text = env.get(PROXY_BODY_TIMEOUT_S)
    if text:
        try:
            timeout = float(text)
        except ValueError:
            timeout = 0.0
        if not 0 < timeout < float("inf"):
            raise EnvVarError(f"{PROXY_BODY_TIMEOUT_S} must be a number of seconds > 0, "
                              f"got {text!r}")
    return ProxySettings(max_body_bytes=_positive_int(env, PROXY_MAX_BODY_BYTES),
                         body_timeout_s=timeout)


# -- subprocesses ----------------------------------------------------------------------


def export(variables: Mapping[str, str]) -> None:
    """Set `variables` in this process's environment, for the processes it starts later
    to inherit (Ray's, whose HTTP proxy reads RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
    and DYNVM_PROXY_*)."""
    os.environ.update(variables)


def child_environment(without: Iterable[str] = (),
                      extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of this process's environment for a subprocess, less the names in
    `without`, plus `extra` (e.g. the Triton AOT worker must not inherit
    TRITON_INTERPRET)."""
    dropped = set(without)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(extra or {})
    return env
