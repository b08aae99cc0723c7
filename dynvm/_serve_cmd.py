"""`dynvm serve MODEL.dvm`: the one-command embedded default of DESIGN.md's cluster.

It starts, in order, a local Ray (no dashboard), a private redis-server when the
environment names no Redis (dynvm.cluster.local_redis), the compile service, Serve's
HTTP proxy on loopback, and the model's replicas with their fleet links; prints the URL;
waits for SIGINT or SIGTERM; then stops what it started, in reverse order, and exits 0.

The kernel store's secret comes from DYNVM_STORE_SECRET when it is set (replicas of
another `dynvm serve`, or `dynvm precompile`, can then share the store). Otherwise it is
random for this run: nothing outside this run can read what it stores (nor needs to; the
private Redis dies with it). The secret travels inside the StoreConfig handed to the
actors and is never printed.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dynvm._env import (
    REDIS_URL,
    STORE_SECRET,
    EnvVarError,
    child_environment,
    export,
    store_settings,
)
from dynvm._run_cmd import CliError

if TYPE_CHECKING:
    from dynvm.cluster.config import BatchingOptions


@dataclass(frozen=True)
class ServeOptions:
    """What `dynvm serve` was asked for (its flags)."""

    model_path: str
    """The .dvm file the replicas load (made absolute: replicas are other processes)."""
    name: str
    """Model name in the v2 routes: /v2/models/<name>/infer."""
    port: int = 8000
    """HTTP port on 127.0.0.1."""
    replicas: int = 1
    """Fixed replica count (ignored when `max_replicas` is set)."""
    min_replicas: int | None = None
    """Autoscaling lower bound (with `max_replicas`)."""
    max_replicas: int | None = None
    """Autoscaling upper bound; set: Serve autoscales the model's deployment."""
    target_ongoing_requests: float = 2.0
    """Autoscaling: requests in flight per replica that trigger another replica."""
    online_compile: bool = True
    """False: replicas never compile (they install from the store, interpret the rest)."""
    device: str = "auto"
    """Replica device: "auto" (a GPU when Ray has one), "cpu", "cuda"."""
    num_cpus: float = 1.0
    """CPUs Ray reserves per replica."""
    call_seconds: float = 30.0
    """Budget of one VM call (Note [Call budget]): past it, the request gets a 500."""
    require_signed: bool = False
    """Replicas load the .dvm file only with a signature made with DYNVM_STORE_SECRET
    (Note [Signed programs]); needs that variable set."""
    gpu_targets: tuple = ()
    """GPU targets, e.g. (("cuda", 90, 32),): the compile service also builds Triton
    binaries for them, and CUDA replicas install those instead of compiling (Note [GPU
    replicas in the fleet]); CPU replicas ignore them."""
    batching: BatchingOptions | None = None
    """Request batching (Note [Opportunistic batching]): the --max-batch-size,
    --max-batch-delay-ms, --preferred-batch-sizes, --shape-aware-batching and
    --max-queued flags over BatchingOptions' defaults; None: the defaults."""


def options_from_args(args) -> ServeOptions:
    """`dynvm serve`'s flags, checked, as ServeOptions (CliError for a bad one)."""
    path = Path(args.file)
    if not path.is_file():
        raise CliError(f"cannot read {args.file}: no such file", 2)
    if (args.min_replicas is None) != (args.max_replicas is None):
        raise CliError("give both --min-replicas and --max-replicas (autoscaling), or "
                       "neither", 2)
    if args.max_replicas is not None and not 0 <= args.min_replicas <= args.max_replicas:
        raise CliError(f"--min-replicas {args.min_replicas} must be between 0 and "
                       f"--max-replicas {args.max_replicas}", 2)
    from dynvm.cluster.replica import check_model_name

    if not 0 < args.call_seconds < float("inf"):
        raise CliError(f"--call-seconds must be a finite number > 0, got {args.call_seconds}",
                       2)
    if args.require_signed and not child_environment().get(STORE_SECRET, "").strip():
        raise CliError(f"--require-signed checks the .dvm file's signature with "
                       f"{STORE_SECRET}, which is not set (sign the file with the same "
                       f"secret: dynvm.vm.dvm_signature.sign_file)", 2)
    name = args.name or path.stem
    try:
        check_model_name(name)
    except ValueError as exc:
        raise CliError(f"bad --name: {exc}", 2) from None
    batching = _batching_from_args(args)
    gpu_targets = _gpu_targets_from_args(args)
    return ServeOptions(model_path=str(path.resolve()), name=name, port=args.port,
                        replicas=args.replicas, min_replicas=args.min_replicas,
                        max_replicas=args.max_replicas,
                        target_ongoing_requests=args.target_ongoing_requests,
                        online_compile=args.online_compile, device=args.device,
                        num_cpus=args.num_cpus, call_seconds=args.call_seconds,
                        require_signed=args.require_signed, batching=batching,
                        gpu_targets=gpu_targets)


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


