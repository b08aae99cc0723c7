"""`python -m bench.warmup_trace`: what the slow calls of a cold JIT's warm-up wait on.

Runs the warm-up phase of Note [Full-width timing] (bench.full_width: eager, the
interpreter and a cold JIT interleaved call by call, nothing drained) with a timeline:
each JIT call's span, each region entry's kind (interpreted miss, specialized hit, the
first call of a freshly installed kernel, a probation shadow call, a deopt), and the
compile thread's work (each compile, each calibration question by op, each install,
each shadow sample and prewarm run).
For every JIT call slower than `--bar` x the interpreter's p90 at its shape it prints
what overlapped it. Diagnostics only: it wraps the JIT's methods in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench._timing import call_order, percentile, stream_input


class Timeline:
    """Intervals (start, end, lane, what) from any thread, appended under a lock."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float, str, str]] = []
        self._lock = threading.Lock()

    def add(self, start: float, end: float, lane: str, what: str) -> None:
        """Record one interval."""
        with self._lock:
            self.spans.append((start, end, lane, what))


def _wrap(owner, name: str, make) -> None:
    setattr(owner, name, make(getattr(owner, name)))


def instrument(timeline: Timeline) -> None:
    """Wrap the JIT's compile, calibration, install and region entry (this process)."""
    from dynvm.jit import engine
    from dynvm.jit.calibration import Calibrator
    from dynvm.jit.region_jit import RegionJit

    clock = time.perf_counter

    def compile_(orig):
        def run(self, region_jit, target, key):
            start = clock()
            try:
                return orig(self, region_jit, target, key)
            finally:
                kind = "family" if hasattr(target, "bounds") else "exact"
                timeline.add(start, clock(), "compile", f"{kind} r{region_jit.region.index}")
        return run

    def choose(orig):
        def run(self, op, key, candidates):
            if self.known(op, key) is not None:
                return orig(self, op, key, candidates)
            start = clock()
            try:
                return orig(self, op, key, candidates)
            finally:
                timeline.add(start, clock(), "calibrate", op)
        return run

    def install(orig):
        def run(self, spec, pending_key=None):
            start = clock()
            fn, calls = spec.fn, [0]

            def timed(regs):
                calls[0] += 1
                if calls[0] > 1:
                    return fn(regs)
                first = clock()
                try:
                    return fn(regs)
                finally:
                    timeline.add(first, clock(), "first-call", spec.artifact.kernel_name)
            spec.fn = timed
            orig(self, spec, pending_key)
            timeline.add(start, clock(), "install", spec.artifact.kernel_name)
        return run

    def enter(orig):
        def run(self, regs):
            counters = self.counters
            shadows = self.engine.probation_counters.shadow_calls
            deopts, hits = counters.deopts, counters.specialized
            start = clock()
            ticket = orig(self, regs)
            end = clock()
            if counters.deopts != deopts:
                kind = "deopt"
            elif self.engine.probation_counters.shadow_calls != shadows:
                kind = "shadow"
            elif counters.specialized != hits:
                kind = "hit"
            else:
                kind = "miss"
            timeline.add(start, end, "region", f"{kind} r{self.region.index}")
            return ticket
        return run

    def worker_step(lane):
        def wrap(orig):
            def run(*args):
                start = clock()
                try:
                    return orig(*args)
                finally:
                    timeline.add(start, clock(), lane, lane)
            return run
        return wrap

    _wrap(engine.Jit, "_compile", compile_)
    _wrap(Calibrator, "choose", choose)
    # The worker's other work: probation's shadow samples (RegionJit._shadow, queued as
    # tasks of their own) and a fresh exact kernel's prewarm (inside _compile).
    _wrap(RegionJit, "_shadow", worker_step("shadow sample"))
    _wrap(engine, "prewarm", worker_step("prewarm"))
    _wrap(RegionJit, "install", install)
    _wrap(RegionJit, "enter", enter)


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def classify(calls: list, timeline: Timeline, interp: dict, bar: float) -> dict:
    """Per slow JIT call: the seconds of it overlapped by each kind of background work
    and the region entries' kinds inside it; totals by kind."""
    slow, totals = [], defaultdict(float)
    background = [s for s in timeline.spans
                  if s[2] in ("compile", "calibrate", "install", "shadow sample", "prewarm")]
    inside = [s for s in timeline.spans if s[2] in ("region", "first-call")]
    for start, end, label in calls:
        limit = bar * percentile(interp[label], 90)
        if end - start <= limit:
            continue
        over: dict[str, float] = defaultdict(float)
        calib = [s for s in background if s[2] == "calibrate" and _overlap(start, end, s[0], s[1])]
        for s in calib:
            what = "calibrate onednn (GIL)" if s[3].startswith("onednn") else f"calibrate {s[3]}"
            over[what] += _overlap(start, end, s[0], s[1])
        for lane in ("shadow sample", "prewarm"):
            over[lane] = sum(_overlap(start, end, s[0], s[1]) for s in background
                             if s[2] == lane)
        compiling = sum(_overlap(start, end, s[0], s[1]) for s in background
                        if s[2] == "compile")
        over["compile outside calibration"] = max(0.0, compiling - over["prewarm"] - sum(
            _overlap(start, end, s[0], s[1]) for s in calib))
        kinds = sorted({s[3].split()[0] if s[2] == "region" else "first-call"
                        for s in inside if s[0] >= start and s[1] <= end})
        record = {"label": label, "ms": 1e3 * (end - start), "limit_ms": 1e3 * limit,
                  "kinds": kinds, "overlap_ms": {k: round(1e3 * v, 1)
                                                  for k, v in over.items() if v > 0}}
        slow.append(record)
        cause = ("shadow" if "shadow" in kinds else "first-call" if "first-call" in kinds
                 else "deopt" if "deopt" in kinds else
                 max(record["overlap_ms"], key=record["overlap_ms"].get)
                 if record["overlap_ms"] else "nothing overlapped")
        record["cause"] = cause
        totals[cause] += 1
    return {"slow": slow, "by_cause": dict(totals)}


