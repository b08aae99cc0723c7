"""Overhead of tracing: the demo Transformer walk (seq 32, batch on a random walk over
{1, 4, 16, 64}) through two JIT runtimes of the same program, one with telemetry
disabled and one tracing into an in-memory exporter, called alternately on the same
inputs (which goes first alternates too).

    python -m bench.tracing_overhead [--calls 200] [--warmup 40] [--seed 0]

Prints steady-state p50 per batch size for both and the ratio enabled / disabled.
"""

from __future__ import annotations

import platform
import time

import torch

import dynvm
from bench._timing import BATCHES, SEQ, median, random_walk, walk_setup
from dynvm.jit.config import JitConfig
from dynvm.telemetry import Telemetry


def main() -> None:
    args, demo, program = walk_setup(__doc__.splitlines()[0], calls=200, warmup=40)
    telemetry, exporter = Telemetry.in_memory()
    systems = {"disabled": dynvm.Runtime(program, jit=JitConfig()),
               "in-memory": dynvm.Runtime(program, jit=JitConfig(), telemetry=telemetry)}
    walk = random_walk(BATCHES, args.calls, args.seed)
    inputs = {b: torch.randn(b, SEQ, 256) for b in BATCHES}
    latency = {name: [] for name in systems}
    order = list(systems)
    for step, batch in enumerate(walk):
        for name in order if step % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            systems[name](inputs[batch])
            latency[name].append(time.perf_counter() - t0)
    spans = len(exporter.get_finished_spans())
    compiles = {name: rt.stats()["compiles"] for name, rt in systems.items()}
    for rt in systems.values():
        rt.close()
    warm = args.warmup
    print(f"# tracing_overhead: {platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} threads, {args.calls} calls ({warm} warm-up), seq {SEQ}, "
          f"seed {args.seed}; compiles {compiles}; {spans} spans exported")
    print("\n| batch | calls | p50 ms disabled | p50 ms in-memory | ratio |")
    print("|---:|---:|---:|---:|---:|")
    ratios = []
    for batch in BATCHES:
        p50 = {}
        for name, samples in latency.items():
            steady = [s for s, b in zip(samples[warm:], walk[warm:]) if b == batch]
            p50[name] = median(steady) if steady else None
        if p50["disabled"] is None:
            continue
        ratio = p50["in-memory"] / p50["disabled"]
        ratios.append(ratio)
        calls = sum(1 for b in walk[warm:] if b == batch)
        print(f"| {batch} | {calls} | {p50['disabled'] * 1e3:.3f} | "
              f"{p50['in-memory'] * 1e3:.3f} | {ratio:.3f} |")
    overall = median(latency["in-memory"][warm:]) / median(latency["disabled"][warm:])
    print(f"\noverall steady p50 ratio {overall:.3f}; median of per-batch ratios "
          f"{median(ratios):.3f}")


if __name__ == "__main__":
    main()
