"""`python -m bench.full_width`: dynvm at a released model's width against eager PyTorch,
ONNX Runtime and OpenVINO: Hugging Face BERT at bert-base width (768 hidden, 12 heads,
FFN 3072, vocab 30522, 4 layers, random weights; input ids + attention mask; batch
{1,2,4,8} x seq {16,32,64,128}) and torchvision ResNet-50 at 224x224 (batch 1, 2, 4).
Llama-style decoder at 2048 width and ViT-B/16 at 224 are there too (--models llama,vit;
bench/full_width_models.py builds all four). Writes results.json and report.md, and with
--update-docs its block of docs/bench_results.md; `--tier` measures the zoo's full-width
tier instead (three shapes per model, a short run) and writes its block of
docs/MODELS.md (Note [Full-width tier] in bench/full_width_report.py). Run as a command,
it starts itself again with OMP_WAIT_POLICY=PASSIVE unless that is set (Note [OpenMP
wait policy] in bench/_omp.py); the reports state the policy.

Note [Full-width timing]
~~~~~~~~~~~~~~~~~~~~~~~~
Per model, three phases, all in one process with the same torch thread count for every
system (the peers get the same count, Note [ONNX peers] in bench.peers):

1. Warm-up, the JIT cold: the first `warmup` calls of a fresh JIT Runtime, interleaved
   call by call with eager and the interpreter on the same inputs (bench._timing:
   call_order, stream_input), nothing drained: the JIT's background compiles and
   calibrations run beside the calls, as they do on a server's first requests. Per
   shape, the JIT's p90 over the interpreter's p90 in these calls is the warm-up column
   (the speed issue's bar: at most 1.1 at every shape); the compile seconds and the
   calibration seconds (the process's Calibrator, jit.calibration) it spent are stated.
   A second interpreter runs in the same rotation as the warm-up's A/A: a p90 of the
   12-13 calls a shape gets is its second-slowest call, and interpreter B's p90 over
   A's says how far this host alone moves that ratio in the same run. Before the first
   timed call, eager runs every shape once, untimed: the process's first use of torch's
   own kernels at a shape (its allocator, torch's oneDNN primitives, lazy
   initialisation) costs whichever system comes first, and the call order puts the JIT
   first at steps 0 and 1, so without it ResNet-50's batch 1 charged the process's
   first forward (1.2-1.6x the interpreter's call, 5 of its 100 pooled calls in
   bench.warmup_bar) to the JIT (H31J, 2026-12-06). A server does the same before it is
   ready; the JIT stays cold: nothing of its own runs before step 0.
2. Seasoning: the JIT alone, untimed, over the shapes until it is settled (nothing
   queued, nothing on probation, Runtime.settled) or a cap; every other system runs
   every shape once, untimed.
3. Steady: every system (eager, interpreter A, interpreter B for the A/A, JIT, peers)
   interleaved call by call, each call after the JITs' background work ended (Note
   [Quiet before each timed call]), the order
   changing call by call; per shape the median of each system's time over eager's of
   the same call; the A/A margin (bench._timing.aa_margin) of interpreter B over A is
   the margin of every "JIT at or below" statement. 16 calls a BERT shape and 8 a
   ResNet-50 batch size by default (`--calls`, `--resnet-calls`): with 4 a shape, two
   runs of the same code moved a small bf16 shape's median by up to 0.27 while the A/A
   margin over all 64 calls said 0.017-0.020; with 16 the margin was 0.006 (2026-12-06,
   docs/bench_log.md, stop 24's end). That margin is over all calls; one shape's median
   of 16 is coarser, so the report gives each shape's A/A too (interpreter B's median
   over A's at that shape): 0.967-1.035 over BERT's 16 shapes in a run whose margin was
   0.007 (2026-12-06 16:39 UTC, AMD EPYC).

Each system's outputs at the first steady call of every shape are compared with eager's:
the largest absolute difference is stated (peers in bf16/int8 are not fp32).

`--jit-precisions bf16,int8-dynamic` adds the JIT in that precision (JitConfig.precision,
Note [Lower-precision GEMMs] in dynvm.jit.backends.cpu.precision) as systems jit-bf16 and
jit-int8: not in the warm-up (phase 1 is the fp32 JIT's), seasoned after the fp32 JIT
with the same cap, timed in the same steady rotation, and held against the peers of its
own precision (openvino-bf16, onnxruntime-int8) in columns of their own. `--cache DIR`
keeps each model's program and ONNX export (`--prepare` fills it, untimed, outside the
benchmark lock), so that a timed run is the phases alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":   # Note [OpenMP wait policy]: before torch loads
    from bench._omp import reexec_passive

    reexec_passive([sys.executable, "-m", "bench.full_width", *sys.argv[1:]])

import torch

from bench._omp import wait_policy
from bench._timing import aa_margin, call_order, percentile, stream_input
from bench.full_width_models import (  # noqa: F401  (the names callers use)
    BERT_SHAPES,
    RESNET_BATCHES,
    FullWidthModel,
    bert,
    heldout,
    llama,
    resnet50,
    tier,
    vit,
)
from bench.full_width_report import (  # noqa: F401  (the names callers use)
    WARMUP_BAR,
    jit_system,
    keep_models,
    markdown,
    tier_markdown,
)
from bench.zoo_report import insert_block

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "bench_results.md"
BEGIN = ("<!-- full-width:begin (generated by `python -m bench.full_width --update-docs`; "
         "do not edit) -->")
END = "<!-- full-width:end -->"
SETTLE_SECONDS = 240.0   # Note [Full-width timing]: the cap of the JIT's seasoning
TIER_SETTLE_SECONDS = 90.0   # ... in a --tier run (Note [Full-width tier])
MODELS_DOCS = ROOT / "docs" / "MODELS.md"


def _tuple(out) -> tuple:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def _error(actual, expected) -> float:
    actual, expected = _tuple(actual), _tuple(expected)
    return max(float((a.float() - e.float()).abs().max()) for a, e in zip(actual, expected))


def _timed(fn, inputs) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*inputs)
    return time.perf_counter() - start, out


# Compiles at full width take longer than the zoo's: wait up to this long for them.
DRAIN_S = 600.0


# Note [Quiet before each timed call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The steady phase times every system with none of the JITs' background work running.
# Waiting for the compile queue to be empty and no promotion pending is not that: a
# probation shadow sample (Note [Probation] in dynvm.jit.probation: the region in the
# interpreter and in the kernel, back to back, on the compile worker) is never marked
# pending and leaves the queue when it starts, and it runs for 50-1,200 ms at BERT-base
# width. The seasoning ends at its cap with kernels still on probation (08:16 run, 226
# rounds: not settled), so their shadow pairs ran beside the timed calls: logged task
# by task (2026-12-05 09:23, load 4-5), 2x128's JIT call overlapped a shadow sample at 4
# of its 6 steady calls, 1x16's one 1.2 s pair took a call to 0.05x eager (the eager call
# was the one slowed). Such a pair slows whichever call it overlaps, the JIT's or a
# peer's, so a shape's median moved either way (2x128: 1.86-1.92x the best peer in two
# runs, 1.02 in a third). Each timed call therefore waits until every JIT's queue is
# empty, nothing is pending and no task is running (a task the previous call queued
# included); the seasoning waits the same way, so that the shadow samples it causes are
# timed on a quiet host and reach their verdicts sooner.
QUIET_POLL_S = 0.002


def _busy(runtime) -> bool:
    """Background work of `runtime`'s JIT: queued, pending or running."""
    engine = runtime.jit
    if engine is None:
        return False
    queue = engine.queue
    return bool(len(queue) or queue.running()
                or any(rj.pending for rj in list(engine.regions.values())))


