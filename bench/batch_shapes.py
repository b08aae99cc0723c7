"""Shape-aware batching vs plain opportunistic batching, on a jittery trace, in process.

    python bench/batch_shapes.py [--seconds 6] [--clients 8] [--repeats 2] [--json out.json]

The recommender demo behind dynvm's `OpportunisticBatcher` (dynvm.cluster.serving._batcher) and
a real JIT (families on, then off): `--clients` asyncio clients in a closed loop, each
request 1..4 rows with a random 0..2 ms think time, so batches come in every size. Per
run: the share of formed batches whose VM call ran entirely specialized (the batcher's
`specialized_batch_ratio`, counted after a warm-up), requests/s, p50 latency, mean
requests per batch, splits and holds. Runs of the two modes alternate, each with a fresh
Runtime (a fresh JIT), so both see the same host load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import dynvm  # noqa: E402
from dynvm.cluster.serving._batcher import OpportunisticBatcher  # noqa: E402
from dynvm.cluster.serving.serving_config import BatchingOptions  # noqa: E402
from dynvm.jit.config import JitConfig  # noqa: E402
from dynvm.models import recommender  # noqa: E402

WARMUP_S = 2.0


def _inputs(demo, rows: int, seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    sample = demo.sample_inputs(rng)
    return [t[:rows] if t.shape[0] >= rows else
            t.repeat((rows + t.shape[0] - 1) // t.shape[0], *[1] * (t.dim() - 1))[:rows]
            for t in sample]


async def _run(program, demo, shape_aware: bool, families: bool, clients: int,
               seconds: float) -> dict:
    runtime = dynvm.Runtime(program, "cpu", jit=JitConfig(
        min_recurrence=2, max_recurrence=4, horizon_calls=10**7, families=families))
    pools = {rows: [_inputs(demo, rows, 10 * rows + k) for k in range(4)]
             for rows in range(1, 5)}

    def execute(items: list) -> list:
        sizes = [item[0].shape[0] for item in items]
        cat = [torch.cat([item[k] for item in items]) for k in range(len(items[0]))]
        specialized, interpreted = runtime.region_calls()
        out = runtime(*cat)
        now_specialized, now_interpreted = runtime.region_calls()
        batcher.record(sum(sizes), now_interpreted == interpreted
                       and now_specialized > specialized)
        return list(out.split(sizes))

    batcher = OpportunisticBatcher(execute, BatchingOptions(
        max_batch_size=8, max_delay_s=0.002, shape_aware=shape_aware))
    latencies: list[float] = []
    start = time.perf_counter()
    warm_at = start + WARMUP_S
    stop = warm_at + seconds
    snapshot: dict = {}

    async def client(c: int) -> None:
        rng = random.Random(c)
        while time.perf_counter() < stop:
            await asyncio.sleep(rng.uniform(0, 0.002))
            rows = rng.randint(1, 4)
            sent = time.perf_counter()
            await batcher.submit(rng.choice(pools[rows]), rows, "x")
            if sent >= warm_at:
                latencies.append(time.perf_counter() - sent)

    async def mark() -> None:
        await asyncio.sleep(WARMUP_S)
        snapshot.update(batcher.stats())

    await asyncio.gather(mark(), *(client(c) for c in range(clients)))
    end = batcher.stats()
    runtime.close()
    batcher.close()
    recorded = end["recorded_batches"] - snapshot["recorded_batches"]
    batches = end["batches"] - snapshot["batches"]
    return {"shape_aware": shape_aware, "families": families,
            "specialized_batch_share": round(
                (end["specialized_batches"] - snapshot["specialized_batches"])
                / max(1, recorded), 3),
            "requests_per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(1000 * statistics.median(latencies), 3) if latencies else None,
            "requests_per_batch": round(
                (end["batched_requests"] - snapshot["batched_requests"]) / max(1, batches), 2),
            "splits": end["split_batches"] - snapshot["split_batches"],
            "holds": end["held_batches"] - snapshot["held_batches"],
            "hot_sizes": end["hot_sizes"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    demo = recommender(max_batch=64)
    module = demo.module.eval()  # safe: nn.Module.eval, not Python's eval
    program = dynvm.compile(module, demo.example_inputs, demo.dynamic_shapes,
                            name="recommender")
    runs = []
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("families shape_aware  specialized_share  req/s   p50_ms  req/batch  splits  holds")
    for families in (True, False):
        for _ in range(args.repeats):
            for aware in (True, False):
                run = asyncio.run(_run(program, demo, aware, families, args.clients,
                                       args.seconds))
                runs.append(run)
                print(f"{families!s:8} {aware!s:11}  {run['specialized_batch_share']:17}  "
                      f"{run['requests_per_s']:6}  {run['p50_ms']:7}  "
                      f"{run['requests_per_batch']:9}  {run['splits']:6}  {run['holds']:5}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"load_average": os.getloadavg(), "runs": runs}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
