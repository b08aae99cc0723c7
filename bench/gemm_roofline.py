"""The machine's fp32 GEMM peak, and how close the demo Transformer gets to it.

    python -m bench.gemm_roofline [--threads 1] [--batch 64] [--calls 30]

1. Peak: large fp32 GEMMs (M x K @ K x N, sizes below) through torch.mm and through
   oneDNN (mkldnn._linear_pointwise on a packed weight), best of several rounds each;
   GFLOP/s = 2*M*N*K / seconds.
2. The demo Transformer (6 layers, hidden 256, seq 32) at one batch size: eager, the
   dynvm JIT (oneDNN rewrites on, measured) and the peak's GEMM (2048x1024x1024 on
   oneDNN) interleaved call by call; the model's GEMM work (linear layers and the two
   attention products) divided by its median call time, as a fraction of the peak
   GEMM's median rate in the same calls. Median against median, taken in the same
   instants: the first version divided a median model time into a best-of peak taken
   before it (Note [Roofline] below).
   Compile happens first, in the background, before anything is timed.
2b. The model's own GEMM shapes at that batch on oneDNN, interleaved with the peak
   GEMM: how far each shape's efficiency is from the peak's (K=256 GEMMs).
3. Where the JIT's time goes at that batch size (torch.profiler, self CPU time per
   ATen/oneDNN op over a few calls): GEMMs (oneDNN linear, SDPA's products) against
   layer norm and elementwise ops, which bounds what fusing the latter could save
   (Note [CPU fusion groups without a vendor op]).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.models import transformer

PEAK_SHAPES = ((2048, 1024, 1024), (4096, 1024, 256), (2048, 256, 1024))
SEQ = 32

# Note [Roofline]
# ~~~~~~~~~~~~~~~
# The roofline asks what fraction of the machine's GEMM rate the model's GEMM work
# reaches: its GEMM FLOPs per call / its median call time, against the rate of a large
# GEMM on the same path (oneDNN, packed weight) and the same thread count. Both rates
# must be taken alike: medians of calls interleaved one by one in the same loop, so
# that load from other processes on this shared host slows both equally. A best-of peak
# measured before the model (the first version) is a quiet-moment figure that the
# model's median could never reach under the same load.


def _best_seconds(fn, rounds: int = 7, per_round: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(per_round):
            fn()
        best = min(best, (time.perf_counter() - start) / per_round)
    return best


def gemm_peak() -> dict[str, float]:
    """Best GFLOP/s over PEAK_SHAPES per path."""
    best = {"torch.mm": 0.0, "oneDNN": 0.0}
    for m, n, k in PEAK_SHAPES:
        a, w = torch.randn(m, k), torch.randn(n, k)
        wt = w.t().contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        flop = 2.0 * m * n * k
        runs = {"torch.mm": lambda a=a, wt=wt: torch.mm(a, wt),
                "oneDNN": lambda a=a, packed=packed: torch.ops.mkldnn._linear_pointwise(
                    a, packed, None, "none", [], "")}
        for name, fn in runs.items():
            best[name] = max(best[name], flop / _best_seconds(fn) / 1e9)
    return best


def transformer_gemm_flop(batch: int, hidden: int = 256, ffn: int = 1024, layers: int = 6,
                          seq: int = SEQ) -> float:
    tokens = batch * seq
    linear = 2 * tokens * hidden * (3 * hidden + hidden + 2 * ffn)
    attention = 2 * 2 * batch * seq * seq * hidden       # q @ k^T and probs @ v
    return float(layers * (linear + attention))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peak = gemm_peak()
    demo = transformer()
    program = dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes)
    runtime = dynvm.Runtime(program, jit=JitConfig())
    x = torch.randn(args.batch, SEQ, 256)
    deadline = time.monotonic() + 300
    while runtime.stats()["specialized_region_calls"] < 3 and time.monotonic() < deadline:
        runtime(x)
        time.sleep(0.05)
    notes = [n for a in runtime.jit.artifacts.values() for n in a.source.splitlines()
             if "oneDNN" in n or "stays on torch" in n]

    def eager():
        with torch.inference_mode():
            return demo.module(x)

    peak_m, peak_n, peak_k = PEAK_SHAPES[0]
    peak_flop, peak_call = _onednn_gemm(peak_m, peak_n, peak_k)
    runs = {"eager": eager, "dynvm JIT": lambda: runtime(x), "peak GEMM": peak_call}
    times = _interleaved(runs, args.calls)
    flop = transformer_gemm_flop(args.batch)
    # Note [Roofline]: the peak's rate at its median, in the same instants as the model.
    best_peak = peak_flop / statistics.median(times.pop("peak GEMM")) / 1e9
    print(f"# gemm_roofline: torch {torch.__version__}, {args.threads} thread(s), "
          f"transformer batch {args.batch} x seq {SEQ}")
    print(f"fp32 GEMM peak: torch.mm {peak['torch.mm']:.1f} GFLOP/s, oneDNN "
          f"{peak['oneDNN']:.1f} GFLOP/s (best of {PEAK_SHAPES}); interleaved with the "
          f"model, median: oneDNN {best_peak:.1f} GFLOP/s (the roofline below)")
    print(f"transformer GEMM work per call: {flop / 1e9:.3f} GFLOP")
    print("| system | p50 ms | GFLOP/s | fraction of peak |")
    print("|---|---:|---:|---:|")
    for name, samples in times.items():
        p50 = statistics.median(samples)
        rate = flop / p50 / 1e9
        print(f"| {name} | {p50 * 1e3:.2f} | {rate:.1f} | {rate / best_peak:.0%} |")
    print(f"specialized calls {runtime.stats()['specialized_region_calls']}, "
          f"{sum('oneDNN' in n for n in notes)} GEMMs on oneDNN, "
          f"{sum('stays on torch' in n for n in notes)} on torch")
    runtime.close()
    print()
    print(f"the model's GEMM shapes at batch {args.batch} on oneDNN, against the peak GEMM "
          "(interleaved, medians):")
    print(shape_efficiency(args.batch * SEQ, args.calls))
    print()
    print(f"where the specialized kernel's time goes at batch {args.batch}:")
    print(time_breakdown(kernel_call(program, x)))


def _onednn_gemm(m: int, n: int, k: int):
    """(FLOP, a zero-argument call) of an M x K @ K x N GEMM on a packed oneDNN weight."""
    a, w = torch.randn(m, k), torch.randn(n, k)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
    return 2.0 * m * n * k, lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None,
                                                                        "none", [], "")


def _interleaved(runs: dict, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each run, call by call in rotating order, after one warm-up."""
    for fn in runs.values():
        fn()
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for call in range(calls):
        shift = call % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return times


