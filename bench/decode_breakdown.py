"""Where a decode step's time goes in the JIT's kernel: the bench Llama's B=1 generator
(`dynvm bench generate`'s model and JitConfig), its decode kernel's calls timed by
callee (each operation the kernel binds, wrapped in a timer), beside the step's wall
time and the kernel alone on a captured register file.

    python -m bench.decode_breakdown [--batch 1] [--calls 200]

Diagnostics: the wrapped kernel's timers add ~0.2 us a call. Timing figures belong
under the bench lock (`flock /tmp/dynvm_bench.lock ...`), one thread as the bench runs.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import types

import torch


def _steps(generator, ids, mask, new: int) -> list[float]:
    stamps = []
    for _ in generator.stream(ids, mask, max_new_tokens=new, stop_tokens=()):
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _timed(fn, totals, counts):
    """`fn`'s code over globals whose callables (the kernel's bound operations) add
    their time to `totals` by name."""
    clock = time.perf_counter

    def wrap(name, callee):
        def timed(*args, **kwargs):
            start = clock()
            result = callee(*args, **kwargs)
            totals[name] += clock() - start
            counts[name] += 1
            return result
        return timed

    bound = dict(fn.__globals__)
    for name, value in list(bound.items()):
        if name.startswith("__") or name.startswith("kernel_") or isinstance(value, type):
            continue
        if callable(value):
            bound[name] = wrap(name, value)
    return types.FunctionType(fn.__code__, bound)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import dynvm
    from bench.generate import NEW, PROMPT, build_model

    model = build_model("llama")
    programs = dynvm.compile_generator(model, max_batch=16, max_length=PROMPT + NEW + 1,
                                       jit=False).programs
    ids = torch.randint(3, model.config.vocab_size, (args.batch, PROMPT))
    mask = torch.ones_like(ids)
    with dynvm.Generator(programs, jit=True) as generator:
        for _ in range(2):
            generator.generate(ids, mask, max_new_tokens=NEW, stop_tokens=())
        time.sleep(3)   # the last compiles land
        region = next(iter(generator.step.jit.regions.values()))
        decode = [s for s in region.installed()
                  if f"({args.batch}, 1) int64" in s.artifact.source.splitlines()[1]]
        if not decode:
            raise SystemExit("no exact decode kernel installed for this batch size")
        spec = decode[0]
        fn, captured = spec.fn, []

        def capture(regs):
            if len(captured) < 100:
                captured.append(list(regs))
            return fn(regs)

        spec.fn = capture
        region._memo.clear()
        steps = _steps(generator, ids, mask, NEW) + _steps(generator, ids, mask, NEW)
        spec.fn = fn
        regs = captured[len(captured) // 2]
        alone = []
        for _ in range(args.calls):
            copy = list(regs)
            start = time.perf_counter()
            fn(copy)
            alone.append(time.perf_counter() - start)
        totals, counts = collections.defaultdict(float), collections.Counter()
        timed = _timed(fn, totals, counts)
        for _ in range(args.calls):
            timed(list(regs))
        step, kernel = statistics.median(steps), statistics.median(alone)
        print(f"# B={args.batch}, {args.threads} thread(s): step p50 {step * 1e3:.3f} ms, "
              f"kernel alone p50 {kernel * 1e3:.3f} ms, outside the kernel "
              f"{(step - kernel) * 1e3:.3f} ms")
        print("| callee | calls a step | ms a step (mean) | us a call |")
        print("|---|---:|---:|---:|")
        for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
            per_step = seconds / args.calls
            calls = counts[name] / args.calls
            print(f"| {name} | {calls:g} | {per_step * 1e3:.3f} | "
                  f"{per_step / calls * 1e6:.1f} |")
        print(f"| all calls | | {sum(totals.values()) / args.calls * 1e3:.3f} | |")


if __name__ == "__main__":
    main()
