"""Cluster warm start and replica scaling, on real Ray Serve + HTTP + redis-server.

    python bench/cluster_warm.py [--clients 8] [--seconds 10] [--json out.json]

1. Time to the first specialized request of a new replica: cold (empty store: the
   fleet must see the shape, the compile service compile and announce it) vs warm (a
   replica deployed after that installs everything before it reports ready).
2. Requests/s of 1 vs 2 replicas under a closed loop: `--clients` threads, each sending
   its next request as soon as the previous one is answered, for `--seconds`; and the
   replicas' own CPU per request (from /proc), which the shared host's load disturbs
   far less than latency.

The model is the recommender demo (batch 1..64), requests JSON over HTTP. Everything
runs on this machine: Ray's proxy, the replicas, Redis and the client threads share
its cores, so the scaling figure says what a second replica buys *here*.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODEL = "rec"
# The recommender's regions take microseconds: with the default horizon a compile does
# not pay for itself; this horizon makes the policy promote (as tests/cluster do).
HORIZON = 10**7


def _body(inputs, names) -> dict:
    return {"inputs": [{"name": n, "shape": list(t.shape),
                        "datatype": "FP32" if t.is_floating_point() else "INT64",
                        "data": t.flatten().tolist()} for n, t in zip(names, inputs)]}


def _requests_for(demo, names, batches, seed=0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for batch in batches:
        inputs = demo.sample_inputs(rng)
        inputs = tuple(t[:batch] if t.shape[0] >= batch else
                       t.repeat((batch + t.shape[0] - 1) // t.shape[0],
                                *[1] * (t.dim() - 1))[:batch] for t in inputs)
        out.append(_body(inputs, names))
    return out


def _stats(base: str) -> dict:
    return requests.get(f"{base}/v2/models/{MODEL}/stats", timeout=10).json()


def _first_specialized(base: str, body: dict, limit: int = 400) -> dict:
    """Send `body` until a request is served specialized; time and requests taken."""
    session = requests.Session()
    start = time.perf_counter()
    before = _stats(base)["specialized_region_calls"]
    for n in range(1, limit + 1):
        response = session.post(f"{base}/v2/models/{MODEL}/infer", json=body, timeout=30)
        response.raise_for_status()
        stats = _stats(base)
        if stats["specialized_region_calls"] > before:
            return {"seconds": time.perf_counter() - start, "requests": n,
                    "replica_compiles": stats["compiles"], "installs": stats["installs"],
                    "warm_start_installs": stats["fleet"]["warm_start_installs"]}
    return {"seconds": None, "requests": limit}


def _replica_cpu_seconds() -> float:
    """User + system CPU seconds of every replica process of MODEL on this machine (Ray
    titles them ray::ServeReplica:<app>:...), from /proc: what the replicas spent,
    whatever else the shared host runs."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f"ServeReplica:dynvm-model-{MODEL}".encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick   # utime, stime
    return total


