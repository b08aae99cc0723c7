"""`dynvm bench zoo`: every model of the zoo (tests/zoo) in eager PyTorch, the dynvm
interpreter and the dynvm JIT, interleaved call by call on the same inputs; writes
results.json and report.md, and with --update-docs docs/MODELS.md.

Note [Zoo timing]
~~~~~~~~~~~~~~~~~
Per model: dynvm.compile is timed once (torch.export, decompositions, lowering). Then a
shape sequence cycles through the entry's export point and held-out points; each call
runs eager, the interpreter and the JIT on the same inputs, in an order that changes
call by call (bench._timing.call_order, Note [Call order]: every system in every
position, right after each other one, and first after each other one's last,
equally often; with rotations alone the JIT always ran right after the interpreter, on
inputs it had just warmed, with rotations and their reverse the second interpreter
never followed eager, which put the A/A at 0.93-0.94, and with the Williams rows taken
in turn the system listed last began the next call after eager twice as often as the
others), the shapes following so that each takes every place of the cycle equally
often (bench._timing.stream_input), and each system's time is divided by eager's time of
the same call. The figure is the median of these per-call ratios over at least
STEADY_CALLS steady calls (whole periods of shapes and orders), after `warmup`
rounds: with the ten rounds of before, a median over 40 calls, a model's A/A ranged
0.92-1.06 in one run. Each call is timed by the wall clock and by the calling thread's CPU time
(time.thread_time): with one torch thread the model's work runs on that thread, and
CPU time leaves out the time other processes held the core. No call is timed
while the JIT's background compile runs (it holds the GIL for long stretches, and made
eager look 10x slower on BART in a first run): each call waits for the queue to drain,
and a call during which the JIT promoted a signature is discarded (counted). The JIT
runs its default JitConfig (background compiles, the promotion policy a server uses),
so where the policy finds a region not worth
specializing the JIT column is the interpreter with profiling; the specialized share
of its steady region calls says which.

"JIT <= interpreter" is judged per call, with its margin measured beside it: a second
interpreter Runtime (B) runs in the same rotation, and per model the doc gives the median
of JIT / interpreter and of B / interpreter on the same calls (the A/A). B's distance
from 1 is what noise alone does to that median in that model's window; the summary
names the models whose JIT / interpreter exceeds 1 by more than it. Comparing the two
x-eager medians instead (each a median of its own ratios) left a 1.5-4% gap on 14 models
with nothing specialized, within the A/A distance of 0.6-2.4% measured beside them.

Steady means settled and seasoned: after the `warmup` rounds, the JIT alone runs more
rounds of the shapes (untimed, each call after the queue drained) until it has made
`SEASON_CALLS` calls in all and `Runtime.settled()` holds (no compile queued or running,
every region with nothing installed past its first cold check, Note [Cold regions], no
specialization still on probation, Note [Probation]: a verdict needs about 48 hits of a
specialization), at most `SETTLE_ROUNDS` rounds or `SETTLE_SECONDS` per model; the doc
reports each model's warm-up calls of the JIT and whether it settled within the cap.
Why a count as well: the promotion horizon grows with a region's age (Note [Rent or
buy] in dynvm.jit.policy), so a region that is settled at 64 calls promotes a few
hundred calls later. Timed right after the first settled moment, 15 models promoted
inside their 256 timed calls, and their medians mixed the watch, the compile, the
probation's shadow calls and the kernel (distilbert, timed per 80 calls: 1.009-1.014 of
the interpreter watching, 1.039 around its promotion at call ~500, 0.933-0.965 after).
A server's steady state is thousands of calls in, so the zoo times the JIT after
`SEASON_CALLS`, and says so. Where steady calls still ran interpreted, the row keeps,
per region, the key the policy is nearest to promoting (jit.settling.best_waiting: its
share of the window, mean time, expected saving, benefit against its compile's cost and
the region's age at which it pays), and the doc states it: a JIT column at the
interpreter's speed says why (gpt2 and albert, whose kernels pay at ~1,600-2,100 calls at
the prior saving, Note [Sampling a rotation] in dynvm.jit.region_watch). Nothing else
about what is timed changes. One torch thread by default (as the suite, see README's
Benchmarks): the machine is shared, and ratios taken in the same instant are what stays
comparable.

Note [Zoo peers]
~~~~~~~~~~~~~~~~
`--peers torch.compile` adds torch.compile in its default mode (dynamic=None: static at
the first shape, dynamic from the first recompile) as a fourth system in the same
changing order, on the same inputs, with Dynamo reset, Inductor's caches cleared and a fresh
cache folder first (bench.systems.TorchCompile, Note [Counting compiles]), so no model
reuses another's kernels. Its compile seconds are the whole of every call during which
Dynamo made a graph (its first calls, in the warm-up rounds; a recompile later is
counted too, and its call stays in the figures). Its outputs are not held to the zoo's
tolerance (Inductor's own numerics are not dynvm's to check). `--peer-models A,B` times
the peers on those models only (the CPU backend issue names the CNNs and two encoders;
torch.compile's compiles take 10-45 s a model here, minutes for the whole zoo), the
other rows as without peers.

`--peers onnxruntime,openvino` (and their -int8 / -bf16 forms) add ONNX Runtime and
OpenVINO (Note [ONNX peers] in bench.peers), exported once per model on its export
point with its dynamic dims, in the same rotation. Their setup seconds are the export
plus the runtime's build; their largest distance from eager over the first steady call
of every shape is stated beside the figure (int8 and bf16 are not fp32), not held to the
zoo's tolerance. A peer that is not installed or does not export that model is a row
saying why, and the run goes on.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from bench import _omp
from bench._timing import aa_margin, balanced_steps, call_order, stream_input
from bench.systems import warm_shared_imports

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "tests" / "zoo"
DOCS = ROOT / "docs" / "MODELS.md"
STEADY_CALLS = 256     # Note [Zoo timing]: timed calls per model (at least)
SEASON_CALLS = 1024    # Note [Zoo timing]: the JIT's calls (warm-up included) before timing
SETTLE_ROUNDS = 512    # ... the cap of the JIT's extra warm-up rounds
SETTLE_SECONDS = 30.0  # ... and of their wall time per model


class ZooUsageError(ValueError):
    """The zoo is not there (not a checkout) or the options do not fit."""


def _registry():
    """Import the zoo registry and harness from the checkout's tests/ (not shipped)."""
    if not (ZOO / "_zoo.py").is_file():
        raise ZooUsageError(f"dynvm bench zoo needs a source checkout: no tests/zoo/_zoo.py "
                            f"under {ROOT} (the zoo is not part of the installed package)")
    if str(ROOT) not in sys.path:  # tests/ is a package of the checkout (tests.zoo...)
        sys.path.insert(0, str(ROOT))
    try:
        from tests.zoo import _zoo, _zoo_harness
    except ImportError as exc:
        raise ZooUsageError(f"the zoo needs its model libraries: pip install -e '.[zoo]' "
                            f"(see scripts/setup) ({exc})") from None
    return _zoo, _zoo_harness


