"""dynvm.cluster: the kernel store (Redis or a local directory) and signed artifacts.

Ray Serve replicas and the compile service share compiled kernels through a
`KernelStore`; `ArtifactCache` seals what is published and verifies what is fetched
(Note [Signed artifacts] in dynvm.cluster.signed). Configuration comes from
`StoreConfig.from_env()` (dynvm.cluster.config).
"""

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

__all__ = [
    "FORMAT_VERSION",
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
]
