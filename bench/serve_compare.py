"""dynvm's serving path vs a plain Ray Serve deployment of the same model, side by side.

    python bench/serve_compare.py [--seconds 8] [--repeats 2] [--models recommender,transformer]
                                  [--clients 1,8] [--encodings json,binary,grpc] [--floor]
                                  [--json out.json]

One local Ray + Serve (dynvm's proxy guard on, as `dynvm serve` runs it), two
applications at once, one replica each (1 CPU each):

- dynvm: `serve_models` with the JIT on as `dynvm serve` has it (its policy decides what
  to compile; online compile, no fleet: one replica has nothing to share) and the
  default BatchingOptions (Note [Opportunistic batching]);
- plain: a Serve deployment running the same nn.Module in eager under
  `@serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)`, parsing the v2 JSON and
  binary-tensor bodies itself on its event loop (what a plain Serve user writes).

The client sends the same pre-serialized v2 bodies (random batch 1..4; the transformer
at seq 32) to both, from `--clients` threads in a closed loop over keep-alive
connections, for `--seconds` per run; runs of the two systems alternate (dynvm, plain,
dynvm, plain, ...) so that both see the same host load. Each system is warmed up
(JIT compiles included) before the timed runs. Prints req/s and p50/p99 per run and the
median over repeats.

Per run it prints each process's CPU per answered request (from /proc: the system's
replica, Serve's HTTP proxy, this client process) and the whole host's (/proc/stat, other
sessions' work included), and for dynvm what its replica did (requests per batch, the
share of batches run inline, the specialized share of region calls, compile seconds,
from its /stats). `--floor` adds a third system over JSON: Serve alone, a deployment
that reads the body and answers a fixed response on dynvm's replica settings, the most
any handler could get from this host through Serve's HTTP proxy.

"grpc" runs the same tensors through Serve's gRPC ingress (the v2 gRPC protocol,
dynvm.cluster.protocol.grpc_v2, bench/_grpc_load.py) to dynvm only: the plain deployment speaks
HTTP alone.

`--ingress direct` starts this session's Ray in Serve's direct ingress (Note [Direct
ingress] in dynvm.cluster.protocol.ingress) for every system alike: the client sends each
system's requests straight to its replica's own port, no proxy in the path (HTTP only:
"grpc" is left out). Serve's ingress is one mode per Ray cluster, so the two cannot
share a session: `--alternate-ingress N` runs N pairs of sessions, each its own Ray,
alternating proxy and direct (proxy, direct, direct, proxy, ...; this script in a
subprocess per session, with the other flags), and prints per pair how much is the
ingress (plain direct / plain proxy) and how much is dynvm (dynvm direct / plain
direct), and dynvm direct against plain Serve as a user deploys it (behind its proxy).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SEQ = 32
PLAIN_PREFIX = "/plain"


def _model(name: str):
    from dynvm.models import recommender, transformer

    return recommender(max_batch=64) if name == "recommender" else transformer(
        max_batch=64, max_seq=128)


def _inputs(demo, name: str, batch: int, seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    if name == "transformer":
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(batch, SEQ, demo.example_inputs[0].shape[2], generator=gen)]
    sample = demo.sample_inputs(rng)
    return [t[:batch] if t.shape[0] >= batch else
            t.repeat((batch + t.shape[0] - 1) // t.shape[0], *[1] * (t.dim() - 1))[:batch]
            for t in sample]


def _datatype(t: torch.Tensor) -> str:
    return {torch.float32: "FP32", torch.int64: "INT64"}[t.dtype]


def _tensor_sets(demo, name: str, count: int = 32) -> list[list[torch.Tensor]]:
    """The inputs of every body, whatever its encoding: random batch 1..4."""
    return [_inputs(demo, name, 1 + k % 4, seed=k) for k in range(count)]


def _bodies(demo, name: str, names: list[str], binary: bool, count: int = 32):
    """(body bytes, headers) pairs: v2 JSON, or the binary-tensor extension."""
    out = []
    for tensors in _tensor_sets(demo, name, count):
        if not binary:
            doc = {"inputs": [{"name": n, "shape": list(t.shape), "datatype": _datatype(t),
                               "data": t.flatten().tolist()} for n, t in zip(names, tensors)]}
            out.append((json.dumps(doc).encode(), {"Content-Type": "application/json"}))
            continue
        raws = [t.contiguous().numpy().tobytes() for t in tensors]
        doc = {"inputs": [{"name": n, "shape": list(t.shape), "datatype": _datatype(t),
                           "parameters": {"binary_data_size": len(raw)}}
                          for n, t, raw in zip(names, tensors, raws)],
               "parameters": {"binary_data_output": True}}
        header = json.dumps(doc).encode()
        out.append((header + b"".join(raws),
                    {"Content-Type": "application/octet-stream",
                     "Inference-Header-Content-Length": str(len(header))}))
    return out


# ---------------------------------------------------------------------- plain Serve


def _plain_deployment():
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    dtypes = {"FP32": np.float32, "INT64": np.int64}

    @serve.deployment(max_ongoing_requests=256)
    class PlainV2:
        """The same module in eager, @serve.batch(8, 0.01), v2 parsed on the loop."""

        def __init__(self, module) -> None:
            self.module = module.eval()  # safe: nn.Module.eval

        @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
        async def run(self, items: list[list[torch.Tensor]]) -> list[torch.Tensor]:
            sizes = [item[0].shape[0] for item in items]
            with torch.inference_mode():
                out = self.module(*[torch.cat([item[k] for item in items])
                                    for k in range(len(items[0]))])
            return list(out.split(sizes))

        async def __call__(self, request: Request) -> Response:
            body = await request.body()
            length = request.headers.get("inference-header-content-length")
            header = json.loads(body[:int(length)] if length else body)
            tensors, offset = [], int(length or 0)
            for spec in header["inputs"]:
                dtype = dtypes[spec["datatype"]]
                if length:
                    size = spec["parameters"]["binary_data_size"]
                    arr = np.frombuffer(body, dtype, size // np.dtype(dtype).itemsize, offset)
                    offset += size
                else:
                    arr = np.asarray(spec["data"], dtype=dtype)
                tensors.append(torch.from_numpy(arr.reshape(spec["shape"]).copy()))
            out = await self.run(tensors)
            binary = header.get("parameters", {}).get("binary_data_output", False)
            entry = {"name": "output__0", "datatype": "FP32", "shape": list(out.shape)}
            if binary:
                raw = out.contiguous().numpy().tobytes()
                entry["parameters"] = {"binary_data_size": len(raw)}
                head = json.dumps({"model_name": "plain", "outputs": [entry]}).encode()
                return Response(head + raw, media_type="application/octet-stream",
                                headers={"Inference-Header-Content-Length": str(len(head))})
            entry["data"] = out.flatten().tolist()
            return Response(json.dumps({"model_name": "plain", "outputs": [entry]}).encode(),
                            media_type="application/json")

    return PlainV2


def _floor_deployment():
    """Serve alone: reads the body and answers one fixed v2 JSON response, with no
    parsing and no model, on dynvm's replica settings (Serve's own loop, no access log:
    Note [Replica on Serve's loop]). Its CPU per request is the part of each replica's
    that neither system's code can cut."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    from dynvm.cluster.serving._deployment import REPLICA_ENV

    answer = json.dumps({"model_name": "floor", "outputs": [
        {"name": "output__0", "datatype": "FP32", "shape": [1, 1], "data": [0.0]}]}).encode()

    # No CPU reserved: with two models, dynvm's and plain's replicas hold the 4 CPUs this
    # benchmark gives Ray, and a reservation would leave the floor undeployable.
    @serve.deployment(max_ongoing_requests=256,
                      ray_actor_options={"num_cpus": 0,
                                         "runtime_env": {"env_vars": REPLICA_ENV}},
                      logging_config={"enable_access_log": False})
    class Floor:
        async def __call__(self, request: Request) -> Response:
            await request.body()
            return Response(answer, media_type="application/json")

    return Floor


# ---------------------------------------------------------------------- client


def _closed_loop(port: int, path: str, bodies, clients: int, seconds: float) -> dict:
    """bench._closed_loop over keep-alive HTTP connections (a broken one is replaced)."""
    from bench._closed_loop import closed_loop

    def connect() -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def send(conn, body) -> tuple:
        payload, headers = body
        try:
            conn.request("POST", path, body=payload, headers=headers)
            response = conn.getresponse()
            response.read()
            return conn, response.status == 200
        except (OSError, http.client.HTTPException):
            conn.close()
            return connect(), False

    return closed_loop(connect, send, bodies, clients, seconds)


def _serve_pids(apps: dict[str, str]) -> dict[str, int]:
    """{system: pid} of each system's replica actor and {"proxy": pid} of Serve's HTTP
    proxy, asked of the actors themselves (Serve names replica actors
    SERVE_REPLICA::<app>#..., its proxies SERVE_PROXY_ACTOR-...; only this benchmark's
    Ray cluster)."""
    import ray

    pids = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        prefixes = {f"SERVE_REPLICA::{app}#": system for system, app in apps.items()}
        prefixes["SERVE_PROXY_ACTOR"] = "proxy"
        for prefix, role in prefixes.items():
            if actor["name"].startswith(prefix):
                handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
                pids[role] = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()))
    return pids