def _drain(*runtimes, timeout: float = DRAIN_S) -> None:
    """Wait until none of `runtimes` has background work (Note [Quiet before each timed
    call]), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(_busy(r) for r in runtimes) and time.monotonic() < deadline:
        time.sleep(QUIET_POLL_S)


def _warmup(model, systems, jit, calls: int, log) -> dict:
    """Phase 1 of Note [Full-width timing]: the cold JIT beside eager and the
    interpreter, nothing drained; per shape the p90s and their ratio."""
    from dynvm.jit.calibration import calibrator_for

    calibrator = calibrator_for("cpu")
    calibration_before = calibrator.seconds
    # interp_b is the warm-up's A/A: its p90 over the interpreter's is the noise of a
    # p90 of this many calls on this host (Note [Full-width timing]).
    order = ["eager", "interp", "interp_b", "jit"]
    times = {name: {label: [] for label in model.labels} for name in order}
    n = len(model.inputs)
    for inputs in model.inputs:   # untimed: the process's first use of torch (the Note)
        systems["eager"](*inputs)
    started = time.perf_counter()
    for step in range(calls):
        index = stream_input(step, n, len(order))
        for name in call_order(order, step):
            times[name][model.labels[index]].append(_timed(systems[name],
                                                           model.inputs[index])[0])
        if (step + 1) % max(1, calls // 4) == 0:
            log(f"[{model.name}] warm-up {step + 1}/{calls} calls, "
                f"{time.perf_counter() - started:.0f} s")
    stats = jit.stats()
    per_shape = {}
    for label in model.labels:
        if not times["jit"][label]:   # a warm-up shorter than the shapes
            continue
        jit_p90 = percentile(times["jit"][label], 90)
        interp_p90 = percentile(times["interp"][label], 90)
        interp_b_p90 = percentile(times["interp_b"][label], 90)
        per_shape[label] = {"calls": len(times["jit"][label]), "jit_p90_ms": 1e3 * jit_p90,
                            "interp_p90_ms": 1e3 * interp_p90,
                            "aa_over_interp_p90": interp_b_p90 / interp_p90,
                            "interp_p99_ms": 1e3 * percentile(times["interp"][label], 99),
                            "jit_max_ms": 1e3 * max(times["jit"][label]),
                            "jit_over_interp_p90": jit_p90 / interp_p90}
    # The calls' own times too: bench.warmup_bar pools them over fresh processes.
    raw = {name: {label: [round(1e3 * t, 4) for t in by] for label, by in shapes.items()}
           for name, shapes in times.items()}
    return {"calls": calls, "wall_seconds": time.perf_counter() - started,
            "per_shape": per_shape, "times_ms": raw, "compiles": stats["compiles"],
            "compile_seconds": stats["compile_seconds"],
            "calibration_seconds": calibrator.seconds - calibration_before,
            "loadavg": os.getloadavg()}


def _jits(systems) -> dict:
    """The JIT runtimes among `systems`: "jit" and its other precisions ("jit-bf16", ...)."""
    return {n: s for n, s in systems.items() if n == "jit" or n.startswith("jit-")}


def _settle(model, systems, jit, log, cap_s: float = SETTLE_SECONDS) -> dict:
    """Phase 2: the JIT alone until settled (capped), every system once per shape; a JIT
    in another precision after it, the same way (its own cap)."""
    started, rounds = time.perf_counter(), 0
    jits = _jits(systems)
    for name, runtime in jits.items():
        deadline, done = time.monotonic() + cap_s, 0
        while time.monotonic() < deadline:
            _drain(runtime)
            if runtime.settled() and done:
                break
            for x in model.inputs:
                _drain(runtime)
                runtime(*x)
            done += 1
        _drain(runtime)
        rounds = done if name == "jit" else rounds
        if name != "jit":
            log(f"[{model.name}] {name} seasoned: {done} rounds, settled {runtime.settled()}")
    for name, fn in systems.items():
        if name not in jits:
            for x in model.inputs:
                fn(*x)
    stats = jit.stats()
    log(f"[{model.name}] seasoned: {rounds} rounds, settled {jit.settled()}, "
        f"{time.perf_counter() - started:.0f} s")
    return {"rounds": rounds, "settled": jit.settled(),
            "wall_seconds": time.perf_counter() - started, "compiles": stats["compiles"],
            "compile_seconds": stats["compile_seconds"]}


def _steady(model, systems, jit, calls_per_shape: int, log, deadline=None) -> dict:
    """Phase 3: every system interleaved, each call after the JITs' background work
    ended (Note [Quiet before each timed call])."""
    order = list(systems)
    n = len(model.inputs)
    # Whole cycles of the call orders (balanced_steps) would be 16 x 98 calls with seven
    # systems, an hour at this width: `calls_per_shape` rounds of the shapes instead,
    # the orders still changing call by call.
    steps = calls_per_shape * n
    ratios = {name: {label: [] for label in model.labels} for name in order if name != "eager"}
    eager_s = {label: [] for label in model.labels}
    paired = {"jit": [], "interp_b": []}
    errors = {name: 0.0 for name in order if name != "eager"}
    checked: set[int] = set()
    started = round_started = time.perf_counter()
    done, last_round = 0, 0.0
    for step in range(steps):
        if step % n == 0 and step:
            now = time.perf_counter()
            last_round, round_started = now - round_started, now
            # Whole rounds of the shapes only, so every shape has as many calls.
            if deadline is not None and time.monotonic() + last_round > deadline:
                log(f"[{model.name}] steady stopped at {step} calls: --budget-seconds")
                break
        done = step + 1
        index = stream_input(step, n, len(order))
        x, label = model.inputs[index], model.labels[index]
        jits = tuple(_jits(systems).values())
        seconds, outputs = {}, {}
        for name in call_order(order, step):
            _drain(*jits)
            seconds[name], outputs[name] = _timed(systems[name], x)
        if index not in checked:
            checked.add(index)
            for name in errors:
                errors[name] = max(errors[name], _error(outputs[name], outputs["eager"]))
        eager_s[label].append(seconds["eager"])
        for name in ratios:
            ratios[name][label].append(seconds[name] / seconds["eager"])
        for name in paired:
            paired[name].append(seconds[name] / seconds["interp"])
        if (step + 1) % max(1, steps // 4) == 0:
            log(f"[{model.name}] steady {step + 1}/{steps} calls, "
                f"{time.perf_counter() - started:.0f} s")
    return {"calls": done,
            "wall_seconds": time.perf_counter() - started,
            "x_eager": {name: {label: statistics.median(r) for label, r in by.items() if r}
                        for name, by in ratios.items()},
            "eager_ms": {label: 1e3 * statistics.median(t) for label, t in eager_s.items() if t},
            "jit_over_interp": statistics.median(paired["jit"]),
            "interp_aa": statistics.median(paired["interp_b"]),
            "aa_margin": aa_margin(paired["interp_b"]), "max_abs_error": errors,
            "loadavg": os.getloadavg()}


def prepare(model: FullWidthModel, cache: Path | None, with_onnx: bool = False, log=print):
    """The model's program, loaded from `cache` (a folder) if it holds one, else lowered
    (and kept there); with `with_onnx`, its ONNX export kept there too. What --prepare
    builds before a timed run, outside the benchmark lock (export and lowering take
    minutes on a loaded host; neither is timed). Returns (program, seconds, onnx path)."""
    import dynvm

    dvm = cache / f"{model.name}.dvm" if cache else None
    onnx = str(cache / f"{model.name}.onnx") if cache else None
    start = time.perf_counter()
    if dvm is not None and dvm.exists():
        program = dynvm.load(dvm)
    else:
        program = dynvm.compile(model.module, model.export_inputs,
                                model.dynamic_shapes, name=model.name)
        if dvm is not None:
            dvm.parent.mkdir(parents=True, exist_ok=True)
            dynvm.save(program, dvm)
    seconds = time.perf_counter() - start
    if with_onnx and onnx is not None and not os.path.exists(onnx):
        from bench.peers import Exported

        Exported(model.module, model.export_inputs, model.dynamic_shapes,
                 kept=onnx).close()
        log(f"[{model.name}] ONNX export kept at {onnx}")
    return program, seconds, onnx


def measure(model: FullWidthModel, warmup: int, calls_per_shape: int, peers=(),
            log=print, settle_s: float = SETTLE_SECONDS, jit_precisions=(),
            cache: Path | None = None, deadline: float | None = None) -> dict:
    """One model's result (Note [Full-width timing]); `jit_precisions` ("bf16",
    "int8-dynamic") add the JIT in that precision as a system ("jit-bf16", "jit-int8"),
    seasoned after the fp32 JIT and timed beside it in the steady phase."""
    import dynvm
    from bench.peers import Exported, Peer, PeerUnavailable

    program, export_seconds, onnx = prepare(model, cache, log=log)
    log(f"[{model.name}] dynvm.compile {export_seconds:.1f} s"
        + (" (loaded from the cache)" if cache else ""))

    def eager(*x):
        with torch.inference_mode():
            return model.module(*x)

    interp = dynvm.Runtime(program, jit=False)
    interp_b = dynvm.Runtime(program, jit=False)
    jit = dynvm.Runtime(program, jit=dynvm.JitConfig())
    systems = {"eager": eager, "interp": interp, "interp_b": interp_b, "jit": jit}
    for precision in jit_precisions:   # Note [Lower-precision GEMMs]
        systems[jit_system(precision)] = dynvm.Runtime(
            program, jit=dynvm.JitConfig(precision=precision))
    built, unavailable, exported = {}, {}, None
    try:
        for name in peers:
            try:
                # One ONNX export serves every peer (the export is most of the setup).
                exported = exported or Exported(model.module, model.export_inputs,
                                                model.dynamic_shapes, kept=onnx)
                built[name] = Peer(name, model.module, model.export_inputs,
                                   model.dynamic_shapes, exported=exported)
                log(f"[{model.name}] {name}: {built[name].exporter} export + build "
                    f"{built[name].setup_seconds:.1f} s")
            except PeerUnavailable as exc:
                unavailable[name] = str(exc)
                log(f"[{model.name}] {name} skipped: {exc}")
        systems.update(built)
        warm = _warmup(model, systems, jit, warmup, log)
        seasoned = _settle(model, systems, jit, log, settle_s)
        steady = _steady(model, systems, jit, calls_per_shape, log, deadline)
    finally:
        for runtime in (interp, interp_b, *_jits(systems).values()):
            runtime.close()
        for peer in built.values():
            peer.close()
        if exported is not None:
            exported.close()
    return {"name": model.name, "labels": list(model.labels),
            "parameters": model.parameters,
            "dynvm_compile_seconds": export_seconds, "program_cached": cache is not None,
            "warmup": warm, "season": seasoned,
            "steady": steady,
            "peers": {name: {"setup_seconds": p.setup_seconds, "exporter": p.exporter,
                             "version": p.version} for name, p in built.items()},
            "unavailable": unavailable}


def update_docs(markdown_text: str, docs: Path = DOCS, begin: str = BEGIN,
                end: str = END) -> None:
    """Put the report between the markers `begin` and `end` of docs/bench_results.md
    (appended with them the first time); everything else in the file is kept."""
    text = docs.read_text() if docs.exists() else ""
    block = f"{begin}\n\n{markdown_text}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    docs.write_text(text)


def main(argv=None) -> int:
    """Parse the options, run the models, write the results (and the docs)."""
    from bench import report

    parser = argparse.ArgumentParser(prog="python -m bench.full_width",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models",
                        help="bert, resnet50, llama, vit, heldout (issue 14's held-out "
                             "encoder at batch 1 / 4 / 16 / 64), comma-separated (default: "
                             "bert, resnet50; with --tier the first four)")
    parser.add_argument("--tier", action="store_true",
                        help="the zoo's full-width tier (bench.full_width_models.tier): "
                             "three shapes per model, warm-up of two rounds, seasoning "
                             f"capped at {TIER_SETTLE_SECONDS:.0f} s; --update-docs writes "
                             "its block of docs/MODELS.md")
    parser.add_argument("--peers", default="onnxruntime,openvino",
                        help="ONNX peers (bench.peers.PEER_SYSTEMS), comma-separated")
    parser.add_argument("--warmup", type=int, default=200,
                        help="calls of BERT's cold-JIT warm-up phase (default 200)")
    parser.add_argument("--calls", type=int, default=16,
                        help="steady calls per BERT shape (default 16)")
    parser.add_argument("--resnet-warmup", type=int, default=60,
                        help="the same for ResNet-50 (default 60: its calls take seconds)")
    parser.add_argument("--resnet-calls", type=int, default=8,
                        help="steady calls per batch size for ResNet-50 (default 8)")
    parser.add_argument("--settle-seconds", type=float,
                        help=f"cap of the seasoning phase per model (default "
                             f"{SETTLE_SECONDS:.0f}, with --tier {TIER_SETTLE_SECONDS:.0f})")
    parser.add_argument("--jit-precisions", default="",
                        help="the JIT also in these precisions (bf16, int8-dynamic), "
                             "comma-separated: systems jit-bf16, jit-int8")
    parser.add_argument("--cache", type=Path, metavar="DIR",
                        help="keep each model's program and ONNX export in DIR and reuse "
                             "them (their seconds are then a load's)")
    parser.add_argument("--budget-seconds", type=float,
                        help="stop the steady phase after the last whole round of shapes "
                             "that fits this many seconds from the start")
    parser.add_argument("--prepare", action="store_true",
                        help="no run: fill --cache (untimed: run it outside the lock)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bert-layers", type=int, default=4)
    parser.add_argument("--bert-hidden", type=int, default=768,
                        help="hidden width (heads = hidden / 64, FFN = 4 x hidden)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument("--from", dest="from_dir", type=Path, metavar="DIR",
                        help="no run: rebuild report.md from DIR/results.json")
    parser.add_argument("--keep", dest="keep_dir", type=Path, metavar="DIR",
                        help="with --from: also the models of DIR/results.json that the "
                             "run of --from did not measure, each under its own run's line")
    args = parser.parse_args(argv)
    log = lambda m: print(m, flush=True)
    if args.from_dir:
        run = json.loads((args.from_dir / "results.json").read_text())
        if args.keep_dir:
            run = keep_models(run, json.loads((args.keep_dir / "results.json").read_text()))
        _report(run, args.from_dir, args.update_docs, log)
        return 0
    torch.set_num_threads(args.threads)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    out = args.out or ROOT / "bench" / "results" / time.strftime("full-width-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    started, load_start = time.time(), os.getloadavg()
    from bench.systems import warm_shared_imports

    warm_shared_imports()
    models = []
    tier_models = tier()
    names = args.models or ",".join(tier_models if args.tier else ("bert", "resnet50"))
    settle_s = args.settle_seconds or (TIER_SETTLE_SECONDS if args.tier else SETTLE_SECONDS)
    for name in (m.strip() for m in names.split(",")):
        if args.tier:
            if name not in tier_models:
                parser.error(f"unknown model {name!r}; the tier's: {', '.join(tier_models)}")
            model = tier_models[name][1]()
            warmup, calls = 2 * len(model.inputs), args.calls
        elif name == "bert":
            h = args.bert_hidden
            model = bert(hidden=h, layers=args.bert_layers, heads=max(1, h // 64), ffn=4 * h)
            warmup, calls = args.warmup, args.calls
        elif name == "resnet50":
            model = resnet50()
            warmup, calls = args.resnet_warmup, args.resnet_calls
        elif name in ("llama", "vit"):
            model = tier_models[name][1]()
            warmup, calls = args.warmup, args.calls
        elif name == "heldout":
            model = heldout()
            warmup, calls = args.warmup, args.calls
        else:
            parser.error(f"unknown model {name!r}; known: bert, resnet50, llama, vit, "
                         "heldout")
        if args.prepare:
            if args.cache is None:
                parser.error("--prepare fills --cache: give it")
            prepare(model, args.cache, with_onnx=bool(peers), log=log)
            continue
        precisions = [p.strip() for p in args.jit_precisions.split(",") if p.strip()]
        deadline = None if args.budget_seconds is None else \
            time.monotonic() - (time.time() - started) + args.budget_seconds
        result = measure(model, warmup, calls, peers, log, settle_s, precisions,
                         args.cache, deadline)
        if args.tier:
            result["tier"] = {"key": name, "description": tier_models[name][0]}
        models.append(result)
    if args.prepare:
        return 0
    run = {"command": "python -m bench.full_width " + " ".join(argv or sys.argv[1:]),
           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
           "total_wall_seconds": time.time() - started, "machine": report.machine(),
           "threads": args.threads, "loadavg_start": load_start,
           "loadavg_end": os.getloadavg(), "omp": wait_policy(), "tier": args.tier,
           "models": models}
    (out / "results.json").write_text(json.dumps(run, indent=1))
    _report(run, out, args.update_docs, log)
    return 0


def _report(run: dict, out: Path, docs: bool, log) -> None:
    """report.md in `out`, and with `docs` the run's block of its doc: a --tier run's in
    docs/MODELS.md (Note [Full-width tier]), any other in docs/bench_results.md."""
    text = tier_markdown(run) if run.get("tier") else markdown(run)
    (out / "report.md").write_text(text)
    log(text)
    if docs and run.get("tier"):
        MODELS_DOCS.write_text(insert_block(
            MODELS_DOCS.read_text() if MODELS_DOCS.exists() else "", text))
        log(f"updated {MODELS_DOCS}")
    elif docs:
        update_docs(text)
        log(f"updated {DOCS}")


if __name__ == "__main__":
    sys.exit(main())
