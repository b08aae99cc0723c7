"""`dynvm serve MODEL.dvm`: the one-command embedded default of docs/ARCHITECTURE.md's cluster.

It starts, in order (dynvm.cluster.serving._local_stack, which Python calls as `serve_local`), a
private redis-server when the environment names no Redis (dynvm.cluster.store._local_redis), a
local Ray (no dashboard), the compile service, Serve's HTTP proxy on --host (127.0.0.1 by
default), and the model's replicas with their fleet links, each replica serving HTTP on
a port of its own too (Serve's direct ingress, unless `--ingress proxy`:
Note [Direct ingress]); prints the URLs; waits for SIGINT or SIGTERM. With the default
--host every socket of the run, Ray's included, listens on loopback only
(Note [Loopback listeners] in dynvm.cluster.protocol._loopback).

Note [Stopping dynvm serve]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
SIGINT and SIGTERM (Ctrl-C, `timeout`, `docker stop`, Kubernetes, systemd) start the
same graceful stop (Note [Stop signals] in dynvm.cluster.serving._stop_signals). First the
model's replicas drain (Note [Drain before Serve stops] in dynvm.cluster.serving._drain):
/v2/health/ready turns 503 at once, a new request gets 503 + Retry-After, those in
flight finish, within ServingConfig.drain_s (`--drain-seconds`). Then Serve shuts down
(each replica as on scale-down, Note [Replica drain] in dynvm.cluster.serving._deployment: its
listener closes, a later connection is refused), then the compile service, Ray (its
raylet, GCS and workers) and the private redis-server, in that order, and the command
exits EXIT_STOPPED (0). A second signal, or a stop still running STOP_BUDGET_S after
the drain (counted from the end of start-up), forces it: the redis-server is killed
and the command exits at once, EXIT_FORCED_BY_SIGNAL + the signal's number (130 for
SIGINT, 143 for SIGTERM) or EXIT_STOP_TIMEOUT. Even then, and even after a SIGKILL of
the command, nothing is left behind: the redis-server has a parent-death signal
(LocalRedisOptions.die_with_parent), Ray starts its GCS and raylet with one too (its
workers exit when the raylet is gone), and a watchdog kills whatever else the command
started at once (Note [Orphan watch] in dynvm.cluster.serving._orphan_watch), instead of the
minute Ray's agents take alone.

The kernel store's secret comes from DYNVM_STORE_SECRET when it is set (replicas of
another `dynvm serve`, or `dynvm precompile`, can then share the store). Otherwise it is
random for this run: nothing outside this run can read what it stores (nor needs to; the
private Redis dies with it). The secret travels inside the StoreConfig handed to the
actors and is never printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dynvm._env import (
    STORE_SECRET,
    EnvVarError,
    child_environment,
    export,
)
from dynvm._run_cmd import CliError

if TYPE_CHECKING:
    from dynvm.cluster.serving._stop_signals import StopSignals
    from dynvm.cluster.serving.serving_config import ServingConfig
    from dynvm.cluster.store._local_redis import LocalRedis

# Exit statuses (Note [Stopping dynvm serve]).
EXIT_STOPPED = 0
EXIT_FORCED_BY_SIGNAL = 128
EXIT_STOP_TIMEOUT = 124
STOP_BUDGET_S = 30.0


@dataclass(frozen=True)
class ServeOptions:
    """What `dynvm serve` was asked for (its flags)."""

    model_path: str
    """The .dvm file the replicas load (made absolute: replicas are other processes)."""
    name: str
    """Model name in the v2 routes: /v2/models/<name>/infer."""
    serving: ServingConfig
    """How the model is served: the flags over ServingConfig's defaults (the fleet is
    added at start-up, once the store exists)."""
    port: int
    """HTTP port of Serve's proxy on `host` (--port, else serving_config.HTTP_PORT)."""
    host: str = "127.0.0.1"
    """Address every socket of the run listens on: loopback by default, Ray's own
    sockets included (Note [Loopback listeners]); another address (0.0.0.0: every
    interface) opens Serve's proxy and direct-ingress ports there, and Ray's."""
    grpc_port: int | None = None
    """The v2 gRPC protocol's port, on `host`; None: no gRPC."""
    service_shards: int = 1
    """Compile service actors; a program goes to one of them by its hash (Note [Compile
    service shards])."""
    generate: object | None = None
    """For a generator directory (dynvm._serve_generate_cmd): its SchedulerConfig; None:
    a .dvm file served for inference."""
    gpu_targets: tuple = ()
    """GPU targets, e.g. (("cuda", 90, 32),): the compile service also builds Triton
    binaries for them, and CUDA replicas install those instead of compiling (Note [GPU
    replicas in the fleet]); CPU replicas ignore them."""


