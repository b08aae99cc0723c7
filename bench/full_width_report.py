"""The report of `python -m bench.full_width` (Note [Full-width timing] in
bench/full_width.py): per model the steady table, each JIT against the peers of its
precision, the warm-up table and the compile seconds; and the merge of an earlier run's
models into a report (`--keep`)."""

from __future__ import annotations

import statistics

WARMUP_BAR = 1.1         # the speed issue's bar: JIT p90 / interpreter p90 per shape


def jit_system(precision: str) -> str:
    """The system name of the JIT in `precision` ("jit-bf16", "jit-int8")."""
    return "jit-" + precision.split("-")[0]


# A JIT in lower precision is held against the peers in the same precision.
SAME_PRECISION = {"jit-bf16": ("openvino-bf16",), "jit-int8": ("onnxruntime-int8",)}


def _cell(value) -> str:
    return "—" if value is None else f"{value:.3f}"


def markdown(run: dict) -> str:
    """The report: per model a steady table (x eager per shape), the warm-up table and
    the compile and calibration seconds."""
    from bench import report

    lines = ["## Full width: BERT-base (4 layers) and ResNet-50 at 224",
             f"Run of {run['started']}: `{run['command']}`, {run['total_wall_seconds']:.0f} s "
             f"wall; torch {run['machine']['torch']}, {run['threads']} threads for every "
             f"system; load average (1 min) {run['loadavg_start'][0]:.2f} at the start, "
             f"{run['loadavg_end'][0]:.2f} at the end. "
             f"{report.machine().get('cpu_model', '')}. How it is measured: Note "
             "[Full-width timing] in bench/full_width.py; peers: Note [ONNX peers] in "
             "bench/peers.py. The host is shared with other work: the ratios, taken call "
             "by call, are what is comparable, each with the A/A margin beside it."]
    for m in run["models"]:
        steady, warm = m["steady"], m["warmup"]
        systems = list(steady["x_eager"])
        lines.append(f"### {m['name']}")
        if "from_run" in m:
            r = m["from_run"]
            lines.append(f"From the run of {r['started']}: `{r['command']}`, "
                         f"{r['total_wall_seconds']:.0f} s wall; load average (1 min) "
                         f"{r['loadavg_start'][0]:.2f} at the start, "
                         f"{r['loadavg_end'][0]:.2f} at the end.")
        lines.append(
            f"Steady: {steady['calls']} calls ({steady['calls'] // len(m['labels'])} per "
            f"shape), x eager, median per shape. JIT / interpreter over the same calls "
            f"{steady['jit_over_interp']:.3f}; A/A (interpreter B / A) "
            f"{steady['interp_aa']:.3f}, margin {steady['aa_margin']:.3f}; load "
            f"{steady['loadavg'][0]:.2f} at its end.")
        # The JIT runs fp32: it is held against the fp32 peers; bf16 and int8 peers
        # are columns of their own (Note [ONNX peers]).
        # Each JIT against the best peer of its own precision (Note [ONNX peers]).
        peer_names = [s for s in systems if s not in ("interp", "interp_b")
                      and not s.startswith("jit") and not s.endswith(("-bf16", "-int8"))]
        versus = {"jit": (peer_names, "JIT / best fp32 peer")}
        for jit_name, same in SAME_PRECISION.items():
            present = [p for p in same if p in systems]
            if jit_name in systems and present:
                versus[jit_name] = (present, f"{jit_name} / {' or '.join(present)}")
        # Per shape, the A/A of that shape's calls: the margin over all calls is finer
        # than any one shape's median of 16 resolves (Note [Full-width timing]).
        has_aa = "interp_b" in systems and "interp" in systems
        table = ["| shape | " + " | ".join(systems) + " | "
                 + " | ".join(title for _, title in versus.values())
                 + (" | A/A (interp B / A) |" if has_aa else " |"),
                 "|---|" + "---:|" * (len(systems) + len(versus) + has_aa)]
        ratios = {name: [] for name in versus}
        shape_aa = []
        for label in m["labels"]:
            cells = [steady["x_eager"][s].get(label) for s in systems]
            compared = []
            for name, (against, _) in versus.items():
                best = min((steady["x_eager"][p][label] for p in against), default=None)
                mine = steady["x_eager"][name].get(label)
                ratio = mine / best if best and mine else None
                ratios[name] += [ratio] if ratio is not None else []
                compared.append(_cell(ratio))
            if has_aa:
                shape_aa.append(steady["x_eager"]["interp_b"][label]
                                / steady["x_eager"]["interp"][label])
                compared.append(_cell(shape_aa[-1]))
            table.append(f"| {label} | " + " | ".join(_cell(c) for c in cells) + " | "
                         + " | ".join(compared) + " |")
        meds = {s: statistics.median(steady["x_eager"][s].values()) for s in systems}
        table.append("| median | " + " | ".join(_cell(meds[s]) for s in systems) + " | "
                     + " | ".join([_cell(statistics.median(r)) if r else "—"
                                   for r in ratios.values()]
                                  + ([_cell(statistics.median(shape_aa))] if has_aa else []))
                     + " |")
        lines.append("\n".join(table))
        if shape_aa:
            spread = max(abs(a - 1.0) for a in shape_aa)
            lines.append(
                f"Per shape, the A/A (interpreter B's median over A's, the same calls) is "
                f"{min(shape_aa):.3f}-{max(shape_aa):.3f}: a shape's median of "
                f"{steady['calls'] // len(m['labels'])} calls resolves about "
                f"{spread:.3f}, where the margin over all calls is "
                f"{steady['aa_margin']:.3f}.")
        lines.append("Largest |output - eager| at the first steady call of each shape: "
                     + ", ".join(f"{s} {e:.1e}" for s, e in steady["max_abs_error"].items())
                     + ".")
        for name, why in m["unavailable"].items():
            lines.append(f"- {name} not run: {why}")
        over = [label for label, s in warm["per_shape"].items()
                if s["jit_over_interp_p90"] > WARMUP_BAR]
        aa = [s["aa_over_interp_p90"] for s in warm["per_shape"].values()
              if "aa_over_interp_p90" in s]   # runs before the warm-up had an A/A lack it
        aa_text = (f" The warm-up's A/A (a second interpreter's p90 over the first's): "
                   f"{min(aa):.2f}-{max(aa):.2f} over the shapes, above {WARMUP_BAR} at "
                   f"{sum(r > WARMUP_BAR for r in aa)}." if aa else "")
        lines.append(
            f"Warm-up: the first {warm['calls']} calls of a cold JIT beside eager and the "
            f"interpreter, nothing drained ({warm['wall_seconds']:.0f} s, load "
            f"{warm['loadavg'][0]:.2f} at its end): {warm['compiles']} compiles, "
            f"{warm['compile_seconds']:.1f} s of compile (calibration included), of it "
            f"{warm['calibration_seconds']:.1f} s calibration; dynvm.compile (export and "
            + ("lowering; here a load from --cache" if m.get("program_cached") else "lowering")
            + f") {m['dynvm_compile_seconds']:.1f} s; seasoning afterwards "
            f"{m['season']['rounds']} rounds, settled {m['season']['settled']}, compile "
            f"seconds in all {m['season']['compile_seconds']:.1f}. JIT p90 above "
            f"{WARMUP_BAR}x the interpreter's: "
            + (", ".join(over) if over else "no shape") + "." + aa_text)
        table = ["| shape | calls | JIT p90 ms | interp. p90 ms | JIT / interp. p90 "
                 "| A/A p90 | JIT max ms | interp. p99 ms |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for label, s in warm["per_shape"].items():
            aa_cell = f"{s['aa_over_interp_p90']:.2f}" if "aa_over_interp_p90" in s else "—"
            table.append(f"| {label} | {s['calls']} | {s['jit_p90_ms']:.1f} | "
                         f"{s['interp_p90_ms']:.1f} | {s['jit_over_interp_p90']:.2f} | "
                         f"{aa_cell} | {s['jit_max_ms']:.1f} | {s['interp_p99_ms']:.1f} |")
        lines.append("\n".join(table))
        if m["peers"]:
            lines.append("Peers: " + "; ".join(
                f"{n} {p['version']} ({p['exporter']} export, setup {p['setup_seconds']:.1f} s)"
                for n, p in m["peers"].items()) + ".")
    return "\n\n".join(lines) + "\n"


def keep_models(run: dict, earlier: dict) -> dict:
    """`run` with the models of `earlier` it does not have, each marked with the run it
    comes from (markdown prints that run's line under the model's heading)."""
    have = {m["name"] for m in run["models"]}
    origin = {k: earlier[k] for k in ("command", "started", "total_wall_seconds",
                                      "loadavg_start", "loadavg_end")}
    kept = [{**m, "from_run": m.get("from_run", origin)} for m in earlier["models"]
            if m["name"] not in have]
    return {**run, "models": run["models"] + kept}


# Note [Full-width tier]
# ~~~~~~~~~~~~~~~~~~~~~~
# docs/MODELS.md's full-width tier is a `python -m bench.full_width --tier --update-docs`
# run: the models of bench.full_width_models.tier() (released widths, few layers,
# random weights), three shapes each, measured as Note [Full-width timing] says with
# a short warm-up (two rounds of the shapes), the seasoning capped at
# TIER_SETTLE_SECONDS and `--calls` steady calls per shape, every system interleaved
# call by call; ONNX Runtime and OpenVINO (fp32) beside them. The block sits between
# the markers below in docs/MODELS.md; `dynvm bench zoo --update-docs`, which writes
# the rest of that file, keeps it (bench.zoo_report.insert_block). OpenMP's wait
# policy is stated: Note [OpenMP wait policy] in bench/_omp.py.


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _x(value) -> str:
    return "—" if value is None else f"{value:.3f}"


def tier_markdown(run: dict) -> str:
    """The full-width tier's block of docs/MODELS.md (Note [Full-width tier]): one row per
    model (medians over its shapes), then one per model and shape."""
    from bench import report

    peer_names = [p for p in ("onnxruntime", "openvino")
                  if any(p in m["steady"]["x_eager"] for m in run["models"])]
    lines = [
        "## Full-width tier",
        "Released widths, few layers, random weights (bench/full_width_models.py; "
        "tests/zoo/test_full_width.py checks each against eager in the interpreter and "
        "the JIT at a shape it was not exported with). Generated by `python -m "
        "bench.full_width --tier --update-docs` (Note [Full-width tier] in "
        "bench/full_width_report.py): run of "
        f"{run['started']}, `{run['command']}`, {run['total_wall_seconds']:.0f} s wall; "
        f"torch {run['machine']['torch']}, {run['threads']} threads for every system; "
        f"{run.get('omp', 'OMP_WAIT_POLICY not recorded')} for the torch systems "
        "(eager, interpreter, JIT; Note [OpenMP wait policy] in bench/_omp.py), the "
        "ONNX peers with spinning off; load average (1 min) "
        f"{run['loadavg_start'][0]:.2f} at the start, {run['loadavg_end'][0]:.2f} at the "
        f"end. {report.machine().get('cpu_model', '')}. x eager: per shape the median of "
        "each system's time over eager's on the same call (Note [Full-width timing] in "
        "bench/full_width.py: every system interleaved call by call, the JIT's "
        "background work drained before each call, after a cold warm-up and a capped "
        "seasoning); a model's figure is the median of its shapes'. 'JIT / best peer': "
        "the JIT over the faster of " + " and ".join(peer_names or ["the peers"])
        + " per shape, the median of those. 'dynvm.compile s': export and lowering, "
        "'(load)' where the run read the program from --cache (filled by --prepare "
        "before it); 'JIT compile s': the JIT's background compiles over the whole run, "
        "calibrations included; 'settled': whether the JIT had nothing queued or on "
        "probation when the seasoning's cap ended (Runtime.settled). The A/A margin "
        "(interpreter B over A) is "
        "what noise alone moves a ratio in that model's window. The host is shared: "
        "the ratios, taken call by call, are what is comparable."]
    head = (["model", "what", "parameters", "shapes", "eager ms", "interpreter", "JIT"]
            + peer_names + ["JIT / best peer", "JIT / interp. (A/A, margin)",
                            "max abs err interp., JIT", "dynvm.compile s",
                            "JIT compile s", "settled"])
    table = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    shapes = ["| model | shape | eager ms | interpreter | JIT | " + " | ".join(peer_names)
              + " | JIT / best peer |", "|---|---|" + "---:|" * (4 + len(peer_names))]
    for m in run["models"]:
        steady = m["steady"]
        x = steady["x_eager"]

        def best(label, x=x):
            return _best([x[p].get(label) for p in peer_names if p in x])

        versus = {label: (x["jit"][label] / best(label) if best(label) else None)
                  for label in m["labels"]}
        for label in m["labels"]:
            shapes.append(f"| {m['name']} | {label} | "
                          f"{steady.get('eager_ms', {}).get(label, float('nan')):.1f} | "
                          f"{_x(x['interp'].get(label))} | {_x(x['jit'].get(label))} | "
                          + " | ".join(_x(x.get(p, {}).get(label)) for p in peer_names)
                          + f" | {_x(versus[label])} |")
        errors = steady["max_abs_error"]
        compile_s = m["season"]["compile_seconds"]
        table.append(
            f"| {m['name']} | {m.get('tier', {}).get('description', '')} | "
            f"{m.get('parameters', 0) / 1e6:.1f} M | {', '.join(m['labels'])} | "
            f"{_median(steady.get('eager_ms', {}).values()) or float('nan'):.1f} | "
            f"{_x(_median(x['interp'].values()))} | {_x(_median(x['jit'].values()))} | "
            + " | ".join(_x(_median(x[p].values())) if p in x else "not run"
                         for p in peer_names)
            + f" | {_x(_median(versus.values()))} | {steady['jit_over_interp']:.3f} "
            f"({steady['interp_aa']:.3f}, {steady['aa_margin']:.3f}) | "
            f"{errors.get('interp', 0):.1e}, {errors.get('jit', 0):.1e} | "
            f"{m['dynvm_compile_seconds']:.1f}{' (load)' if m.get('program_cached') else ''}"
            f" | {compile_s:.1f} | {m['season']['settled']} |")
    lines += ["\n".join(table), "Per shape (x eager):", "\n".join(shapes)]
    for m in run["models"]:
        for name, why in m["unavailable"].items():
            lines.append(f"- {m['name']}: {name} not run: {why[:300]}")
    versions = {n: p["version"] for m in run["models"] for n, p in m["peers"].items()}
    if versions:
        lines.append("Peers: " + ", ".join(f"{n} {v}" for n, v in versions.items()) + ".")
    return "\n\n".join(lines) + "\n"


def _best(values) -> float | None:
    """The best (lowest) x-eager of the peers that ran at a shape."""
    values = [v for v in values if v is not None]
    return min(values) if values else None
