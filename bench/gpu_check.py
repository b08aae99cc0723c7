"""The Triton backend's check on a GPU (issues 5 and 19): one prepared script.

    python bench/gpu_check.py --out bench/results/gpu_check            # CUDA (the real run)
    python bench/gpu_check.py --device cpu --calls 20 --out /tmp/gc    # smoke run, no GPU

1. Correctness of every generated kernel kind (elementwise chain, softmax, layer norm,
   matmul + epilogue), each a hand-built region compiled once for a code family and run
   for several members (varying dims included) against eager PyTorch on the device. On
   CUDA the kernels run through Triton's JIT (`run_cuda.CudaRegion`); on a CPU through
   Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported).
2. Stored artifacts loaded without compiling (issue 19): the same kernels compiled ahead
   of time for this GPU's architecture (sm_90 on a CPU) in a child process, as the
   compile service does; then, with Triton's compiler made to raise in this process,
   loaded from the artifact bytes (dynvm.jit.backends.triton.loader) and launched against
   eager. On a CPU the launch goes through the fake device boundary of the tests
   (tests/triton/_fake_device.py: the same launcher arguments, interpreted).
3. The Transformer random walk (batch over {1, 4, 16, 64}, seq 32, 500 calls of which 50
   warm-up; `--calls`/`--warmup` shorten it) for eager, torch.compile(dynamic=False),
   torch.compile(dynamic=True), torch.compile(mode="reduce-overhead"), the dynvm
   interpreter, the dynvm JIT, and the dynvm JIT with CUDA graphs (exact
   specializations of batch <= 16 captured, Note [CUDA graph outputs]). Each system runs
   alone over the same walk and inputs (Dynamo's caches are process-wide); every call is
   timed to completion (the device is synchronized). On CUDA the JIT uses the Triton
   backend; on a CPU it uses the CPU backend (interpreted Triton would take minutes per
   call at batch 64), and the table says which. After the walk, the JIT's output at each
   batch size is compared with eager.

Writes `gpu_check.json` and `gpu_check.md` to `--out`; exits 1 if a kernel or a loaded
artifact disagrees with eager. tests/triton/test_gpu_check.py runs it with --device cpu
and tiny sizes so it cannot rot. Nothing here has been run on a GPU by the sessions that
wrote it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_NAMES = ("eager", "compile-static", "compile-dynamic", "compile-reduce-overhead",
                "dynvm-interp", "dynvm-jit", "dynvm-jit-graphs")



def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_check")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up calls (default 50, or a tenth of --calls if fewer "
                             "than 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default=",".join(SYSTEM_NAMES),
                        help=f"comma-separated subset of {','.join(SYSTEM_NAMES)}")
    parser.add_argument("--skip-kernels", action="store_true",
                        help="skip parts 1 and 2 (kernels, stored artifacts)")
    parser.add_argument("--members", type=int, default=4,
                        help="family members each kernel case is checked on")
    parser.add_argument("--cases", default="",
                        help="comma-separated kernel cases to check (default: all)")
    parser.add_argument("--batches", default="1,4,16,64",
                        help="batch sizes of the walk (the issue's: 1,4,16,64)")
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.cases = [c for c in args.cases.split(",") if c]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    unknown = set(args.systems) - set(SYSTEM_NAMES)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEM_NAMES)}")
    if args.warmup is None:
        args.warmup = min(50, max(1, args.calls // 10))
    if args.warmup >= args.calls:
        parser.error("--warmup must be smaller than --calls")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    # Triton's interpreter must be chosen before triton is first imported (Note [Loading
    # generated kernels] in dynvm.jit.backends.triton._loading).
    os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))   # bench and tests (hand-built regions, eager references)

import dynvm  # noqa: E402
from bench._timing import SEQ, median, percentile, random_walk  # noqa: E402
from bench.systems import LABELS as BENCH_LABELS  # noqa: E402
from bench.systems import Dynvm, System, TorchCompile, make  # noqa: E402
from dynvm.jit.backends.triton import generate_region  # noqa: E402
from dynvm.jit.backends.triton.options import DEFAULT_OPTIONS  # noqa: E402
from dynvm.jit.config import JitConfig  # noqa: E402
from dynvm.jit.ir import ConstRef, Literal  # noqa: E402
from dynvm.models import transformer  # noqa: E402
from tests.triton import _triton_helpers as th  # noqa: E402


def _members_against_eager(runner, spec, fam, rng, members, device, on_device):
    """Run `members` drawn from the family through `runner` and eager: (largest absolute
    error, whether every output is within rtol/atol 1e-4, the members' shapes)."""
    worst, ok, tested = 0.0, True, []
    for dims in th.member_dims(fam, rng, members):
        x = torch.randn(dims[0], device=device)
        got = th.run_region(runner, spec, {0: x})
        want = th.eager(spec, {0: x}, on_device)
        for reg in want:
            err = (got[reg] - want[reg]).abs().max().item() if want[reg].numel() else 0.0
            worst = max(worst, err)
            ok = ok and torch.allclose(got[reg], want[reg], rtol=1e-4, atol=1e-4)
        tested.append(list(dims[0]))
    return worst, ok, tested

op = th.op
LABELS = {**BENCH_LABELS, "compile-reduce-overhead": 'torch.compile(mode="reduce-overhead")',
          "dynvm-jit-graphs": "dynvm JIT + CUDA graphs"}
C0, C1, C2 = ConstRef(0), ConstRef(1), ConstRef(2)


# -- part 1: kernels -----------------------------------------------------------------------


def kernel_cases(only=()):
    """(name, family, ops, outputs, constants, expected group kind) per kernel kind, two
    families each (rows vary; batch and sequence vary)."""
    rows = th.family({0: (6, 64)}, {(0, 0)})
    batch_seq = th.family({0: (2, 8, 48)}, {(0, 0), (0, 1)})
    cases = []
    for tag, fam, width in (("rows", rows, 64), ("batch-seq", batch_seq, 48)):
        bias, scale = torch.randn(width), torch.rand(width) + 0.5
        cases.append((f"elementwise-{tag}", fam, [
            op("ADD", 1, 0, C0), op("GELU", 2, 1, "none"), op("MUL", 3, 2, 0),
            op("SUB", 4, 3, 0.25), op("TANH", 5, 4), op("SILU", 6, 5), op("SIGMOID", 7, 6),
            op("DIV", 8, 7, C1), op("RELU", 9, 8), op("GELU", 10, 9, "tanh")],
            (5, 10), [bias, scale], "elementwise"))
        cases.append((f"softmax-{tag}", fam, [
            op("MUL", 1, 0, 0.125), op("ADD", 2, 1, C0),
            op("SOFTMAX", 3, 2, Literal(-1), Literal(None)), op("MUL", 4, 3, C1)],
            (4,), [bias, scale], "row"))
        cases.append((f"layer-norm-{tag}", fam, [
            op("MUL", 1, 0, 2.0), op("ADD", 2, 1, 0),
            op("LAYER_NORM", 3, 2, Literal([width]), C0, C1, 1e-5, Literal(False)),
            op("GELU", 4, 3, "tanh")], (2, 4), [scale, bias], "row"))
        weight = torch.randn(96, width) / width ** 0.5
        cases.append((f"matmul-epilogue-{tag}", fam, [
            op("LINEAR", 1, 0, C0, C1), op("GELU", 2, 1, "none"), op("ADD", 3, 2, 1.0),
            op("MUL", 4, 3, 0.5)], (4,), [weight, torch.randn(96)], "matmul"))
    unknown = set(only) - {c[0] for c in cases}
    if unknown:
        raise SystemExit(f"unknown kernel cases {sorted(unknown)}")
    return [c for c in cases if not only or c[0] in only]


def check_kernels(device: torch.device, members: int, only=()) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for name, fam, ops, outputs, constants, kind in kernel_cases(only):
        spec = th.build_region(ops, fam, (0,), outputs, constants)
        code = generate_region(spec, constants)
        kinds = sorted({s.kind for s in code.plan.kernels()})
        on_device = [c.to(device) for c in constants]
        start = time.perf_counter()
        runner = make_runner(code, on_device, device)
        compile_s = time.perf_counter() - start
        worst, agrees, tested = _members_against_eager(runner, spec, fam, rng, members,
                                                       device, on_device)
        ok = kind in kinds and agrees
        rows.append({"case": name, "family": fam.key, "kernel_kinds": kinds, "expected": kind,
                     "members": tested, "max_abs_err": worst, "ok": bool(ok),
                     "compile_s": compile_s, "launches": runner.launches})
        print(f"  {name:28s} {'ok' if ok else 'FAIL'}  kinds {kinds}  max|err| {worst:.2e}  "
              f"members {tested}", flush=True)
    return rows


def make_runner(code, constants, device: torch.device):
    if device.type == "cuda":
        from dynvm.jit.backends.triton.run_cuda import CudaRegion

        runner = CudaRegion(code.plan, code.kernels, constants, device)
        runner.warm_up()
        return runner
    from dynvm.jit.backends.triton.run_interpreted import InterpretedRegion

    return InterpretedRegion(code.plan, code.kernels, constants)


# -- part 2: stored artifacts, loaded without compiling -------------------------------------


class CompilerCalled(AssertionError):
    """Triton's compiler ran while stored binaries were being loaded or launched."""


@contextlib.contextmanager
def compiler_forbidden():
    """Every way into Triton's compiler raises in this process while inside (the
    ahead-of-time compiles run in child processes); yields the list of attempts. Restored
    on exit: the walk's JIT and torch.compile compile with Triton."""
    import triton
    import triton.compiler.compiler
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction

    calls: list[str] = []

    def forbidden(what):
        def raise_(*args, **kwargs):
            calls.append(what)
            raise CompilerCalled(f"{what} was called")
        return raise_

    places = [(triton, "compile"), (triton.compiler, "compile"),
              (triton.compiler.compiler, "compile"), (CUDABackend, "add_stages"),
              (JITFunction, "_do_compile")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in places]
    for owner, name in places:
        setattr(owner, name, forbidden(f"{getattr(owner, '__name__', owner)}.{name}"))
    try:
        yield calls
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def check_stored(device: torch.device, members: int, only=()) -> list[dict]:
    """Every kernel case as a stored artifact: built for this GPU (sm_90 on a CPU) in a
    child process, then loaded and launched here with the compiler forbidden."""
    from dynvm.jit.backends.triton import build_binaries
    from dynvm.jit.backends.triton.artifact import build_artifact
    from dynvm.jit.backends.triton.run_binary import CudaBoundary

    if device.type == "cuda":
        boundary = CudaBoundary(device)
    else:
        from tests.triton._fake_device import InterpretedBoundary

        boundary = InterpretedBoundary(arch=90)
    cases = []
    for name, fam, ops, outputs, constants, _kind in kernel_cases(only):
        spec = th.build_region(ops, fam, (0,), outputs, constants)
        cases.append((name, fam, spec, constants, generate_region(spec, constants)))
    kernels = {k.name: k for *_, code in cases for k in code.kernels}
    # Its own architecture (cubin), and sm_80 (whose PTX the driver compiles for a newer
    # GPU: Note [Stored binaries on other GPUs]).
    targets = [f"cuda:{boundary.arch}"] + (["cuda:80"] if boundary.arch > 80 else [])
    start = time.perf_counter()
    binaries = build_binaries(kernels.values(), targets,
                              jobs=max(1, min(8, (os.cpu_count() or 2) // 2)))
    build_s = time.perf_counter() - start
    stored = []
    for target in targets:
        for name, fam, spec, constants, code in cases:
            mine = {target: {k.name: binaries[target][k.name] for k in code.kernels}}
            data = build_artifact(code, program_hash="0" * 64, family_key=fam.key,
                                  binaries=mine, options=DEFAULT_OPTIONS).to_bytes()
            stored.append((name, fam, spec, constants, data))
    print(f"  {len(kernels)} kernels built for {', '.join(targets)} in a child process "
          f"in {build_s:.1f} s; loading with Triton's compiler forbidden", flush=True)
    with compiler_forbidden() as calls:
        return [_load_and_run(row, boundary, members, calls) for row in stored]


def _load_and_run(stored, boundary, members: int, calls: list) -> dict:
    from dynvm.jit.backends.triton import TritonArtifact
    from dynvm.jit.backends.triton.loader import choose_binary, load_kernels
    from dynvm.jit.backends.triton.run_binary import BinaryRegion

    name, fam, spec, constants, data = stored
    rng = random.Random(1)
    on_device = [c.to(boundary.device) for c in constants]
    start = time.perf_counter()
    artifact = TritonArtifact.from_bytes(data)
    choice = choose_binary(artifact, boundary.arch)
    runner = BinaryRegion(artifact.plan, load_kernels(artifact, choice), on_device,
                          boundary)
    runner.prepare()
    load_ms = (time.perf_counter() - start) * 1e3
    worst, ok, _ = _members_against_eager(runner, spec, fam, rng, members, boundary.device,
                                          on_device)
    ok = ok and not calls and runner.launches > 0
    print(f"  {name:28s} {'ok' if ok else 'FAIL'}  {choice.how} of {choice.target}  "
          f"load {load_ms:.1f} ms  max|err| {worst:.2e}", flush=True)
    return {"case": name, "how": choice.how, "target": choice.target, "load_ms": load_ms,
            "launches": runner.launches, "max_abs_err": worst,
            "compiler_calls": list(calls), "ok": bool(ok)}


# -- part 3: the walk ----------------------------------------------------------------------


class DynvmOn(Dynvm):
    """bench.systems.Dynvm on a chosen device with a chosen JitConfig."""

    def __init__(self, demo, name: str, jit, device: torch.device) -> None:
        System.__init__(self, demo)
        self.name = name
        start = time.perf_counter()
        program = dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes,
                                name=demo.name)
        self.setup_seconds = time.perf_counter() - start
        self.runtime = dynvm.Runtime(program, device=device, jit=jit)


def on_device(demo, device: torch.device):
    """The demo model with its module on `device` (dynvm compiles the CPU original)."""
    import copy
    import dataclasses

    if device.type == "cpu":
        return demo
    return dataclasses.replace(demo, module=copy.deepcopy(demo.module).to(device))


class ReduceOverhead(TorchCompile):
    """torch.compile(mode="reduce-overhead"): Inductor with CUDA graphs (on a CPU Inductor
    skips the graphs, and says so in a warning)."""

    def __init__(self, demo) -> None:
        super().__init__(demo, "compile-reduce-overhead", dynamic=False)
        self.fn = torch.compile(demo.module, mode="reduce-overhead")


def build_system(name: str, demo, device: torch.device, jit_backend: str):
    if name == "dynvm-interp":
        return DynvmOn(demo, name, False, device)
    if name == "dynvm-jit":
        return DynvmOn(demo, name, JitConfig(backend=jit_backend, cuda_graphs_max_batch=0),
                       device)
    if name == "dynvm-jit-graphs":
        return DynvmOn(demo, name, JitConfig(backend=jit_backend, cuda_graphs_max_batch=16),
                       device)
    if name == "compile-reduce-overhead":
        return ReduceOverhead(on_device(demo, device))
    return make(name, on_device(demo, device))


def captured_graphs(runtime) -> int:
    """Specializations the JIT captured into CUDA graphs (their artifact notes say so)."""
    return sum(any(n.startswith("cuda graph: captured") for n in a.notes)
               for a in runtime.jit.artifacts.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_walk(args, device: torch.device, jit_backend: str) -> dict:
    torch.manual_seed(args.seed)
    demo = transformer()
    hidden = demo.example_inputs[0].shape[-1]
    walk = random_walk(args.batches, args.calls, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    inputs = {b: torch.randn(b, SEQ, hidden, generator=gen).to(device) for b in args.batches}
    with torch.inference_mode():
        reference = {b: on_device(demo, device).module(x) for b, x in inputs.items()}
    results = {}
    for name in args.systems:
        print(f"  {LABELS[name]} ...", flush=True)
        start = time.perf_counter()
        system = build_system(name, demo, device, jit_backend)
        latency = []
        for batch in walk:
            sync(device)
            t0 = time.perf_counter()
            system(inputs[batch])
            sync(device)
            latency.append(time.perf_counter() - t0)
        errors = {}
        for batch, x in inputs.items():
            out, _ = system(x)
            sync(device)
            errors[batch] = (out - reference[batch]).abs().max().item()
        count, seconds = system.compiles()
        entry = {"label": LABELS[name], "latency_s": latency, "compiles": count,
                 "compile_seconds": seconds, "setup_seconds": system.setup_seconds,
                 "wall_s": time.perf_counter() - start, "max_abs_err_vs_eager": errors,
                 "extra": system.extra()}
        if name in ("dynvm-jit", "dynvm-jit-graphs"):
            stats = system.runtime.stats()
            entry["backend"] = stats["backend"]
            entry["triton_compiles"] = stats["triton_compiles"]
            entry["triton_fallbacks"] = stats["triton_fallbacks"]
            entry["cuda_graphs"] = captured_graphs(system.runtime)
            entry["label"] = f"dynvm JIT ({stats['backend']} backend)"
            if name == "dynvm-jit-graphs":
                entry["label"] += f" + CUDA graphs ({entry['cuda_graphs']} captured)"
            entry["event_log"] = list(system.runtime.jit.event_log[-10:])
        system.close()
        results[name] = entry
        print(f"    {entry['wall_s']:.1f} s, {count} compiles ({seconds:.2f} s), max|err| vs "
              f"eager {max(errors.values()):.2e}", flush=True)
    return {"walk": walk, "systems": results}


# -- report --------------------------------------------------------------------------------


def summarize(walk: list[int], latency: list[float], warmup: int) -> dict:
    rows = {}
    for batch in sorted(set(walk)):
        steady = [s for s, b in zip(latency[warmup:], walk[warmup:]) if b == batch]
        if steady:
            rows[batch] = {"calls": len(steady), "p50_ms": median(steady) * 1e3,
                           "p99_ms": percentile(steady, 99) * 1e3}
    return rows


def markdown(report: dict) -> str:
    lines = [f"# gpu_check: {report['device_name']}", "",
             f"torch {report['torch']}, triton {report['triton']}, {report['calls']} calls "
             f"({report['warmup']} warm-up), seq {SEQ}, batches {report['batches']}, seed "
             f"{report['seed']}; dynvm JIT backend: {report['jit_backend']}.", ""]
    if report["kernels"]:
        lines += ["## Kernels vs eager", "", "| case | kinds | members | max abs err | ok |",
                  "|---|---|---|---:|---|"]
        for row in report["kernels"]:
            lines.append(f"| {row['case']} | {', '.join(row['kernel_kinds'])} | "
                         f"{len(row['members'])} | {row['max_abs_err']:.2e} | "
                         f"{'yes' if row['ok'] else 'NO'} |")
        lines.append("")
    if report["stored"]:
        lines += ["## Stored artifacts, loaded without compiling", "",
                  "| case | binary | load ms | launches | max abs err | compiler calls | ok |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for row in report["stored"]:
            lines.append(f"| {row['case']} | {row['how']} of {row['target']} | "
                         f"{row['load_ms']:.1f} | {row['launches']} | "
                         f"{row['max_abs_err']:.2e} | {len(row['compiler_calls'])} | "
                         f"{'yes' if row['ok'] else 'NO'} |")
        lines.append("")
    lines += ["## Transformer random walk (steady state)", "",
              "| system | batch | calls | p50 ms | p99 ms |", "|---|---:|---:|---:|---:|"]
    for entry in report["walk"]["systems"].values():
        for batch, row in entry["steady"].items():
            lines.append(f"| {entry['label']} | {batch} | {row['calls']} | "
                         f"{row['p50_ms']:.3f} | {row['p99_ms']:.3f} |")
    lines += ["", "| system | compiles | compile s (+ setup s) | max ms warm-up | "
              "max ms steady | max abs err vs eager |", "|---|---:|---:|---:|---:|---:|"]
    for entry in report["walk"]["systems"].values():
        latency, warm = entry["latency_s"], report["warmup"]
        lines.append(f"| {entry['label']} | {entry['compiles']} | "
                     f"{entry['compile_seconds']:.2f} (+ {entry['setup_seconds']:.2f}) | "
                     f"{max(latency[:warm]) * 1e3:.2f} | {max(latency[warm:]) * 1e3:.2f} | "
                     f"{max(entry['max_abs_err_vs_eager'].values()):.2e} |")
    systems = report["walk"]["systems"]
    if "dynvm-jit" in systems and "compile-static" in systems:
        lines += ["", "dynvm JIT p50 / torch.compile(dynamic=False) p50 per batch: " + ", ".join(
            f"{b}: {systems['dynvm-jit']['steady'][b]['p50_ms'] / row['p50_ms']:.2f}"
            for b, row in systems["compile-static"]["steady"].items()
            if b in systems["dynvm-jit"]["steady"])]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: run with --device cpu", file=sys.stderr)
            return 2
        # Eager fp32 as the kernels compute it (TritonOptions.matmul_precision "ieee").
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        device_name = torch.cuda.get_device_name(device)
        jit_backend = "triton"
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, "\
                      f"{torch.get_num_threads()} threads)"
        jit_backend = "cpu"
    import triton

    started = time.perf_counter()
    kernels, stored = [], []
    if not args.skip_kernels:
        print(f"kernels on {device_name}:", flush=True)
        kernels = check_kernels(device, args.members, args.cases)
        print(f"stored artifacts on {device_name}:", flush=True)
        stored = check_stored(device, args.members, args.cases)
    print(f"walk on {device_name}:", flush=True)
    walk = run_walk(args, device, jit_backend)
    for entry in walk["systems"].values():
        entry["steady"] = summarize(walk["walk"], entry["latency_s"], args.warmup)
    report = {"device": str(device), "device_name": device_name, "torch": torch.__version__,
              "triton": triton.__version__, "calls": args.calls, "warmup": args.warmup,
              "seed": args.seed, "jit_backend": jit_backend, "batches": args.batches,
              "kernels": kernels, "stored": stored, "walk": walk,
              "wall_s": time.perf_counter() - started}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (args.out / "gpu_check.md").write_text(text)
    print(text)
    print(f"wrote {args.out / 'gpu_check.json'} and gpu_check.md in {report['wall_s']:.0f} s")
    kernels_ok = all(row["ok"] for row in (*kernels, *stored))
    return 0 if kernels_ok else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
