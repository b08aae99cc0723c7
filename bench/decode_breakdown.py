"""Where a decode step's time goes in the JIT's kernel: the bench Llama's B=1 generator
(`dynvm bench generate`'s model and JitConfig), its decode kernel's calls timed by
callee (each operation the kernel binds, wrapped in a timer), beside the step's wall
time and the kernel alone on a captured register file.

    python -m bench.decode_breakdown [--batch 1] [--calls 200]
    python -m bench.decode_breakdown --ab [--batch 1] [--rounds 8]

--ab: the pass of Note [A decode step's small ops in C] off against on, two generators
over the same programs in one process, whole generations interleaved (the order
alternating each round): tokens/s and step p50 of each, their ratio, tokens equal.

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


def _rate(generator, ids, mask, new: int) -> tuple[float, float, torch.Tensor]:
    stamps, tokens = [], []
    for token in generator.stream(ids, mask, max_new_tokens=new, stop_tokens=()):
        stamps.append(time.perf_counter())
        tokens.append(token)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return ids.shape[0] * len(steps) / sum(steps), statistics.median(steps), torch.stack(
        tokens, 1)


def ab(programs, ids, mask, new: int, rounds: int) -> None:
    """The decode-ops pass off (A) against on (B), generations interleaved."""
    import dynvm
    from dynvm.jit.backends.cpu import codegen
    from dynvm.jit.backends.cpu.fusion import FusionResult

    real = codegen.fuse_decode_ops
    made = []
    try:
        for on in (False, True):
            codegen.fuse_decode_ops = real if on else (
                lambda spec, constants, device: FusionResult(spec, ()))
            generator = dynvm.Generator(programs, jit=True)
            for _ in range(2):   # compiles land while the pass is as chosen
                generator.generate(ids, mask, max_new_tokens=new, stop_tokens=())
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not generator.step.settled():
                time.sleep(0.05)
            made.append(generator)
    finally:
        codegen.fuse_decode_ops = real
    rates, steps, same = ([], []), ([], []), True
    reference = None
    for round_ in range(rounds):
        for who in ((0, 1) if round_ % 2 == 0 else (1, 0)):
            rate, step, tokens = _rate(made[who], ids, mask, new)
            rates[who].append(rate)
            steps[who].append(step)
            reference = tokens if reference is None else reference
            same = same and torch.equal(tokens, reference)
    a, b = (statistics.median(r) for r in rates)
    print(f"# B={ids.shape[0]}: tok/s off {a:.1f}, on {b:.1f}, on / off {b / a:.3f}; step "
          f"p50 off {statistics.median(steps[0]) * 1e3:.3f} ms, on "
          f"{statistics.median(steps[1]) * 1e3:.3f} ms; tokens equal: {same}")
    for generator in made:
        generator.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ab", action="store_true",
                        help="the decode-ops pass off against on, generations interleaved")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import dynvm
    from bench.generate import NEW, PROMPT, build_model

    model = build_model("llama")
    programs = dynvm.compile_generator(model, max_batch=16, max_length=PROMPT + NEW + 1,
                                       jit=False).programs
    ids = torch.randint(3, model.config.vocab_size, (args.batch, PROMPT))
    mask = torch.ones_like(ids)
    if args.ab:
        ab(programs, ids, mask, NEW, args.rounds)
        return
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
