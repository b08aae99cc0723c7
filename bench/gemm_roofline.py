"""The machine's fp32 GEMM peak, and how close the demo Transformer gets to it.

    python -m bench.gemm_roofline [--threads 1] [--batch 64] [--calls 30]

1. Peak: large fp32 GEMMs (M x K @ K x N, sizes below) through torch.mm and through
   oneDNN (mkldnn._linear_pointwise on a packed weight), best of several rounds each;
   GFLOP/s = 2*M*N*K / seconds.
2. The demo Transformer (6 layers, hidden 256, seq 32) at one batch size: eager and the
   dynvm JIT (oneDNN rewrites on, measured) interleaved call by call on the same input;
   its GEMM work (linear layers and the two attention products) divided by the median
   call time, as a fraction of the peak. Compile happens first, in the background,
   before anything is timed.
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

    times: dict[str, list[float]] = {"eager": [], "dynvm JIT": []}
    for _ in range(args.calls):
        for name, fn in (("eager", eager), ("dynvm JIT", lambda: runtime(x))):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    flop = transformer_gemm_flop(args.batch)
    best_peak = max(peak.values())
    print(f"# gemm_roofline: torch {torch.__version__}, {args.threads} thread(s), "
          f"transformer batch {args.batch} x seq {SEQ}")
    print(f"fp32 GEMM peak: torch.mm {peak['torch.mm']:.1f} GFLOP/s, oneDNN "
          f"{peak['oneDNN']:.1f} GFLOP/s (best of {PEAK_SHAPES})")
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
    print(f"where the specialized kernel's time goes at batch {args.batch}:")
    print(time_breakdown(kernel_call(program, x)))


def kernel_call(program, x: torch.Tensor):
    """A zero-argument call of region 0's CPU kernel for `x` (oneDNN rewrites measured,
    no arena), without the Runtime around it: the profile then holds only the kernel's
    ops, not the interpreter calls the JIT makes while it checks a specialization."""
    from dynvm.jit.backends.cpu import CpuOptions, compile_kernel
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