def _host_busy_seconds() -> float:
    """CPU seconds every core of the host spent busy so far (/proc/stat): with the
    answered requests, what one request costs the whole host, other sessions' work
    included."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]   # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (/proc), 0 when unknown."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_STATS_KEYS = ("compile_seconds", "specialized_region_calls", "interpreted_region_calls")
_BATCHING_KEYS = ("batches", "batched_requests", "inline_batches", "held_batches")


def _replica_counters(port: int, name: str) -> dict:
    """The dynvm replica's request, batching and JIT counters (its /stats)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", f"/v2/models/{name}/stats")
    stats = json.loads(conn.getresponse().read())
    conn.close()
    return {**{k: stats[k] for k in _STATS_KEYS},
            **{k: stats["batching"][k] for k in _BATCHING_KEYS}}


def _batching_summary(before: dict, after: dict) -> dict:
    """What a run did inside the dynvm replica: requests per formed batch, the shares of
    batches run inline on the event loop (Note [Inline fast batches]) and held for
    requests on their way (Note [Opportunistic batching]), the share of region calls
    that ran specialized, and the JIT's compile seconds in the replica."""
    d = {k: after[k] - before[k] for k in after}
    regions = d["specialized_region_calls"] + d["interpreted_region_calls"]
    return {"requests_per_batch": round(d["batched_requests"] / d["batches"], 2)
            if d["batches"] else None,
            "inline_share": round(d["inline_batches"] / d["batches"], 3)
            if d["batches"] else None,
            "held_share": round(d["held_batches"] / d["batches"], 3)
            if d["batches"] else None,
            "specialized_share": round(d["specialized_region_calls"] / regions, 3)
            if regions else None,
            "compile_s": round(d["compile_seconds"], 3)}


