"""Closed-loop load over the v2 gRPC protocol, for bench/serve_compare.py's "grpc" rows.

`clients` threads, each with its own tritonclient.grpc channel (as each HTTP client
thread keeps its own connection), send the same tensors as the JSON and binary runs
(raw_input_contents, what tritonclient sends) to one model through Serve's gRPC ingress,
back to back, for `seconds`; the result has serve_compare's keys (rps, p50_ms, p99_ms,
failures). Only dynvm answers gRPC: the plain Serve deployment has no gRPC servicer, as
a plain Serve user would not write one in twenty lines.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import torch

from bench._timing import percentile

_DATATYPES = {torch.float32: "FP32", torch.int64: "INT64"}


def _client(address: str):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(address)


def grpc_requests(tensor_sets, names: list[str]) -> list[list]:
    """One tritonclient InferInput list per tensor list (the same bodies as the JSON
    runs, sent as raw bytes). The inputs are only read by `infer`, so threads share them."""
    import tritonclient.grpc as grpcclient

    requests = []
    for tensors in tensor_sets:
        inputs = []
        for name, tensor in zip(names, tensors, strict=True):
            item = grpcclient.InferInput(name, list(tensor.shape), _DATATYPES[tensor.dtype])
            item.set_data_from_numpy(tensor.contiguous().numpy())
            inputs.append(item)
        requests.append(inputs)
    return requests


def answer(address: str, model: str, application: str, inputs) -> np.ndarray:
    """output__0 of one gRPC infer (serve_compare checks it against the HTTP answer)."""
    client = _client(address)
    try:
        return client.infer(model, inputs, headers={"application": application}) \
            .as_numpy("output__0")
    finally:
        client.close()


def closed_loop(address: str, model: str, application: str, requests, clients: int,
                seconds: float) -> dict:
    """`clients` threads in a closed loop over `requests` (picked at random per call)
    for `seconds`: requests/s, p50 and p99 latency (ms) and the failures."""
    from tritonclient.utils import InferenceServerException

    latencies: list[list[float]] = [[] for _ in range(clients)]
    failures = [0] * clients
    gate = threading.Barrier(clients + 1)
    headers = {"application": application}

    def worker(index: int) -> None:
        client = _client(address)
        rng = random.Random(index)
        gate.wait()
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            inputs = requests[rng.randrange(len(requests))]
            sent = time.perf_counter()
            try:
                client.infer(model, inputs, headers=headers)
                latencies[index].append(time.perf_counter() - sent)
            except InferenceServerException:
                failures[index] += 1
        client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    gate.wait()
    for thread in threads:
        thread.join()
    done = [x for xs in latencies for x in xs]
    if not done:
        return {"rps": 0.0, "p50_ms": None, "p99_ms": None, "failures": sum(failures)}
    return {"rps": round(len(done) / seconds, 1),
            "p50_ms": round(1000 * percentile(done, 50), 2),
            "p99_ms": round(1000 * percentile(done, 99), 2),
            "failures": sum(failures)}
