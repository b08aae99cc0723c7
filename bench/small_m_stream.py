"""`python -m bench.small_m_stream`: how fast each GEMM path torch exposes streams the
weights of BERT-base's four layers at a few rows, against what the cores can stream.

    python -m bench.small_m_stream [--rows 1,4,16] [--threads 1,2] [--calls 30] [--native]
                                   [--panel]

Note [Small-M weight streaming]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At batch 1 x seq 16 a BERT-base call's 24 GEMMs multiply 16 rows by 113 MB of fp32
weights (56 MB in bf16): each weight byte is read once from memory and used 16 times,
so the call is bounded mostly by how fast the weights stream, not by arithmetic (AMX
makes the bf16 arithmetic nearly free on this project's host). This tool times the 24 GEMMs in a
chain (their weights together far larger than the caches, as in the model) through
every path torch offers: oneDNN's linear on a weight packed for that M (what the JIT
emits), `F.linear` and `addmm` on the dense weight (MKL for fp32, oneDNN matmul for
bf16), and the transposed product W @ x^T (the weight as the GEMM's tall operand).
With --native, also dynvm's own small-M kernel (fp32, on the dense weight: Note [A small-M
GEMM of our own] in jit/backends/cpu/native_linear.py, which this tool's first runs led
to): what a kernel that splits the output columns across the threads gains. With --panel,
dynvm's panel GEMM on a copy of each weight packed in column panels (fp32: Note [A panel
GEMM of our own] in jit/backends/cpu/panel_linear.py), the kernel its 16-32 row counts
are measured with before the JIT chooses it.
Paths and rows are interleaved call by call; each path's rate is the weights' bytes
over its median chain time. The ceiling beside them is a plain reduction over a tensor
of the weights' size at each thread count: what the cores can stream at all.

Rates beside another process's work are lower at two threads (the ceiling needs both
cores): read them with the load the tool prints, and docs/bench_log.md (2026-12-05,
issue 31) for the runs so far.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench._omp import reexec_passive

# (out, in) of one BERT-base layer's GEMMs: Q, K, V, the attention output, FFN up, down.
LAYER = ((768, 768), (768, 768), (768, 768), (768, 768), (3072, 768), (768, 3072))
LAYERS = 4
PATHS = ("onednn-packed", "linear", "addmm-input-major", "w-at-xT")
NATIVE = "native-fp32"
PANEL = "panel-fp32"


def gemm(torch, path: str, x, weight, bias, rows: int):
    """A function computing linear(x, weight, bias) ([rows, out]) through `path`."""
    if path == "onednn-packed":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if path == "linear":
        return lambda: torch.nn.functional.linear(x, weight, bias)
    if path == "addmm-input-major":
        wt = weight.t().contiguous()
        return lambda: torch.addmm(bias, x, wt)
    if path == NATIVE:
        if weight.dtype != torch.float32:
            return None
        return native_linear(torch, x, weight, bias)
    if path == PANEL:
        if weight.dtype != torch.float32:
            return None
        return panel_linear(torch, x, weight, bias)
    if path == "w-at-xT":  # the weight as the tall operand: (W @ x^T + b)^T, a view
        xt, column = x.t().contiguous(), bias.unsqueeze(1)
        return lambda: torch.addmm(column, weight, xt).t()
    raise ValueError(f"unknown path {path!r}")


def native_linear(torch, x, weight, bias):
    """A function computing linear(x, weight, bias) with dynvm's small-M kernel (Note [A
    small-M GEMM of our own] in jit/backends/cpu/native_linear.py), on the dense weight."""
    from dynvm.jit.backends.cpu.native_linear import small_m_linear

    return lambda: small_m_linear(x, weight, bias, None, False)


def panel_linear(torch, x, weight, bias):
    """A function computing linear(x, weight, bias) with dynvm's panel GEMM (Note [A panel
    GEMM of our own] in jit/backends/cpu/panel_linear.py) on the weight packed once."""
    from dynvm.jit.backends.cpu.panel_linear import PackedPanels
    from dynvm.jit.backends.cpu.panel_linear import panel_linear as kernel

    packed = PackedPanels(weight)
    return lambda: kernel(x, packed, bias)


def _chain(torch, weights, biases, rows: int, dtype, path: str):
    """A function running the 24 GEMMs once through `path` at `rows` rows, or None where
    the path has no kernel for `dtype`."""
    gen = torch.Generator().manual_seed(1)
    inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (768, 3072)}
    calls = [gemm(torch, path, inputs[weight.shape[1]], weight.to(dtype).contiguous(),
                  bias.to(dtype), rows)
             for weight, bias in zip(weights, biases, strict=True)]
    if None in calls:
        return None

    def run():
        for call in calls:
            call()
    return run


def _ceiling(torch, nbytes: int, calls: int) -> float:
    """GB/s of a plain reduction over `nbytes` of fp32 at torch's thread count."""
    data = torch.ones(nbytes // 4)
    data.sum()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def run(rows_list, threads_list, calls: int, log=print, native: bool = False,
        panel: bool = False) -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02
               for _ in range(LAYERS) for n, k in LAYER]
    biases = [torch.randn(n, generator=gen) for _ in range(LAYERS) for n, _ in LAYER]
    fp32_bytes = sum(w.numel() for w in weights) * 4
    results = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        ceiling = _ceiling(torch, fp32_bytes, calls)
        log(f"{threads} thread(s): a reduction over {fp32_bytes / 1e6:.0f} MB streams "
            f"{ceiling:.1f} GB/s")
        paths = (*PATHS, *((NATIVE,) if native else ()), *((PANEL,) if panel else ()))
        chains = {(rows, dtype, path): _chain(torch, weights, biases, rows, dtype, path)
                  for rows in rows_list for dtype in (torch.float32, torch.bfloat16)
                  for path in paths}
        chains = {key: chain for key, chain in chains.items() if chain is not None}
        for chain in chains.values():
            chain()
        times: dict[tuple, list[float]] = {key: [] for key in chains}
        for _ in range(calls):  # interleaved call by call
            for key, chain in chains.items():
                start = time.perf_counter()
                chain()
                times[key].append(time.perf_counter() - start)
        for (rows, dtype, path), samples in times.items():
            nbytes = fp32_bytes // (4 // dtype.itemsize)
            median = statistics.median(samples)
            row = {"threads": threads, "rows": rows, "dtype": str(dtype).split(".")[1],
                   "path": path, "ms": 1e3 * median, "gb_s": nbytes / median / 1e9,
                   "ceiling_gb_s": ceiling, "loadavg": os.getloadavg()[0]}
            results.append(row)
            log(f"  M={rows:<3d} {row['dtype']:9s} {path:18s} {row['ms']:7.2f} ms "
                f"{row['gb_s']:5.1f} GB/s ({row['gb_s'] / ceiling:.0%} of the ceiling)")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.small_m_stream",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--native", action="store_true",
                   help="also dynvm's small-M kernel, fp32 (built at install where a C "
                        "compiler is)")
    p.add_argument("--panel", action="store_true",
                   help="also dynvm's panel GEMM, fp32, on weights packed in column panels")
    args = p.parse_args(argv)
    rows = [int(v) for v in args.rows.split(",")]
    threads = [int(v) for v in args.threads.split(",")]
    print(f"load {os.getloadavg()[0]:.2f}")
    run(rows, threads, args.calls, native=args.native, panel=args.panel)
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    # the JIT's benchmarks run torch with passive OpenMP waits: the same here
    reexec_passive([sys.executable, "-m", "bench.small_m_stream", *sys.argv[1:]])
    raise SystemExit(main())
