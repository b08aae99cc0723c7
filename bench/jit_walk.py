"""The design article's walk: the demo Transformer (seq 32) with the batch size on a
random walk over {1, 4, 16, 64}; eager PyTorch, the dynvm interpreter and the dynvm JIT
side by side, call by call, on the same inputs.

    python bench/jit_walk.py [--calls 500] [--warmup 50] [--threads 2] [--seed 0]

Reports, per system: steady-state p50/p99 per batch size, the largest single call during
warm-up and after, compiles and compile seconds, and the first call after a batch-size
switch against the second call.
"""

from __future__ import annotations

import platform
import time

import torch

import dynvm
from bench._timing import BATCHES, SEQ, median, percentile, random_walk, walk_setup
from dynvm.jit.config import JitConfig


def main() -> None:
    args, demo, program = walk_setup(__doc__.splitlines()[0], calls=500, warmup=50)
    interp = dynvm.Runtime(program, jit=False)
    jit = dynvm.Runtime(program, jit=JitConfig())

    def eager(x):
        with torch.inference_mode():
            return demo.module(x)

    systems = {"eager": eager, "dynvm interpreter": interp, "dynvm JIT": jit}
    walk = random_walk(BATCHES, args.calls, args.seed)
    inputs = {b: torch.randn(b, SEQ, 256) for b in BATCHES}
    latency = {name: [] for name in systems}
    start_wall = time.perf_counter()
    for batch in walk:
        x = inputs[batch]
        for name, fn in systems.items():
            t0 = time.perf_counter()
            fn(x)
            latency[name].append(time.perf_counter() - t0)
    wall = time.perf_counter() - start_wall
    jit_stats = jit.stats()
    jit.close()
    report(args, walk, latency, jit_stats, wall)


def report(args, walk, latency, jit_stats, wall) -> None:
    warm = args.warmup
    print(f"# jit_walk: {platform.machine()}, torch {torch.__version__}, {args.threads} "
          f"threads, {args.calls} calls ({warm} warm-up), seq {SEQ}, seed {args.seed}, "
          f"wall {wall:.1f} s for all systems")
    print("\n| system | batch | calls | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|")
    for name, samples in latency.items():
        for batch in BATCHES:
            steady = [s for s, b in zip(samples[warm:], walk[warm:]) if b == batch]
            if steady:
                print(f"| {name} | {batch} | {len(steady)} | {median(steady) * 1e3:.3f} | "
                      f"{percentile(steady, 99) * 1e3:.3f} |")
    print("\n| system | max ms warm-up | max ms steady | p99 ms steady | first after switch "
          "/ second call (median ratio) |")
    print("|---|---:|---:|---:|---:|")
    for name, samples in latency.items():
        ratios = [samples[i] / samples[i + 1] for i in range(max(warm, 1), len(walk) - 1)
                  if walk[i] != walk[i - 1] and walk[i + 1] == walk[i]]
        print(f"| {name} | {max(samples[:warm]) * 1e3:.3f} | {max(samples[warm:]) * 1e3:.3f} "
              f"| {percentile(samples[warm:], 99) * 1e3:.3f} | "
              f"{median(ratios) if ratios else float('nan'):.3f} ({len(ratios)} switches) |")
    print(f"\ndynvm JIT: {jit_stats['compiles']} compiles, "
          f"{jit_stats['compile_seconds']:.3f} s compiling, "
          f"{jit_stats['specialized_region_calls']} specialized / "
          f"{jit_stats['interpreted_region_calls']} interpreted region calls, "
          f"{jit_stats['guard_failures']} guard failures, {jit_stats['deopts']} deopts, "
          f"{jit_stats['dropped_tasks']} dropped compile tasks")


if __name__ == "__main__":
    main()
