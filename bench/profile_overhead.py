"""Cost of recording shapes: the interpreter with the JIT's profiling slots attached but
promotion impossible, against the pure interpreter, side by side on the demo
Transformer (seq 32). Also the cost of one strong signature of a region's live-ins.

    python -m bench.profile_overhead [--calls 300] [--threads T]
"""

from __future__ import annotations

import argparse
import time
import timeit

import torch

import dynvm
from bench._timing import median
from dynvm.jit.config import JitConfig
from dynvm.jit.signature import strong_signer
from dynvm.models import transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    demo = transformer()
    program = dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes)
    plain = dynvm.Runtime(program, jit=False)
    # expected_speedup=0: every signature is recorded, none is ever worth compiling.
    profiled = dynvm.Runtime(program, jit=JitConfig(expected_speedup=0.0))
    print(f"# profile_overhead: torch {torch.__version__}, {args.threads} threads, "
          f"{args.calls} interleaved calls per batch size")
    print("| batch | interpreter ms | interpreter + profiling ms | ratio |")
    print("|---:|---:|---:|---:|")
    for batch in (1, 4, 16, 64):
        x = torch.randn(batch, 32, 256)
        a, b = [], []
        for _ in range(5):
            plain(x)
            profiled(x)
        for _ in range(args.calls):
            t0 = time.perf_counter()
            plain(x)
            t1 = time.perf_counter()
            profiled(x)
            t2 = time.perf_counter()
            a.append(t1 - t0)
            b.append(t2 - t1)
        print(f"| {batch} | {median(a) * 1e3:.3f} | {median(b) * 1e3:.3f} | "
              f"{median(b) / median(a):.4f} |")
    assert profiled.stats()["compiles"] == 0
    sign = strong_signer((0,))
    regs = [torch.randn(4, 32, 256)]
    per_call = min(timeit.repeat(lambda: sign(regs), number=10000, repeat=5)) / 10000
    print(f"\nstrong signature of one tensor live-in: {per_call * 1e6:.2f} us")


if __name__ == "__main__":
    main()
