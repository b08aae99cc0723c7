"""The closed-loop load of the serving benchmarks (bench/serve_compare.py over HTTP,
bench/_grpc_load.py over gRPC): `clients` threads, each with its own connection, send
requests back to back, each picked at random, for `seconds`; the result is requests/s,
p50 and p99 latency (ms) of the answered requests, and the failures.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence


def closed_loop(connect: Callable[[], object], send: Callable[[object, object], tuple],
                requests: Sequence, clients: int, seconds: float) -> dict:
    """`connect()` makes one thread's connection (it has `close()`); `send(connection,
    request)` returns (the connection to go on with, whether the request succeeded), so
    that a sender may replace a connection that broke."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    failures = [0] * clients
    gate = threading.Barrier(clients + 1)

    def worker(index: int) -> None:
        connection = connect()
        rng = random.Random(index)
        gate.wait()
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            request = requests[rng.randrange(len(requests))]
            sent = time.perf_counter()
            connection, ok = send(connection, request)
            if ok:
                latencies[index].append(time.perf_counter() - sent)
            else:
                failures[index] += 1
        connection.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    gate.wait()
    for thread in threads:
        thread.join()
    done = sorted(x for xs in latencies for x in xs)
    if not done:
        return {"rps": 0.0, "p50_ms": None, "p99_ms": None, "failures": sum(failures)}
    return {"rps": round(len(done) / seconds, 1),
            "p50_ms": round(1000 * done[len(done) // 2], 2),
            "p99_ms": round(1000 * done[min(len(done) - 1, int(0.99 * len(done)))], 2),
            "failures": sum(failures)}