def options_from_args(args) -> ServeOptions:
    """`dynvm serve`'s flags, checked, as ServeOptions (CliError for a bad one)."""
    from dynvm import _serve_generate_cmd as generate

    path = Path(args.file)
    generator = generate.is_generator(args.file)
    if not path.is_file() and not generator:
        raise CliError(f"cannot read {args.file}: no such file (nor a generator directory)",
                       2)
    if generator and args.require_signed:
        raise CliError("--require-signed: a generator directory is not signed", 2)
    from dynvm.cluster.protocol._http_front import check_model_name

    if args.require_signed and not child_environment().get(STORE_SECRET, "").strip():
        raise CliError(f"--require-signed checks the .dvm file's signature with "
                       f"{STORE_SECRET}, which is not set (sign the file with the same "
                       f"secret: dynvm.vm.dvm_signature.sign_file)", 2)
    name = args.name or path.stem
    try:
        check_model_name(name)
    except ValueError as exc:
        raise CliError(f"bad --name: {exc}", 2) from None
    from dynvm.cluster.serving.serving_config import HTTP_PORT

    port = HTTP_PORT if args.port is None else args.port
    return ServeOptions(model_path=str(path.resolve()), name=name, port=port,
                        host=_host_from_args(args), grpc_port=args.grpc_port,
                        serving=_serving_from_args(args),
                        service_shards=_service_shards_from_args(args),
                        gpu_targets=_gpu_targets_from_args(args),
                        generate=generate.scheduler_from_args(args) if generator else None)


def _host_from_args(args) -> str:
    """--host, checked (an address this machine can bind)."""
    import ipaddress

    host = args.host.strip()
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise CliError(f"--host takes an IP address (127.0.0.1, 0.0.0.0, an "
                           f"interface's address), got {args.host[:60]!r}", 2) from None
    return host


def _service_shards_from_args(args) -> int:
    """--service-shards N, checked (an integer >= 1)."""
    if args.service_shards < 1:
        raise CliError(f"--service-shards must be >= 1, got {args.service_shards}", 2)
    return args.service_shards


def _gpu_targets_from_args(args) -> tuple:
    """--gpu-targets cuda:90,cuda:80 as (backend, arch, warp size) tuples."""
    if not args.gpu_targets:
        return ()
    targets = []
    for text in args.gpu_targets.split(","):
        backend, _, arch = text.strip().partition(":")
        if backend != "cuda" or not arch.isdigit():
            raise CliError(f"--gpu-targets: each target looks like cuda:90, got "
                           f"{text.strip()[:40]!r}", 2)
        targets.append(("cuda", int(arch), 32))
    return tuple(targets)


def _serving_from_args(args) -> ServingConfig:
    """ServingConfig from the flags that were given, over ServingConfig.local_stack()
    (this command starts its own Ray); each flag is a field's (Note [Flags from config fields])."""
    from dynvm.cluster.serving._config_flags import FlagError, config_from_flags
    from dynvm.cluster.serving.serving_config import ServingConfig
    from dynvm.jit.config import JitConfig

    if (args.min_replicas is None) != (args.max_replicas is None) or (
            args.target_ongoing_requests is not None and args.max_replicas is None):
        raise CliError("give both --min-replicas and --max-replicas (autoscaling), or "
                       "neither", 2)
    base = ServingConfig.local_stack()
    if args.online_compile is False:  # `jit` is no scalar field: this flag sets it
        base = base.replace(jit=JitConfig(online_compile=False))
    try:
        return config_from_flags(args, base)
    except FlagError as exc:
        raise CliError(str(exc), 2) from None


def _start(options: ServeOptions, stack: contextlib.ExitStack, say, signals: StopSignals,
           private: list[LocalRedis]) -> dict:
    """Start everything (dynvm.cluster.serving._local_stack, the store to Serve, then the model);
    returns {application: [(host, port)]} of each application's replicas in direct
    ingress (Note [Direct ingress]), else {}."""
    from dynvm.cluster.protocol.ingress import direct_addresses
    from dynvm.cluster.serving._local_stack import LocalStackError, start_local_stack
    from dynvm.cluster.store._local_redis import LocalRedisError
    from dynvm.cluster.store._store_config import StoreConfigError

    try:
        # Ray installs its own SIGTERM handlers: ours go back after it (Note [Stop signals]).
        fleet = start_local_stack(options.serving, stack, host=options.host,
                                  port=options.port, grpc_port=options.grpc_port,
                                  service_shards=options.service_shards,
                                  gpu_targets=options.gpu_targets, say=say,
                                  after_ray_init=signals.install, private=private)
    except (EnvVarError, StoreConfigError) as exc:
        raise CliError(str(exc), 2) from None
    except (LocalRedisError, LocalStackError) as exc:
        raise CliError(str(exc), 1) from None
    if options.generate is not None:  # a generator: its own application (at /)
        from dynvm._serve_generate_cmd import deploy

        handles = deploy(options, fleet)
        return direct_addresses(handles) if options.serving.ingress == "direct" else {}
    # Imported once Ray is (Serve's module imports Ray: Note [Loopback listeners]).
    from dynvm.cluster.serving._deployment import serve_models

    handles = serve_models({options.name: options.model_path}, options.serving,
                           fleet=fleet)
    return direct_addresses(handles) if options.serving.ingress == "direct" else {}


