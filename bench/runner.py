"""Run the systems over one workload's input sequence and reduce the samples to figures.

Note [Side by side]
~~~~~~~~~~~~~~~~~~~
Eager, TorchScript and both dynvm systems run interleaved, call by call on the same
input, so machine noise hits them alike. torch.compile systems cannot share a process
with each other unchanged (Dynamo keeps its code cache per code object, process-wide,
and counts every system's graphs against one recompile limit; Inductor keeps loaded
kernels in memory by source hash), so each runs in its own pass over the same sequence
after a reset (Note [Counting compiles] in bench.systems). To still compare every
system side by side, every pass also runs eager PyTorch on each input, right after the
system (in the first pass eager is itself one of the systems; the order of the
systems changes from call to call, bench._timing.call_order): "x eager" is the median
over steady calls of latency / that pass's eager latency on the same input, a paired
ratio that a noisy neighbour slowing one whole pass does not move.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import threading
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench._timing import call_order, median, percentile
from bench.systems import LABELS, Eager, System, make
from bench.workloads import Workload, shape_key
from dynvm.arena import count_allocations


def matmul_peak_gflops(n: int = 2048, repeats: int = 10) -> float:
    """The machine's fp32 matmul throughput: best of `repeats` n x n x n products."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def flops_per_shape(workload: Workload) -> dict:
    """FLOPs of one eager call per distinct input shape (FlopCounterMode: matmul, conv
    and attention FLOPs; elementwise ops count zero)."""
    flops = {}
    for inputs in workload.inputs:
        key = shape_key(inputs)
        if key in flops:
            continue
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            workload.demo.module(*inputs)
        flops[key] = counter.get_total_flops()
    return flops


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_delta(fn, inputs, period: float = 0.001) -> int:
    """Peak resident-set growth during one call, sampled every `period` s from
    /proc/self/statm on a helper thread (memory glibc reuses from earlier calls does not
    show, so this is the call's fresh footprint, a lower bound of its working set)."""
    gc.collect()
    base = _rss_bytes()
    peak = base
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_bytes())
            time.sleep(period)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn(*inputs)
    finally:
        done.set()
        thread.join()
    return max(0, max(peak, _rss_bytes()) - base)


