"""Which v2 transport for which tensor size: JSON, the binary-tensor extension (both
HTTP) and gRPC, one client, through `dynvm serve`'s stack.

    python bench/transport_sizes.py [--rows 1,16,256] [--seconds 4]

A model that costs next to nothing (x * 2 over float32 [rows, 4096]; rows 1, 16, 256
are 16 KiB, 256 KiB and 4 MiB in and out) so that what is measured is the transport:
tritonclient's own encoding, the proxy, the replica's parsing and the response. One
local Ray + Serve with the gRPC proxy on (`start_serve(grpc_port=...)`), one replica,
JIT off. Per size and transport: one checked answer, then requests back to back for
`--seconds`; prints requests/s and p50 ms.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

WIDTH = 4096


class Double(torch.nn.Module):
    """x * 2: the cheapest model whose output is as large as its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


def _time(call, seconds: float) -> dict:
    latencies = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        start = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - start)
    latencies.sort()
    return {"rps": round(len(latencies) / seconds, 1),
            "p50_ms": round(1000 * latencies[len(latencies) // 2], 2)}


def _clients(port: int, grpc_port: int, x: np.ndarray) -> dict:
    """transport -> a call that sends `x` and returns output__0."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from dynvm.cluster.protocol._http_front import model_app_name

    http = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=600)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    calls = {}
    for binary in (False, True):
        item = httpclient.InferInput("x", list(x.shape), "FP32")
        item.set_data_from_numpy(x, binary_data=binary)
        wanted = [httpclient.InferRequestedOutput("output__0", binary_data=binary)]
        calls["binary" if binary else "json"] = (
            lambda item=item, wanted=wanted:
            http.infer("double", [item], outputs=wanted).as_numpy("output__0"))
    item = grpcclient.InferInput("x", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    headers = {"application": model_app_name("double")}
    calls["grpc"] = lambda: grpc.infer("double", [item], headers=headers).as_numpy("output__0")
    return calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,256")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    import dynvm
    from dynvm.cluster import ServingConfig, serve_models, start_serve
    from dynvm.cluster.protocol.proxy_guard import ProxyLimits
    from dynvm.cluster.store._local_redis import free_port

    proxy = ProxyLimits()
    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", **proxy.environment()})
    port, grpc_port = free_port(), free_port()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    rows = torch.export.Dim("rows", min=1, max=1024)
    program = dynvm.compile(Double(), (torch.randn(2, WIDTH),), ({0: rows},), name="double")
    path = os.path.join(tempfile.mkdtemp(prefix="transport-sizes-"), "double.dvm")
    dynvm.save(program, path)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, namespace="transport-sizes")
    try:
        start_serve("127.0.0.1", port, proxy, grpc_port=grpc_port)
        serve_models({"double": path}, ServingConfig(device="cpu", jit=False))
        print("rows  KiB     transport  req/s   p50_ms", flush=True)
        for count in (int(r) for r in args.rows.split(",")):
            x = np.random.default_rng(count).standard_normal((count, WIDTH), np.float32)
            for transport, call in _clients(port, grpc_port, x).items():
                if not np.array_equal(call(), x * 2):
                    raise SystemExit(f"{transport}: wrong answer at {count} rows")
                result = _time(call, args.seconds)
                print(f"{count:4}  {x.nbytes // 1024:6}  {transport:9}  {result['rps']:6}  "
                      f"{result['p50_ms']:7}  (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
