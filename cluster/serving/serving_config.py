"""`ServingConfig`: everything a model deployment is served with, in one frozen dataclass
(vLLM's `VllmConfig` is the model: sub-configs nested, a docstring per field, the
defaults stated once, here).

    config = ServingConfig(device="cpu", batching=BatchingOptions(max_batch_size=16))
    serve_models({"rec": "/models/rec.dvm"}, config)

`ModelReplica`, `model_application`, `serve_models`, the `serve run` builder
(dynvm.cluster.serving.serve_app, which reads a config file's `args` with `from_mapping`) and
`dynvm serve` (its flags, one per field, Note [Flags from config fields] in
dynvm.cluster.serving._config_flags) all consume it; none of them holds a default of its own. A
stack that starts its own Ray (`dynvm serve`) starts from `ServingConfig.local_stack()`,
whose one difference is stated there, and serves HTTP on HTTP_PORT unless told otherwise
(`dynvm top` looks there too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynvm.cluster.protocol._v2 import DEFAULT_MAX_BODY_BYTES
from dynvm.cluster.protocol.ingress import Ingress, check_ingress
from dynvm.cluster.serving._config_flags import cli
from dynvm.cluster.serving._limits import ServingLimits
from dynvm.jit.config import JitConfig
from dynvm.vm.errors import ConfigError, ConfigTypeError

if TYPE_CHECKING:
    from dynvm.cluster.fleet._link import FleetOptions

HTTP_PORT = 8000
"""Serve's HTTP port when nothing names one (`dynvm serve --port`, `dynvm top`'s URL):
Serve's own default."""


@dataclass(frozen=True)
class BatchingOptions:
    """How a model replica batches requests (Note [Opportunistic batching] in
    dynvm.cluster.serving._batcher; Note [Request batching] in dynvm.cluster.serving._replica)."""

    enabled: bool = field(default=True, metadata=cli("--batching"))
    """False for a model whose rows are not independent (Note [Request batching]): every
    request is its own VM call."""
    max_batch_size: int = 8
    """Requests in one batch at most."""
    max_batch_bytes: int = 16 * 1024 * 1024
    """Input bytes in one batch at most (a request larger than this runs alone)."""
    max_delay_s: float = field(default=0.002,
                               metadata=cli("--max-batch-delay-ms", scale=0.001, unit="ms"))
    """Longest a formed batch of two or more requests is held for one more request when
    that would reach a preferred size; a lone request is never held, and a request that
    finds the model idle runs at once. 0: never hold."""
    preferred_sizes: tuple[int, ...] = field(default=(), metadata=cli("--preferred-batch-sizes"))
    """Batch sizes (rows along dim 0) to aim for, besides those the JIT has specialized
    (`shape_aware`), e.g. the sizes `dynvm precompile` filled the store with."""
    shape_aware: bool = field(default=True, metadata=cli("--shape-aware-batching"))
    """Prefer batches whose row count ran specialized before: take fewer requests (the
    rest form the next batch) rather than make a row count that would be interpreted."""
    max_queued: int = 64
    """Requests waiting for the model at most; one more is answered 503 + Retry-After."""
    inline_run_s: float = 0.002
    """A batch whose row count last ran in at most this many seconds runs on the replica's
    event loop instead of the batcher's worker thread (Note [Inline fast batches] in
    dynvm.cluster.serving._batcher). 0: always on the worker thread."""

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_bytes", "max_queued"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"BatchingOptions.{name} must be an integer >= 1, "
                                 f"got {value!r}")
        if not (isinstance(self.max_delay_s, int | float) and math.isfinite(self.max_delay_s)
                and 0 <= self.max_delay_s <= 1):
            raise ConfigError(f"BatchingOptions.max_delay_s must be between 0 and 1 s, "
                             f"got {self.max_delay_s!r}")
        if not (isinstance(self.inline_run_s, int | float)
                and math.isfinite(self.inline_run_s) and 0 <= self.inline_run_s <= 0.05):
            raise ConfigError(f"BatchingOptions.inline_run_s must be between 0 and 0.05 s, "
                             f"got {self.inline_run_s!r}")
        sizes = tuple(self.preferred_sizes)
        if any(type(n) is not int or n < 1 for n in sizes):
            raise ConfigError(f"BatchingOptions.preferred_sizes must be integers >= 1, "
                             f"got {self.preferred_sizes!r}")
        object.__setattr__(self, "preferred_sizes", tuple(sorted(set(sizes))))


@dataclass(frozen=True)
class Autoscaling:
    """Ray Serve autoscaling of each model's deployment."""

    min_replicas: int = 1
    """Never fewer replicas than this."""
    max_replicas: int = 4
    """Never more replicas than this."""
    target_ongoing_requests: float = 2.0
    """Serve adds replicas when requests in flight per replica exceed this."""
    upscale_delay_s: float = 3.0
    """How long load must stay above target before a replica is added."""
    downscale_delay_s: float = 30.0
    """How long load must stay below target before a replica is removed."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ConfigError(f"Autoscaling needs 0 <= min_replicas <= max_replicas, max >= 1; "
                             f"got {self.min_replicas}..{self.max_replicas}")
        if self.target_ongoing_requests <= 0:
            raise ConfigError("Autoscaling.target_ongoing_requests must be > 0")

    def as_serve_config(self) -> dict:
        """Serve's `autoscaling_config` of a deployment."""
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.min_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "metrics_interval_s": 0.5, "look_back_period_s": 2.0}


