"""`dynvm bench`: the side-by-side benchmark suite (bench/ in a source checkout).

The suite compares dynvm with eager PyTorch, TorchScript and torch.compile; it is not
shipped with the package (it needs the peers, matplotlib and minutes of machine time),
so the command runs it from the checkout that an editable install points at. The
options are defined here once; `python -m bench` builds its parser from them too.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from dynvm._run_cmd import CliError

# Kept in step with bench.workloads.NAMES and bench.systems.SYSTEMS (a test checks).
WORKLOADS = ("walk", "jitter", "nlp", "gnn", "loop", "heldout", "heldout-walk")
SYSTEMS = ("eager", "torchscript", "compile-static", "compile-dynamic", "compile-auto",
           "compile-max-autotune", "dynvm-interp", "dynvm-interp-b", "dynvm-jit",
           "onnxruntime", "onnxruntime-int8", "openvino", "openvino-bf16")

DESCRIPTION = f"""\
Run eager PyTorch, TorchScript (traced per shape), torch.compile (dynamic=False,
dynamic=True, default, mode="max-autotune") and the dynvm interpreter and JIT side by
side on dynamic-shape workloads; write results.json (machine and versions), report.md
(tables, targets met or missed) and one latency-over-calls PNG per workload to
bench/results/<time>/.

workloads: {", ".join(WORKLOADS)}, or all (default: walk with --quick, all without)
systems:   {", ".join(SYSTEMS)}

  dynvm bench all --update-docs       regenerate docs/bench_results.md, its plots
  dynvm bench zoo --update-docs       the model zoo (tests/zoo): eager vs interpreter vs
                                      JIT per model, regenerates docs/MODELS.md
  dynvm bench generate                greedy generation (issue 32): eager loop, HF
                                      generate, dynvm interpreter and JIT, CTranslate2
  dynvm bench walk --quick            about 2 min, mostly torch.compile compiling
  dynvm bench nlp --systems eager,dynvm-jit --quick"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dynvm bench` (workloads, systems, sizes, output)."""
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                        help="workloads to run (see above)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), metavar="A,B,...",
                        help="comma-separated subset of the systems (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer calls per workload, for a smoke run (figures are "
                        "indicative only)")
    parser.add_argument("--calls", type=int, metavar="N",
                        help="calls per workload (overrides the size; warm-up a quarter "
                        "at most)")
    parser.add_argument("--threads", type=int, metavar="T",
                        help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="seed of the input sequences (default 0)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="results folder (default bench/results/<time>)")
    parser.add_argument("--update-docs", action="store_true",
                        help="copy the report into docs/bench_results.md and its plots into "
                        "docs/")
    parser.add_argument("--models", metavar="A,B,...",
                        help="zoo only: comma-separated zoo models (default: all)")
    parser.add_argument("--peers", metavar="A,B,...",
                        help="zoo only: peers timed beside eager, interpreter and JIT "
                        "(torch.compile: its default mode, with its compile seconds; "
                        "onnxruntime, onnxruntime-int8, openvino, openvino-bf16: the bench "
                        "extra)")
    parser.add_argument("--peer-models", metavar="A,B,...",
                        help="zoo only: time the peers on these models alone (default: "
                        "every model measured)")
    parser.add_argument("--jit-option", dest="jit_options", action="append",
                        metavar="KEY=VALUE",
                        help="zoo only: a JitConfig field for the JIT's Runtime, e.g. "
                        "cpu_channels_last=off (repeatable; default: JitConfig())")
    parser.add_argument("--batch-sizes", metavar="A,B,...",
                        help="generate only: batch sizes (default 1,4); --models "
                        "llama,gpt2 and --systems eager,hf,dynvm-interp,dynvm-jit,"
                        "ctranslate2 choose the rest")
    parser.add_argument("--long-context", type=int, metavar="L",
                        help="generate only: instead of the table, 16 decode steps (B=1) "
                        "at a cache of L tokens, eager vs interpreter vs JIT")
    parser.add_argument("--from", dest="from_dir", type=Path, metavar="DIR",
                        help="no run: rebuild report.md and plots from DIR/results.json")


def add_parser(sub) -> None:
    """Register `dynvm bench` on the CLI's subparsers."""
    p = sub.add_parser("bench", help="benchmark dynvm against eager, TorchScript and "
                       "torch.compile", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(handler=bench_command)


def _suite():
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "suite.py").is_file():
        raise CliError(f"dynvm bench needs a source checkout: no bench/suite.py under "
                       f"{root} (the suite is not part of the installed package)", 2)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("bench.suite")


def _zoo_command(args) -> int:
    # The zoo is a workload of its own (bench/zoo.py over tests/zoo's registry), with
    # its own table (docs/MODELS.md), so it is dispatched before the suite sees it.
    if args.workloads != ["zoo"]:
        raise CliError("dynvm bench zoo runs alone: name no other workload with it", 2)
    if args.from_dir:
        raise CliError("dynvm bench zoo has no --from", 2)
    _suite()  # puts the checkout on sys.path, or says that there is none
    zoo = importlib.import_module("bench.zoo")
    try:
        return zoo.run(args)
    except zoo.ZooUsageError as exc:
        raise CliError(str(exc), 2) from None


def _generate_command(args) -> int:
    # Generation is a workload of its own (bench/generate.py): its own systems and table.
    if args.workloads != ["generate"] or args.from_dir:
        raise CliError("dynvm bench generate runs alone, without --from", 2)
    _suite()  # puts the checkout on sys.path, or says that there is none
    generate = importlib.import_module("bench.generate")
    if args.systems == ",".join(SYSTEMS):  # the suite's default list: generate's own
        args.systems = None
    return generate.run(args)


def bench_command(args) -> int:
    """`dynvm bench`: the zoo timings, or the benchmark suite under bench/; the
    exit status."""
    if "zoo" in args.workloads:
        return _zoo_command(args)
    if "generate" in args.workloads:
        return _generate_command(args)
    suite = _suite()
    try:
        return suite.run(args, prog="dynvm bench")
    except suite.BenchUsageError as exc:
        raise CliError(str(exc), 2) from None
