"""Interpreter vs eager PyTorch on the demo Transformer (seq 32), batch 1, 4, 16, 64.

    python bench/interp_overhead.py [--calls N] [--threads T]

Both run in one process, interleaved call by call (eager, then dynvm, on the same input)
so that machine noise hits both alike; the table shows the median of each and their
ratio. Eager runs under torch.inference_mode, as a serving stack would run it.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import dynvm
from dynvm.models import transformer


def measure(fn, x, calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(x)
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per batch size")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batches", default="1,4,16,64")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    demo = transformer()
    runtime = dynvm.Runtime(dynvm.compile(demo.module, demo.example_inputs,
                                          demo.dynamic_shapes, name="transformer"),
                            jit=False)

    def eager(x):
        with torch.inference_mode():
            return demo.module(x)

    print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {args.threads} threads, {args.calls} calls each")
    print("| batch | eager median ms | dynvm interpreter median ms | interp / eager |")
    print("|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        x = torch.randn(batch, 32, 256)
        for _ in range(5):  # warm both: allocator, kernels' first-call setup
            eager(x)
            runtime(x)
        eager_s, interp_s = [], []
        for _ in range(args.calls):
            eager_s += measure(eager, x, 1)
            interp_s += measure(runtime, x, 1)
        e, i = statistics.median(eager_s), statistics.median(interp_s)
        print(f"| {batch} | {e * 1e3:.3f} | {i * 1e3:.3f} | {i / e:.3f} |")


if __name__ == "__main__":
    main()