def _url_host(options: ServeOptions) -> str:
    """The host the printed URLs name: --host, or loopback for every interface."""
    return "127.0.0.1" if options.host in ("0.0.0.0", "::") else options.host


def _hint(options: ServeOptions, direct: dict) -> str:
    host = _url_host(options)
    base = f"http://{host}:{options.port}"
    if options.generate is not None:
        from dynvm._serve_generate_cmd import hint

        return hint(options, base, [f"http://{host}:{port}" for addresses in direct.values()
                                    for _, port in addresses])
    model = f"{base}/v2/models/{options.name}"
    return f"""\
{_direct_hint(options, direct)}serving   {options.name} at {model}
  curl {base}/v2/health/ready
  curl {model}                  # inputs, datatypes, shapes (-1: dynamic)
  curl -X POST {model}/infer -H 'Content-Type: application/json' -d '{{"inputs": [...]}}'
  curl {model}/stats            # runtime and fleet counters
  python: tritonclient.http.InferenceServerClient("{host}:{options.port}"){_grpc_hint(options)}
Ctrl-C (or SIGTERM) drains and stops everything; a second one stops at once."""


def _direct_hint(options: ServeOptions, direct: dict) -> str:
    """The hint's lines on the replicas' own addresses ('' in proxy ingress)."""
    if not direct:
        return ""
    from dynvm.cluster.protocol._http_front import SERVER_APP, model_app_name

    def urls(app: str) -> str:
        return ", ".join(f"http://{_url_host(options)}:{port}" for _, port in direct[app])

    return (f"direct    {options.name}'s replicas at {urls(model_app_name(options.name))} "
            f"(every /v2/models/{options.name}/... route; each replica its port), "
            f"/v2 and /v2/health/* at {urls(SERVER_APP)}; everything also answers "
            f"through Serve's proxy, slower:\n")


def _grpc_hint(options: ServeOptions) -> str:
    """The hint's gRPC line ('' without --grpc-port)."""
    if options.grpc_port is None:
        return ""
    from dynvm.cluster.protocol._http_front import model_app_name

    client = (f'tritonclient.grpc.InferenceServerClient('
              f'"{_url_host(options)}:{options.grpc_port}")')
    return (f"\n  gRPC:   {client}, every call with "
            f"headers={{'application': '{model_app_name(options.name)}'}}")


def _drain(options: ServeOptions, say) -> None:
    """Drain the model's replicas before Serve stops (Note [Drain before Serve stops])."""
    from dynvm.cluster.protocol._http_front import model_app_name
    from dynvm.cluster.protocol.ingress import DRAIN_S
    from dynvm.cluster.serving._drain import drain_replicas

    drain_s = options.serving.drain_s
    say(f"draining  {options.name}'s replicas: not ready, new requests 503, in-flight "
        f"ones finish (up to {drain_s:g} s)")
    try:
        report = drain_replicas([model_app_name(options.name)], drain_s, min_s=DRAIN_S)
    except Exception as exc:  # Ray already going: Serve's own drain still runs
        say(f"draining  failed ({type(exc).__name__}: {exc}); Serve's own drain follows")
        return
    say(f"drained   {report.replicas} replica(s) in {report.seconds:.1f} s: "
        f"{report.in_flight_at_start} request(s) were in flight, "
        f"{report.in_flight_at_end} still are")


