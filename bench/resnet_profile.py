"""`python -m bench.resnet_profile`: where a ResNet-50 call's time goes at 224x224, in
the dynvm JIT (torch.profiler: self CPU time per operator and input shape) and in ONNX
Runtime (its own per-node profile), at one batch size and the same thread count.

Note [ResNet profile]
~~~~~~~~~~~~~~~~~~~~~
The JIT is seasoned first (calls until Runtime.settled, capped), so what is profiled is
its installed kernel; the kernel's header notes (what each convolution chain became)
and, with --source, its generated code are printed or written. Wall medians of eager, the
JIT and ONNX Runtime are taken interleaved, call by call, before the profiles (the
profilers add their own cost). The JIT's operators are grouped by name and by input
shapes (a convolution's shapes say which layer it is); ONNX Runtime's nodes by op type,
from its JSON profile (`SessionOptions.enable_profiling`). What this answers: how much
of each system's time is convolution, how much is layout conversion (reorders,
`contiguous`, `clone`) and how much is neither (the per-call overhead). With --layers,
the convolutions side by side per layer geometry, with oneDNN's own execution time and
implementation for each (Note [ResNet layers side by side] in bench.resnet_layers).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench import full_width, resnet_layers
from bench.peers import ort_session_options

# Calls of one shape before `Runtime.settled` is believed: settled() says nothing is
# queued or on probation, which is also true before a new shape was seen often enough
# to be promoted (a batch-2 kernel profiled after batch 1 settled ran the interpreter).
_MIN_SEASON_CALLS = 16


def _settle(runtime, x, cap_s: float, min_calls: int = _MIN_SEASON_CALLS) -> int:
    deadline = time.monotonic() + cap_s
    calls = 0
    runtime(*x)
    while time.monotonic() < deadline and (calls < min_calls or not runtime.settled()):
        runtime(*x)
        calls += 1
        time.sleep(0.01)
    return calls


def _walls(systems: dict, x, calls: int) -> dict[str, float]:
    times: dict[str, list[float]] = defaultdict(list)
    names = list(systems)
    for i in range(calls):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            systems[name](*x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def profile_jit(runtime, x, calls: int) -> list[tuple[str, str, float, int, list]]:
    """(operator, input shapes as text, self ms per call, count per call, input shapes),
    largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(calls):
            runtime(*x)
    rows = [(e.key, str(e.input_shapes)[:90], e.self_cpu_time_total / 1e3 / calls,
             e.count // calls, e.input_shapes)
            for e in prof.key_averages(group_by_input_shape=True)]
    return sorted(rows, key=lambda r: -r[2])


def onednn_verbose_lines(fn, calls: int) -> list[str]:
    """oneDNN's verbose lines (printed by the library to file descriptor 1) over `calls`
    calls of `fn`, caught in a temporary file (a pipe could fill and block the writer):
    torch's oneDNN and, where loaded, the libdnnl that runs dynvm's primitives (Note
    [oneDNN primitives built once])."""
    from dynvm.jit.backends.cpu import onednn_api

    libc = ctypes.CDLL(None)
    library = onednn_api.library()
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 1)
        try:
            if library is not None:
                library.dll.dnnl_set_verbose(1)     # exec lines, as torch's VERBOSE_ON
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                for _ in range(calls):
                    fn()
        finally:
            if library is not None:
                library.dll.dnnl_set_verbose(0)
            libc.fflush(None)   # the C library's stdout buffer, before fd 1 goes back
            os.dup2(saved, 1)
            os.close(saved)
        caught.seek(0)
        return caught.read().decode(errors="replace").splitlines()


def ort_trace(path: str, threads: int, x, calls: int) -> list[dict]:
    """ONNX Runtime's JSON profile events over one warm-up and `calls` calls."""
    import onnxruntime as ort

    options = ort_session_options(ort, threads)
    options.enable_profiling = True
    # The profile's JSON goes to the temporary folder, not the working directory.
    options.profile_file_prefix = os.path.join(tempfile.gettempdir(), "dynvm_ort_profile")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x[0].numpy()}
    session.run(None, feed)
    for _ in range(calls):
        session.run(None, feed)
    profile_path = Path(session.end_profiling())
    trace = json.loads(profile_path.read_text())
    profile_path.unlink(missing_ok=True)
    return trace


def profile_ort(trace: list[dict]) -> dict[str, float]:
    """ms per call by ONNX Runtime node op type, from its profile's events."""
    by_type: dict[str, float] = defaultdict(float)
    runs = 0
    for event in trace:
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            runs += 1
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            by_type[event["args"].get("op_name", "?")] += event["dur"] / 1e3
    return {k: v / max(runs, 1) for k, v in sorted(by_type.items(), key=lambda kv: -kv[1])}


