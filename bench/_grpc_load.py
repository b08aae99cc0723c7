"""Closed-loop load over the v2 gRPC protocol, for bench/serve_compare.py's "grpc" rows.

`clients` threads, each with its own tritonclient.grpc channel (as each HTTP client
thread keeps its own connection), send the same tensors as the JSON and binary runs
(raw_input_contents, what tritonclient sends) to one model through Serve's gRPC ingress,
back to back, for `seconds` (bench/_closed_loop.py, as serve_compare's HTTP runs).
Only dynvm answers gRPC: the plain Serve deployment has no gRPC servicer, as a plain
Serve user would not write one in twenty lines.
"""

from __future__ import annotations

import numpy as np
import torch

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
    """bench._closed_loop over one tritonclient.grpc channel per thread."""
    from tritonclient.utils import InferenceServerException

    from bench._closed_loop import closed_loop as run

    headers = {"application": application}

    def send(client, inputs) -> tuple:
        try:
            client.infer(model, inputs, headers=headers)
            return client, True
        except InferenceServerException:
            return client, False

    return run(lambda: _client(address), send, requests, clients, seconds)