@dataclass(frozen=True)
class ServingConfig:
    """How one model is served: device, JIT, batching, limits, scaling and fleet."""

    device: str = "auto"
    """"auto": the GPU Ray assigned the replica when the cluster has GPUs, else the CPU;
    or "cpu", "cuda"."""
    jit: bool | JitConfig = True
    """The replica's JIT: True (the defaults), False (interpreter only) or a JitConfig
    (e.g. JitConfig(online_compile=False): install from the store, never compile)."""
    batching: BatchingOptions = field(default_factory=BatchingOptions)
    """Request batching (Note [Opportunistic batching])."""
    limits: ServingLimits = field(default_factory=ServingLimits)
    """Per-request bounds: call budget, requests in flight, parse threads, ..."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest request body a replica accepts (the proxy's own bound may be higher)."""
    num_replicas: int = field(default=1, metadata=cli("--replicas"))
    """Fixed replica count, when `autoscaling` is None."""
    autoscaling: Autoscaling | None = None
    """Serve autoscales each model's deployment between these bounds (`num_replicas` is
    then ignored)."""
    num_cpus: float = 1.0
    """CPUs Ray reserves per replica."""
    num_gpus: float | None = None
    """GPUs per replica; None: 1 when the Ray cluster has GPUs, else 0."""
    drain_s: float = field(default=5.0, metadata=cli("--drain-seconds"))
    """How long a replica that Serve stops (`dynvm serve` on SIGTERM/SIGINT, a
    scale-down, a redeploy) may take to finish its in-flight requests before it is
    stopped anyway (Serve's graceful_shutdown_timeout_s; Note [Replica drain] in
    dynvm.cluster.serving._deployment). Set a pod's terminationGracePeriodSeconds above it."""
    access_log: bool = False
    """Serve's access log line per request in the replica's log (off: the replica's own
    counters and metrics count requests; Note [Replica on Serve's loop])."""
    ingress: Ingress = "proxy"
    """How HTTP requests reach the replicas (Note [Direct ingress] in
    dynvm.cluster.protocol.ingress): "proxy", through Serve's HTTP proxy at one address; "direct",
    straight into each replica at its own port. Serve's mode is one per Ray cluster, set
    by the environment Ray starts with (`ingress_environment`); deploying checks that the
    cluster is in the mode named here, so every model of one Serve names the same."""
    fleet: FleetOptions | None = None
    """Share compiled specializations through the compile service and the kernel store
    (dynvm.cluster.fleet._link); None: each replica compiles alone."""

    def __post_init__(self) -> None:
        if type(self.max_body_bytes) is not int or self.max_body_bytes < 1:
            raise ConfigError(f"ServingConfig.max_body_bytes must be an integer >= 1, "
                             f"got {self.max_body_bytes!r}")
        if type(self.num_replicas) is not int or self.num_replicas < 1:
            raise ConfigError(f"ServingConfig.num_replicas must be an integer >= 1, "
                             f"got {self.num_replicas!r}")
        if not (isinstance(self.drain_s, int | float) and math.isfinite(self.drain_s)
                and 0 < self.drain_s <= 600):
            raise ConfigError(f"ServingConfig.drain_s must be between 0 and 600 s, "
                             f"got {self.drain_s!r}")
        check_ingress(self.ingress)
        for name, kind in (("batching", BatchingOptions), ("limits", ServingLimits)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigTypeError(f"ServingConfig.{name} must be a {kind.__name__}, "
                                f"got {type(getattr(self, name)).__name__}")

    @classmethod
    def local_stack(cls, **changes) -> ServingConfig:
        """The config of a stack that starts its own Ray (`dynvm serve`): the defaults,
        but in direct ingress. Such a stack sets Serve's ingress mode for its cluster, and
        direct measured 8.1-11.1x the proxy's requests/s (recommender, JSON, 8 clients;
        1.7-2.3x on the transformer; Note [Direct ingress] in dynvm.cluster.protocol.ingress),
        while every route still answers through the proxy. `ingress` itself defaults to
        "proxy": the mode of a cluster started without Serve's variable."""
        return cls(**{"ingress": "direct", **changes})

    def replace(self, **changes) -> ServingConfig:
        """A copy with these fields changed (their names are ServingConfig's)."""
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def from_mapping(cls, args: Mapping) -> ServingConfig:
        """From a Serve config file's `args` (YAML): ServingConfig's fields, with
        `batching`, `limits` and `autoscaling` as mappings of their fields and `jit` a
        bool or a mapping of JitConfig's. Unknown keys are errors that list the known."""
        values = dict(_checked(cls, args, "dynvm model app arg", exclude={"fleet"}))
        nested = {"batching": BatchingOptions, "limits": ServingLimits,
                  "autoscaling": Autoscaling}
        for name, kind in nested.items():
            if values.get(name) is not None:
                values[name] = kind(**_checked(kind, values[name], f"{name} key"))
        if isinstance(values.get("jit"), Mapping):
            values["jit"] = JitConfig(**_checked(JitConfig, values["jit"], "jit key"))
        return cls(**values)


def _checked(cls, mapping, what: str, exclude: frozenset | set = frozenset()) -> Mapping:
    """`mapping` when every key is a field of `cls` (not in `exclude`), else ValueError
    naming the first unknown key and the known ones."""
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{cls.__name__}: expected a mapping of its fields, "
                         f"got {type(mapping).__name__}")
    known = {f.name for f in dataclasses.fields(cls)} - set(exclude)
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise ConfigError(f"unknown {what} {unknown[0]!r}; known: {', '.join(sorted(known))}")
    return mapping