def _check_same_answer(ports: dict, paths: dict, body) -> np.ndarray:
    """Both systems answer the same body with the same numbers (within float noise);
    returns dynvm's answer."""
    got = {}
    for system, path in paths.items():
        conn = http.client.HTTPConnection("127.0.0.1", ports[system], timeout=120)
        conn.request("POST", path, body=body[0], headers=body[1])
        response = conn.getresponse()
        raw = response.read()
        conn.close()
        if response.status != 200:
            raise SystemExit(f"{system} answered {response.status}: {raw[:300]!r}")
        got[system] = np.asarray(json.loads(raw)["outputs"][0]["data"], dtype=np.float32)
    if not np.allclose(got["dynvm"], got["plain"], atol=1e-4, rtol=1e-4):
        raise SystemExit("dynvm and plain Serve disagree on the same request")
    return got["dynvm"]


# ---------------------------------------------------------------------- ingress pairs


def _alternate_ingress(args) -> int:
    """`--alternate-ingress N`: N pairs of sessions, one in Serve's proxy ingress and one
    in its direct ingress, each this script in a subprocess with its own Ray (Serve's
    ingress is one mode per cluster); the order alternates pair by pair (proxy first,
    then direct first) so that a drift of the host's load falls on both."""
    passed = ["--seconds", str(args.seconds), "--repeats", str(args.repeats),
              "--warmup", str(args.warmup), "--models", args.models,
              "--clients", args.clients, "--encodings", args.encodings,
              *(["--force-promote"] if args.force_promote else []),
              *(["--no-jit"] if args.no_jit else []), *(["--floor"] if args.floor else [])]
    tmp = tempfile.mkdtemp(prefix="serve-compare-ingress-")
    sessions = []
    for pair in range(args.alternate_ingress):
        for ingress in ("proxy", "direct") if pair % 2 == 0 else ("direct", "proxy"):
            out = os.path.join(tmp, f"{pair}-{ingress}.json")
            session = {"pair": pair, "ingress": ingress,
                       "start_utc": time.strftime("%H:%M:%S", time.gmtime()),
                       "load_start": round(os.getloadavg()[0], 1)}
            print(f"\n=== pair {pair}, {ingress} ingress, {session['start_utc']} UTC, "
                  f"load {session['load_start']}", flush=True)
            code = subprocess.call([sys.executable, os.path.abspath(__file__), *passed,
                                    "--ingress", ingress, "--json", out])
            if code:
                raise SystemExit(f"the {ingress} session of pair {pair} failed ({code})")
            with open(out) as f:
                session["runs"] = json.load(f)["runs"]
            session["load_end"] = round(os.getloadavg()[0], 1)
            sessions.append(session)
    _print_ingress_pairs(sessions)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"sessions": sessions}, out, indent=1)
    return 0


