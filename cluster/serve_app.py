"""Application builders for Ray Serve config files (`serve run` / `serve deploy`, KubeRay's
RayService): deploy/serve_config.yaml names them by import path.

    dynvm.cluster.serve_app:build_model_app    one model, route prefix /v2/models/<name>
    dynvm.cluster.serve_app:build_server_app   /v2, /v2/health/*, 404 for unknown models

They build the same deployments as `serve_models` (dynvm.cluster.replica), from the
config's `args` plus the kernel store of the environment (`StoreConfig.from_env`:
DYNVM_STORE_SECRET, DYNVM_REDIS_URL, ...; dynvm._env reads them). Serve calls a builder
inside the cluster, where Ray is up: the model builder also starts the compile service
(or finds it: the actor is named and detached, one per cluster), so a config file is all
a cluster needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from dynvm.cluster import v2_protocol as v2
from dynvm.cluster.config import BatchingOptions

_AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "target_ongoing_requests",
                     "upscale_delay_s", "downscale_delay_s")


@dataclass(frozen=True)
class ModelAppArgs:
    """`args` of a model application in a Serve config file."""

    name: str
    """Model name in the routes; the application's route_prefix must be /v2/models/<name>."""
    path: str
    """The .dvm file, readable on every node that may run a replica."""
    device: str = "auto"
    """"auto": a GPU when the cluster has GPUs (one per replica), else the CPU."""
    online_compile: bool = True
    """False: replicas never compile; they install from the store (fill it with `dynvm
    precompile`) and interpret the rest."""
    max_batch_size: int = BatchingOptions.max_batch_size
    """Requests batched into one VM call at most (Note [Request batching])."""
    batch_wait_timeout_s: float = BatchingOptions.max_delay_s
    """Longest hold of a batch of two or more for one more request that would reach a
    preferred size (BatchingOptions.max_delay_s); a lone request is never held."""
    preferred_batch_sizes: tuple[int, ...] = ()
    """Row counts batches aim for besides the specialized ones
    (BatchingOptions.preferred_sizes)."""
    batching: bool = True
    """Off for models whose rows are not independent."""
    max_body_bytes: int = v2.DEFAULT_MAX_BODY_BYTES
    """Largest accepted request body."""
    num_replicas: int = 1
    """Fixed replica count, when `autoscaling` is not given."""
    num_cpus: float = 1.0
    """CPUs per replica."""
    num_gpus: float | None = None
    """GPUs per replica; None: 1 when the cluster has GPUs, else 0."""
    autoscaling: Mapping | None = None
    """Serve autoscaling: min_replicas, max_replicas, target_ongoing_requests,
    upscale_delay_s, downscale_delay_s (dynvm.cluster.replica.Autoscaling)."""
    service_num_cpus: float = 0.0
    """CPUs reserved for the compile service actor."""

    @classmethod
    def from_args(cls, args: Mapping) -> ModelAppArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown dynvm model app arg {unknown[0]!r}; known: "
                             f"{', '.join(sorted(known))}")
        missing = [k for k in ("name", "path") if k not in args]
        if missing:
            raise ValueError(f"dynvm model app args need {missing[0]!r}")
        made = cls(**args)
        if made.autoscaling is not None:
            bad = sorted(set(made.autoscaling) - set(_AUTOSCALING_KEYS))
            if bad:
                raise ValueError(f"unknown autoscaling key {bad[0]!r}; known: "
                                 f"{', '.join(_AUTOSCALING_KEYS)}")
        return made


def build_model_app(args: Mapping):
    """The Serve application of one model (config `args`: ModelAppArgs' fields)."""
    from dynvm.cluster.compile_service import NAMESPACE, SERVICE_NAME, start_compile_service
    from dynvm.cluster.config import StoreConfig
    from dynvm.cluster.fleet_link import FleetOptions
    from dynvm.cluster.replica import Autoscaling, check_model_name, model_application
    from dynvm.jit.config import JitConfig

    options = ModelAppArgs.from_args(args)
    check_model_name(options.name)
    store = StoreConfig.from_env()
    start_compile_service(store, name=SERVICE_NAME, namespace=NAMESPACE,
                          num_cpus=options.service_num_cpus)
    return model_application(
        options.name, options.path, device=options.device,
        jit=JitConfig(online_compile=options.online_compile),
        batch_options=BatchingOptions(max_batch_size=options.max_batch_size,
                                      max_delay_s=options.batch_wait_timeout_s,
                                      preferred_sizes=tuple(options.preferred_batch_sizes)),
        batching=options.batching,
        max_body_bytes=options.max_body_bytes, num_replicas=options.num_replicas,
        num_cpus=options.num_cpus, num_gpus=options.num_gpus,
        fleet=FleetOptions(store, SERVICE_NAME, NAMESPACE),
        autoscaling=Autoscaling(**options.autoscaling)
        if options.autoscaling is not None else None)


def build_server_app(args: Mapping):
    """The /v2 application (config `args`: {"models": [names]}, every model app's name)."""
    from dynvm.cluster.replica import ServerFront, check_model_name

    models = args.get("models")
    if not isinstance(models, list) or not models:
        raise ValueError("dynvm server app args need 'models': the list of model names")
    unknown = sorted(set(args) - {"models"})
    if unknown:
        raise ValueError(f"unknown dynvm server app arg {unknown[0]!r}; known: models")
    return ServerFront.bind([check_model_name(m) for m in models])
