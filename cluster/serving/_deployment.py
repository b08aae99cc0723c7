"""Deployment builders: Serve's start-up and the bound applications of dynvm models, all
from one `ServingConfig` (dynvm.cluster.serving.serving_config). `dynvm serve`, the `serve run`
builders (dynvm.cluster.serving.serve_app) and Python callers (`dynvm.cluster.serve_models`)
end here.
"""

from __future__ import annotations

from collections.abc import Mapping

from ray import serve
from ray.serve.api import RunTarget

from dynvm.cluster.protocol._http_front import SERVER_APP, check_model_name, model_app_name
from dynvm.cluster.protocol.grpc_v2 import grpc_options
from dynvm.cluster.protocol.ingress import direct_addresses
from dynvm.cluster.protocol.proxy_guard import ProxyLimits
from dynvm.cluster.serving._replica import ModelReplica
from dynvm.cluster.serving._server_front import ServerFront
from dynvm.cluster.serving.serving_config import ServingConfig
from dynvm.vm.errors import ConfigError

# Note [Replica on Serve's loop]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Ray Serve runs a replica's user code on an event loop of its own thread by default, so
# that a handler that blocks cannot stall the replica's system loop (health checks, the
# request stream back to the proxy); every request then crosses between the two loops
# (run_coroutine_threadsafe in, call_soon_threadsafe for each response message out). A
# dynvm replica never blocks its loop: bodies are decoded on the parse threads and the
# model runs on the batcher's worker (Note [Lean request path]). Its replicas run their
# code on Serve's own loop instead (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 in the
# replica's environment, read when Serve starts in that process; Serve's "throughput
# optimized" mode sets the same), and without Serve's per-request access log line
# (`ServingConfig.access_log`: the replica's own counters and Prometheus series count
# every request). Measured (issue 17, recommender, JSON, 8 clients, one replica of each
# variant in one cluster, 4 alternating 6 s runs, load 13-20): 191 req/s and 3.49 ms of
# replica CPU per request against 156 req/s and 3.93 ms with Serve's defaults.
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}

# Note [Replica drain]
# ~~~~~~~~~~~~~~~~~~~~
# A replica that Serve stops (scale-down, redeploy, `serve.shutdown`, hence `dynvm
# serve` on SIGTERM) drains as Serve 2.60 drains any replica (serve/_private/
# replica.py, `_perform_graceful_shutdown`, read and measured): it stops getting new
# requests from the proxy and handles, its Serve health check says DRAINING, in direct
# ingress its own port keeps answering for the draining period (ingress.DRAIN_S under
# `dynvm serve`, Serve's 30 s default elsewhere: a load balancer's time to notice) and
# then closes (a new connection is refused); its in-flight requests finish, then its
# destructor runs. The whole drain is bounded by the deployment's
# graceful_shutdown_timeout_s, ServingConfig.drain_s here (Serve raises it to the
# draining period + 5 s for an ingress in direct ingress); past it the controller kills
# the replica. Serve checks for in-flight requests every graceful_shutdown_wait_loop_s,
# 2 s by default, first after sleeping that long: DRAIN_POLL_S makes an idle replica
# stop in a fraction of a second instead. The deploy/ manifests give pods a grace
# period above drain_s.
DRAIN_POLL_S = 0.2


def drain_options(config: ServingConfig) -> dict:
    """A deployment's Serve options for its drain (Note [Replica drain])."""
    return {"graceful_shutdown_timeout_s": config.drain_s,
            "graceful_shutdown_wait_loop_s": min(DRAIN_POLL_S, config.drain_s)}


def start_serve(host: str, port: int, proxy: ProxyLimits | None = None,
                grpc_port: int | None = None) -> None:
    """Start Serve's HTTP proxy on host:port with dynvm's proxy guard (Note [Limits at
    the proxy]); the one place Serve's start-up options are built. Ray must be up, with
    `proxy.environment()` exported before it started. `grpc_port`: Serve's gRPC proxy
    too, serving the v2 gRPC protocol (dynvm.cluster.protocol.grpc_v2) on that port of every
    interface (Serve binds no other); None: HTTP only."""
    proxy = proxy if proxy is not None else ProxyLimits()
    serve.start(http_options=proxy.http_options(host, port),
                grpc_options=grpc_options(grpc_port) if grpc_port is not None else None)


def model_application(name: str, path, config: ServingConfig | None = None, **changes):
    """The bound Serve deployment of one model, served with `config` (default
    ServingConfig()) with `changes` (ServingConfig field names) applied, its replicas on
    Serve's own event loop (Note [Replica on Serve's loop]). Ray must be initialized."""
    import ray

    check_model_name(name)
    config = (config if config is not None else ServingConfig()).replace(**changes)
    num_gpus = config.num_gpus
    if num_gpus is None:
        num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    scaling = ({"autoscaling_config": config.autoscaling.as_serve_config()}
               if config.autoscaling is not None else {"num_replicas": config.num_replicas})
    return ModelReplica.options(
        name=f"ModelReplica-{name}",
        max_ongoing_requests=max(256, 4 * config.batching.max_batch_size),
        ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": num_gpus,
                           "runtime_env": {"env_vars": REPLICA_ENV}},
        logging_config={"enable_access_log": config.access_log},
        **drain_options(config), **scaling,
    ).bind(name, str(path), config)


def serve_models(models: Mapping[str, str], config: ServingConfig | None = None, *,
                 per_model: Mapping[str, ServingConfig] | None = None, **changes) -> dict:
    """Deploy one Serve application per model (route prefix /v2/models/<name>) plus the
    server application (route prefix /v2). Serve must already be started (`start_serve`).

    Every model is served with `config` (default ServingConfig()) with `changes`
    (ServingConfig field names, e.g. device="cpu") applied; a model named in `per_model`
    with that config instead (e.g. batching off for a model whose rows are not
    independent, Note [Request batching]). With `fleet`, start the compile service first
    (`start_compile_service`). With `ingress="direct"` (the same in every config), waits
    for every application's replica port and raises ConfigError when the cluster is not
    in direct ingress (Note [Direct ingress]). Returns {app name: DeploymentHandle}.
    """
    config = (config if config is not None else ServingConfig()).replace(**changes)
    per_model = per_model or {}
    unknown = sorted(set(per_model) - set(models))
    if unknown:
        raise ConfigError(f"per_model names {unknown[0]!r}, which is not among the models")
    ingress = _one_ingress([config, *per_model.values()])
    targets = [RunTarget(model_application(name, path, per_model.get(name, config)),
                         name=model_app_name(name), route_prefix=f"/v2/models/{name}")
               for name, path in models.items()]
    targets.append(RunTarget(ServerFront.options(**drain_options(config)).bind(list(models)),
                             name=SERVER_APP, route_prefix="/v2"))
    # All applications deploy at once (in parallel); returns when all are running.
    handles = serve.run_many(targets)
    if ingress == "direct":  # the cluster must be in that mode (Note [Direct ingress])
        direct_addresses(target.name for target in targets)
    return {target.name: handle for target, handle in zip(targets, handles, strict=True)}


def _one_ingress(configs: list[ServingConfig]) -> str:
    """The `ingress` every config names (Serve has one mode per cluster), else
    ConfigError."""
    modes = sorted({c.ingress for c in configs})
    if len(modes) > 1:
        raise ConfigError(f"every model of one Serve has the same ingress (one mode per "
                          f"Ray cluster), got {', '.join(modes)}")
    return modes[0]
