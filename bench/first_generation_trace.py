"""`python -m bench.first_generation_trace`: when a first generation's decode kernel lands
and what its compile waited on.

Runs what `dynvm bench generate` calls a JIT generator's first generation: one B=1
generation in the process first, then a fresh Generator per batch size. It prints a
timeline in ms from the generation's start: the step's promotion, the compile's phases
(specialize, emit, prewarm), every checkpoint that waited for a call (Note [Background
work yields to calls], Note [A slice of work per wait]) with its caller, every
calibration question measured, the install, and each step, interpreted (i) or
specialized (S). `--slice` sets `SLICE_S` for an on/off figure. Diagnostics only: it
wraps the JIT's functions in this process. Timing figures belong under the bench lock.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time


class Trace:
    """Events (ms since `start`, thread, what...) from any thread."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.events: list[tuple] = []
        self._lock = threading.Lock()

    def add(self, *what) -> None:
        with self._lock:
            self.events.append(((time.perf_counter() - self.start) * 1e3,
                                threading.current_thread().name, *what))

    def reset(self) -> None:
        with self._lock:
            self.start, self.events = time.perf_counter(), []


def _callers(depth: int) -> str:
    frame, names = sys._getframe(2), []
    while frame is not None and len(names) < depth:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return "<".join(names)


def instrument(trace: Trace) -> None:
    """Wrap the JIT's compile phases, checkpoints, calibration and installs."""
    from dynvm.jit import background, calibration, engine, prewarm, queue, region_jit

    checkpoint = background.checkpoint

    def traced_checkpoint(*args, **kwargs):
        waited = checkpoint(*args, **kwargs)
        if waited >= 1e-3:
            trace.add("wait", round(waited * 1e3, 1), _callers(3))
        return waited

    for module in (calibration, engine, region_jit, prewarm, queue):
        module.checkpoint = traced_checkpoint

    def phase(owner, name: str) -> None:
        inner = getattr(owner, name)

        def run(*args, **kwargs):
            trace.add(name + " +")
            try:
                return inner(*args, **kwargs)
            finally:
                trace.add(name + " -")
        setattr(owner, name, run)

    for name in ("specialize", "compile_kernel", "prewarm"):
        phase(engine, name)
    phase(engine.Jit, "_compile")
    promote, install = engine.Jit.promote, region_jit.RegionJit.install

    def traced_promote(self, region, target, decision):
        trace.add("promote", f"region {region.region.index}", type(target).__name__)
        return promote(self, region, target, decision)

    def traced_install(self, spec, *args, **kwargs):
        trace.add("install", f"region {self.region.index}", spec.strength.value)
        return install(self, spec, *args, **kwargs)

    engine.Jit.promote, region_jit.RegionJit.install = traced_promote, traced_install
    choose = calibration.Calibrator.choose

    def traced_choose(self, op, key, candidates):
        if self.known(op, key) is not None:
            return choose(self, op, key, candidates)
        began = time.perf_counter()
        choice = choose(self, op, key, candidates)
        trace.add("asked", op, str(key)[:40], round((time.perf_counter() - began) * 1e3, 1),
                  choice.name)
        return choice

    calibration.Calibrator.choose = traced_choose


def first_generation(generator, ids, new: int, trace: Trace) -> tuple[int, int]:
    """One generation, each step's end traced; (specialized steps, steps)."""
    trace.reset()
    specialized = 0
    for index, _ in enumerate(generator.stream(ids, max_new_tokens=new, stop_tokens=())):
        now = generator.stats().specialized_steps
        trace.add("step", index, "S" if now > specialized else "i")
        specialized = now
    stats = generator.stats()
    return stats.specialized_steps, stats.decode_steps


def report(trace: Trace, batch: int, share: tuple[int, int]) -> str:
    steps = [e for e in trace.events if e[2] == "step"]
    first = next((e[3] for e in steps if e[4] == "S"), None)
    waits = sum(e[3] for e in trace.events if e[2] == "wait")
    lines = [f"B={batch}: {share[0]}/{share[1]} steps specialized, the first at step "
             f"{first}; checkpoints waited {waits:.0f} ms",
             "steps (ms, i: interpreted, S: specialized): " + " ".join(
                 f"{b[0] - a[0]:.0f}{b[4]}" for a, b in zip(steps, steps[1:]))]
    for event in trace.events:
        if event[2] != "step" or first is None or event[3] <= first:
            lines.append(f"{event[0]:9.1f}  {event[1][:14]:14}  "
                         + " ".join(str(x) for x in event[2:]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.first_generation_trace",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", help="llama or gpt2 (bench.generate)")
    parser.add_argument("--batches", default="4,16")
    parser.add_argument("--runs", type=int, default=1, help="fresh Generators per batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--slice", type=float, help="SLICE_S for this run (seconds)")
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' tiny decoder, a few steps (a smoke run)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    import dynvm
    from bench.generate import NEW, PROMPT, build_model
    from dynvm.jit import background

    if args.slice is not None:
        background.SLICE_S = args.slice
    trace = Trace()
    instrument(trace)
    if args.tiny:
        from tests.generation._tiny import tiny_causal_lm

        model, prompt, new = tiny_causal_lm(args.model), 8, 12
    else:
        model, prompt, new = build_model(args.model), PROMPT, NEW
    vocab = model.config.vocab_size
    programs = dynvm.compile_generator(model, max_batch=max(16, *map(int, args.batches.split(
        ","))), max_length=prompt + new + 1, jit=False).programs
    with dynvm.Generator(programs, jit=True) as warm:   # as bench generate: B=1 first
        warm.generate(torch.randint(3, vocab, (1, prompt)), max_new_tokens=new,
                      stop_tokens=())
    print(f"SLICE_S {background.SLICE_S}", flush=True)
    for batch in map(int, args.batches.split(",")):
        ids = torch.randint(3, vocab, (batch, prompt),
                            generator=torch.Generator().manual_seed(batch))
        for _ in range(args.runs):
            with dynvm.Generator(programs, jit=True) as generator:
                share = first_generation(generator, ids, new, trace)
            print(report(trace, batch, share), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
