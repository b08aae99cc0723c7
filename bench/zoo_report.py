"""docs/MODELS.md from a `dynvm bench zoo` run (bench/zoo.py): the per-model table and
the opcodes each model uses. Everything here is generated; the doc says so."""

from __future__ import annotations

from bench import report

TARGET_INTERP = 1.05  # the zoo issue's bar: interpreter <= 1.05x eager on every model


def _x(value) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _share(value) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n / 1e3:.1f} k"


def _row(r: dict) -> str:
    if "interp_x_eager" not in r:
        return f"| {r['name']} | {r['library']} | | | | | | | | | | | | | | {r['status']} |"
    dims = ", ".join(f"{d} {span}" for d, span in r["dims"].items())
    return (f"| {r['name']} | {r['library']} | {_params(r['parameters'])} | {dims} | "
            f"{len(r['opcodes'])} ({r['instructions']} instr) | {r['compile_seconds']:.1f} | "
            f"{r['eager_ms']:.2f} | {r['eager_spread']:.1f} | {_x(r['interp_x_eager'])} | "
            f"{_x(r['jit_x_eager'])} | {_paired(r)} | {_paired(r, '_cpu')} | "
            f"{_share(r['jit_specialized_share'])} | {_warmup(r)} | {r.get('steady_calls', '—')} | "
            f"{r['status']} |")


def _paired(r: dict, clock: str = "") -> str:
    """JIT / interpreter (A/A) by wall time, or with clock "_cpu" by thread CPU time."""
    if f"jit_over_interp{clock}" not in r:  # a run from before the A/A (or CPU time)
        return "—"
    margin = f", {_margin(r, clock):.3f}" if f"interp_aa_margin{clock}" in r else ""
    return f"{r[f'jit_over_interp{clock}']:.3f} ({r[f'interp_aa{clock}']:.3f}{margin})"


def _margin(r: dict, clock: str) -> float:
    """The margin the model's A/A states (Note [A/A margin] in bench._timing); a run
    from before it: the A/A's distance from 1."""
    return r.get(f"interp_aa_margin{clock}", abs(r[f"interp_aa{clock}"] - 1.0))


def _over(rows: list[dict], clock: str) -> tuple[list[str], list[str]]:
    """The models whose JIT / interpreter exceeds 1 by more than their A/A's margin,
    and those over 1 at all, by one clock."""
    paired = [r for r in rows if f"jit_over_interp{clock}" in r]
    worse = [r["name"] for r in paired
             if r[f"jit_over_interp{clock}"] > 1.0 + _margin(r, clock)]
    return worse, [r["name"] for r in paired if r[f"jit_over_interp{clock}"] > 1.0]


def _warmup(r: dict) -> str:
    if "warmup_calls" not in r:  # a run from before the settled warm-up
        return "—"
    return f"{r['warmup_calls']}" + ("" if r["settled"] else " (cap)")


def _summary(rows: list[dict]) -> list[str]:
    measured = [r for r in rows if "interp_x_eager" in r]
    ok = [r for r in rows if r["status"] == "ok"]
    slow = [r["name"] for r in measured if r["interp_x_eager"] > TARGET_INTERP]
    lines = [f"- {len(ok)} of {len(rows)} models ran without error and matched eager "
             "(interpreter and JIT, first steady call of every shape)."]
    lines.append(f"- Interpreter <= {TARGET_INTERP}x eager: "
                 + ("every model." if not slow else
                    f"missed on {len(slow)}: {', '.join(slow)}."))
    for clock, words in (("_cpu", "by the calling thread's CPU time"), ("", "by wall time")):
        if not any(f"jit_over_interp{clock}" in r for r in measured):
            continue
        worse, over = _over(measured, clock)
        lines.append(f"- JIT <= interpreter, per call, {words}, within the model's A/A "
                     "margin: " + ("every model." if not worse else
                                     f"missed on {len(worse)}: {', '.join(worse)}.")
                     + f" (Over 1.000 at all: {len(over)}" + (f": {', '.join(over)}" if over
                                                               else "") + ".)")
    return lines


def _season(run: dict) -> str:
    return f"at least {run['season_calls']}" if run.get("season_calls") else "any number of"


def _steady_text(run: dict) -> str:
    if "rounds" in run:  # a run from before the per-model count of steady calls
        return f"{run['rounds']} rounds"
    return (f"at least {run['steady_calls_wanted']} steady calls per model (whole cycles "
            f"of the call orders: 'steady calls')")


def _peer_text() -> str:
    return ("`--peers torch.compile` (Note [Zoo peers] in bench/zoo.py): torch.compile in "
            "its default mode as a fourth system in the same call-by-call rotation, on the "
            "same inputs; x eager as above. 'JIT / torch.compile' is the ratio of the two "
            "medians (below 1: the JIT is faster). Compile seconds: dynvm's are export and "
            "lowering plus the JIT's background compiles; torch.compile's are the whole of "
            "the calls during which Dynamo made a graph.")