def main(argv=None) -> int:
    """Season, time, profile, print."""
    import dynvm
    from bench.peers import Exported, OrtRunner

    parser = argparse.ArgumentParser(prog="python -m bench.resnet_profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/rn_cache"))
    parser.add_argument("--settle-seconds", type=float, default=120.0)
    parser.add_argument("--season", default="",
                        help="batch sizes to season the JIT on first, comma-separated, as "
                             "bench.full_width does over all its shapes (default: --batch "
                             "alone); the kernel profiled is then the one serving --batch")
    parser.add_argument("--source", type=Path, help="write the JIT's kernels' code here")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--no-ort", action="store_true")
    parser.add_argument("--layers", action="store_true",
                        help="the convolutions per layer geometry beside ONNX Runtime's, "
                             "with oneDNN's execution time and implementation (Note "
                             "[ResNet layers side by side] in bench.resnet_layers)")
    parser.add_argument("--precision", default="fp32",
                        help="the JIT's JitConfig.precision (fp32, bf16; Note [bf16 "
                             "convolution chains])")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    season = [int(b) for b in args.season.split(",") if b.strip()] or [args.batch]
    model = full_width.resnet50(batches=(args.batch, max(2, args.batch), *season))
    program, _, onnx = full_width.prepare(model, args.cache, with_onnx=not args.no_ort)
    x = model.inputs[0]
    print(f"load {os.getloadavg()[0]:.2f}, batch {args.batch}, threads {args.threads}, "
          f"JIT precision {args.precision}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}", flush=True)
    jit = dynvm.Runtime(program, jit=dynvm.JitConfig(precision=args.precision))
    start = time.perf_counter()
    calls = 0
    for _ in range(3):   # rounds over the batch sizes, as bench.full_width seasons
        for index in range(len(season)):
            calls += _settle(jit, model.inputs[2 + index], args.settle_seconds / 3)
    calls += _settle(jit, x, args.settle_seconds / 3)
    print(f"seasoned: {calls} calls, {time.perf_counter() - start:.1f} s, settled "
          f"{jit.settled()}", flush=True)
    for artifact in jit.jit.artifacts.values():
        print(f"; {artifact.kernel_name}: guard {artifact.guard}")
        for note in artifact.notes:
            print(f";   {note}")
    if args.source:
        args.source.write_text("\n\n".join(a.source for a in jit.jit.artifacts.values()))

    def eager(*inputs):
        with torch.inference_mode():
            return model.module(*inputs)

    systems = {"eager": eager, "jit": jit}
    exported = None
    if not args.no_ort:
        exported = Exported(model.module, x, model.dynamic_shapes, kept=onnx)
        systems["onnxruntime"] = OrtRunner(exported.path, args.threads)
    expected = eager(*x)
    for name, fn in systems.items():
        out = fn(*x)
        out = out[0] if isinstance(out, tuple) else out
        print(f"{name}: |out - eager| {float((out - expected).abs().max()):.2e}")
    # Note [ResNet profile]: walls interleaved first, the profilers' own cost apart
    walls = _walls(systems, x, args.calls)
    print("wall ms (median, interleaved): " + ", ".join(
        f"{k} {1e3 * v:.1f}" for k, v in walls.items()) + f"; load {os.getloadavg()[0]:.2f}")
    rows = profile_jit(jit, x, args.calls)
    total = sum(r[2] for r in rows)
    print(f"\nJIT operators: {total:.1f} ms per call of self time, wall "
          f"{1e3 * walls['jit']:.1f}")
    by_name: dict[str, float] = defaultdict(float)
    for name, _, ms, _, _ in rows:
        by_name[name] += ms
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {ms:8.2f} ms  {name}")
    print("\nlargest by shape:")
    for name, shapes, ms, count, _ in rows[:args.top]:
        print(f"  {ms:7.2f} ms x{count:<3d} {name:40s} {shapes}")
    if exported is not None:
        trace = ort_trace(exported.path, args.threads, x, args.calls)
        ort_rows = profile_ort(trace)
        print(f"\nONNX Runtime nodes: {sum(ort_rows.values()):.1f} ms per call, wall "
              f"{1e3 * walls['onnxruntime']:.1f}")
        for name, ms in ort_rows.items():
            print(f"  {ms:8.2f} ms  {name}")
        if args.layers:
            _print_layers(rows, trace, jit, x, args.calls)
        exported.close()
    jit.close()
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


