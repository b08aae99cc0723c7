"""dynvm.cluster: serving dynvm programs on Ray Serve, the compile fleet and the kernel
store (Redis or a local directory) with signed artifacts.

Its floors, one subpackage each, and what each may import of the others
(tests/dynvm/test_layering.py checks it; `_counters`, the typed counters, is a leaf for
all of them):

    store/     the kernel store (Redis, a local directory), sealed entries, StoreConfig
    fleet/     the compile service, announcements, program index, kept kernels  (store/)
    protocol/  the wire: v2 HTTP/JSON/binary, gRPC, proxy guard, ingress, and the
               transport-neutral seam a replica implements (_seam)
    serving/   replicas, execution, batching, deployment, config, process life
               (store/, fleet/, protocol/)

Serving: `serve_models({name: path}, ServingConfig(...))` after `start_serve(host,
port)`, or `serve_local(...)` for the whole local stack; `ServingConfig`
(dynvm.cluster.serving.serving_config) holds every setting. Internals live in
`_`-prefixed modules; a module without the prefix is one a user names directly (a Serve
config's import_path, a Serve gRPC servicer, the proxy callback). The serving names load
lazily (PEP 562): importing `dynvm.cluster` or any `dynvm.cluster.store` module does not
load Ray Serve.

Ray Serve replicas and the compile service share compiled kernels through a
`KernelStore`; `ArtifactCache` seals what is published and verifies what is fetched
(Note [Signed artifacts] in dynvm.cluster.store._signed). Configuration comes from
`StoreConfig.from_env()`.
"""

import importlib

from dynvm.cluster.store._base import (
    InvalidKey,
    KernelStore,
    StoreError,
    StoreStats,
    StoreUnavailable,
)
from dynvm.cluster.store._local import LocalDirStore
from dynvm.cluster.store._redis import RedisConfig, RedisStore
from dynvm.cluster.store._signed import (
    ArtifactCache,
    CorruptArtifact,
    ForgedArtifact,
    IncompatibleArtifact,
    RejectedArtifact,
    UnsignedArtifact,
)
from dynvm.cluster.store._store_config import StoreConfig, StoreConfigError

# Serving API name -> its module, imported on first use (Ray Serve, FastAPI, torch).
_SERVING = {
    "Autoscaling": "dynvm.cluster.serving.serving_config",
    "BatchingOptions": "dynvm.cluster.serving.serving_config",
    "ServingConfig": "dynvm.cluster.serving.serving_config",
    "ServingLimits": "dynvm.cluster.serving._limits",
    "ProxyLimits": "dynvm.cluster.protocol.proxy_guard",
    "ModelReplica": "dynvm.cluster.serving._replica",
    "ServerFront": "dynvm.cluster.serving._server_front",
    "model_application": "dynvm.cluster.serving._deployment",
    "serve_models": "dynvm.cluster.serving._deployment",
    "start_serve": "dynvm.cluster.serving._deployment",
    "serve_local": "dynvm.cluster.serving._local_stack",
    "KernelKeeper": "dynvm.cluster.fleet._kernel_keeper",
    "keep_kernels": "dynvm.cluster.fleet._kernel_keeper",
}


def __getattr__(name: str):
    module = _SERVING.get(name)
    if module is None:
        raise AttributeError(f"module 'dynvm.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "KernelKeeper",
    "keep_kernels",
    "ArtifactCache",
    "CorruptArtifact",
    "ForgedArtifact",
    "IncompatibleArtifact",
    "InvalidKey",
    "KernelStore",
    "LocalDirStore",
    "RedisConfig",
    "RedisStore",
    "RejectedArtifact",
    "StoreConfig",
    "StoreConfigError",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "UnsignedArtifact",
    *_SERVING,
]