def serve_command(args) -> int:
    """Run `dynvm serve` until SIGINT or SIGTERM; returns the exit status (Note
    [Stopping dynvm serve])."""
    from dynvm.cluster.serving._orphan_watch import RUN_MARKER, kill_descendants_now, new_marker
    from dynvm.cluster.serving._orphan_watch import start as start_orphan_watch
    from dynvm.cluster.serving._stop_signals import StopSignals

    options = options_from_args(args)
    private: list[LocalRedis] = []  # the private redis-server, once started
    watch = None  # the orphan watch, once started (force() may run before)

    def say(line: str) -> None:
        print(line, flush=True)

    def force(signum: int | None) -> None:
        # The watcher thread, while the main thread may hold stdout's lock: write the
        # line with os.write, kill what Ray does not take down with this process, exit.
        for server in private:
            server.kill()
        if watch is not None:  # what started since the watchdog's last list (Note [Orphan watch])
            kill_descendants_now(marker[RUN_MARKER], spare=frozenset({watch.pid}))
        if signum is None:
            why, code = (f"stop still running {STOP_BUDGET_S:.0f} s after the drain",
                         EXIT_STOP_TIMEOUT)
        else:
            why, code = f"second signal {signum}", EXIT_FORCED_BY_SIGNAL + signum
        os.write(2, f"dynvm serve: {why}: forced stop, exit {code}\n".encode())
        os._exit(code)

    signals = StopSignals(force, deadline_s=options.serving.drain_s + STOP_BUDGET_S)
    signals.install()
    marker = new_marker()  # every process this run starts carries it (Note [Orphan watch])
    export(marker)
    watch = start_orphan_watch(marker[RUN_MARKER])
    try:
        with contextlib.ExitStack() as stack:
            try:
                try:
                    direct = _start(options, stack, say, signals, private)
                except CliError:
                    raise
                except Exception as exc:  # Ray or Serve failed to start: say what, unwind
                    raise CliError(f"serve failed to start: {type(exc).__name__}: "
                                   f"{exc}") from None
                if not signals.requested.is_set():
                    say(_hint(options, direct))
                while not signals.requested.wait(0.5):
                    pass
            finally:
                signals.stopping()  # from here the stop is bounded (Note [Stop signals])
            _drain(options, say)
            say("stopping  serve, compile service, ray, redis")
        say("stopped")
        return EXIT_STOPPED
    finally:
        signals.close()
        if watch is not None:  # EOF: the watch kills whatever is left, then exits
            watch.stdin.close()


def add_parser(sub) -> None:
    """Add the `serve` subcommand to the CLI's subparsers."""
    p = sub.add_parser("serve", help="serve a .dvm file over HTTP (local Ray, Redis, compile "
                       "service)", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="""\
Serve a program over the Open Inference Protocol (KServe v2) on 127.0.0.1 (--host): a local Ray,
a private redis-server as the kernel store (unless DYNVM_REDIS_URL names one), the
compile service, and the model's replicas, which share every compiled kernel. Prints
the URL; Ctrl-C or SIGTERM drains the replicas (in-flight requests finish, within
--drain-seconds) and stops everything it started, then exits 0; a second signal stops
at once (exit 128 + the signal's number).

  dynvm compile recommender -o rec.dvm && dynvm serve rec.dvm --replicas 2""")
    p.add_argument("file", metavar="MODEL.dvm")
    p.add_argument("--name", help="model name in the routes (default: the file's stem)")
    p.add_argument("--port", type=int, help="HTTP port of Serve's proxy (default: "
                   "dynvm.cluster.serving.serving_config.HTTP_PORT, Serve's own)")
    p.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                   help="address every socket listens on (default 127.0.0.1: loopback "
                   "only, Ray's own sockets included); 0.0.0.0 opens the HTTP, gRPC and "
                   "direct-ingress ports, and Ray's, on every interface")
    p.add_argument("--grpc-port", type=int, metavar="P",
                   help="also serve the v2 gRPC protocol (KServe GRPCInferenceService) on "
                   "port P of --host; calls name the model's application in "
                   "their 'application' metadata (dynvm-model-<name>)")
    p.add_argument("--service-shards", type=int, metavar="N", default=1,
                   help="run the compile service as N actors, each program on one of them "
                   "by its hash (default 1; a fleet with many programs)")
    # One flag per ServingConfig field, its default the config's: Note [Flags from config fields]
    # (`jit` is no scalar, so --online-compile is this command's).
    from dynvm.cluster.serving._config_flags import add_config_flags
    from dynvm.cluster.serving.serving_config import ServingConfig

    add_config_flags(p, ServingConfig.local_stack())
    p.add_argument("--online-compile", action=argparse.BooleanOptionalAction,
                   help="whether replicas may compile (--no-online-compile: install "
                   "from the store only, e.g. after `dynvm precompile`)")
    p.add_argument("--gpu-targets", metavar="cuda:NN,...",
                   help="GPU architectures the compile service builds Triton binaries for; "
                   "CUDA replicas install them without compiling (e.g. cuda:90,cuda:80)")
    from dynvm._serve_generate_cmd import add_generate_arguments

    add_generate_arguments(p)
    p.set_defaults(handler=serve_command)