def _peer_table(rows: list[dict]) -> str:
    lines = ["| model | JIT | torch.compile | JIT / torch.compile | dynvm compile s "
             "| torch.compile compile s (graphs) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        peer = r["torch_compile"]
        lines.append(f"| {r['name']} | {_x(r['jit_x_eager'])} | {_x(peer['x_eager'])} | "
                     f"{r['jit_x_eager'] / peer['x_eager']:.2f} | "
                     f"{peer['dynvm_compile_seconds']:.1f} | "
                     f"{peer['compile_seconds']:.1f} ({peer['compiles']}) |")
    return "\n".join(lines)


def _onnx_text() -> str:
    return ("`--peers onnxruntime,openvino,...` (Note [ONNX peers] in bench/peers.py): the "
            "model exported to ONNX once, run by each runtime on the same inputs in the "
            "same rotation; x eager as above; 'max |err|' is its largest distance from "
            "eager over the first steady call of each shape; setup s is the export plus "
            "the runtime's build.")


def _onnx_table(rows: list[dict]) -> str:
    lines = ["| model | JIT | peer | peer x eager | JIT / peer | max abs err | setup s "
             "| exporter, version |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        for name, peer in r["onnx_peers"].items():
            if "unavailable" in peer:
                lines.append(f"| {r['name']} | | {name} | | | | | not run: "
                             f"{peer['unavailable'][:160]} |")
                continue
            jit = r.get("jit_x_eager")
            lines.append(f"| {r['name']} | {_x(jit)} | {name} | {_x(peer['x_eager'])} | "
                         + (f"{jit / peer['x_eager']:.2f}" if jit else "—")
                         + f" | {peer['max_abs_error']:.1e} | {peer['setup_seconds']:.1f} | "
                         f"{peer['exporter']}, {peer['version']} |")
    return "\n".join(lines)


def markdown(run: dict) -> str:
    rows = run["models"]
    parts = [
        "# The model zoo",
        "<!-- generated by `dynvm bench zoo --update-docs` (bench/zoo.py); do not edit -->",
        "Real architectures from Hugging Face transformers, torchvision, timm and PyTorch "
        "Geometric in small configurations with random weights (tests/zoo; the test "
        "suite checks every one against eager in the interpreter and the JIT). Each is "
        "exported with its dynamic dims and run through dynvm.compile -> Runtime.",
        report.header(run),
        f"How it is measured (Note [Zoo timing] in bench/zoo.py): per call, eager, the "
        f"interpreter (twice: A, and B for the A/A) and the JIT run on the same inputs in "
        f"an order that changes call by call (Note [Call order] in bench/_timing.py: "
        f"the rows of a Latin square balanced for the one before, taken so that the "
        f"last system of a call and the first of the next are balanced too, the systems "
        f"trading places in the design from cycle to cycle; each shape at every place "
        f"of the cycle equally often); the x-eager columns "
        f"are medians of per-call ratios to eager over {_steady_text(run)} of the "
        f"entry's shapes (export point + held-out points) after {run['warmup_rounds']} "
        f"warm-up rounds and then until the JIT is settled (no compile queued, no "
        f"specialization on probation) and has made {_season(run)} calls (the JIT alone, "
        f"untimed, capped; a region's promotion horizon grows with its age, Note [Rent "
        f"or buy]): 'JIT warm-up' is "
        f"how many calls the JIT had before the timed ones, '(cap)' where it was not "
        f"settled by the cap. The JIT runs its default "
        f"config; 'JIT spec.' is the share of its steady region calls that ran "
        f"specialized code. 'JIT / interp. (A/A, margin)': the median over the same "
        f"steady calls of the JIT's time over the interpreter's, and in brackets of a "
        f"second interpreter's (B) over the first, and the margin that A/A states: its "
        f"largest distance from 1 over the steady calls and over each third of them "
        f"(Note [A/A margin] in bench/_timing.py), what noise alone does to that median "
        f"in that model's window. 'The same, CPU time': those medians by the calling "
        f"thread's CPU time (time.thread_time; with one torch thread the model's work "
        f"runs on that thread), which leaves out the time other "
        f"processes held the core; on a shared host it is the steadier of the two. "
        f"'eager p90/p10' is the spread "
        f"of eager's own steady times "
        f"(over the entry's mixed shapes): where it is large, load from other processes "
        f"hit that model's window and its ratios are the least trustworthy. The host is "
        f"shared with other work: figures move between runs (on this 2-core host under "
        f"other engineers' tests, a tiny HF model's eager median moved from about 1 ms "
        f"to 8 ms between two runs); the ratios, taken call by call, move least.",
        "## Summary", "\n".join(_summary(rows)),
        "## Models",
        "| model | library | parameters | dynamic dims | opcodes (distinct) | compile s "
        "| eager ms | eager p90/p10 | interpreter | JIT | JIT / interp. (A/A, margin) "
        "| the same, CPU time | JIT spec. "
        "| JIT warm-up | steady calls | status |\n"
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
        + "\n".join(_row(r) for r in rows),
    ]
    peers = [r for r in rows if "torch_compile" in r]
    if peers:
        parts += ["## Against torch.compile (default)", _peer_text(), _peer_table(peers)]
    onnx = [r for r in rows if "onnx_peers" in r]
    if onnx:
        parts += ["## Against ONNX Runtime and OpenVINO", _onnx_text(), _onnx_table(onnx)]
    notes = [f"- **{r['name']}**: {r['note']}" for r in rows if r.get("note")]
    if notes:
        parts += ["## What export fixed", "\n".join(notes)]
    parts += ["## Opcodes used", "| model | opcodes (count) |\n|---|---|\n" + "\n".join(
        f"| {r['name']} | " + ", ".join(f"{op} {n}" for op, n in r["opcodes"].items()) + " |"
        for r in rows if "opcodes" in r)]
    return "\n\n".join(parts) + "\n"