def _closed_loop(base: str, bodies: list[dict], clients: int, seconds: float) -> dict:
    cpu_before = _replica_cpu_seconds()
    done, errors = [0] * clients, [0] * clients
    latencies: list[list[float]] = [[] for _ in range(clients)]
    stop = time.perf_counter() + seconds

    def client(i: int) -> None:
        session = requests.Session()
        k = i
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            response = session.post(f"{base}/v2/models/{MODEL}/infer",
                                    json=bodies[k % len(bodies)], timeout=30)
            k += 1
            if response.status_code == 200:
                done[i] += 1
                latencies[i].append(time.perf_counter() - t0)
            else:
                errors[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    ordered = sorted(x for lat in latencies for x in lat)
    p = (lambda q: round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)
         if ordered else None)
    cpu = _replica_cpu_seconds() - cpu_before
    return {"requests_per_s": round(sum(done) / elapsed, 1), "requests": sum(done),
            "errors": sum(errors), "p50_ms": p(0.5), "p99_ms": p(0.99),
            "replica_cpu_ms_per_request": round(1000 * cpu / max(sum(done), 1), 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    import dynvm
    from dynvm.cluster import StoreConfig, serve_models
    from dynvm.cluster.fleet._link import FleetOptions
    from dynvm.cluster.fleet.compile_service import start_compile_service, stop_compile_service
    from dynvm.cluster.protocol._http_front import model_app_name
    from dynvm.cluster.store._local_redis import LocalRedis, free_port
    from dynvm.jit.config import JitConfig
    from dynvm.models import recommender

    config = JitConfig(min_recurrence=2, max_recurrence=4, horizon_calls=HORIZON)
    demo = recommender(max_batch=64)
    module = demo.module.eval()  # safe: nn.Module.eval, not Python's eval
    program = dynvm.compile(module, demo.example_inputs, demo.dynamic_shapes,
                            name="recommender")
    workdir = tempfile.mkdtemp(prefix="dynvm-bench-")
    path = os.path.join(workdir, "rec.dvm")
    dynvm.save(program, path)
    names = [spec.name for spec in program.inputs]
    probe = _requests_for(demo, names, [8])[0]
    mix = _requests_for(demo, names, [1, 4, 8, 16, 3, 12], seed=1)

    results: dict = {"machine": f"{os.cpu_count()} CPUs", "clients": args.clients,
                     "seconds": args.seconds}
    redis = LocalRedis().start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        ray.init(include_dashboard=False, log_to_driver=False)
        store = StoreConfig(secret=os.urandom(32), redis=redis.config())
        fleet = FleetOptions(store)
        start_compile_service(store, config)
        serve.start(http_options={"host": "127.0.0.1", "port": port})

        def deploy(replicas: int) -> float:
            t0 = time.perf_counter()
            serve_models({MODEL: path}, device="cpu", jit=config, num_replicas=replicas,
                         num_cpus=1.0, fleet=fleet)
            return time.perf_counter() - t0

        # 1. cold: empty store, nothing promoted yet
        cold_deploy = deploy(1)
        results["cold"] = {"deploy_s": cold_deploy, **_first_specialized(base, probe)}
        # 2. warm: a new replica after promotion (the old one is deleted first)
        serve.delete(model_app_name(MODEL))
        warm_deploy = deploy(1)
        results["warm"] = {"deploy_s": warm_deploy, **_first_specialized(base, probe)}
        # 3. throughput, 1 then 2 replicas (both warm: every shape of the mix promoted)
        for body in mix:
            for _ in range(6):
                requests.post(f"{base}/v2/models/{MODEL}/infer", json=body, timeout=30)
        time.sleep(2.0)  # announcements installed
        results["replicas_1"] = _closed_loop(base, mix, args.clients, args.seconds)
        deploy(2)
        time.sleep(2.0)
        results["replicas_2"] = _closed_loop(base, mix, args.clients, args.seconds)
    finally:
        try:
            serve.shutdown()
            stop_compile_service()
        finally:
            ray.shutdown()
            redis.stop()

    _print(results)
    text = json.dumps(results, indent=2, default=float)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


def _print(r: dict) -> None:
    def s(x):
        return "-" if x is None else f"{x:.2f}"

    print(f"\ncluster warm start and scaling ({r['machine']}, recommender, JSON over HTTP)\n")
    print(f"{'new replica':<12} {'deploy s':>9} {'to 1st specialized s':>21} "
          f"{'requests':>9} {'replica compiles':>17} {'warm installs':>14}")
    for key in ("cold", "warm"):
        row = r[key]
        print(f"{key:<12} {s(row['deploy_s']):>9} {s(row['seconds']):>21} "
              f"{row['requests']:>9} {row.get('replica_compiles', '-'):>17} "
              f"{row.get('warm_start_installs', '-'):>14}")
    print(f"\n{'replicas':<12} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'errors':>7} "
          f"{'replica CPU ms/req':>19}   ({r['clients']} clients, closed loop, "
          f"{r['seconds']:.0f} s)")
    for n in (1, 2):
        row = r[f"replicas_{n}"]
        print(f"{n:<12} {row['requests_per_s']:>9} {s(row['p50_ms']):>9} "
              f"{s(row['p99_ms']):>9} {row['errors']:>7} "
              f"{s(row['replica_cpu_ms_per_request']):>19}")
    ratio = r["replicas_2"]["requests_per_s"] / max(r["replicas_1"]["requests_per_s"], 1e-9)
    print(f"\n2 replicas / 1: {ratio:.2f}x\n")


if __name__ == "__main__":
    sys.exit(main())