def _batching_from_args(args):
    """BatchingOptions from the batching flags that were given (None: all defaults)."""
    from dynvm.cluster.config import BatchingOptions

    changes = {}
    if args.max_batch_size is not None:
        changes["max_batch_size"] = args.max_batch_size
    if args.max_batch_delay_ms is not None:
        changes["max_delay_s"] = args.max_batch_delay_ms / 1000.0
    if args.preferred_batch_sizes is not None:
        try:
            changes["preferred_sizes"] = tuple(
                int(n) for n in args.preferred_batch_sizes.split(",") if n.strip())
        except ValueError:
            raise CliError(f"--preferred-batch-sizes takes integers separated by commas, "
                           f"got {args.preferred_batch_sizes!r}", 2) from None
    if args.shape_aware_batching is not None:
        changes["shape_aware"] = args.shape_aware_batching
    if args.max_queued is not None:
        changes["max_queued"] = args.max_queued
    if not changes:
        return None
    try:
        return BatchingOptions(**changes)
    except ValueError as exc:
        raise CliError(f"bad batching flag: {exc}", 2) from None


def _store_config(stack: contextlib.ExitStack, say):
    """The store: the environment's Redis, else a private redis-server (stopped by
    `stack`); the environment's secret, else a random one."""
    from dynvm.cluster.config import StoreConfig, StoreConfigError
    from dynvm.cluster.local_redis import LocalRedis, LocalRedisError

    env = child_environment()  # dynvm._env reads the environment; we fill in defaults
    if not env.get(STORE_SECRET, "").strip():
        env[STORE_SECRET] = secrets.token_hex(32)
    try:
        settings = store_settings(env)
        if settings.redis_url is not None:
            say(f"store     Redis from {REDIS_URL}")
            return StoreConfig.from_env(env)
    except (EnvVarError, StoreConfigError) as exc:
        raise CliError(str(exc), 2) from None
    try:
        local = LocalRedis().start()
    except LocalRedisError as exc:
        raise CliError(str(exc), 1) from None
    stack.callback(local.stop)
    say(f"store     private redis-server on 127.0.0.1:{local.port} (pid {local.pid})")
    return StoreConfig(secret=settings.secret.encode(), redis=local.config())


def _start(options: ServeOptions, stack: contextlib.ExitStack, say) -> None:
    import ray
    from ray import serve

    from dynvm.cluster.compile_service import (
        NAMESPACE,
        SERVICE_NAME,
        start_compile_service,
        stop_compile_service,
    )
    from dynvm.cluster.fleet_link import FleetOptions
    from dynvm.cluster.limits import ServingLimits
    from dynvm.cluster.proxy_guard import ProxyLimits
    from dynvm.cluster.replica import Autoscaling, serve_models
    from dynvm.jit.config import JitConfig

    store = _store_config(stack, say)
    proxy = ProxyLimits()
    # Serve's proxy takes dynvm's guard only from its environment, which Ray's
    # processes inherit from this one (Note [Limits at the proxy]).
    export(proxy.environment())
    ray.init(include_dashboard=False, log_to_driver=False)
    stack.callback(ray.shutdown)
    say(f"ray       local, {int(ray.cluster_resources().get('CPU', 0))} CPUs")
    start_compile_service(store, name=SERVICE_NAME, namespace=NAMESPACE,
                          gpu_targets=options.gpu_targets)
    stack.callback(stop_compile_service, SERVICE_NAME, NAMESPACE)
    say("compile   service started")
    serve.start(http_options=proxy.http_options("127.0.0.1", options.port))
    stack.callback(serve.shutdown)
    autoscaling = None
    if options.max_replicas is not None:
        autoscaling = Autoscaling(min_replicas=options.min_replicas,
                                  max_replicas=options.max_replicas,
                                  target_ongoing_requests=options.target_ongoing_requests)
    serve_models({options.name: options.model_path}, device=options.device,
                 jit=JitConfig(online_compile=options.online_compile),
                 num_replicas=options.replicas, num_cpus=options.num_cpus,
                 batch_options=options.batching,
                 fleet=FleetOptions(store, SERVICE_NAME, NAMESPACE,
                                    gpu_targets=options.gpu_targets),
                 autoscaling=autoscaling,
                 limits=ServingLimits(call_seconds=options.call_seconds,
                                      require_signed_programs=options.require_signed))


