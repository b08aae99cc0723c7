"""`python -m bench.precision_accuracy`: how far the JIT's bf16 and int8 kernels
(`JitConfig.precision`, Note [Lower-precision GEMMs] in dynvm.jit.backends.cpu_precision)
land from fp32, per model: BERT at bert-base width (bench.full_width's 16 shapes) and
the tiny zoo (tests/zoo, every entry's export point and held-out points).

Note [Precision accuracy]
~~~~~~~~~~~~~~~~~~~~~~~~~
Per model and precision, a JIT Runtime with promotion forced (compiles on the calling
thread, code families on, probation off: what is measured is the kernel, not whether
it was kept) runs every shape three times; the third call's outputs are compared with
the fp32 interpreter's on the same inputs (the reference: the JIT's fp32 kernels agree
with it to ~1e-5). Stated per model: the largest |out - fp32| over shapes and outputs,
the same relative to the largest |fp32| of that output (a scale-free figure: hidden
states of a random-weight model are O(1), a logit may be O(10)), the share of the
third calls' region calls that ran specialized code (1.0: every region ran a kernel; a
model whose GEMMs the pass did not reach shows 0 GEMMs and an error of 0), and how many
GEMMs the installed kernels lowered. Integer outputs (token ids, indices) are compared
exactly and reported as mismatches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PRECISIONS = ("bf16", "int8-dynamic")


def forced_config(precision: str):
    """A JitConfig that compiles every shape on its first call, families on, probation
    off (Note [Precision accuracy])."""
    import dynvm

    return dynvm.JitConfig(sync=True, min_recurrence=1, max_recurrence=2,
                           expected_speedup=1.0, instructions_per_recurrence_step=10**6,
                           horizon_calls=10**9, families=True, probation=False,
                           precision=precision)


def _tuple(out) -> tuple:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def compare(actual, expected) -> dict:
    """Largest absolute and relative (to max |expected|) distance over float outputs;
    integer outputs counted as mismatching elements."""
    worst_abs = worst_rel = 0.0
    mismatches = 0
    for a, e in zip(_tuple(actual), _tuple(expected)):
        if not e.is_floating_point():
            mismatches += int((a != e).sum())
            continue
        diff = float((a.float() - e.float()).abs().max()) if e.numel() else 0.0
        scale = float(e.float().abs().max()) if e.numel() else 0.0
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / scale if scale > 0 else 0.0)
    return {"max_abs": worst_abs, "max_rel": worst_rel, "int_mismatches": mismatches}


def lowered_gemms(runtime) -> int:
    """GEMMs lowered to bf16/int8 in the runtime's installed kernels (their notes)."""
    count = 0
    for artifact in runtime.jit.artifacts.values():
        source = getattr(artifact, "source", "") or ""
        for line in source.splitlines():
            if not line.startswith("#"):
                break
            count += ("bf16 linear" in line) or ("int8 dynamic" in line)
    return count


def measure(name: str, program, shapes: list, precisions=PRECISIONS, log=print) -> dict:
    """One model: per precision, the figures of Note [Precision accuracy]."""
    import dynvm

    reference = dynvm.Runtime(program, jit=False)
    expected = [reference(*x) for x in shapes]
    reference.close()
    result = {"name": name, "shapes": len(shapes), "precisions": {}}
    for precision in precisions:
        runtime = dynvm.Runtime(program, jit=forced_config(precision))
        try:
            worst = {"max_abs": 0.0, "max_rel": 0.0, "int_mismatches": 0}
            specialized = interpreted = 0
            for x, ref in zip(shapes, expected):
                runtime(*x)
                runtime(*x)
                before = runtime.stats()
                out = runtime(*x)
                after = runtime.stats()
                specialized += (after["specialized_region_calls"]
                                - before["specialized_region_calls"])
                interpreted += (after["interpreted_region_calls"]
                                - before["interpreted_region_calls"])
                here = compare(out, ref)
                worst = {k: max(worst[k], here[k]) for k in worst}
            total = specialized + interpreted
            result["precisions"][precision] = {
                **worst, "specialized_share": specialized / total if total else 0.0,
                "gemms_lowered": lowered_gemms(runtime),
                "specialize_failures": runtime.stats()["specialize_failures_total"]}
        finally:
            runtime.close()
        p = result["precisions"][precision]
        log(f"[{name}] {precision}: max |out - fp32| {p['max_abs']:.2e}, relative "
            f"{p['max_rel']:.2e}, specialized {p['specialized_share']:.2f}, "
            f"{p['gemms_lowered']} GEMMs lowered")
    return result


def _bert(layers: int):
    import dynvm
    from bench.full_width import bert

    model = bert(layers=layers)
    program = dynvm.compile(model.module, model.inputs[model.export_index],
                            model.dynamic_shapes, name=model.name)
    return model.name, program, list(model.inputs)


def _zoo(names):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.zoo import _zoo, _zoo_harness

    for entry in _zoo.entries():
        if names and entry.name not in names:
            continue
        compiled = _zoo_harness.compile_entry(entry)
        points = (entry.export_point, *entry.held_out)
        yield entry.name, compiled.program, [compiled.built.make_inputs(p, 1) for p in points]


def markdown(run: dict) -> str:
    """The table: one row per model, per precision max abs / relative / GEMMs."""
    precisions = run["precisions"]
    head = "| model | shapes | " + " | ".join(
        f"{p} max abs | {p} rel. | {p} GEMMs (specialized)" for p in precisions) + " |"
    lines = [f"Run of {run['started']}: `{run['command']}`; torch {torch.__version__}, "
             f"{run['threads']} threads. Reference: the fp32 interpreter on the same "
             "inputs (Note [Precision accuracy] in bench/precision_accuracy.py).", "",
             head, "|---|---:|" + "---:|---:|---:|" * len(precisions)]
    for m in run["models"]:
        cells = []
        for p in precisions:
            r = m["precisions"].get(p)
            if r is None:
                cells += ["—"] * 3
                continue
            cells += [f"{r['max_abs']:.1e}", f"{r['max_rel']:.1e}",
                      f"{r['gemms_lowered']} ({r['specialized_share']:.2f})"]
        lines.append(f"| {m['name']} | {m['shapes']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Parse the options, measure the models, write results.json and report.md."""
    parser = argparse.ArgumentParser(prog="python -m bench.precision_accuracy",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert,zoo",
                        help="bert (bert-base width), zoo (every tiny zoo entry), or "
                             "zoo entry names, comma-separated")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--bert-layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/precision-accuracy"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    log = lambda m: print(m, flush=True)
    models = []
    if "bert" in names:
        name, program, shapes = _bert(args.bert_layers)
        models.append(measure(name, program, shapes, precisions, log))
    zoo_names = [n for n in names if n not in ("bert", "zoo")]
    if "zoo" in names or zoo_names:
        for name, program, shapes in _zoo(set(zoo_names)):
            models.append(measure(name, program, shapes, precisions, log))
    run = {"command": "python -m bench.precision_accuracy " + " ".join(argv or sys.argv[1:]),
           "started": started, "threads": args.threads, "precisions": precisions,
           "models": models}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(run, indent=1))
    text = markdown(run)
    (args.out / "report.md").write_text(text)
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
