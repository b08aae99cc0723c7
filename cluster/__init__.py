"""dynvm.cluster: serving dynvm programs on Ray Serve, the kernel store (Redis or a local
directory) and signed artifacts.

Serving: `serve_models({name: path}, ServingConfig(...))` after `start_serve(host,
port)`; `ServingConfig` (dynvm.cluster.serving_config) holds every setting. Internals
live in `_`-prefixed modules. The serving names load lazily (PEP 562): importing
`dynvm.cluster.config` does not load Ray Serve.

Ray Serve replicas and the compile service share compiled kernels through a
`KernelStore`; `ArtifactCache` seals what is published and verifies what is fetched
(Note [Signed artifacts] in dynvm.cluster.signed). Configuration comes from
`StoreConfig.from_env()` (dynvm.cluster.config).
"""

import importlib

from dynvm.cluster.config import StoreConfig, StoreConfigError
from dynvm.cluster.signed import (
    FORMAT_VERSION,
    ArtifactCache,
    CorruptArtifact,
    ForgedArtifact,
    IncompatibleArtifact,
    RejectedArtifact,
    UnsignedArtifact,
    artifact_fields,
    artifact_from_fields,
    open_sealed,
    seal,
)
from dynvm.cluster.store_base import (
    InvalidKey,
    KernelStore,
    StoreError,
    StoreStats,
    StoreUnavailable,
    check_key,
)
from dynvm.cluster.store_local import LocalDirStore
from dynvm.cluster.store_redis import RedisConfig, RedisStore

# Serving API name -> its module, imported on first use (Ray Serve, FastAPI, torch).
_SERVING = {
    "Autoscaling": "dynvm.cluster.serving_config",
    "BatchingOptions": "dynvm.cluster.serving_config",
    "ServingConfig": "dynvm.cluster.serving_config",
    "ServingLimits": "dynvm.cluster.limits",
    "ProxyLimits": "dynvm.cluster.proxy_guard",
    "ModelReplica": "dynvm.cluster.replica",
    "ServerFront": "dynvm.cluster.server_front",
    "model_application": "dynvm.cluster._deployment",
    "serve_models": "dynvm.cluster._deployment",
    "start_serve": "dynvm.cluster._deployment",
    "serve_local": "dynvm.cluster.local_stack",
    "KernelKeeper": "dynvm.cluster.kernel_keeper",
    "keep_kernels": "dynvm.cluster.kernel_keeper",
}


def __getattr__(name: str):
    module = _SERVING.get(name)
    if module is None:
        raise AttributeError(f"module 'dynvm.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "FORMAT_VERSION",
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
    "artifact_fields",
    "artifact_from_fields",
    "check_key",
    "open_sealed",
    "seal",
    *_SERVING,
]
