"""Side-by-side benchmark of eager PyTorch, TorchScript, torch.compile and dynvm on
dynamic-shape workloads.

    python -m bench [walk|jitter|nlp|gnn|loop|all ...] [--systems a,b,...] [--quick]
                    [--calls N] [--threads T] [--seed S] [--out DIR] [--update-docs]
    python -m bench --from bench/results/<time> --update-docs

Without a workload: walk with --quick, all five without. Results go to
bench/results/<time>/ (results.json, report.md, <workload>_latency.png);
--update-docs copies the report and plots into docs/BENCHMARKS.md and docs/.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from bench import report
from bench.runner import flops_per_shape, matmul_peak_gflops, roofline, run_workload
from bench.systems import SYSTEMS
from bench.workloads import NAMES, build


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", metavar="workload",
                        help=f"{', '.join(NAMES)} or all (default: walk with --quick, "
                        "all without)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--quick", action="store_true",
                        help="fewer calls per workload (walk: 120 calls, 20 warm-up)")
    parser.add_argument("--calls", type=int, help="override the calls per workload")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/<time>)")
    parser.add_argument("--update-docs", action="store_true",
                        help="copy the report into docs/BENCHMARKS.md and docs/*.png")
    parser.add_argument("--from", dest="from_dir", type=Path,
                        help="no run: rebuild report.md and plots from DIR/results.json "
                        "(then --update-docs copies them)")
    args = parser.parse_args(argv)
    if args.from_dir:
        run = json.loads((args.from_dir / "results.json").read_text())
        print(report.write(run, args.from_dir).read_text())
        if args.update_docs:
            report.update_docs(args.from_dir)
            print(f"updated {report.DOCS}")
        return
    names = args.workloads or (["walk"] if args.quick else ["all"])
    if "all" in names:
        names = NAMES
    bad = [n for n in names if n not in NAMES]
    if bad:
        parser.error(f"unknown workloads {bad}; known: {', '.join(NAMES)}, all")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    torch.set_num_threads(args.threads)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or Path(__file__).resolve().parent / "results" / stamp
    started = time.perf_counter()
    peak = matmul_peak_gflops()
    print(f"fp32 matmul peak: {peak:.1f} GFLOP/s", flush=True)
    run = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "command": "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
           "machine": report.machine(), "loadavg_start": os.getloadavg(),
           "peak_gflops": peak, "systems": systems, "workloads": []}
    for name in names:
        workload = build(name, args.quick, args.seed, args.calls)
        result = run_workload(workload, systems, log=lambda m: print(m, flush=True))
        result["peak_gflops"] = peak
        try:
            roofline(workload, result, flops_per_shape(workload), peak)
        except Exception as exc:  # noqa: BLE001 - FLOP counting is a nice-to-have
            result["flops_error"] = f"{type(exc).__name__}: {exc}"[:200]
        run["workloads"].append(result)
    run["total_wall_seconds"] = time.perf_counter() - started
    run["loadavg_end"] = os.getloadavg()
    md = report.write(run, out)
    print(md.read_text())
    print(f"results in {out}")
    if args.update_docs:
        report.update_docs(out)
        print(f"updated {report.DOCS}")


if __name__ == "__main__":
    main()