def shape_efficiency(rows: int, calls: int, hidden: int = 256, ffn: int = 1024) -> str:
    """The Transformer's GEMM shapes (M = batch x seq rows) against the peak GEMM."""
    shapes = {"peak 2048x1024x1024": PEAK_SHAPES[0],
              f"qkv {rows}x{3 * hidden}x{hidden}": (rows, 3 * hidden, hidden),
              f"out {rows}x{hidden}x{hidden}": (rows, hidden, hidden),
              f"ffn up {rows}x{ffn}x{hidden}": (rows, ffn, hidden),
              f"ffn down {rows}x{hidden}x{ffn}": (rows, hidden, ffn)}
    built = {name: _onednn_gemm(*mnk) for name, mnk in shapes.items()}
    times = _interleaved({name: call for name, (_, call) in built.items()}, calls)
    rate = {name: built[name][0] / statistics.median(times[name]) / 1e9 for name in built}
    peak = rate["peak 2048x1024x1024"]
    lines = ["| GEMM (M x N x K) | GFLOP/s | of the peak GEMM |", "|---|---:|---:|"]
    lines += [f"| {name} | {r:.1f} | {r / peak:.0%} |" for name, r in rate.items()]
    return "\n".join(lines)


def kernel_call(program, x: torch.Tensor):
    """A zero-argument call of region 0's CPU kernel for `x` (oneDNN rewrites measured,
    no arena), without the Runtime around it: the profile then holds only the kernel's
    ops, not the interpreter calls the JIT makes while it checks a specialization."""
    from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
    from dynvm.jit.specialize import specialize

    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: x})
    constants = [t.detach() for t in program.constants]
    kernel = compile_kernel(spec, program, constants, torch.device("cpu"), "bench",
                            "strong", CpuOptions(None))

    def call():
        regs: list = [None] * (max(r.index for r in region.live_out) + 1)
        regs[region.live_in[0].index] = x
        kernel.fn(regs)
    return call


GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm",
            "aten::linear", "aten::matmul", "aten::_scaled_dot_product_flash_attention_for_cpu")


def time_breakdown(fn, calls: int = 5) -> str:
    """Self CPU time per op over `calls` calls, grouped: GEMM work (attention included)
    and everything else, as a markdown table."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()
            if e.self_cpu_time_total > 0]
    total = sum(t for _, t in rows)
    gemm = sum(t for k, t in rows if k in GEMM_OPS)
    lines = ["| op | self CPU ms per call | share |", "|---|---:|---:|"]
    for key, t in sorted(rows, key=lambda r: -r[1])[:10]:
        lines.append(f"| {key} | {t / calls / 1e3:.2f} | {t / total:.0%} |")
    lines.append(f"| **GEMM + attention** | {gemm / calls / 1e3:.2f} | {gemm / total:.0%} |")
    lines.append(f"| **everything else** | {(total - gemm) / calls / 1e3:.2f} | "
                 f"{(total - gemm) / total:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