def _print_ingress_pairs(sessions: list[dict]) -> None:
    """Per pair of sessions and per (model, encoding, clients): each system's median
    req/s in each ingress, and the ratios that split dynvm's gain from the ingress's."""
    ratios = {"ingress alone: plain direct / plain proxy": ("plain", "direct", "plain",
                                                           "proxy"),
              "dynvm alone: dynvm direct / plain direct": ("dynvm", "direct", "plain",
                                                          "direct"),
              "dynvm direct / plain proxy": ("dynvm", "direct", "plain", "proxy"),
              "dynvm proxy / plain proxy": ("dynvm", "proxy", "plain", "proxy")}
    keys = sorted({(r["model"], r["encoding"], r["clients"])
                   for s in sessions for r in s["runs"]})
    print("\nper pair of sessions (median req/s over each session's runs; p50 ms):")
    for key in keys:
        print(f"  {key[0]} {key[1]} {key[2]} clients:")
        by_ratio: dict[str, list[float]] = {name: [] for name in ratios}
        for pair in sorted({s["pair"] for s in sessions}):
            medians, loads, p50s = {}, [], []
            for session in (s for s in sessions if s["pair"] == pair):
                loads.append(f"{session['ingress']} {session['start_utc']} load "
                             f"{session['load_start']}->{session['load_end']}")
                for system in ("dynvm", "plain", "floor"):
                    rows = [r for r in session["runs"] if r["system"] == system
                            and (r["model"], r["encoding"], r["clients"]) == key]
                    if rows:
                        rps = statistics.median(r["rps"] for r in rows)
                        medians[(system, session["ingress"])] = rps
                        p50s.append(f"{system} {session['ingress']} {rps:.1f} "
                                    f"({statistics.median(r['p50_ms'] or 0 for r in rows):.1f})")
            line = []
            for name, (a, a_in, b, b_in) in ratios.items():
                if medians.get((b, b_in)) and (a, a_in) in medians:
                    by_ratio[name].append(medians[(a, a_in)] / medians[(b, b_in)])
                    line.append(f"{name.split(':')[0]} {by_ratio[name][-1]:.2f}")
            print(f"    pair {pair} ({'; '.join(loads)}): {', '.join(p50s)}")
            print(f"      {'; '.join(line)}")
        for name, values in by_ratio.items():
            if values:
                print(f"    {name}: {', '.join(f'{v:.2f}' for v in values)} (median "
                      f"{statistics.median(values):.2f})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=8.0,
                        help="seconds of 8-client load per system before timing")
    parser.add_argument("--models", default="recommender,transformer")
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--encodings", default="json,binary,grpc")
    parser.add_argument("--force-promote", action="store_true",
                        help="JIT promotes every recurring shape (default: its policy)")
    parser.add_argument("--no-jit", action="store_true",
                        help="dynvm's interpreter alone (what the request path costs "
                        "without the JIT's compiles in the replica)")
    parser.add_argument("--floor", action="store_true",
                        help="a third system over JSON: Serve alone (a fixed answer, "
                        "no parsing, no model) on dynvm's replica settings")
    parser.add_argument("--ingress", choices=("proxy", "direct"), default="proxy",
                        help="Serve's ingress for every system of this session")
    parser.add_argument("--alternate-ingress", type=int, metavar="N",
                        help="N pairs of sessions, proxy and direct alternating, each its "
                        "own Ray (a subprocess running this script)")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    if args.alternate_ingress:
        return _alternate_ingress(args)

    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    import dynvm
    from bench import _grpc_load
    from dynvm.cluster import serve_models
    from dynvm.cluster.protocol._http_front import model_app_name
    from dynvm.cluster.protocol.grpc_v2 import grpc_options
    from dynvm.cluster.protocol.ingress import direct_addresses, ingress_environment
    from dynvm.cluster.protocol.proxy_guard import ProxyLimits
    from dynvm.jit.config import JitConfig
    from tests.cluster._redis_server import free_port

    limits = ProxyLimits()
    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", **limits.environment(),
                       **ingress_environment(args.ingress)})
    port, grpc_port = free_port(), free_port()
    direct = args.ingress == "direct"
    encodings = [e for e in args.encodings.split(",") if not (direct and e == "grpc")]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, "
          f"ingress {args.ingress}", flush=True)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False, namespace="serve-compare")
    runs = []
    try:
        serve.start(http_options=limits.http_options("127.0.0.1", port),
                    grpc_options=grpc_options(grpc_port))
        tmp = tempfile.mkdtemp(prefix="serve-compare-")
        demos, paths = {}, {}
        for name in args.models.split(","):
            demo = _model(name)
            program = dynvm.compile(demo.module.eval(), demo.example_inputs,  # safe: nn.Module.eval
                                    demo.dynamic_shapes, name=name)
            paths[name] = os.path.join(tmp, f"{name}.dvm")
            dynvm.save(program, paths[name])
            demos[name] = (demo, [spec.name for spec in program.inputs])
        started = time.perf_counter()
        # What `dynvm serve` runs: the JIT's own policy decides what pays to compile
        # (`--force-promote`: the tests' settings, which promote every recurring shape).
        jit = (False if args.no_jit else
               JitConfig(min_recurrence=2, max_recurrence=4, horizon_calls=10**7)
               if args.force_promote else JitConfig())
        serve_models(paths, device="cpu", num_cpus=1.0, jit=jit, ingress=args.ingress)
        print(f"dynvm deployed in {time.perf_counter() - started:.1f} s", flush=True)
        plain = _plain_deployment()
        started = time.perf_counter()
        serve.run_many([RunTarget(plain.options(name=f"Plain-{name}",
                                                ray_actor_options={"num_cpus": 1.0}
                                                ).bind(demos[name][0].module),
                                  name=f"plain-{name}",
                                  route_prefix=f"{PLAIN_PREFIX}/v2/models/{name}")
                        for name in paths])
        print(f"plain deployed in {time.perf_counter() - started:.1f} s", flush=True)
        if args.floor:
            serve.run(_floor_deployment().bind(), name="floor", route_prefix="/floor")
        # Each application's replica port in direct ingress, else the proxy's for all.
        apps = {name: {"dynvm": model_app_name(name), "plain": f"plain-{name}",
                       **({"floor": "floor"} if args.floor else {})} for name in paths}
        addresses = (direct_addresses({app for by in apps.values() for app in by.values()})
                     if direct else {})
        ports = {name: {system: addresses[app][0][1] if direct else port
                        for system, app in by.items()} for name, by in apps.items()}
        print("model        enc     clients system  run  req/s    p50_ms   p99_ms  fails  "
              "CPU ms/req: replica proxy client host", flush=True)
        for name in paths:
            demo, names = demos[name]
            routes = {"dynvm": f"/v2/models/{name}/infer",
                      "plain": f"{PLAIN_PREFIX}/v2/models/{name}/infer"}
            answer = _check_same_answer(ports[name], routes,
                                        _bodies(demo, name, names, False, 1)[0])
            pids = _serve_pids({"dynvm": model_app_name(name), "plain": f"plain-{name}",
                                "floor": "floor"})
            pids["client"] = os.getpid()
            print(f"pids: {pids}", flush=True)  # for a profiler attached from outside
            for encoding in encodings:
                if encoding == "grpc":  # dynvm only (the plain deployment has no gRPC)
                    requests = _grpc_load.grpc_requests(_tensor_sets(demo, name), names)
                    got = _grpc_load.answer(f"127.0.0.1:{grpc_port}", name,
                                            model_app_name(name), requests[0])
                    if not np.allclose(got.flatten(), answer, atol=1e-4, rtol=1e-4):
                        raise SystemExit("dynvm answers gRPC and HTTP differently")

                    def run(system, clients, seconds, requests=requests, name=name):
                        return _grpc_load.closed_loop(
                            f"127.0.0.1:{grpc_port}", name, model_app_name(name),
                            requests, clients, seconds)
                    systems = ("dynvm",)
                else:
                    bodies = _bodies(demo, name, names, encoding == "binary")
                    targets = ({**routes, "floor": "/floor"}
                               if args.floor and encoding == "json" else routes)

                    def run(system, clients, seconds, bodies=bodies, targets=targets,
                            by_system=ports[name]):
                        return _closed_loop(by_system[system], targets[system], bodies,
                                            clients, seconds)
                    systems = tuple(targets)
                for system in systems:  # warm-up (JIT compiles) untimed
                    run(system, 8, args.warmup)
                for clients in (int(c) for c in args.clients.split(",")):
                    for repeat in range(args.repeats):
                        for system in systems:
                            roles = {"replica": system, "proxy": "proxy",
                                     "client": "client"}
                            counters = (_replica_counters(ports[name]["dynvm"], name)
                                        if system == "dynvm" else None)
                            cpu = {role: _cpu_seconds(pids.get(key))
                                   for role, key in roles.items()}
                            host = _host_busy_seconds()
                            result = run(system, clients, args.seconds)
                            answered = result["rps"] * args.seconds
                            # Each process's CPU per answered request (ms): the replica's
                            # is what the side-by-side req/s cannot separate from the
                            # host's load; the proxy's and the client's (this process:
                            # its threads and Ray's) say how much of the 2 cores is left.
                            for role, key in roles.items():
                                result[f"{role}_cpu_ms"] = (round(1000 * (_cpu_seconds(
                                    pids.get(key)) - cpu[role]) / answered, 3)
                                    if answered and key in pids else None)
                            result["host_cpu_ms"] = (round(1000 * (
                                _host_busy_seconds() - host) / answered, 3)
                                if answered else None)
                            if counters is not None:
                                result["dynvm_replica"] = _batching_summary(
                                    counters, _replica_counters(ports[name]["dynvm"], name))
                            row = {"ingress": args.ingress, "model": name,
                                   "encoding": encoding, "clients": clients,
                                   "system": system, "repeat": repeat,
                                   "load": round(os.getloadavg()[0], 1), **result}
                            runs.append(row)
                            print(f"{name:12} {encoding:7} {clients:7} {system:7} "
                                  f"{repeat:3}  {result['rps']:7}  {result['p50_ms']!s:7}  "
                                  f"{result['p99_ms']!s:7}  {result['failures']:5}  "
                                  f"{result['replica_cpu_ms']} {result['proxy_cpu_ms']} "
                                  f"{result['client_cpu_ms']} {result['host_cpu_ms']}  "
                                  f"{result.get('dynvm_replica', '')}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("\nmedian over repeats (req/s, p50 ms; CPU ms per request: replica, host):")
    keys = sorted({(r["model"], r["encoding"], r["clients"]) for r in runs})
    for key in keys:
        line = []
        for system in ("dynvm", "plain", "floor"):
            rows = [r for r in runs if (r["model"], r["encoding"], r["clients"]) == key
                    and r["system"] == system]
            if not rows:  # gRPC: dynvm only; floor: with --floor, JSON only
                continue
            rps = statistics.median(r["rps"] for r in rows)
            p50 = statistics.median(r["p50_ms"] or float("nan") for r in rows)
            cpu = "".join(f", {role} {statistics.median(values):.2f}"
                          for role in ("replica", "host")
                          if (values := [r[f"{role}_cpu_ms"] for r in rows
                                         if r.get(f"{role}_cpu_ms") is not None]))
            line.append(f"{system} {rps:.1f} req/s p50 {p50:.1f} ms{cpu}")
        print(f"  {key[0]:12} {key[1]:7} {key[2]} clients: " + " | ".join(line))
        # Runs alternate, so pair each dynvm run with the plain run right after it.
        pairs = [d["rps"] / p["rps"] for d, p in zip(
            *([r for r in runs if (r["model"], r["encoding"], r["clients"]) == key
               and r["system"] == system] for system in ("dynvm", "plain"))) if p["rps"]]
        if pairs:
            print(f"    dynvm / plain req/s per pair: "
                  f"{', '.join(f'{x:.2f}' for x in pairs)} (median "
                  f"{statistics.median(pairs):.2f})")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"runs": runs}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
