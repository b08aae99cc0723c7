"""`dynvm serve` as a real subprocess: local Ray, private redis-server, compile service,
HTTP; one tritonclient request; SIGINT stops every process it started."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import pytest
import torch

import dynvm
from dynvm.cluster.serving._config_flags import cli
from dynvm.cluster.store._local_redis import LocalRedis, LocalRedisError, LocalRedisOptions
from tests.cluster._cluster_helpers import process_alive, saved_recommender
from tests.cluster._redis_server import REDIS_SERVER, free_port

httpclient = pytest.importorskip("tritonclient.http")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> dict[int, str]:
    tree, found, todo = _children(), {}, [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            try:
                with open(f"/proc/{child}/comm") as f:
                    found[child] = f.read().strip()
            except OSError:
                continue
            todo.append(child)
    return found


def _get(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, json.loads(response.read())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return saved_recommender(tmp_path_factory.mktemp("serve"), "rec.dvm")


@pytest.mark.slow
def test_serve_answers_and_ctrl_c_stops_everything_it_started(model, tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    demo, program, path = model
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("DYNVM_REDIS_URL", "DYNVM_STORE_SECRET", "DYNVM_STORE_DIR")}
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "dynvm", "serve", str(path),
                                    "--port", str(port), "--name", "rec"],
                                   stdout=stdout, stderr=stderr, env=env)
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, out.read_text() + err.read_text()[-3000:]
            try:
                # Ready may answer a moment before the command prints its URL.
                if _get(f"http://127.0.0.1:{port}/v2/health/ready")[1].get("ready") and \
                        "Ctrl-C" in out.read_text():
                    break
            except (OSError, ValueError):
                pass
            assert time.monotonic() < deadline, "not ready in 90 s: " + err.read_text()[-3000:]
            time.sleep(0.1)  # a refused connect or one request: cheap beside the start
        started = _descendants(process.pid)
        names = set(started.values())
        assert "redis-server" in names and "raylet" in names, started
        printed = out.read_text()
        assert f"http://127.0.0.1:{port}/v2/models/rec" in printed

        inputs = demo.sample_inputs(random.Random(3))
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        infer_inputs = []
        for spec, tensor in zip(program.inputs, inputs):
            item = httpclient.InferInput(spec.name, list(tensor.shape),
                                         "FP32" if tensor.is_floating_point() else "INT64")
            item.set_data_from_numpy(tensor.numpy(), binary_data=True)
            infer_inputs.append(item)
        result = client.infer("rec", infer_inputs)
        expected = dynvm.Runtime(program, jit=False)(*inputs)
        torch.testing.assert_close(torch.from_numpy(result.as_numpy("output__0").copy()), expected)
        stats = _get(f"http://127.0.0.1:{port}/v2/models/rec/stats")[1]
        assert stats["fleet"]["service_ok"], stats["fleet"]
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=45)
        except subprocess.TimeoutExpired:
            process.kill()
            for pid in started:
                if process_alive(pid):
                    os.kill(pid, signal.SIGKILL)
            raise
    assert code == 0, err.read_text()[-3000:]
    assert "stopped" in out.read_text()
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = {pid: name for pid, name in started.items() if process_alive(pid)}
    assert not survivors, survivors


def test_local_redis_keeps_its_password_off_the_command_line():
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = LocalRedis().start()
    try:
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert server.options.password.encode() not in cmdline
        assert server.options.password not in repr(server.config()) + repr(server.options)
        from dynvm.cluster import RedisStore

        with RedisStore(server.config()) as store:
            store.put("a" * 64, b"x")
            assert store.get(["a" * 64]) == {"a" * 64: b"x"}
        pid = server.pid
    finally:
        server.stop()
    assert not process_alive(pid)
    server.stop()  # twice is fine


def test_local_redis_missing_executable_is_a_clear_error():
    missing = LocalRedis(LocalRedisOptions(executable="dynvm-no-such-redis-server"))
    with pytest.raises(LocalRedisError, match="dynvm-no-such-redis-server is not on PATH"):
        missing.start()
    assert missing.process is None


def _serve_args(*flags: str):
    import argparse

    from dynvm._serve_cmd import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_flags_map_to_one_serving_config(tmp_path):
    from dynvm._run_cmd import CliError
    from dynvm._serve_cmd import options_from_args
    from dynvm.cluster import Autoscaling, BatchingOptions, ServingConfig, ServingLimits
    from dynvm.jit.config import JitConfig

    path = tmp_path / "m.dvm"
    path.write_bytes(b"x")  # options_from_args only checks that the file exists
    # No flag: ServingConfig.local_stack(), the defaults but the ingress (the command
    # starts its own Ray in direct ingress: Note [Direct ingress]).
    assert options_from_args(_serve_args(str(path))).serving == ServingConfig(
        ingress="direct") == ServingConfig.local_stack()
    options = options_from_args(_serve_args(
        str(path), "--max-batch-size", "16", "--max-batch-delay-ms", "1.5",
        "--preferred-batch-sizes", "8,4,16", "--no-shape-aware-batching",
        "--max-queued", "32", "--replicas", "3", "--device", "cpu", "--call-seconds", "2",
        "--no-online-compile", "--access-log"))
    assert options.serving == ServingConfig(
        device="cpu", num_replicas=3, jit=JitConfig(online_compile=False), access_log=True,
        ingress="direct",
        batching=BatchingOptions(max_batch_size=16, max_delay_s=0.0015,
                                 preferred_sizes=(4, 8, 16), shape_aware=False,
                                 max_queued=32),
        limits=ServingLimits(call_seconds=2.0))
    scaled = options_from_args(_serve_args(str(path), "--min-replicas", "0",
                                           "--max-replicas", "3"))
    assert scaled.serving.autoscaling == Autoscaling(min_replicas=0, max_replicas=3)
    for bad in (["--max-batch-size", "0"], ["--preferred-batch-sizes", "4,x"],
                ["--max-batch-delay-ms", "5000"]):
        with pytest.raises(CliError) as error:
            options_from_args(_serve_args(str(path), *bad))
        assert error.value.args[0].startswith(("bad batching flag", "--preferred"))
    for bad, message in ((["--call-seconds", "inf"], "call_seconds"),
                         (["--min-replicas", "2"], "give both"),
                         (["--min-replicas", "3", "--max-replicas", "2"], "min_replicas")):
        with pytest.raises(CliError, match=message):
            options_from_args(_serve_args(str(path), *bad))


# Flags that set a ServingConfig field (or a part's) or the port: each defaults to None
# (False for an on-switch), so that the default stated in dynvm.cluster.serving.serving_config
# applies: one default per setting.
_CONFIG_FLAGS = {"port", "drain_seconds", "replicas", "min_replicas", "max_replicas",
                 "target_ongoing_requests", "online_compile", "device", "num_cpus",
                 "call_seconds", "ingress", "access_log", "require_signed", "max_batch_size",
                 "max_batch_delay_ms", "preferred_batch_sizes", "shape_aware_batching",
                 "max_queued"}


def test_the_clis_defaults_are_serving_configs(tmp_path):
    import argparse

    from dynvm._serve_cmd import add_parser, options_from_args
    from dynvm.cluster.serving.serving_config import HTTP_PORT, ServingConfig

    subparsers = argparse.ArgumentParser().add_subparsers()
    add_parser(subparsers)
    actions = {a.dest: a for a in subparsers.choices["serve"]._actions}
    assert set(actions) >= _CONFIG_FLAGS
    restated = {dest: actions[dest].default for dest in _CONFIG_FLAGS
                if actions[dest].default is not None
                and not (actions[dest].default is False and actions[dest].nargs == 0)}
    assert not restated, f"flags with a default of their own: {restated}"
    path = tmp_path / "m.dvm"
    path.write_bytes(b"x")
    options = options_from_args(_serve_args(str(path)))
    assert (options.serving, options.port) == (ServingConfig.local_stack(), HTTP_PORT)
    # local_stack() differs from the library's defaults in the ingress alone.
    assert options_from_args(_serve_args(str(path), "--ingress", "proxy")).serving \
        == ServingConfig.local_stack(ingress="proxy") == ServingConfig()
    assert options_from_args(_serve_args(str(path), "--port", "8123")).port == 8123


def test_gpu_targets_flag_reaches_the_options(tmp_path):
    from dynvm._run_cmd import CliError
    from dynvm._serve_cmd import options_from_args

    path = tmp_path / "m.dvm"
    path.write_bytes(b"x")
    assert options_from_args(_serve_args(str(path))).gpu_targets == ()
    options = options_from_args(_serve_args(str(path), "--gpu-targets", "cuda:90, cuda:80"))
    assert options.gpu_targets == (("cuda", 90, 32), ("cuda", 80, 32))
    with pytest.raises(CliError, match="cuda:90"):
        options_from_args(_serve_args(str(path), "--gpu-targets", "rocm:90"))


def test_service_shards_flag_reaches_the_options(tmp_path):
    from dynvm._run_cmd import CliError
    from dynvm._serve_cmd import options_from_args

    path = tmp_path / "m.dvm"
    path.write_bytes(b"x")
    assert options_from_args(_serve_args(str(path))).service_shards == 1
    assert options_from_args(_serve_args(str(path), "--service-shards", "3")).service_shards == 3
    with pytest.raises(CliError, match="--service-shards must be >= 1"):
        options_from_args(_serve_args(str(path), "--service-shards", "0"))


def test_every_serving_config_field_is_a_flag():
    # Note [Flags from config fields]: a field is a flag without touching the CLI, its
    # default the config's (the help states it), a Literal's values its choices.
    import argparse
    import dataclasses

    from dynvm.cluster.serving._config_flags import (
        FlagError,
        add_config_flags,
        config_flags,
        config_from_flags,
    )
    from dynvm.cluster.serving.serving_config import ServingConfig

    paths = {flag.path for flag in config_flags(ServingConfig)}
    for f in dataclasses.fields(ServingConfig):
        value = getattr(ServingConfig(), f.name)
        if dataclasses.is_dataclass(value) or f.name == "autoscaling":
            from dynvm.cluster.serving.serving_config import Autoscaling

            part = type(value) if value is not None else Autoscaling
            assert {(f.name, g.name) for g in dataclasses.fields(part)} <= paths, f.name
        elif f.name not in ("jit", "fleet"):  # not scalars: --online-compile; start-up
            assert (f.name,) in paths, f.name
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ServingConfig.local_stack())
    ingress = next(a for a in parser._actions if a.dest == "ingress")
    assert ingress.choices == ("proxy", "direct") and "(default: direct)" in ingress.help
    assert all(a.default is None for a in parser._actions if a.dest != "help")
    args = parser.parse_args(["--parse-threads", "3", "--no-batching", "--num-gpus", "0.5",
                              "--upscale-delay-s", "1", "--max-batch-delay-ms", "1"])
    config = config_from_flags(args, ServingConfig())
    assert (config.limits.parse_threads, config.batching.enabled, config.num_gpus,
            config.autoscaling.upscale_delay_s, config.batching.max_delay_s) \
        == (3, False, 0.5, 1.0, 0.001)
    assert config_from_flags(parser.parse_args([]), ServingConfig()) == ServingConfig()
    with pytest.raises(FlagError, match="bad limits flag"):
        config_from_flags(parser.parse_args(["--parse-threads", "0"]), ServingConfig())


@dataclass(frozen=True)
class _Part:
    """A config's part (test_a_new_field_is_a_flag_and_two_fields_cannot_share_one)."""

    wait_s: float = field(default=0.5, metadata=cli("--wait-ms", scale=0.001, unit="ms"))
    """How long to wait."""


