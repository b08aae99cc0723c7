"""The fleet simulator (issue 18): N replicas speaking the real link protocol to the real
compile service (Ray actors) and a real redis-server, replaying a drifting Zipf shape
trace; no model runs. What is real and what is simulated: bench/_fleet_host.py.

    python -m bench.fleet_sim [--n 10 100 1000] [--modes single sharded]
                              [--seconds 30] [--json PATH] [--plot docs/fleet_scale.png]

Modes: `single` is the service as it was before issue 18 (one actor for every
program, one record per interpreted call, no back-pressure); `sharded` is one shard
per program (Note [Compile service shards]), records pre-aggregated per signature per
report and back-pressure (Note [Pre-aggregated observations]). Each (mode, N) gets a
fresh redis-server and fresh service actors on one local Ray; replicas are spread over
a few host processes (Ray actors), the programs over the replicas round-robin.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import sys
import time
import uuid
from pathlib import Path

from bench._fleet_metrics import process_usage, propagation, redis_counters

PROGRAMS = 4
# Simulated replicas per host process: two processes at N = 1000. Spreading them wider
# was measured and did not pay on two shared cores: at 125 per process (eight) the
# processes used 1.15 cores against 0.74-0.78 at 500, and propagation was slower, not
# faster (announcement -> 99% installed 11.5 s against 7.1-7.5 s, load 5-12).
REPLICAS_PER_HOST = 500
NAMESPACE = "dynvm-fleet-sim"
MODES = {
    "single": {"shards": 1, "aggregate": False, "max_backoff_s": 1e-3},
    "sharded": {"shards": PROGRAMS, "aggregate": True, "max_backoff_s": 2.0},
}


def _jit_config():
    from dynvm.jit.config import JitConfig

    # The small transformer's region takes ~100 us: with the default horizon a compile
    # would not pay and nothing would be promoted; this makes hot shapes promote.
    return JitConfig(min_recurrence=2, max_recurrence=4, horizon_calls=10**7)


def run_one(mode: str, n: int, dvm_files: list[bytes], seconds: float, rate: float,
            settle_s: float, per_host: int = REPLICAS_PER_HOST,
            threads: tuple[int, int] = (4, 4), freeze_heap: bool = True) -> dict:
    """One (mode, N) run; returns its figures. `threads`: tick and delivery threads
    per host process; `freeze_heap`: see bench/_fleet_host.py."""
    import ray

    from bench import _fleet_timeline as timeline
    from bench._fleet_host import ReplicaHost
    from dynvm.cluster.fleet._link import FleetOptions
    from dynvm.cluster.fleet._shards import shard_names
    from dynvm.cluster.fleet.compile_service import start_compile_service, stop_compile_service
    from dynvm.cluster.store._local_redis import LocalRedis, LocalRedisOptions
    from dynvm.cluster.store._redis import redis_client
    from dynvm.cluster.store._store_config import StoreConfig

    settings = MODES[mode]
    shards = settings["shards"]
    name = f"fleet-sim-{uuid.uuid4().hex[:6]}"
    with LocalRedis(LocalRedisOptions(maxmemory="1gb")) as local:
        store = StoreConfig(secret=secrets.token_bytes(32), redis=local.config())
        options = FleetOptions(store, service_name=name, service_namespace=NAMESPACE,
                               service_shards=shards, aggregate=settings["aggregate"],
                               max_backoff_s=settings["max_backoff_s"],
                               service_timeout_s=10.0)
        start_compile_service(store, _jit_config(), name=name, namespace=NAMESPACE,
                              shards=shards)
        services = [ray.get_actor(s, namespace=NAMESPACE) for s in shard_names(name, shards)]
        pids = ray.get([s.pid.remote() for s in services])
        ray.get([s.__ray_call__.remote(timeline.instrument) for s in services])
        redis = redis_client(local.config(), "dynvm-fleet-sim")
        host_count = max(1, math.ceil(n / per_host))
        programs = [r % len(dvm_files) for r in range(n)]
        remote_host = ray.remote(ReplicaHost).options(num_cpus=0, max_concurrency=2)
        hosts = [remote_host.remote(h, dvm_files, programs[h::host_count], options,
                                    _jit_config(), *threads, freeze_heap)
                 for h in range(host_count)]
        try:
            start_seconds = ray.get([h.ready.remote() for h in hosts])
            # The clock starts with a warm fleet at every N (Note [Fleet stage clock]).
            warm_by = time.monotonic() + 120
            while time.monotonic() < warm_by and any(
                    s["warmup_seconds"] is None
                    for s in ray.get([s.stats.remote() for s in services])):
                time.sleep(0.2)
            cpu_before, _ = process_usage(pids)
            redis_before = redis_counters(redis)
            start_at = time.time() + 1.0
            ray.get([h.run_traffic.remote(start_at, seconds, rate, seed)
                     for seed, h in enumerate(hosts)])
            time.sleep(max(0.0, start_at + seconds + settle_s - time.time()))
            window = time.time() - start_at
            cpu_after, service_rss = process_usage(pids)
            redis_after = redis_counters(redis)
            results = ray.get([h.results.remote() for h in hosts])
            # Compiles and publishes counted after the last announcement was heard.
            ray.get([s.wait_idle.remote(30.0) for s in services])
            service_stats = ray.get([s.stats.remote() for s in services])
            timelines = ray.get([s.__ray_call__.remote(timeline.read) for s in services])
        finally:
            for h in hosts:
                ray.kill(h)
            stop_compile_service(name, NAMESPACE, shards=shards)
            redis.close()
    row = summarize(mode, n, shards, window, seconds, results, service_stats,
                    cpu_after - cpu_before, service_rss, redis_before, redis_after,
                    start_seconds, host_count)
    row.update(timeline.shape_stages(results, timelines))
    return row


def summarize(mode, n, shards, window, seconds, results, service_stats, service_cpu,
              service_rss, redis_before, redis_after, start_seconds, host_count=1) -> dict:
    counters: dict[str, int] = {}
    for host in results:
        for key, value in host["counters"].items():
            counters[key] = counters.get(key, 0) + value
    compiles = sum(p["compiles"] for s in service_stats for p in s["programs"].values())
    indexed = sum(p["indexed"] for s in service_stats for p in s["programs"].values())
    published = sum(s["published"] for s in service_stats)
    compile_seconds = sum(p["compile_seconds"] for s in service_stats
                          for p in s["programs"].values())
    reach = propagation(results)
    keys = reach["keys_announced"]
    commands = redis_after["commands"] - redis_before["commands"]
    publishes = redis_after["publish"] - redis_before["publish"]
    requests = sum(h["requests"] for h in results)
    return {
        "mode": mode, "replicas": n, "shards": shards, "window_s": window,
        "host_processes": host_count,
        "host_rss_mb": sum(h.get("host_rss_bytes", 0) for h in results) / 2**20,
        "traffic_s": seconds, "requests": requests,
        "specialized_fraction": sum(h["specialized_requests"] for h in results)
        / max(1, requests),
        "report_messages_per_s": counters["messages"] / window,
        "report_bytes_per_s": counters["bytes"] / window,
        "records_per_s": counters["records"] / window,
        "observations_per_s": counters["reported"] / window,
        "dropped_observations": counters["dropped_observations"],
        "service_failures": counters["service_failures"],
        "backoffs": counters["backoffs"],
        "service_cpu_s": service_cpu,
        "service_cpu_fraction": service_cpu / window,
        "service_cpu_us_per_replica_s": 1e6 * service_cpu / window / n,
        "service_rss_mb": service_rss / 2**20,
        "redis_commands_per_replica_s": commands / window / n,
        "redis_calls_by_command": {
            name: calls - redis_before["by_command"].get(name, 0)
            for name, calls in redis_after["by_command"].items()
            if calls > redis_before["by_command"].get(name, 0)},
        "redis_used_memory_mb": redis_after["used_memory"] / 2**20,
        "redis_rss_mb": redis_after["used_memory_rss"] / 2**20,
        "announce_subscribers": redis_after["subscribers"],
        "publishes": publishes,
        "announcements_delivered": sum(h["announcements_received"] for h in results),
        # on_announcements calls: a link's announcements read while it waited go together
        "announcement_deliveries": sum(h.get("announcement_deliveries", 0) for h in results),
        # CPU one replica spends per announcement it hears (read, decode, and for its
        # program's: fetch + verify); in a fleet each replica spends it on its own core.
        "replica_cpu_ms_per_announcement": 1e3 * sum(h["announcement_cpu_s"] for h in results)
        / max(1, sum(h["announcements_received"] for h in results)),
        "service_compiles": compiles, "published": published, "indexed": indexed,
        "service_compile_ms_mean": 1e3 * compile_seconds / compiles if compiles else None,
        "keys_announced": keys,
        # Every compile in the fleet (the service's and any replica's) per distinct
        # artifact the service published: 1.0 means each hot shape was compiled once.
        "compiles_per_key": (compiles + counters["local_compiles"]) / published
        if published else None,
        "replica_local_compiles": counters["local_compiles"],
        "installed": counters["installed"],
        # The simulator's own delays: the longest one host took to read one announcement
        # from all its subscriptions, and the mean wait of a read message for delivery.
        "announcement_read_spread_s": max(h["announcement_read_spread_s"] for h in results),
        "announcement_queued_s": max(h["announcement_queued_s"] for h in results),
        "installed_by_poll": counters["installed_by_poll"],
        "index_reads_skipped": counters["index_reads_skipped"],
        "index_stamps_followed": counters.get("index_stamps_followed", 0),
        "announcements_dropped": counters["announcements_dropped"],
        "install_rejected": counters["install_rejected"],
        "host_start_s": max(start_seconds),
        "simulator_cpu_fraction": sum(h["host_cpu_s"] for h in results) / window,
        # The hosts' cyclic garbage collections, summed (bench/_fleet_host.py: frozen heap)
        "host_gc_s": sum(h.get("gc_seconds", 0.0) for h in results),
        "reference_install_ms": max(h["reference_install_ms"] for h in results),
        "tick_sweep_p50_s": max(h["sweep_p50_s"] for h in results),
        "tick_sweep_max_s": max(h["sweep_max_s"] for h in results),
        "tick_sweep_p99_s": max(h["sweep_p99_s"] for h in results),
        # How long a link waited for the service's answer to one report (the worst host).
        "report_wait_s": {q: max(h["report_wait_s"][q] for h in results)
                          for q in ("p50", "p99", "max")},
        **{k: v for k, v in reach.items() if k != "keys_announced"},
    }


def table(rows: list[dict]) -> str:
    """A Markdown table of the figures that say where it bends."""
    def fmt(value, digits=2):
        if value is None:
            return "-"
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = ["| mode | req/s/replica | N | reports/s | records/s | KB/s in | service CPU | "
             "CPU µs/replica/s | "
             "sight→first (med s) | sight→99% (med / p90 s) | announce→99% (med s) | "
             "Redis cmd/replica/s | service RSS MB | Redis MB | compiles/key | "
             "local compiles | load |",
             "|" + "---|" * 17]
    for r in rows:
        s1, s99, a99 = r["sighting_to_first"], r["sighting_to_99"], r["announce_to_99"]
        lines.append(
            f"| {r['mode']} | {r.get('rate_per_replica', 5.0):g} | {r['replicas']} | "
            f"{fmt(r['report_messages_per_s'], 0)} | {fmt(r['records_per_s'], 0)} | "
            f"{fmt(r['report_bytes_per_s'] / 1024, 0)} | {fmt(r['service_cpu_fraction'])} | "
            f"{fmt(r['service_cpu_us_per_replica_s'], 0)} | {fmt(s1['median'])} | "
            f"{fmt(s99['median'])} / {fmt(s99['p90'])} ({s99['reached']}/{s99['of']}) | "
            f"{fmt(a99['median'])} ({a99['reached']}/{a99['of']}) | "
            f"{fmt(r['redis_commands_per_replica_s'])} | {fmt(r['service_rss_mb'], 0)} | "
            f"{fmt(r['redis_rss_mb'], 0)} | {fmt(r['compiles_per_key'])} | "
            f"{r['replica_local_compiles']} | "
            f"{fmt(r.get('load_before'), 1)} / {fmt(r.get('load_after'), 1)} |")
    return "\n".join(lines)


def stage_table(rows: list[dict]) -> str:
    """Per run, the median seconds of each stage of Note [Fleet stage clock]."""
    from bench._fleet_timeline import STAGES

    chain = ["sighted", *STAGES, "first", "50%", "99%"]
    steps = [f"{a}->{b}" for a, b in zip(chain, chain[1:])]
    lines = ["| mode | req/s/replica | N | hosts x (tick, delivery) threads | "
             + " | ".join(s.replace("->", "→") for s in steps) + " | sight→99% | load |",
             "|" + "---|" * (len(steps) + 6)]
    for r in rows:
        stages = r.get("stages", {})
        cells = [f"{stages[s]['median']:.2f}" if s in stages else "-" for s in steps]
        lines.append(
            f"| {r['mode']} | {r.get('rate_per_replica', 5.0):g} | {r['replicas']} | "
            f"{r['host_processes']} x ({r.get('tick_threads', 4)}, "
            f"{r.get('delivery_threads', 4)}) | " + " | ".join(cells)
            + f" | {r['sighting_to_99']['median']:.2f} | "
            f"{r.get('load_before', 0):.1f} / {r.get('load_after', 0):.1f} |")
    return "\n".join(lines)


def _label(row: dict) -> str:
    return f"{row['mode']}, {row.get('rate_per_replica', 5.0):g} req/s/replica"


def _points(rows: list[dict], key: str) -> tuple[list, list]:
    """(N, value) of every run, and (N, median over the runs at that N)."""
    import statistics

    runs = [(r["replicas"], r[key]["median"] if isinstance(r[key], dict) else r[key])
            for r in rows]
    runs = [(x, y) for x, y in runs if y is not None]
    by_n: dict[int, list[float]] = {}
    for x, y in runs:
        by_n.setdefault(x, []).append(y)
    return runs, [(x, statistics.median(ys)) for x, ys in sorted(by_n.items())]


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("records_per_s", "observation records / s into the service"),
              ("service_cpu_fraction", "service CPU (cores)"),
              ("service_cpu_us_per_replica_s", "service CPU µs per replica-second"),
              ("sighting_to_99", "first sighting → 99% installed (median s)\n"
               "dashed: → first replica serving it"),
              ("announce_to_99", "announcement → 99% installed (median s)"),
              ("redis_commands_per_replica_s", "Redis commands / replica / s")]
    figure, axes = plt.subplots(2, 3, figsize=(13, 7))
    for axis, (key, title) in zip(axes.flat, panels):
        for label in dict.fromkeys(_label(r) for r in rows):
            mine = [r for r in rows if _label(r) == label]
            runs, medians = _points(mine, key)
            if medians:
                # The line joins the medians over repeated runs; the dots are the runs.
                line, = axis.plot(*zip(*medians), marker="o", label=label)
                axis.scatter(*zip(*runs), s=10, color=line.get_color(), alpha=0.5)
                if key == "sighting_to_99":   # promotion + compile + one install
                    _, first = _points(mine, "sighting_to_first")
                    if first:
                        axis.plot(*zip(*first), linestyle="--", marker=".",
                                  color=line.get_color())
        axis.set_xscale("log")
        if key in ("service_cpu_us_per_replica_s", "records_per_s"):
            axis.set_yscale("log")
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("replicas")
        axis.grid(True, alpha=0.3)
    axes.flat[0].legend()
    figure.suptitle("dynvm fleet simulator (bench/fleet_sim.py): one shared 2-core machine; "
                    "line: median of the runs, dots: each run")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_sim",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES),
                        default=["single", "sharded"])
    parser.add_argument("--seconds", type=float, default=30.0, help="traffic per run")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds after the traffic before measuring")
    parser.add_argument("--rate", type=float, default=5.0, help="requests/s per replica")
    parser.add_argument("--replicas-per-host", type=int, default=REPLICAS_PER_HOST,
                        help="simulated replicas per host process")
    parser.add_argument("--tick-threads", type=int, default=4,
                        help="threads per host process driving its links' ticks")
    parser.add_argument("--delivery-threads", type=int, default=4,
                        help="threads per host process handing announcements to links")
    parser.add_argument("--json", default="bench/results/fleet_scale.json")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="leave the hosts' start-up heap to the cyclic GC "
                             "(bench/_fleet_host.py says why it is frozen)")
    parser.add_argument("--plot", default=None, help="e.g. docs/fleet_scale.png")
    parser.add_argument("--replot", nargs="+", metavar="JSON",
                        help="only draw --plot and print the table from these results")
    args = parser.parse_args(argv)
    if args.replot:
        rows = [row for path in args.replot for row in json.loads(Path(path).read_text())]
        print(table(rows))
        print(stage_table(rows))
        if args.plot:
            plot(rows, args.plot)
        return 0

    import ray

    from bench._fleet_trace import fleet_programs

    dvm_files = fleet_programs(PROGRAMS, PROGRAMS)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, namespace=NAMESPACE)
    rows = []
    try:
        for mode in args.modes:
            for n in args.n:
                load = os.getloadavg()[0]
                row = run_one(mode, n, dvm_files, args.seconds, args.rate, args.settle,
                              args.replicas_per_host,
                              (args.tick_threads, args.delivery_threads),
                              not args.no_gc_freeze)
                row["gc_freeze"] = not args.no_gc_freeze
                row["replicas_per_host"] = args.replicas_per_host
                row["tick_threads"] = args.tick_threads
                row["delivery_threads"] = args.delivery_threads
                row["rate_per_replica"] = args.rate
                row["load_before"] = load
                row["load_after"] = os.getloadavg()[0]
                rows.append(row)
                print(json.dumps({k: row[k] for k in (
                    "mode", "replicas", "report_messages_per_s", "service_cpu_fraction",
                    "sighting_to_99", "announce_to_99", "compiles_per_key",
                    "load_before", "stages", "queue_at_promotion_median",
                    "compile_s_median", "compile_s_first_per_shard")}, default=str),
                      flush=True)
    finally:
        ray.shutdown()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2, default=float))
    print(table(rows))
    print(stage_table(rows))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