def _timed(fn, inputs) -> tuple[float, float, object]:
    """(wall seconds, the calling thread's CPU seconds, outputs) of one call."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    out = fn(*inputs)
    return time.perf_counter() - start, time.thread_time() - start_cpu, out


def _specialized_share(before: dict, after: dict) -> float | None:
    hits = after["specialized_region_calls"] - before["specialized_region_calls"]
    misses = after["interpreted_region_calls"] - before["interpreted_region_calls"]
    return hits / (hits + misses) if hits + misses else None


def _busy(runtime) -> bool:
    """A compile is queued or running (a promoted signature not yet installed)."""
    return bool(runtime.stats()["queue_length"]
                or any(rj.pending for rj in runtime.jit.regions.values()))


def _drain(runtime, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while _busy(runtime) and time.monotonic() < deadline:
        time.sleep(0.005)


def _settle(jit, inputs: list, season: int) -> tuple[int, bool]:
    """Run the JIT alone over the shapes until it is settled and has made `season` calls
    in all (Note [Zoo timing]), within the caps; returns (calls made, settled)."""
    calls, deadline = 0, time.monotonic() + SETTLE_SECONDS
    for _ in range(SETTLE_ROUNDS):
        _drain(jit)
        if (jit.settled() and jit.stats()["calls"] >= season) \
                or time.monotonic() > deadline:
            break
        for x in inputs:
            _drain(jit)
            jit(*x)
            calls += 1
    _drain(jit)
    return calls, jit.settled()


def measure(entry, harness, warmup: int, calls: int, log, peers=(),
            season: int = SEASON_CALLS, jit_config=None) -> dict:
    """One model's row (Note [Zoo timing]): at least `calls` steady calls, in whole
    cycles of the call orders."""
    import dynvm

    compiled = harness.compile_entry(entry)
    built = compiled.built
    points = [entry.export_point, *entry.held_out]
    inputs = [built.make_inputs(p, 100 + i) for i, p in enumerate(points)]
    expected = [harness.eager(built, x) for x in inputs]
    interp = dynvm.Runtime(compiled.program, jit=False)
    # A second interpreter: the A/A that states the margin of "JIT <= interpreter" per
    # model (Note [Zoo timing]).
    interp_b = dynvm.Runtime(compiled.program, jit=False)
    jit = dynvm.Runtime(compiled.program,
                        jit=jit_config if jit_config is not None else dynvm.JitConfig())
    systems = {"eager": lambda *x: harness.eager(built, x), "interp": interp,
               "interp_b": interp_b, "jit": jit}
    compiled_peer = _torch_compile(built) if "torch.compile" in peers else None
    if compiled_peer is not None:   # Note [Zoo peers]
        systems["compile"] = lambda *x: compiled_peer(*x)[0]
    onnx_peers, unavailable = _onnx_peers(built, entry, peers, log)
    systems.update(onnx_peers)
    peer_error = {name: 0.0 for name in onnx_peers}
    order = list(systems)
    steps = balanced_steps(len(inputs), len(order), calls)
    ratios = {name: [] for name in order if name != "eager"}
    paired = {"jit": [], "interp_b": []}   # per call, over the interpreter's own time
    paired_cpu = {"jit": [], "interp_b": []}   # the same by thread CPU time
    times = {name: [] for name in systems}
    discarded = 0
    try:
        for round_ in range(warmup):   # every system on every shape, untimed
            for index, x in enumerate(inputs):
                _drain(jit)
                for name in call_order(order, round_ * len(inputs) + index):
                    systems[name](*x)
        settle_calls, settled = _settle(jit, inputs, season)
        jit_before = jit.stats()
        checked: set[int] = set()
        for step in range(steps):
            index = stream_input(step, len(inputs), len(order))
            x = inputs[index]
            seconds, cpu, outputs = {}, {}, {}
            # A background compile holds the GIL for long stretches: never time a call
            # while one runs (Note [Zoo timing]).
            _drain(jit)
            promotions = jit.stats()["promotions"]
            for name in call_order(order, step):
                seconds[name], cpu[name], outputs[name] = _timed(systems[name], x)
            if index not in checked:  # each shape's first steady outputs against eager
                checked.add(index)
                for name in ("interp", "jit"):
                    harness.assert_matches(entry, outputs[name], expected[index],
                                           f"{entry.name} {name} at {points[index]}")
                for name in onnx_peers:   # stated, not asserted (Note [Zoo peers])
                    peer_error[name] = max(peer_error[name],
                                           _max_error(outputs[name], expected[index]))
            if jit.stats()["promotions"] != promotions or _busy(jit):
                discarded += 1  # this call started a compile, which ran beside it
                continue
            for name in systems:
                times[name].append(seconds[name])
            for name in ratios:
                ratios[name].append(seconds[name] / seconds["eager"])
            for name in paired:
                paired[name].append(seconds[name] / seconds["interp"])
                paired_cpu[name].append(cpu[name] / cpu["interp"])
        stats = jit.stats()
        waiting = _waiting(jit)
    finally:
        interp.close()
        interp_b.close()
        jit.close()
        if compiled_peer is not None:
            compiled_peer.close()
        for peer in onnx_peers.values():
            peer.close()
    failures = harness.jit_failures(stats)
    row = {
        "name": entry.name, "library": entry.library, "note": entry.note,
        "parameters": sum(p.numel() for p in built.module.parameters()),
        "dims": {d: _dim_range(compiled.program, d) for d in entry.dims},
        "opcodes": dict(sorted(compiled.opcodes.items())),
        "instructions": len(compiled.program.code),
        "compile_seconds": compiled.compile_seconds,
        "eager_ms": 1e3 * statistics.median(times["eager"]),
        # How much eager itself moved during the steady calls (p90 / p10 of its times,
        # mixed shapes): on a shared host a model's window can catch a burst of load.
        "eager_spread": _spread(times["eager"]),
        "ms_per_call": {name: [round(1e3 * t, 4) for t in ts] for name, ts in times.items()
                        if name != "interp_b"},
        "interp_x_eager": statistics.median(ratios["interp"]),
        "jit_x_eager": statistics.median(ratios["jit"]),
        "jit_over_interp": statistics.median(paired["jit"]),
        "interp_aa": statistics.median(paired["interp_b"]),
        "jit_over_interp_cpu": statistics.median(paired_cpu["jit"]),
        "interp_aa_cpu": statistics.median(paired_cpu["interp_b"]),
        # the margin the A/A states (Note [A/A margin] in bench._timing)
        "interp_aa_margin": aa_margin(paired["interp_b"]),
        "interp_aa_margin_cpu": aa_margin(paired_cpu["interp_b"]),
        "jit_specialized_share": _specialized_share(jit_before, stats),
        "jit_compiles": stats["compiles"],
        # Note [Zoo timing]: what the policy waits for, where calls stayed interpreted
        "jit_waiting": waiting,
        "steps": steps,
        "steady_calls": len(ratios["jit"]),
        "discarded_calls": discarded,
        "warmup_calls": warmup * len(inputs) + settle_calls,
        "settled": settled,
        "status": "ok" if not failures else f"JIT: {failures}",
    }
    if compiled_peer is not None:
        graphs, seconds = compiled_peer.compiles()
        row["torch_compile"] = {"x_eager": statistics.median(ratios["compile"]),
                                "compile_seconds": seconds, "compiles": graphs,
                                "dynvm_compile_seconds": compiled.compile_seconds
                                + stats["compile_seconds"]}
        log(f"{entry.name}: torch.compile (default) {row['torch_compile']['x_eager']:.3f}x "
            f"eager, compile {seconds:.1f} s")
    for name, peer in onnx_peers.items():
        row.setdefault("onnx_peers", {})[name] = {
            "x_eager": statistics.median(ratios[name]), "setup_seconds": peer.setup_seconds,
            "exporter": peer.exporter, "version": peer.version,
            "max_abs_error": peer_error[name]}
        log(f"{entry.name}: {name} {row['onnx_peers'][name]['x_eager']:.3f}x eager")
    for name, reason in unavailable.items():
        row.setdefault("onnx_peers", {})[name] = {"unavailable": reason}
    log(f"{entry.name}: interp {row['interp_x_eager']:.3f}x, JIT {row['jit_x_eager']:.3f}x "
        f"eager ({row['eager_ms']:.2f} ms), compile {row['compile_seconds']:.1f} s, "
        f"{row['warmup_calls']} warm-up calls{'' if settled else ' (not settled)'}")
    return row


def _waiting(runtime) -> list[dict]:
    """Per region of the JIT, the key its policy is nearest to promoting and has not
    (jit.settling.best_waiting), with the region's watch state: why calls of a model
    still run interpreted at the end of its timed calls (Note [Zoo timing])."""
    from dynvm.jit.settling import best_waiting

    engine, found = runtime.jit, []
    for index, region_jit in sorted(engine.regions.items()):
        best = best_waiting(region_jit)
        if best is None:
            continue
        watch = region_jit.watch
        state = ("detached" if index in engine.detached else
                 "cold" if watch.cold and watch.judged_cold else
                 f"watched, one miss in {watch.sample_every}" if watch.sample_every > 1
                 else "watched")
        found.append(dict(best, region=index, instructions=len(region_jit.region),
                          state=state))
    return found


def _torch_compile(built):
    """torch.compile (default mode) of a zoo model, as the suite's peer (Note [Zoo peers])."""
    from types import SimpleNamespace

    from bench.systems import TorchCompile

    return TorchCompile(SimpleNamespace(module=built.module), "compile-auto", dynamic=None)


