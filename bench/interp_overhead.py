"""Interpreter vs eager PyTorch on the demo Transformer (seq 32), batch 1, 4, 16, 64.

    python bench/interp_overhead.py [--calls N] [--threads T]
    python -m bench.interp_overhead --zoo phi,vit,... [--rounds R]
    python -m bench.interp_overhead --workloads gnn,loop [--workload-calls N]

With --zoo: per zoo model, two interpreter Runtimes (A and B) and the JIT, interleaved
call by call on the model's shapes (the order rotating), after the JIT has settled as
in `dynvm bench zoo` (Note [Zoo timing] in bench/zoo.py): the median of B / A per call is
the A/A noise floor (the same code against itself, so any distance from 1.000 and its
p10-p90 spread are what noise alone gives), beside the median of JIT / A. The three
systems run in each of the six orders in turn (see zoo_aa). A JIT / A
inside the A/A band is "no slower than the interpreter" at the margin measured.

Both run in one process, interleaved call by call (eager, then dynvm, on the same input)
so that machine noise hits both alike; the table shows the median of each and their
ratio. Eager runs under torch.inference_mode, as a serving stack would run it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
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


def _quantiles(ratios: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(ratios, n=10)
    return cuts[0], statistics.median(ratios), cuts[-1]


def zoo_aa(models: list[str], rounds: int, warmup: int = 8) -> None:
    """The A/A noise floor and JIT / interpreter per zoo model (module docstring)."""
    from bench.zoo import _drain, _registry, _settle

    zoo, harness = _registry()
    entries = {e.name: e for e in zoo.entries()}
    print(f"# A/A: {platform.node()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {warmup} warm-up + {rounds} timed rounds, "
          f"load {os.getloadavg()[0]:.1f} at start")
    print("| model | B / A (A/A) p10 / p50 / p90 | JIT / A p10 / p50 / p90 | JIT spec. share |")
    print("|---|---|---|---:|")
    for name in models:
        entry = entries[name]
        compiled = harness.compile_entry(entry)
        points = [entry.export_point, *entry.held_out]
        inputs = [compiled.built.make_inputs(p, 100 + i) for i, p in enumerate(points)]
        a = dynvm.Runtime(compiled.program, jit=False)
        b = dynvm.Runtime(compiled.program, jit=False)
        jit = dynvm.Runtime(compiled.program, jit=dynvm.JitConfig())
        systems = {"a": a, "b": b, "jit": jit}
        for _ in range(warmup):
            for x in inputs:
                _drain(jit)
                for runtime in systems.values():
                    runtime(*x)
        _settle(jit, inputs)
        before = jit.stats()
        ratios = {"b": [], "jit": []}
        # All six orders in turn, not the three rotations of one: with rotations each
        # system runs right after a given other one in 2 calls of 3, and the one that runs
        # second on the same input finds it (and the weights) in cache: A/A measured
        # B / A = 0.95 that way.
        orders = list(itertools.permutations(systems))
        for round_ in range(rounds):
            for index, x in enumerate(inputs):
                _drain(jit)
                seconds = {}
                for key in orders[(round_ * len(inputs) + index) % len(orders)]:
                    start = time.perf_counter()
                    systems[key](*x)
                    seconds[key] = time.perf_counter() - start
                for key in ratios:
                    ratios[key].append(seconds[key] / seconds["a"])
        after = jit.stats()
        hits = after["specialized_region_calls"] - before["specialized_region_calls"]
        misses = after["interpreted_region_calls"] - before["interpreted_region_calls"]
        share = f"{hits / (hits + misses):.0%}" if hits + misses else "n/a"
        aa, vs = (" / ".join(f"{q:.3f}" for q in _quantiles(ratios[k])) for k in ("b", "jit"))
        print(f"| {name} | {aa} | {vs} | {share} |", flush=True)
        for runtime in systems.values():
            runtime.close()
    print(f"# load {os.getloadavg()[0]:.1f} at end")


def workloads_aa(names: list[str], calls: int | None, chunk: int = 50) -> None:
    """Two interpreter Runtimes (A, B) and the JIT over a suite workload's own input
    sequence (bench.workloads), all six orders in turn, the JIT learning as it goes (no
    draining: its compiles and probation fall where the suite's do). Per block of
    `chunk` calls after the warm-up: the median of B / A and of JIT / A, by wall time
    and by the calling thread's CPU time (time.thread_time: on a host loaded by other
    processes it leaves out the time this one was descheduled; torch runs on the
    calling thread with one intra-op thread)."""
    from bench.workloads import build

    print(f"# workloads A/A: {platform.node()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f} at start")
    print("| workload | calls | B / A wall | JIT / A wall | B / A CPU | JIT / A CPU |")
    print("|---|---|---:|---:|---:|---:|")
    for name in names:
        workload = build(name, quick=False, seed=0, calls=calls)
        demo = workload.demo
        program = dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes,
                                name=name)
        systems = {"a": dynvm.Runtime(program, jit=False),
                   "b": dynvm.Runtime(program, jit=False),
                   "jit": dynvm.Runtime(program, jit=dynvm.JitConfig())}
        orders = list(itertools.permutations(systems))
        rows: list[tuple[float, float, float, float]] = []
        for index, x in enumerate(workload.inputs):
            wall, cpu = {}, {}
            for key in orders[index % len(orders)]:
                start, start_cpu = time.perf_counter(), time.thread_time()
                systems[key](*x)
                cpu[key] = time.thread_time() - start_cpu
                wall[key] = time.perf_counter() - start
            if index >= workload.warmup:
                rows.append((wall["b"] / wall["a"], wall["jit"] / wall["a"],
                             cpu["b"] / max(cpu["a"], 1e-9), cpu["jit"] / max(cpu["a"], 1e-9)))
        blocks = [rows[i:i + chunk] for i in range(0, len(rows), chunk)] + [rows]
        for number, block in enumerate(blocks):
            first = workload.warmup + number * chunk
            span = "all steady" if number == len(blocks) - 1 else f"{first}-{first + len(block)}"
            medians = [statistics.median(r[k] for r in block) for k in range(4)]
            cells = " | ".join(f"{m:.3f}" for m in medians)
            print(f"| {name} | {span} | {cells} |", flush=True)
        stats = systems["jit"].stats()
        print(f"# {name}: JIT compiles {stats['compiles']}, specialized / interpreted "
              f"region calls {stats['specialized_region_calls']} / "
              f"{stats['interpreted_region_calls']}, probation {dict(stats['probation'])}")
        for runtime in systems.values():
            runtime.close()
        # A compile still running would share the GIL with the next workload's calls and
        # stretch the region times its JIT decides on.
        systems["jit"].jit.queue.close(wait_s=300.0)
    print(f"# load {os.getloadavg()[0]:.1f} at end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per batch size")
    parser.add_argument("--threads", type=int, default=1 if "--zoo" in sys.argv
                        else torch.get_num_threads())
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--zoo", help="comma-separated zoo models: the A/A noise floor "
                        "and JIT / interpreter per model instead")
    parser.add_argument("--rounds", type=int, default=30, help="--zoo: timed rounds")
    parser.add_argument("--workloads", help="comma-separated suite workloads (gnn, loop, "
                        "...): A/A and JIT / interpreter over each one's input sequence")
    parser.add_argument("--workload-calls", type=int, help="--workloads: calls (default: "
                        "the suite's)")
    args = parser.parse_args()
    if args.workloads:
        torch.set_num_threads(1 if "--threads" not in sys.argv else args.threads)
        workloads_aa([w.strip() for w in args.workloads.split(",") if w.strip()],
                     args.workload_calls)
        return
    torch.set_num_threads(args.threads)
    if args.zoo:
        zoo_aa([m.strip() for m in args.zoo.split(",") if m.strip()], args.rounds)
        return
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
