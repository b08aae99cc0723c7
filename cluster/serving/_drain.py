"""Drain every replica of some Serve applications before Serve itself stops (`dynvm
serve` on SIGTERM/SIGINT: Note [Stopping dynvm serve] in dynvm._serve_cmd).

Note [Drain before Serve stops]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`serve.shutdown()` drains each replica (Note [Replica drain] in
dynvm.cluster.serving._deployment) but kills Serve's proxies at once (`ProxyState.shutdown`,
serve/_private/proxy_state.py in Ray 2.60: `ray.kill`, no drain): a request in flight
through the proxy is cut (measured: "Remote end closed connection without response"
0.1 s after SIGTERM). And a replica under a closed loop of clients always has a
request in flight, so Serve's own drain, which waits for none, runs to its timeout and
then closes the listener under connections still in its backlog (connection reset).
So `dynvm serve` drains first, itself: every replica of the model applications is
told `begin_drain()` (readiness false, so /v2/health/ready answers 503 at once; a new
infer request 503 + Retry-After + Connection: close; those in flight finish), then
polled until none is in flight or ServingConfig.drain_s passed, and for at least
`min_s` (dynvm serve: ingress.DRAIN_S, 1 s): time for a load balancer polling
readiness to notice, and for the last refusals to travel back through the proxy (they
are not in flight at the replica any more, but would be cut with it); only then Serve
stops, its proxy with nothing in flight.

The replicas are reached one by one: Ray's named actors (`list_named_actors`) whose
names Serve gives its replicas ("SERVE_REPLICA::<app>#...", the names its target
groups carry too, dynvm.cluster.protocol.ingress), each called with Ray's `__ray_call__` running
a function in the actor's process, where Serve's replica context holds the replica's
object (`serve.get_replica_context().servable_object`). A Serve handle would route
each call to one replica of its choice, not to every one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

REPLICA_PREFIX = "SERVE_REPLICA::"
SERVE_NAMESPACE = "serve"


@dataclass(frozen=True)
class DrainReport:
    """What `drain_replicas` saw."""

    replicas: int
    """Replicas told to drain."""
    in_flight_at_start: int
    """Requests in flight on them when they were told."""
    in_flight_at_end: int
    """Requests still in flight when the drain ended (0 unless it timed out)."""
    seconds: float
    """How long the drain took."""


def _begin(actor) -> int | None:
    from ray import serve

    servable = serve.get_replica_context().servable_object
    begin = getattr(servable, "begin_drain", None)
    return begin() if begin is not None else None


def _in_flight(actor) -> int:
    from ray import serve

    stats = getattr(serve.get_replica_context().servable_object, "request_stats", None)
    return stats.in_flight if stats is not None else 0


def replica_actors(app_names) -> list:
    """Ray actor handles of the running replicas of these Serve applications."""
    import ray

    prefixes = tuple(f"{REPLICA_PREFIX}{app}#" for app in app_names)
    handles = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == SERVE_NAMESPACE and entry["name"].startswith(prefixes):
            try:
                handles.append(ray.get_actor(entry["name"], namespace=SERVE_NAMESPACE))
            except ValueError:  # gone since it was listed
                continue
    return handles


def drain_replicas(app_names, deadline_s: float, min_s: float = 0.0, poll_s: float = 0.05,
                   call_timeout_s: float = 5.0) -> DrainReport:
    """Tell every replica of `app_names` to drain, then wait until none has a request
    in flight and `min_s` passed, at most `deadline_s` (Note [Drain before Serve
    stops]). A replica that does not answer is left to Serve's own drain."""
    import ray

    start = time.monotonic()
    actors = replica_actors(app_names)
    answers = _gather(ray, [a.__ray_call__.remote(_begin) for a in actors], call_timeout_s)
    at_start = sum(n or 0 for n in answers)
    left = at_start
    while left and time.monotonic() - start < deadline_s:
        time.sleep(poll_s)
        left = sum(n or 0 for n in _gather(
            ray, [a.__ray_call__.remote(_in_flight) for a in actors], call_timeout_s))
    rest = min(min_s, deadline_s) - (time.monotonic() - start)
    if actors and rest > 0:
        time.sleep(rest)
    return DrainReport(len(actors), at_start, left, time.monotonic() - start)


def _gather(ray, refs: list, timeout_s: float) -> list:
    """Each call's answer, None for one that failed or did not answer in time."""
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    answers = []
    for ref in refs:
        try:
            answers.append(ray.get(ref, timeout=0) if ref in ready else None)
        except Exception:  # a replica that died or raised: Serve's drain covers it
            answers.append(None)
    return answers