def primitive_times(fn, calls: int) -> dict:
    """Per (input, weight) key: [ms per call summed, calls per call] of the JIT's
    convolutions that run dynvm's oneDNN primitives (Note [oneDNN primitives built
    once]): Python functions the operator profiler does not see, so timed here, wall
    time around each call, over `calls` calls of `fn`."""
    from dynvm.jit.backends.cpu.onednn_conv import PrimitiveConv

    found: dict = defaultdict(lambda: [0.0, 0])
    plain, into = PrimitiveConv.__call__, PrimitiveConv.into

    def timed(method):
        def run(self, x, *rest):
            start = time.perf_counter()
            try:
                return method(self, x, *rest)
            finally:
                entry = found[(tuple(x.shape), self.weight_shape)]
                entry[0] += (time.perf_counter() - start) * 1e3 / calls
                entry[1] += 1
        return run
    PrimitiveConv.__call__, PrimitiveConv.into = timed(plain), timed(into)
    try:
        for _ in range(calls):
            fn()
    finally:
        PrimitiveConv.__call__, PrimitiveConv.into = plain, into
    return {k: [ms, n // calls] for k, (ms, n) in found.items()}


def pool_times(fn, calls: int) -> dict:
    """Per input shape: [ms per call summed, calls per call] of the JIT's max poolings
    on dynvm's oneDNN primitives (Note [oneDNN pooling built once]), timed as
    `primitive_times` times the convolutions."""
    from dynvm.jit.backends.cpu.onednn_pool import PrimitivePool

    found: dict = defaultdict(lambda: [0.0, 0])
    plain = PrimitivePool.__call__

    def run(self, x):
        start = time.perf_counter()
        try:
            return plain(self, x)
        finally:
            entry = found[tuple(x.shape)]
            entry[0] += (time.perf_counter() - start) * 1e3 / calls
            entry[1] += 1
    PrimitivePool.__call__ = run
    try:
        for _ in range(calls):
            fn()
    finally:
        PrimitivePool.__call__ = plain
    return {k: [ms, n // calls] for k, (ms, n) in found.items()}


def chain_times(fn, calls: int) -> tuple[float, int]:
    """(ms per call, primitives per call) of the JIT's chains of primitives made in one
    native call (Note [A chain of primitives in one call]), wall time around each chain
    over `calls` calls of `fn`."""
    from dynvm.jit.backends.cpu.onednn_chain import PrimitiveChain

    found = [0.0, 0]
    plain = PrimitiveChain.__call__

    def run(self, x):
        start = time.perf_counter()
        try:
            return plain(self, x)
        finally:
            found[0] += (time.perf_counter() - start) * 1e3 / calls
            found[1] += len(self.steps)
    PrimitiveChain.__call__ = run
    try:
        for _ in range(calls):
            fn()
    finally:
        PrimitiveChain.__call__ = plain
    return found[0], found[1] // calls


def _exec_ms(lines, kind: str) -> float:
    """Summed ms of oneDNN's verbose `exec` lines of primitive `kind`."""
    total = 0.0
    for line in lines:
        fields = line.strip().split(",")
        if len(fields) >= 8 and "exec" in fields[:4] and kind in fields:
            total += float(fields[-1])
    return total


def _print_layers(rows, trace, jit, x, calls: int) -> None:
    """The per-layer table (Note [ResNet layers side by side])."""
    jit_convs: dict = defaultdict(lambda: [0.0, 0])
    for name, _, ms, count, shapes in rows:
        key = resnet_layers.jit_conv_key(name, shapes)
        if key is not None:
            jit_convs[key][0] += ms
            jit_convs[key][1] += count
    for key, (ms, count) in primitive_times(lambda: jit(*x), calls).items():
        jit_convs[key][0] += ms
        jit_convs[key][1] += count
    ort_convs, runs = resnet_layers.ort_conv_times(trace)
    verbose_calls = 3
    lines = onednn_verbose_lines(lambda: jit(*x), verbose_calls)
    onednn = resnet_layers.onednn_exec(lines)
    # rows are per call already; ONNX Runtime's sums cover `runs` runs (warm-up included)
    table = resnet_layers.join({k: tuple(v) for k, v in jit_convs.items()},
                               {k: (ms / max(runs, 1), n // max(runs, 1))
                                for k, (ms, n) in ort_convs.items()},
                               onednn, onednn_calls=verbose_calls)
    print("\nper layer (ms per call, summed over the layers of one geometry):")
    print(resnet_layers.markdown(table))
    chained, steps = chain_times(lambda: jit(*x), calls)
    if steps:
        executed = sum(_exec_ms(lines, k) for k in ("convolution", "pooling")) / verbose_calls
        print(f"chains of primitives in one native call: {chained:.3f} ms per call over "
              f"{steps} primitive(s); oneDNN's execution of them {executed:.3f} ms "
              f"(verbose): {1e3 * (chained - executed) / steps:.1f} us a primitive outside "
              f"oneDNN's execution (the chain's Python, its results' allocation and the "
              f"verbose timing's own cost)")
    for shape, (ms, count) in pool_times(lambda: jit(*x), calls).items():
        print(f"max pooling on a oneDNN primitive, input {list(shape)}: {ms:.3f} ms per "
              f"call (x{count}; ONNX Runtime's MaxPool is among its nodes above)")


if __name__ == "__main__":
    sys.exit(main())