@dataclass(frozen=True)
class _Config:
    """A config with a setting added later."""

    new_setting: int = 3
    """A setting added later."""
    part: _Part = field(default_factory=_Part)
    """Its part."""


@dataclass(frozen=True)
class _Clash:
    """Two fields, one flag."""

    wait_ms: int = 1
    """A wait."""
    part: _Part = field(default_factory=_Part)
    """Its part."""


def test_a_new_field_is_a_flag_and_two_fields_cannot_share_one():
    import argparse

    from dynvm.cluster.serving._config_flags import add_config_flags, config_from_flags
    from dynvm.vm.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_config_flags(parser, _Config())
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["new_setting"] == "A setting added later. (default: 3)"
    assert helps["wait_ms"] == "How long to wait. The flag takes ms. (default: 500)"
    assert config_from_flags(parser.parse_args(["--new-setting", "5", "--wait-ms", "20"]),
                             _Config()) == _Config(new_setting=5, part=_Part(wait_s=0.02))
    with pytest.raises(ConfigError, match="both make --wait-ms"):
        add_config_flags(argparse.ArgumentParser(), _Clash())


def test_every_generation_setting_is_one_flag():
    # A generator's SchedulerConfig makes its flags as ServingConfig does; the rows and
    # the waiting room read the inference flags of the same settings, so `dynvm serve`
    # has one flag per setting and the parser builds without a clash.
    import dataclasses

    from dynvm._run_cmd import CliError
    from dynvm._serve_generate_cmd import scheduler_from_args
    from dynvm.cluster.serving._config_flags import config_flags
    from dynvm.cluster.serving._generate_scheduler import SchedulerConfig

    flags = {flag.path[0]: flag for flag in config_flags(SchedulerConfig)}
    assert set(flags) == {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert {name for name, flag in flags.items() if flag.shared} == {"max_sequences",
                                                                     "max_waiting"}
    assert scheduler_from_args(_serve_args("m.dvm")) == SchedulerConfig()
    given = scheduler_from_args(_serve_args(
        "m.dvm", "--max-batch-size", "4", "--max-queued", "9", "--step-token-budget", "24",
        "--min-prompt-tokens", "2", "--request-seconds", "5"))
    assert (given.max_sequences, given.max_waiting, given.step_token_budget,
            given.min_prompt_tokens, given.request_seconds) == (4, 9, 24, 2, 5.0)
    with pytest.raises(CliError, match="bad generation flag.*step_token_budget"):
        scheduler_from_args(_serve_args("m.dvm", "--step-token-budget", "0"))
