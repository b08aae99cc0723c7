"""dynvm._env: the one module that reads the environment, its parsers, the DYNVM_JIT
switch, and that every variable it reads is documented."""

from __future__ import annotations

import re
import secrets
import tokenize
from pathlib import Path

import pytest
import torch

import dynvm
from dynvm import _env
from dynvm._env import EnvVarError, runtime_settings, store_settings, trace_settings
from dynvm.cli import main
from tests.jit._jit_helpers import compiled, eager_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("dynvm", "vm", "jit", "shape_cluster", "arena", "cluster")
# Reading the environment: os.environ, os.getenv, os.putenv, os.unsetenv, environb.
_READS_ENV = re.compile(r"\b(environ|environb|getenv|putenv|unsetenv)\b")
# Copies the environment for its Triton worker subprocess; the jit owner is asked to use
# dynvm._env.child_environment(without=("TRITON_INTERPRET",)) instead, which empties this.
_KNOWN_OTHER_READERS: set[str] = set()


def _code_names(path: Path) -> str:
    """The file's names and operators, without comments or string literals (a path
    such as "/proc/<pid>/environ", another process's, is not this one's environment)."""
    with path.open("rb") as source:
        return " ".join(token.string for token in tokenize.tokenize(source.readline)
                        if token.type in (tokenize.NAME, tokenize.OP))


def test_only_env_module_reads_the_environment():
    readers = set()
    for package in SHIPPED:
        for path in (REPO / package).rglob("*.py"):
            code = _code_names(path)
            if re.search(r"\bos \.", code) and _READS_ENV.search(code):
                readers.add(str(path.relative_to(REPO)))
    assert readers == {"dynvm/_env.py", *_KNOWN_OTHER_READERS}


def test_every_variable_is_documented():
    names = set(re.findall(r'"((?:DYNVM|OTEL|XDG)_[A-Z_]+)"',
                           (REPO / "dynvm" / "_env.py").read_text()))
    assert {"DYNVM_JIT", "DYNVM_STORE_SECRET", "OTEL_TRACES_EXPORTER"} <= names
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    for name in sorted(names):
        assert name in _env.__doc__, f"{name} is not in dynvm._env's docstring"
        assert name in section, f"{name} is not in the README's Environment variables"


@pytest.mark.parametrize("text, on", [("", True), ("1", True), ("on", True), ("TRUE", True),
                                      ("0", False), ("off", False), ("no", False),
                                      (" False ", False)])
def test_jit_switch_values(text, on):
    assert runtime_settings({"DYNVM_JIT": text}).jit is on
    assert runtime_settings({}).jit is True


def test_bad_jit_switch_names_the_variable(monkeypatch):
    with pytest.raises(EnvVarError, match=r"DYNVM_JIT must be a boolean .* got 'of'"):
        runtime_settings({"DYNVM_JIT": "of"})
    monkeypatch.setenv("DYNVM_JIT", "of")
    with pytest.raises(EnvVarError, match="DYNVM_JIT"):
        dynvm.Runtime(compiled("branchy"), jit=True)
    dynvm.Runtime(compiled("branchy"), jit=False)  # the switch is only read for a JIT


def test_dynvm_jit_off_runs_the_interpreter(monkeypatch):
    program = compiled("branchy")
    x = torch.randn(3, 32)
    reference = dynvm.Runtime(program, jit=False)(x)
    monkeypatch.setenv("DYNVM_JIT", "off")
    for jit in (True, eager_config()):
        with dynvm.Runtime(program, jit=jit) as runtime:
            for _ in range(3):
                torch.testing.assert_close(runtime(x), reference)
            stats = runtime.stats()
            assert runtime.jit is None and stats["jit"] is False
            assert stats["jit_disabled_by"] == "DYNVM_JIT=off"
            assert "compiles" not in stats and stats["calls"] == 3
    monkeypatch.setenv("DYNVM_JIT", "1")
    with dynvm.Runtime(program, jit=eager_config()) as runtime:
        runtime(x)
        runtime(x)
        stats = runtime.stats()
        assert stats["jit"] is True and "jit_disabled_by" not in stats
        assert stats["compiles"] > 0


def test_cli_reports_the_switch(monkeypatch, capsys):
    monkeypatch.setenv("DYNVM_JIT", "0")
    assert main(["run", "branchy", "--calls", "2", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "jit=off (DYNVM_JIT=0 in the environment)" in out
    assert re.search(r"jit_disabled_by\s+DYNVM_JIT=0", out)
    assert main(["explain", "branchy"]) == 1
    assert "the JIT is disabled by DYNVM_JIT=0" in capsys.readouterr().err


def test_trace_settings_resolve_exporters():
    assert trace_settings({}).exporters == ()
    assert trace_settings({"OTEL_TRACES_EXPORTER": "none"}).exporters == ()
    assert trace_settings({"OTEL_SDK_DISABLED": "true",
                           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}).exporters == ()
    (only,) = trace_settings({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318",
                              "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}).exporters
    assert (only.name, only.entry_point) == ("otlp", "otlp_proto_http")
    choices = trace_settings({"OTEL_TRACES_EXPORTER": "console, otlp"}).exporters
    assert [(c.name, c.entry_point) for c in choices] == [("console", "console"),
                                                          ("otlp", "otlp_proto_grpc")]


def test_store_settings_never_show_secrets():
    secret, password = "s3cret-value-" + secrets.token_hex(16), "pa55word-xyz"
    settings = store_settings({"DYNVM_STORE_SECRET": secret, "DYNVM_REDIS_URL": "redis://h",
                               "DYNVM_REDIS_PASSWORD": password, "DYNVM_REDIS_TLS": "yes"})
    assert settings.redis_tls and settings.local_dir is None
    assert secret not in repr(settings) and password not in repr(settings)
    with pytest.raises(EnvVarError, match="DYNVM_REDIS_TLS") as caught:
        store_settings({"DYNVM_STORE_SECRET": secret, "DYNVM_REDIS_URL": "redis://h",
                        "DYNVM_REDIS_PASSWORD": password, "DYNVM_REDIS_TLS": "sure"})
    assert secret not in str(caught.value) and password not in str(caught.value)


def test_child_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("DYNVM_TEST_KEEP", "kept")
    env = _env.child_environment(without=("TRITON_INTERPRET",), extra={"X_EXTRA": "1"})
    assert "TRITON_INTERPRET" not in env
    assert env["DYNVM_TEST_KEEP"] == "kept" and env["X_EXTRA"] == "1"
