"""Shape jitter: does dynvm keep compiles bounded and family kernels fast?

    python -m bench.jitter [--workload jitter|nlp|gnn|all] [--calls 1000] [--threads T]

Workloads (dynvm.models):
  jitter  the demo Transformer, batch uniform over 1..64, seq 32
  nlp     the demo Transformer, batch 8, seq uniform over 8..128
  gnn     the message-passing GNN, node and edge counts drawn per call

For each, the interpreter and the JIT run the same input sequence side by side, call by
call. Reported: distinct signatures seen, compiles (family kernels and exact), the
compile bound (compiles <= distinct / 10), steady-state p50 of both systems, the p50 of
family kernels against exact specializations on shapes that have both (measured side
by side on a second runtime compiled exact-only), and allocations per forward.
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import torch

import dynvm
from bench._timing import median
from dynvm.jit.config import JitConfig
from dynvm.models import get, transformer

EXACT_ONLY = JitConfig(families=False, sync=True, min_recurrence=1, max_recurrence=1,
                       expected_speedup=1.0, horizon_calls=10**9)


def workload(name: str, calls: int, seed: int):
    rng = random.Random(seed)
    if name == "gnn":
        demo = get("gnn")
        return demo, [demo.sample_inputs(rng) for _ in range(calls)]
    demo = transformer()
    if name == "jitter":
        shapes = [(rng.randint(1, 64), 32) for _ in range(calls)]
    else:
        shapes = [(8, rng.randint(8, 128)) for _ in range(calls)]
    cache: dict = {}
    inputs = []
    for shape in shapes:
        if shape not in cache:
            cache[shape] = (torch.randn(*shape, 256),)
        inputs.append(cache[shape])
    return demo, inputs


def signature_of(inputs) -> tuple:
    return tuple(tuple(t.shape) for t in inputs)


def run(name: str, calls: int, warmup: int, seed: int) -> None:
    demo, inputs = workload(name, calls, seed)
    program = dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes, name=name)
    interp = dynvm.Runtime(program, jit=False)
    jit = dynvm.Runtime(program)
    times = {"interpreter": [], "JIT": []}
    for args in inputs:
        for label, runtime in (("interpreter", interp), ("JIT", jit)):
            start = time.perf_counter()
            runtime(*args)
            times[label].append(time.perf_counter() - start)
    stats = jit.stats()
    distinct = len({signature_of(args) for args in inputs})
    bound = distinct / 10
    print(f"\n## {name}: {calls} calls, {distinct} distinct signatures")
    print(f"compiles {stats['compiles']} ({stats['family_compiles']} family kernels, "
          f"{stats['compiles'] - stats['family_compiles']} exact), bound {bound:.1f}: "
          f"{'OK' if stats['compiles'] <= bound else 'OVER'}; "
          f"{stats['compile_seconds']:.2f} s compiling; specialized "
          f"{stats['specialized_region_calls']} / interpreted "
          f"{stats['interpreted_region_calls']} region calls; deopts {stats['deopts']}")
    steady = {label: median(samples[warmup:]) for label, samples in times.items()}
    ratio = steady["JIT"] / steady["interpreter"]
    print(f"steady-state p50: interpreter {steady['interpreter'] * 1e3:.3f} ms, JIT "
          f"{steady['JIT'] * 1e3:.3f} ms (JIT / interpreter {ratio:.3f})")
    compare_family_exact(jit, program, inputs)
    compare_allocations(interp, jit, inputs)
    jit.close()


def _served_by_family(jit, args) -> bool:
    region = jit.jit.regions.get(0)
    if region is None:
        return False
    jit(*args)  # make sure the memo knows the signature
    signature = region._sign(list(args) + [None] * (region.live_in[-1] + 1))
    return signature not in region.strong and signature in region._memo


def compare_family_exact(jit, program, inputs, shapes: int = 6, reps: int = 15) -> None:
    chosen = []
    for args in inputs:
        if len(chosen) == shapes:
            break
        if signature_of(args) not in {signature_of(c) for c in chosen} and \
                _served_by_family(jit, args):
            chosen.append(args)
    if not chosen:
        print("family vs exact: no shape served by a family kernel")
        return
    exact = dynvm.Runtime(program, jit=EXACT_ONLY)
    for args in chosen:
        exact(*args)
        exact(*args)
    print("| shape | family kernel p50 ms | exact p50 ms | family / exact |")
    print("|---|---:|---:|---:|")
    ratios = []
    for args in chosen:
        family_s, exact_s = [], []
        for _ in range(reps):
            for samples, runtime in ((family_s, jit), (exact_s, exact)):
                start = time.perf_counter()
                runtime(*args)
                samples.append(time.perf_counter() - start)
        ratio = median(family_s) / median(exact_s)
        ratios.append(ratio)
        print(f"| {signature_of(args)} | {median(family_s) * 1e3:.3f} | "
              f"{median(exact_s) * 1e3:.3f} | {ratio:.3f} |")
    print(f"family / exact, median over shapes: {median(ratios):.3f}")
    exact.close()


def compare_allocations(interp, jit, inputs, samples: int = 4) -> None:
    picked = inputs[-samples:]
    before = [interp.measure_allocations(*args) for args in picked]
    after = [jit.measure_allocations(*args) for args in picked]
    reduction = 1 - sum(after) / max(1, sum(before))
    print(f"allocations per forward (last {samples} calls): interpreter {before}, JIT "
          f"{after}: {reduction:.0%} fewer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="all", choices=["jitter", "nlp", "gnn", "all"])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=200,
                        help="calls excluded from the steady-state figures")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# bench.jitter: {platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} threads, seed {args.seed}")
    names = ["jitter", "nlp", "gnn"] if args.workload == "all" else [args.workload]
    for name in names:
        run(name, args.calls, min(args.warmup, args.calls // 2), args.seed)


if __name__ == "__main__":
    main()
