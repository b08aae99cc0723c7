"""The serving layer's counters, typed: one dataclass per component, all of them here.

    RequestCounters  a replica's requests, errors, busy rejections (its event loop)
    ExecCounters     its VM calls and batches (the batcher's worker thread)
    BatcherCounters  the opportunistic batcher's batches (its loop and worker)
    LinkCounters     a fleet link's reports, installs and announcements
    GenerationRates, GenerationOccupancy   a generator replica's tokens, latencies and
                     cache occupancy, as `dynvm top` reads them

Each owner bumps fields by attribute (`counters.requests += 1`), on the thread its
module names, as the dicts these replace were bumped. The JSON keys of a replica's
`/stats` are the field names (`as_dict`), and the readers, `dynvm top` and the
Prometheus exporter (dynvm.cluster.serving._metrics), take them back through the same types
(`read`, `field_of`, from dynvm._runtime_stats, which reads RuntimeStats the same way):
renaming a field renames the key for every reader at once, and a reader that asks for a
name no type has fails when it is defined, not with a '-' in a table. Nothing here
imports Ray.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dynvm._runtime_stats import field_of, read

__all__ = ["BatcherCounters", "ExecCounters", "GenerationOccupancy", "GenerationRates",
           "LinkCounters", "RequestCounters", "as_dict", "field_of", "read"]


@dataclass
class RequestCounters:
    """One replica's inference requests, of any transport (bumped on its event loop)."""

    requests: int = 0
    """Inference requests received."""
    errors: int = 0
    """Of those, the ones that failed (a 4xx/5xx or a gRPC error)."""
    rejected_busy: int = 0
    """Requests refused because the replica had its limit in flight (503/UNAVAILABLE)."""


@dataclass
class ExecCounters:
    """One replica's model execution (bumped on the batcher's worker thread). Also the
    counts of one batch (`ReplicaExecutor.run_batch`), which `add` folds in."""

    vm_calls: int = 0
    """Runtime calls (a batched call counts once)."""
    batches: int = 0
    """Batches the batcher handed over."""
    batched_vm_calls: int = 0
    """Runtime calls that served more than one request."""
    batched_requests: int = 0
    """Requests served by those calls."""
    max_requests_per_vm_call: int = 0
    """The most requests one Runtime call has served."""
    unbatched_fallbacks: int = 0
    """Groups that could not run batched and ran request by request."""

    def add(self, batch: ExecCounters) -> None:
        """Fold one batch's counts in: sums, and the larger maximum."""
        self.vm_calls += batch.vm_calls
        self.batches += batch.batches
        self.batched_vm_calls += batch.batched_vm_calls
        self.batched_requests += batch.batched_requests
        self.max_requests_per_vm_call = max(self.max_requests_per_vm_call,
                                            batch.max_requests_per_vm_call)
        self.unbatched_fallbacks += batch.unbatched_fallbacks


@dataclass
class BatcherCounters:
    """An `OpportunisticBatcher`'s counters (dynvm.cluster.serving._batcher)."""

    batches: int = 0
    """Batches formed."""
    batched_requests: int = 0
    """Requests in them."""
    max_batch_requests: int = 0
    """The most requests one batch held."""
    held_batches: int = 0
    """Batches that waited for more requests (Note [Opportunistic batching])."""
    split_batches: int = 0
    """Batches cut short of the queue for a size that runs specialized."""
    rejected_overload: int = 0
    """Requests refused because `max_queued` were waiting."""
    recorded_batches: int = 0
    """VM calls whose specialized-or-not the worker reported."""
    specialized_batches: int = 0
    """Of those, the ones that ran entirely specialized."""
    inline_batches: int = 0
    """Batches run on the event loop itself (Note [Inline fast batches])."""


@dataclass
class LinkCounters:
    """A replica's `FleetLink` counters (dynvm.cluster.fleet._link)."""

    reported: int = 0
    """Observations sent to the compile service."""
    records: int = 0
    """Records they were sent in (one per signature per report)."""
    reports: int = 0
    """Reports sent."""
    dropped_observations: int = 0
    """Observations dropped (buffer full, or the service unreachable)."""
    service_failures: int = 0
    """Reports the service did not answer."""
    backoffs: int = 0
    """Answers that asked the link to back off."""
    registrations: int = 0
    """Reports that registered the program with the service."""
    installed: int = 0
    """Artifacts installed."""
    install_rejected: int = 0
    """Artifacts refused at install."""
    announcements: int = 0
    """Announcements heard."""
    announcements_dropped: int = 0
    """Announcements dropped by the fetch rate limit."""
    warm_start_installs: int = 0
    """Artifacts installed from the index when the link started."""
    index_reads_skipped: int = 0
    """Index polls that read the stamp alone (Note [Index stamps])."""
    index_stamps_followed: int = 0
    """Index stamps taken from an announcement."""
    index_rejected: int = 0
    """Index reads refused (bad MAC, bad form)."""


@dataclass
class GenerationRates:
    """A generator replica's tokens, rate and latency percentiles (its /stats, from
    dynvm.cluster.serving._generate_metrics.GenerateMetrics.snapshot)."""

    tokens: int = 0
    """Tokens generated so far."""
    tokens_per_s: float = 0.0
    """Tokens per second over the last RATE_WINDOW_S."""
    ttft_p50_s: float | None = None
    """Median time to first token over the recent sequences (None before any)."""
    ttft_p99_s: float | None = None
    """Its 99th percentile."""
    itl_p50_s: float | None = None
    """Median inter-token latency over the recent tokens (None before any)."""
    itl_p99_s: float | None = None
    """Its 99th percentile."""
    sequences: dict = field(default_factory=dict)
    """Sequences ended, by reason (stop, length, cancelled, error)."""


@dataclass
class GenerationOccupancy:
    """The keys of a generator's /stats that `dynvm top` reads from its scheduler's
    occupancy (dynvm.cluster.serving._generate_scheduler.GenerateScheduler.occupancy)."""

    running: int | None = None
    """Sequences decoding now."""
    waiting: int | None = None
    """Sequences waiting for cache room."""
    reserved_tokens: int | None = None
    """Cache tokens reserved by the admitted sequences."""
    cache_tokens: int | None = None
    """Cache tokens in all."""
    cache: str | None = None
    """The cache's kind ("slots" or "plain")."""


COUNTER_TYPES = (RequestCounters, ExecCounters, BatcherCounters, LinkCounters)


def as_dict(counters) -> dict[str, int]:
    """The JSON form of one counters object: a key per field."""
    return asdict(counters)