def _hint(options: ServeOptions) -> str:
    base = f"http://127.0.0.1:{options.port}"
    model = f"{base}/v2/models/{options.name}"
    return f"""\
serving   {options.name} at {model}
  curl {base}/v2/health/ready
  curl {model}                  # inputs, datatypes, shapes (-1: dynamic)
  curl -X POST {model}/infer -H 'Content-Type: application/json' -d '{{"inputs": [...]}}'
  curl {model}/stats            # runtime and fleet counters
  python: tritonclient.http.InferenceServerClient("127.0.0.1:{options.port}")
Ctrl-C stops everything."""


def serve_command(args) -> int:
    """Run `dynvm serve` until SIGINT or SIGTERM; returns the exit status."""
    options = options_from_args(args)
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()

    def say(line: str) -> None:
        print(line, flush=True)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.ExitStack() as stack:
            try:
                _start(options, stack, say)
            except CliError:
                raise
            except Exception as exc:  # Ray or Serve failed to start: say what, then unwind
                raise CliError(f"serve failed to start: {type(exc).__name__}: {exc}") \
                    from None
            if not stop.is_set():
                say(_hint(options))
            while not stop.wait(0.5):
                pass
            say("stopping  (serve, compile service, ray, redis)")
        say("stopped")
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def add_parser(sub) -> None:
    """Add the `serve` subcommand to the CLI's subparsers."""
    p = sub.add_parser("serve", help="serve a .dvm file over HTTP (local Ray, Redis, compile "
                       "service)", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="""\
Serve a program over the Open Inference Protocol (KServe v2) on 127.0.0.1: a local Ray,
a private redis-server as the kernel store (unless DYNVM_REDIS_URL names one), the
compile service, and the model's replicas, which share every compiled kernel. Prints
the URL; Ctrl-C (or SIGTERM) stops everything it started.

  dynvm compile recommender -o rec.dvm && dynvm serve rec.dvm --replicas 2""")
    p.add_argument("file", metavar="MODEL.dvm")
    p.add_argument("--name", help="model name in the routes (default: the file's stem)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="fixed replica count (default 1)")
    p.add_argument("--min-replicas", type=int, metavar="A", help="autoscale from A ...")
    p.add_argument("--max-replicas", type=int, metavar="B", help="... up to B replicas")
    p.add_argument("--target-ongoing-requests", type=float, default=2.0, metavar="R",
                   help="autoscaling: requests in flight per replica (default 2)")
    p.add_argument("--online-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="whether replicas may compile (--no-online-compile: install "
                   "from the store only, e.g. after `dynvm precompile`)")
    p.add_argument("--device", default="auto", help="replica device (default auto)")
    p.add_argument("--num-cpus", type=float, default=1.0, metavar="C",
                   help="CPUs reserved per replica (default 1)")
    p.add_argument("--call-seconds", type=float, default=30.0, metavar="S",
                   help="budget of one model call: a call still looping after S seconds "
                   "stops and its request gets a 500 (default 30)")
    p.add_argument("--require-signed", action="store_true",
                   help="load the .dvm file only if MODEL.dvm.sig holds its signature "
                   "with DYNVM_STORE_SECRET (dynvm.vm.dvm_signature.sign_file)")
    p.add_argument("--gpu-targets", metavar="cuda:NN,...",
                   help="GPU architectures the compile service builds Triton binaries for; "
                   "CUDA replicas install them without compiling (e.g. cuda:90,cuda:80)")
    batching = p.add_argument_group(
        "batching", "Note [Opportunistic batching]: a request that finds the model idle "
        "runs at once; requests arriving while it is busy form the next batch")
    batching.add_argument("--max-batch-size", type=int, metavar="N",
                          help="requests per batch at most (default 8)")
    batching.add_argument("--max-batch-delay-ms", type=float, metavar="MS",
                          help="longest hold of a batch of two or more for one more request "
                          "that reaches a preferred size; a lone request is never held "
                          "(default 2)")
    batching.add_argument("--preferred-batch-sizes", metavar="N,N,...",
                          help="row counts batches aim for, e.g. the precompiled ones")
    batching.add_argument("--shape-aware-batching", action=argparse.BooleanOptionalAction,
                          default=None, help="prefer batch sizes that ran specialized "
                          "(default on)")
    batching.add_argument("--max-queued", type=int, metavar="N",
                          help="requests waiting for the model at most; more get 503 + "
                          "Retry-After (default 64)")
    p.set_defaults(handler=serve_command)
