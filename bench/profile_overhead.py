"""Cost of recording shapes: the interpreter with the JIT's profiling slots attached but
promotion impossible, against the pure interpreter, side by side on the demo
Transformer (seq 32). Also the cost of one strong signature of a region's live-ins, and
(--entry) the cost per region entry of the slot itself, on the loop body of
`dynvm bench loop` (a region of ~10 us): a profiled miss, a sampled (cold) miss and a
specialized hit, each against the interpreter's plain unit, interleaved.

    python -m bench.profile_overhead [--calls 300] [--threads T] [--entry]
"""

from __future__ import annotations

import argparse
import time
import timeit

import torch

import dynvm
from bench._timing import median
from dynvm.jit.config import JitConfig
from dynvm.jit.guards import strong_signer
from dynvm.models import transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--entry", action="store_true",
                        help="only the per-entry cost of the slot (loop body)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.entry:
        entry_costs()
        return
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


def captured_entry(runtime, region_index: int, inputs) -> list:
    """The register file at one entry of `region_index` (a slot that copies it)."""
    captured = []

    class Capture:
        def enter(self, regs):
            captured.append(regs.copy())
            return self

        def leave(self, ticket, seconds):
            pass

    runtime.interpreter.install_slot(region_index, Capture())
    runtime(*inputs)
    runtime.interpreter.install_slot(region_index, None)
    return captured[0]


def _per_call(fn, regs: list, number: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn(regs.copy())
    return (time.perf_counter() - start) / number


def entry_costs(rounds: int = 600) -> None:
    """Per-entry cost of the slot over the plain unit, on the loop body (batch 4)."""
    from dynvm.models import get

    demo = get("looping")
    program = dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes)
    # Nothing is ever worth compiling (the hit's specialization is compiled here).
    config = JitConfig(probation=False, families=False, compile_seconds_base=1e9)
    runtime = dynvm.Runtime(program, jit=config)
    jit = runtime.jit
    inputs = (torch.randn(4, 32) * 0.5,)
    runtime(*inputs)
    body = max(jit.regions.values(), key=lambda r: r.counters.interpreted)
    index = body.region.index
    regs = captured_entry(runtime, index, inputs)
    steps = runtime.interpreter.region_steps(index)

    def plain(regs):
        for step in steps:
            step(regs)

    def unit(slot):
        def run(regs):
            ticket = slot.enter(regs)
            if ticket is None:
                return
            start = time.perf_counter()
            plain(regs)
            slot.leave(ticket, time.perf_counter() - start)
        return run

    profiled = unit(body)
    body.watch._since_cold_check = -(1 << 40)   # profiled on every miss, never cold
    sampled_slot = type(body)(jit, body.region, body._steps, body._writes_state)
    sampled_slot.watch.sample_every, sampled_slot.watch.cold = 2, 1 << 30
    sampled = unit(sampled_slot)
    hit_slot = type(body)(jit, body.region, body._steps, body._writes_state)
    hit_slot.leave(hit_slot._sign(regs), 1e-5)
    signature = hit_slot._sign(regs)
    hit_slot.install(jit._compile(hit_slot, signature, jit.key_for(hit_slot, signature)))
    hit = unit(hit_slot)
    cases = {"plain unit": plain, "profiled miss": profiled, "sampled miss": sampled,
             "specialized hit": hit}
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(_per_call(fn, regs))
    base = median(times["plain unit"])
    print(f"# per region entry, loop body ({len(body.region)} instructions, batch 4), "
          f"median of {rounds} rounds of 20 calls, interleaved")
    print("| entry | us per entry | over the plain unit, us |")
    print("|---|---:|---:|")
    for name in cases:
        t = median(times[name])
        print(f"| {name} | {t * 1e6:.2f} | {(t - base) * 1e6:+.2f} |")


if __name__ == "__main__":
    main()