def _onnx_peers(built, entry, peers, log) -> tuple[dict, dict]:
    """The ONNX peers asked for, built on the entry's export point (Note [Zoo peers]),
    and the reason of each that cannot run here."""
    from bench.peers import PEER_SYSTEMS, Peer, PeerUnavailable

    built_peers, unavailable = {}, {}
    example = built.make_inputs(entry.export_point, 0)
    for name in peers:
        if name not in PEER_SYSTEMS:
            continue
        try:
            built_peers[name] = Peer(name, built.module, example, built.dynamic_shapes)
        except PeerUnavailable as exc:
            unavailable[name] = str(exc)
            log(f"{entry.name}: {name} skipped: {exc}")
    return built_peers, unavailable


def _max_error(actual, expected) -> float:
    actual = actual if isinstance(actual, tuple | list) else (actual,)
    if len(actual) != len(expected):
        return float("inf")
    return max(float((a.float() - e.float()).abs().max()) if a.shape == e.shape
               else float("inf") for a, e in zip(actual, expected))


def _spread(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[int(0.9 * (len(ordered) - 1))] / ordered[int(0.1 * (len(ordered) - 1))]


def _dim_range(program, name: str) -> str:
    for spec in program.inputs:
        for dim in spec.dims:
            if dim.name == name and dim.is_derived:   # Note [Derived dims]: 2..5 (size 32*kh)
                low, high = dim.root_range()
                return f"{low}..{high} (size {dim.expression})"
            if dim.name == name:
                return f"{dim.low}..{dim.high}"
    return "?"


def _command(prog: str, args) -> str:
    words = prog.split()
    for flag, value in (("--models", args.models), ("--calls", args.calls),
                        ("--threads", args.threads), ("--peers", ",".join(_peers(args))),
                        ("--peer-models", getattr(args, "peer_models", None))):
        if value:
            words += [flag, str(value)]
    for option in getattr(args, "jit_options", None) or ():
        words += ["--jit-option", option]
    words += ["--quick"] * bool(args.quick) + ["--update-docs"] * bool(args.update_docs)
    return " ".join(map(shlex.quote, words))


PEERS = ("torch.compile", "onnxruntime", "onnxruntime-int8", "openvino", "openvino-bf16")


def _peers(args) -> list[str]:
    return _names(getattr(args, "peers", None))


def _names(text: str | None) -> list[str]:
    """The names of a comma-separated option."""
    return [name.strip() for name in (text or "").split(",") if name.strip()]


def run(args, prog: str = "dynvm bench zoo", log=None) -> int:
    """Measure the zoo (all of it, or args.models); returns the exit status: 1 when a
    model failed (its row says why), else 0."""
    from bench import jit_options, report, zoo_report

    log = log or (lambda m: print(m, flush=True))
    _omp.reexec_cli_passive()   # Note [OpenMP wait policy]: `dynvm bench zoo` only
    zoo, harness = _registry()
    torch.set_num_threads(args.threads or 1)
    wanted = _names(args.models)
    known = {e.name for e in zoo.entries()}
    unknown = [m for m in wanted if m not in known]
    if unknown:
        raise ZooUsageError(f"unknown zoo model {unknown[0]!r}; known: {', '.join(sorted(known))}")
    peers = _peers(args)
    if any(p not in PEERS for p in peers):
        raise ZooUsageError(f"unknown peer {next(p for p in peers if p not in PEERS)!r}; "
                            f"known: {', '.join(PEERS)}")
    chosen = [e for e in zoo.entries() if not wanted or e.name in wanted]
    peer_models = _names(getattr(args, "peer_models", None))
    if peer_models and not peers:
        raise ZooUsageError("--peer-models needs --peers")
    if stray := [m for m in peer_models if m not in {e.name for e in chosen}]:
        raise ZooUsageError(f"--peer-models names {stray[0]!r}, which this run does not "
                            "measure")
    try:
        config = jit_options.jit_config(getattr(args, "jit_options", None))
    except jit_options.JitOptionError as exc:
        raise ZooUsageError(str(exc)) from None
    # Steady calls per model: --quick gives one cycle of the call orders.
    warmup, calls, season = (2, 1, 0) if args.quick else (8, STEADY_CALLS, SEASON_CALLS)
    if args.calls:
        calls = args.calls
    out = args.out or ROOT / "bench" / "results" / time.strftime("zoo-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load_start = os.getloadavg()
    imports = warm_shared_imports()   # Note [Shared first use] in bench.systems
    rows = []
    for entry in chosen:
        try:
            timed_peers = peers if not peer_models or entry.name in peer_models else ()
            rows.append(measure(entry, harness, warmup, calls, log, timed_peers, season,
                                config))
        except Exception as exc:  # a failing model is a row of the table, not the end
            log(traceback.format_exc())
            rows.append({"name": entry.name, "library": entry.library, "note": entry.note,
                         "status": f"failed: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200] if str(exc) else ''}"})
    run_ = {"command": _command(prog, args),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
            "total_wall_seconds": time.time() - started, "machine": report.machine(),
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "omp": _omp.wait_policy(), "shared_import_seconds": imports, "warmup_rounds": warmup,
            "steady_calls_wanted": calls, "season_calls": season, "quick": bool(args.quick),
            "models": rows}
    (out / "results.json").write_text(json.dumps(run_, indent=1))
    markdown = zoo_report.markdown(run_)
    (out / "report.md").write_text(markdown)
    log(markdown)
    if args.update_docs:   # the full-width tier's block is another run's: kept
        tier = zoo_report.tier_block(DOCS.read_text()) if DOCS.exists() else ""
        DOCS.write_text(markdown if not tier else zoo_report.insert_block(
            markdown, tier.removeprefix(zoo_report.TIER_BEGIN).removesuffix(
                zoo_report.TIER_END)))
        log(f"updated {DOCS}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1
