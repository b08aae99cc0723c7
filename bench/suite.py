"""One run of the side-by-side suite: workloads x systems -> results.json, report.md,
plots, and optionally docs/bench_results.md. Entry points: `dynvm bench` and
`python -m bench` (both parse the options of dynvm._bench_cmd)."""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

import torch

from bench import report
from bench.runner import flops_per_shape, matmul_peak_gflops, roofline, run_workload
from bench.systems import SYSTEMS, warm_shared_imports
from bench.workloads import NAMES, build


class BenchUsageError(ValueError):
    """An unknown workload or system, or options that do not fit together."""


def _choose(args) -> tuple[list[str], list[str]]:
    names = list(args.workloads) or (["walk"] if args.quick else ["all"])
    if "all" in names:
        names = list(NAMES)
    bad = [n for n in names if n not in NAMES]
    if bad:
        raise BenchUsageError(f"unknown workload {bad[0]!r}; known: {', '.join(NAMES)}, all")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise BenchUsageError(f"unknown system {unknown[0]!r}; known: {', '.join(SYSTEMS)}")
    if not systems:
        raise BenchUsageError("--systems names no system")
    if args.calls is not None and args.calls < 4:
        raise BenchUsageError(f"--calls must be at least 4, got {args.calls}")
    if args.threads is not None and args.threads < 1:
        raise BenchUsageError(f"--threads must be at least 1, got {args.threads}")
    return names, systems


def run(args, prog: str = "python -m bench", log=None) -> int:
    """Run (or, with args.from_dir, re-report) the suite; returns the exit status."""
    log = log or (lambda m: print(m, flush=True))
    if getattr(args, "jit_options", None):
        raise BenchUsageError("--jit-option is for the zoo (dynvm bench zoo); the suite's "
                              "JIT runs the default JitConfig its figures are published for")
    if args.from_dir:
        results = args.from_dir / "results.json"
        if not results.is_file():
            raise BenchUsageError(f"--from {args.from_dir}: no results.json there")
        log(report.write(json.loads(results.read_text()), args.from_dir).read_text())
        if args.update_docs:
            report.update_docs(args.from_dir)
            log(f"updated {report.DOCS}")
        return 0
    names, systems = _choose(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or Path(__file__).resolve().parent / "results" / time.strftime(
        "%Y%m%d-%H%M%S")
    started = time.perf_counter()
    repeats = 3 if args.quick else 10
    peak = matmul_peak_gflops(repeats=repeats)
    log(f"fp32 matmul peak: {peak:.1f} GFLOP/s")
    imports = warm_shared_imports()
    log(f"torch.export / Dynamo imported in {imports:.1f} s (Note [Shared first use])")
    run_info = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "command": _command(args, prog), "quick": args.quick,
                "machine": report.machine(), "loadavg_start": os.getloadavg(),
                "shared_import_seconds": imports, "systems": systems, "workloads": []}
    done = []
    for name in names:
        workload = build(name, args.quick, args.seed, args.calls)
        result = run_workload(workload, systems, log=log)
        try:
            flops = flops_per_shape(workload)
        except Exception as exc:  # noqa: BLE001 - FLOP counting is a nice-to-have
            result["flops_error"] = f"{type(exc).__name__}: {exc}"[:200]
            flops = None
        run_info["workloads"].append(result)
        done.append((workload, result, flops))
    # The peak, like every latency, moves with the machine's other load: keep the best
    # of a measurement before and after the workloads.
    peak = max(peak, matmul_peak_gflops(repeats=repeats))
    run_info["peak_gflops"] = peak
    for workload, result, flops in done:
        result["peak_gflops"] = peak
        if flops:
            roofline(workload, result, flops, peak)
    run_info["total_wall_seconds"] = time.perf_counter() - started
    run_info["loadavg_end"] = os.getloadavg()
    md = report.write(run_info, out)
    log(md.read_text())
    log(f"results in {out}")
    if args.update_docs:
        report.update_docs(out)
        log(f"updated {report.DOCS}")
    return 0


def _command(args, prog: str) -> str:
    """The command line that repeats this run (options in canonical form)."""
    parts = [*args.workloads]
    if args.systems != ",".join(SYSTEMS):
        parts += ["--systems", args.systems]
    for flag in ("quick", "update_docs"):
        if getattr(args, flag):
            parts.append("--" + flag.replace("_", "-"))
    for flag in ("calls", "threads", "seed"):
        value = getattr(args, flag)
        if value is not None and not (flag == "seed" and value == 0):
            parts += [f"--{flag}", str(value)]
    return " ".join([prog, *(shlex.quote(p) for p in parts)])