def main(argv=None) -> int:
    """Run one instrumented warm-up and print the slow calls' causes."""
    parser = argparse.ArgumentParser(prog="python -m bench.warmup_trace",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bert", help="bert or resnet50")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bert-layers", type=int, default=4)
    parser.add_argument("--bar", type=float, default=1.1)
    parser.add_argument("--deadline", type=float, default=200.0,
                        help="stop the warm-up this many seconds after the start (default 200)")
    parser.add_argument("--no-pacing", action="store_true",
                        help="compile checkpoints never wait for calls (the before figure)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    torch.set_num_threads(args.threads)
    from bench import full_width
    from bench.systems import warm_shared_imports

    warm_shared_imports()
    import dynvm
    try:
        from dynvm.jit.background import serving
    except ImportError:   # a tree from before Note [Background work yields to calls]
        serving = None
    if serving is not None:
        serving().pacing = not args.no_pacing
    timeline = Timeline()
    instrument(timeline)
    model = (full_width.bert(layers=args.bert_layers) if args.model == "bert"
             else full_width.resnet50())
    cached = Path(f"/tmp/dynvm_warmup_trace_{model.name}.dvm")
    if cached.exists():   # the export is the same for every run: load it
        program = dynvm.load(cached)
    else:
        program = dynvm.compile(model.module, model.export_inputs,
                                model.dynamic_shapes, name=model.name)
        dynvm.save(program, cached)

    def eager(*x):
        with torch.inference_mode():
            return model.module(*x)

    interp = dynvm.Runtime(program, jit=False)
    jit = dynvm.Runtime(program, jit=dynvm.JitConfig())
    systems = {"eager": eager, "interp": interp, "jit": jit}
    order = list(systems)
    times = {name: defaultdict(list) for name in order}
    jit_calls = []
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    print(f"export done, warm-up starts (load {load_start[0]:.2f})", flush=True)
    for step in range(args.calls):
        if time.perf_counter() - began > args.deadline:
            print(f"deadline: stopped after {step} steps", flush=True)
            break
        index = stream_input(step, len(model.inputs), len(order))
        label = model.labels[index]
        for name in call_order(order, step):
            start = time.perf_counter()
            systems[name](*model.inputs[index])
            end = time.perf_counter()
            times[name][label].append(end - start)
            if name == "jit":
                jit_calls.append((start, end, label))
    wall = time.perf_counter() - t0
    result = classify(jit_calls, timeline, times["interp"], args.bar)
    per_shape = {label: round(percentile(times["jit"][label], 90)
                              / percentile(times["interp"][label], 90), 2)
                 for label in model.labels}
    spent = defaultdict(float)
    for start, end, lane, what in timeline.spans:
        if lane in ("compile", "calibrate", "shadow sample", "prewarm"):
            spent[lane if lane != "calibrate" else f"calibrate {what.split()[0]}"] += end - start
    summary = {"wall_s": wall, "load": [load_start, os.getloadavg()],
               "p90_ratio": per_shape, "over_bar": [k for k, v in per_shape.items() if v > 1.1],
               "by_cause": result["by_cause"], "seconds": dict(spent),
               "stats": {k: jit.stats()[k] for k in ("compiles", "compile_seconds")},
               "prewarm_s": getattr(jit.jit, "prewarm_seconds", None),
               "pacing": {"waits": serving().waits, "waited_s": serving().waited_seconds}
               if serving is not None else None}
    print(json.dumps(summary, indent=1))
    for record in result["slow"]:
        print(json.dumps(record))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "slow": result["slow"],
                                        "spans": [(s - t0, e - t0, lane, what) for s, e, lane, what
                                                  in timeline.spans],
                                        "jit_calls": [(s - t0, e - t0, lbl)
                                                      for s, e, lbl in jit_calls]}))
    jit.close()
    interp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
