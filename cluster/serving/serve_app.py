"""Application builders for Ray Serve config files (`serve run` / `serve deploy`, KubeRay's
RayService): deploy/serve_config.yaml names them by import path.

    dynvm.cluster.serving.serve_app:build_model_app    one model, route prefix /v2/models/<name>
    dynvm.cluster.serving.serve_app:build_server_app   /v2, /v2/health/*, 404 for unknown models

A model application's `args` are `name`, `path`, `service_num_cpus`, `service_shards` and
the fields of `ServingConfig` (dynvm.cluster.serving.serving_config; `batching`, `limits`,
`autoscaling` and `jit` as mappings of their own fields), read by `ServingConfig.from_mapping`; the
kernel store comes from the environment (`StoreConfig.from_env`: DYNVM_STORE_SECRET,
DYNVM_REDIS_URL, ...; dynvm._env reads them). Serve calls a builder inside the cluster,
where Ray is up: the model builder also starts the compile service (or finds it: the
actor is named and detached, one per cluster), so a config file is all a cluster needs.

`ingress: direct` (Note [Direct ingress] in dynvm.cluster.protocol.ingress) needs the cluster
started with `ingress_environment("direct")` on every node; Serve deploys a config
file's applications after the builders return, so nothing here can check it: each
application's replica port is then in Serve's target groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dynvm.cluster.protocol._http_front import check_model_name
from dynvm.cluster.serving.serving_config import ServingConfig
from dynvm.vm.errors import ConfigError


@dataclass(frozen=True)
class ModelAppArgs:
    """`args` of a model application in a Serve config file."""

    name: str
    """Model name in the routes; the application's route_prefix must be /v2/models/<name>."""
    path: str
    """The .dvm file, readable on every node that may run a replica."""
    serving: ServingConfig
    """Every other arg: how the model is served."""
    service_num_cpus: float = 0.0
    """CPUs reserved for each compile service actor."""
    service_shards: int = 1
    """Compile service actors; each program goes to one by its hash (Note [Compile
    service shards])."""

    @classmethod
    def from_args(cls, args: Mapping) -> ModelAppArgs:
        """Checked `args` (unknown keys name the known ones)."""
        missing = [k for k in ("name", "path") if k not in args]
        if missing:
            raise ConfigError(f"dynvm model app args need {missing[0]!r}")
        own = {"name", "path", "service_num_cpus", "service_shards"}
        serving = ServingConfig.from_mapping({k: v for k, v in args.items() if k not in own})
        return cls(name=check_model_name(args["name"]), path=str(args["path"]),
                   serving=serving,
                   service_num_cpus=float(args.get("service_num_cpus", cls.service_num_cpus)),
                   service_shards=_shards(args.get("service_shards", cls.service_shards)))


def _shards(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"service_shards must be an integer >= 1, got {value!r}")
    return value


def build_model_app(args: Mapping):
    """The Serve application of one model (config `args`: see the module docstring)."""
    from dynvm.cluster.fleet._link import FleetOptions
    from dynvm.cluster.fleet.compile_service import NAMESPACE, SERVICE_NAME, start_compile_service
    from dynvm.cluster.serving._deployment import model_application
    from dynvm.cluster.store._store_config import StoreConfig

    options = ModelAppArgs.from_args(args)
    store = StoreConfig.from_env()
    start_compile_service(store, name=SERVICE_NAME, namespace=NAMESPACE,
                          num_cpus=options.service_num_cpus, shards=options.service_shards)
    return model_application(options.name, options.path, options.serving,
                             fleet=FleetOptions(store, SERVICE_NAME, NAMESPACE,
                                                service_shards=options.service_shards))


def build_server_app(args: Mapping):
    """The /v2 application (config `args`: {"models": [names]}, every model app's name)."""
    from dynvm.cluster.serving._server_front import ServerFront

    models = args.get("models")
    if not isinstance(models, list) or not models:
        raise ConfigError("dynvm server app args need 'models': the list of model names")
    unknown = sorted(set(args) - {"models"})
    if unknown:
        raise ConfigError(f"unknown dynvm server app arg {unknown[0]!r}; known: models")
    return ServerFront.bind([check_model_name(m) for m in models])