def run_workload(workload: Workload, system_names: list[str], log=print) -> dict:
    n = len(workload.inputs)
    latency: dict[str, list[float]] = {}
    latency_cpu: dict[str, list[float]] = {}   # the calling thread's CPU time per call
    reference: dict[str, list[float]] = {}
    results: dict[str, dict] = {}
    passes = []
    started = time.perf_counter()
    interleaved = [s for s in system_names if make_is_interleaved(s)]
    alone = [s for s in system_names if s not in interleaved]
    groups = ([interleaved] if interleaved else []) + [[s] for s in alone]
    for group in groups:
        log(f"[{workload.name}] running {', '.join(group)} over {n} calls"
            + ("" if "eager" in group else " (with eager alongside)"))
        systems: dict[str, System] = {}
        failed: dict[str, str] = {}
        for name in group:
            try:
                systems[name] = make(name, workload.demo)
            except Exception as exc:  # noqa: BLE001 - a system that cannot build is reported
                failed[name] = f"setup failed: {type(exc).__name__}: {exc}"[:300]
        # Note [Side by side]: every pass times eager on each input too.
        ref = systems.get("eager") or Eager(workload.demo)
        ref_samples: list[float] = []
        for name in systems:
            latency[name] = []
            latency_cpu[name] = []
        hidden_ref = ref is not systems.get("eager")
        group_start = time.perf_counter()
        for i, inputs in enumerate(workload.inputs):
            # The order changes call by call (bench._timing.call_order), so no system
            # always runs first on an input (cold caches) or right after the same one.
            order = [*systems] + ([None] if hidden_ref else [])
            for name in call_order(order, i):
                if name is None:
                    ref_samples.append(ref(*inputs)[1])
                    continue
                if name not in systems:
                    continue
                try:
                    _, elapsed = systems[name](*inputs)
                except Exception as exc:  # noqa: BLE001
                    failed[name] = f"call {i} failed: {type(exc).__name__}: {exc}"[:300]
                    systems.pop(name).close()
                    latency.pop(name)
                    latency_cpu.pop(name)
                    continue
                latency[name].append(elapsed)
                latency_cpu[name].append(systems[name].last_cpu_seconds)
            if (i + 1) % max(1, n // 5) == 0:
                log(f"[{workload.name}]   {i + 1}/{n} calls, "
                    f"{time.perf_counter() - group_start:.0f} s")
        if not hidden_ref:
            ref_samples = latency.get("eager", [])
        group_wall = time.perf_counter() - group_start
        passes.append({"systems": group, "eager_alongside": "eager" not in group,
                       "wall_seconds": group_wall})
        for name, system in systems.items():
            reference[name] = ref_samples
            results[name] = summarize(workload, system, latency[name], ref_samples)
            results[name]["pass_wall_seconds"] = group_wall
            results[name]["memory"] = _memory(system, workload)
            system.close()
        for name, why in failed.items():
            results[name] = {"label": LABELS[name], "status": why}
            log(f"[{workload.name}]   {name}: {why}")
    wall = time.perf_counter() - started
    return {"workload": workload.name, "description": workload.description, "calls": n,
            "warmup": workload.warmup, "distinct_shapes": len({shape_key(x) for x in
                                                               workload.inputs}),
            "buckets": workload.buckets, "bucket_order": workload.bucket_order,
            "systems": results, "passes": passes, "latency": latency,
            "latency_cpu": latency_cpu,
            "eager_same_pass": reference,
            "wall_seconds": wall}


def make_is_interleaved(name: str) -> bool:
    return not name.startswith("compile-")


def _memory(system: System, workload: Workload) -> dict:
    largest = max(workload.inputs, key=lambda x: sum(t.numel() for t in x))
    out: dict = {"largest_shape": [list(t.shape) for t in largest]}
    try:
        call = system.counted_callable() or system.runtime
        out["peak_rss_delta_mb"] = peak_rss_delta(call, largest) / 2**20
    except Exception as exc:  # noqa: BLE001
        out["peak_rss_delta_mb"] = None
        out["peak_error"] = f"{type(exc).__name__}: {exc}"[:200]
    last = workload.inputs[-1]
    try:
        if system.counted_callable() is None:
            out["allocations_per_forward"] = system.runtime.measure_allocations(*last)
        else:
            before = system.compiles()[0]
            _, count = count_allocations(system.counted_callable(), *last)
            # A TorchDispatchMode hides Inductor's own buffers (they never reach
            # dispatch as separate ops); say so rather than print a flattering zero.
            out["allocations_per_forward"] = count
            if system.name.startswith("compile-"):
                out["allocations_note"] = "ops dispatched under the mode only"
            if system.compiles()[0] != before:
                out["allocations_note"] = "measurement call compiled"
    except Exception as exc:  # noqa: BLE001
        out["allocations_per_forward"] = None
        out["allocations_error"] = f"{type(exc).__name__}: {exc}"[:200]
    out["process_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _switch_pairs(keys: list, start: int) -> list[int]:
    """Indices i >= start where the shape switched at i and stayed for call i + 1."""
    return [i for i in range(max(start, 1), len(keys) - 1)
            if keys[i] != keys[i - 1] and keys[i + 1] == keys[i]]


def _first_over_second_sight(samples: list[float], keys: list) -> dict:
    """Per shape seen at least twice (warm-up included: that is where most shapes are
    new), the latency of its first call over that of its second: what a new shape costs
    (tracing, compiling) against the same shape once seen."""
    seen: dict = {}
    for i, k in enumerate(keys):
        seen.setdefault(k, []).append(i)
    ratios = [samples[v[0]] / samples[v[1]] for v in seen.values()
              if len(v) >= 2 and samples[v[1]] > 0]
    return {"median": median(ratios) if ratios else None,
            "max": max(ratios) if ratios else None, "shapes": len(ratios)}


def _paired_ratio(samples: list[float], ref: list[float]) -> float | None:
    ratios = [s / r for s, r in zip(samples, ref) if r > 0]
    return median(ratios) if ratios else None


def same_shape_spread(samples: list[float], keys: list, min_calls: int = 3) -> dict:
    """p99 over p50 at the same shape, pooled: each steady call's latency over the median
    of its own shape's steady calls, over shapes with at least `min_calls` steady calls
    (with 64 or 121 distinct shapes, few shapes alone have enough calls for a p99)."""
    by_shape: dict = {}
    for s, k in zip(samples, keys):
        by_shape.setdefault(k, []).append(s)
    kept = {k: v for k, v in by_shape.items() if len(v) >= min_calls}
    pooled = [s / median(v) for v in kept.values() for s in v]
    return {"p99_over_p50": percentile(pooled, 99) if pooled else None,
            "calls": len(pooled), "shapes": len(kept), "min_calls_per_shape": min_calls}


def summarize(workload: Workload, system: System, samples: list[float],
              reference: list[float] | None = None) -> dict:
    """Figures of one system; `reference` is eager's latency on the same inputs in the
    same pass (Note [Side by side])."""
    warm = workload.warmup
    keys = [shape_key(x) for x in workload.inputs][: len(samples)]
    steady = samples[warm:]
    ref_steady = (reference or [])[warm: len(samples)]
    per_bucket = {}
    for bucket in workload.bucket_order:
        idx = [i for i, b in enumerate(workload.buckets[warm: len(samples)]) if b == bucket]
        if idx:
            chosen = [steady[i] for i in idx]
            per_bucket[bucket] = {"calls": len(chosen), "p50_ms": median(chosen) * 1e3,
                                  "p99_ms": percentile(chosen, 99) * 1e3}
            if ref_steady:
                per_bucket[bucket]["x_eager"] = _paired_ratio(
                    chosen, [ref_steady[i] for i in idx])
    pairs = _switch_pairs(keys, warm)
    first = [samples[i] for i in pairs]
    second = [samples[i + 1] for i in pairs]
    sights = _first_over_second_sight(samples, keys)
    count, compile_s = system.compiles()
    return {
        "label": LABELS[system.name],
        "status": "ok",
        "p50_ms": median(steady) * 1e3 if steady else None,
        "p99_ms": percentile(steady, 99) * 1e3 if steady else None,
        "x_eager": _paired_ratio(steady, ref_steady) if ref_steady else None,
        "max_ms_warmup": max(samples[:warm]) * 1e3 if warm else None,
        "max_ms_steady": max(steady) * 1e3 if steady else None,
        "per_bucket": per_bucket,
        "same_shape": same_shape_spread(steady, keys[warm:]),
        "compiles": count,
        "compile_seconds": compile_s,
        "setup_seconds": system.setup_seconds,
        "total_compile_seconds": compile_s + system.setup_seconds,
        "compile_events": system.compile_events,
        "switch_first_ms": median(first) * 1e3 if first else None,
        "switch_second_ms": median(second) * 1e3 if second else None,
        "switches": len(pairs),
        "first_over_second_sight": sights,
        "sum_call_seconds": sum(samples),
        "warnings": system.warnings,
        "extra": system.extra(),
    }


def roofline(workload: Workload, result: dict, flops: dict, peak_gflops: float) -> None:
    """Add achieved GFLOP/s (median over steady calls of FLOPs / latency) and its fraction
    of the measured matmul peak to each system's result."""
    keys = [shape_key(x) for x in workload.inputs]
    for name, samples in result["latency"].items():
        rates = [flops[k] / s / 1e9 for k, s in
                 zip(keys[workload.warmup:], samples[workload.warmup:]) if s > 0]
        if rates:
            gflops = statistics.median(rates)
            result["systems"][name]["steady_gflops"] = gflops
            result["systems"][name]["fraction_of_peak"] = gflops / peak_gflops
    counted = list(flops.values())
    result["flops_per_call"] = {"min": min(counted), "max": max(counted),
                                "median": statistics.median(counted)}
