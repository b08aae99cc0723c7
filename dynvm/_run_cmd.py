"""`dynvm run`: call a program on random inputs whose dynamic dims follow a schedule, and
report latency per input shape (the command line itself lives in `dynvm.cli`)."""

from __future__ import annotations

import itertools
import math
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

import dynvm
from dynvm._progress import call_bar
from dynvm.telemetry import Telemetry
from dynvm.vm.errors import DynvmError
from dynvm.vm.sample_inputs import INT_HIGH, declared_dims, dim_values, random_inputs


class CliError(DynvmError):
    """A failure to report as `dynvm: error: <message>`; `code` 2 is a usage error."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class DimSchedule:
    """How one dynamic dim changes from call to call."""

    dim: str
    mode: str
    """"cycle" through `values`, "uniform" over [values[0], values[1]], or "walk": a
    random walk that steps to a neighbour in `values` each call."""
    values: tuple[int, ...]
    text: str
    """The part of --schedule it came from, for messages."""

    def bounds(self) -> tuple[int, int]:
        return min(self.values), max(self.values)

    def draws(self, rng: random.Random) -> Iterator[int]:
        """The dim's value for each call, forever."""
        values = self.values
        if self.mode == "cycle":
            yield from itertools.cycle(values)
        elif self.mode == "uniform":
            while True:
                yield rng.randint(values[0], values[1])
        else:
            i = rng.randrange(len(values))
            while True:
                yield values[i]
                if len(values) > 1:  # reflect at the ends so that every step moves
                    step = rng.choice((-1, 1))
                    i = i + step if 0 <= i + step < len(values) else i - step


_PART = re.compile(r"\s*([\w.]+)\s*=\s*(.*?)\s*")
_INTS = re.compile(r"\d+(\s*,\s*\d+)*")
_RANGE = re.compile(r"(\d+)\s*\.\.\s*(\d+)")


def parse_schedule(text: str) -> tuple[DimSchedule, ...]:
    """`batch=1,4,16;seq=2..128;n=walk:1,2,4` -> one DimSchedule per named dim."""
    schedules: dict[str, DimSchedule] = {}
    for part in filter(str.strip, text.split(";")):
        schedule = _parse_part(part.strip())
        if schedule.dim in schedules:
            raise CliError(f"--schedule names dim {schedule.dim!r} twice", 2)
        schedules[schedule.dim] = schedule
    if not schedules:
        raise CliError(f"--schedule {text!r} names no dims", 2)
    return tuple(schedules.values())


def _parse_part(part: str) -> DimSchedule:
    bad = CliError(f"bad --schedule part {part!r}: expected NAME=A,B,C (cycle), "
                   "NAME=LO..HI (uniform) or NAME=walk:A,B,C (random walk)", 2)
    match = _PART.fullmatch(part)
    if match is None:
        raise bad
    dim, rhs = match.groups()
    if rhs.startswith("walk:") and _INTS.fullmatch(rhs[5:].strip()):
        return DimSchedule(dim, "walk", _ints(rhs[5:]), part)
    if _INTS.fullmatch(rhs):
        return DimSchedule(dim, "cycle", _ints(rhs), part)
    if (span := _RANGE.fullmatch(rhs)) is not None:
        low, high = int(span.group(1)), int(span.group(2))
        if low > high:
            raise CliError(f"bad --schedule part {part!r}: empty range {low}..{high}", 2)
        return DimSchedule(dim, "uniform", (low, high), part)
    raise bad


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def check_schedule(schedules, program) -> None:
    """Every scheduled dim exists in `program` and stays within its declared range
    (a usage error naming the dim otherwise)."""
    dims = declared_dims(program)
    for schedule in schedules:
        if schedule.dim not in dims:
            known = ", ".join(dims) if dims else "none (all its shapes are static)"
            raise CliError(f"--schedule names dim {schedule.dim!r}, which {program.name} "
                           f"does not have; its dynamic dims: {known}", 2)
        (low, high), (lo, hi) = dims[schedule.dim], schedule.bounds()
        if lo < low or hi > high:
            raise CliError(f"--schedule {schedule.text!r}: {schedule.dim} must stay within "
                           f"its declared range {low}..{high}", 2)


def input_source(program, demo, schedules, seed: int) -> Callable[[], list[torch.Tensor]]:
    """A function drawing one call's flat inputs (on the CPU)."""
    rng = random.Random(seed)
    if demo is not None and not schedules:
        return lambda: pytree.tree_leaves(demo.sample_inputs(rng))
    gen = torch.Generator().manual_seed(seed)
    declared = declared_dims(program)
    drawers = {s.dim: s.draws(rng) for s in schedules}
    defaults = {key: max(low, 1) for key, (low, _) in declared.items()}

    def draw() -> list[torch.Tensor]:
        values = {key: next(drawer) for key, drawer in drawers.items()}
        if demo is not None and len(values) < len(declared):
            # Dims the schedule leaves alone vary as the model's own sampler draws them.
            sample = pytree.tree_leaves(demo.sample_inputs(rng))
            values = {**dim_values(program, sample), **values}
        values = {**defaults, **values}
        return random_inputs(program, values, gen)
    return draw


def make_telemetry(trace: bool) -> Telemetry:
    """--trace: every span printed (JSON) on stderr as it ends, so stdout keeps the
    report. Otherwise the OTEL_* environment decides (dynvm._env); with no exporter
    configured the Telemetry is disabled: no provider, no span processor, no spans."""
    return Telemetry.console(out=sys.stderr) if trace else Telemetry.from_env()


def make_runtime(program, device: str, jit: bool, telemetry: Telemetry | None = None):
    """The Runtime and a word on the JIT for the report."""
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise CliError(f"bad --device {device!r}: {exc}", 2) from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {device}: this machine has no CUDA device", 2)
    if not jit:
        return dynvm.Runtime(program, where, jit=False, telemetry=telemetry), "off (--no-jit)"
    runtime = dynvm.Runtime(program, where, jit=True, telemetry=telemetry)
    if runtime.jit_disabled_by:
        return runtime, f"off ({runtime.jit_disabled_by} in the environment)"
    return runtime, "on"


def percentile(sorted_ms: list[float], p: float) -> float:
    """Nearest-rank percentile: always a latency that was actually measured."""
    return sorted_ms[max(0, math.ceil(p / 100 * len(sorted_ms)) - 1)]


def _label(values: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items()) or "(static shapes)"


def run_command(args, program, demo, header: list[str]) -> int:
    """`dynvm run`: time calls of `program` on inputs drawn per the schedule and
    print latency per shape and the runtime's counters; the exit status."""
    schedules = parse_schedule(args.schedule) if args.schedule else ()
    if args.threads:
        torch.set_num_threads(args.threads)
    check_schedule(schedules, program)
    telemetry = make_telemetry(args.trace)
    runtime, jit_note = make_runtime(program, args.device, not args.no_jit, telemetry)
    try:
        latencies, labels = _timed_calls(args, program, demo, schedules, runtime)
    finally:
        runtime.close()
        telemetry.shutdown()
    header.append(f"runtime   device={runtime.device} jit={jit_note} "
                  f"threads={torch.get_num_threads()} warmup={args.warmup} calls={args.calls} "
                  f"seed={args.seed}")
    if schedules:
        header.append("schedule  " + "; ".join(f"{s.text} ({s.mode})" for s in schedules))
    if args.trace:
        header.append("trace     spans printed on stderr as they end (--trace)")
    elif telemetry.enabled:
        header.append("trace     exported as the OTEL_* environment says")
    print("\n".join(header) + "\n")
    _print_table(latencies, labels, args.max_rows)
    print("\nruntime.stats()")
    stats = runtime.stats().to_dict()  # every counter, as the JSON form names it
    width = max(map(len, stats), default=0)
    for key, value in stats.items():
        print(f"  {key:<{width}}  {value}")
    return 0


def _timed_calls(args, program, demo, schedules, runtime) -> tuple[dict, dict]:
    """Warm-up and timed calls: latencies (ms) and a label per distinct input shape."""
    draw = input_source(program, demo, schedules, args.seed)
    in_spec = pytree.treespec_loads(program.in_spec)
    sync = torch.cuda.synchronize if runtime.device.type == "cuda" else (lambda: None)
    has_ints = demo is None or bool(schedules)
    has_ints = has_ints and any(not (s.dtype.is_floating_point or s.dtype.is_complex)
                                for s in program.inputs)
    latencies: dict[tuple, list[float]] = {}
    labels: dict[tuple, str] = {}
    total = args.warmup + args.calls
    # The bar would interleave with --trace's spans on stderr; the spans show progress.
    with call_bar(total, off=args.trace) as bar:
        for i in range(total):
            flat = [t.to(runtime.device) for t in draw()]
            values = dim_values(program, flat)
            call_args = pytree.tree_unflatten(flat, in_spec)
            start = time.perf_counter()
            try:
                runtime(*call_args)
                sync()
            except dynvm.DynvmError as exc:
                hint = f"; integer inputs are random in [0, {INT_HIGH})" if has_ints else ""
                raise CliError(f"call {i + 1} ({_label(values)}): {exc}{hint}", 1) from None
            elapsed_ms = (time.perf_counter() - start) * 1e3
            key = tuple(values.items())
            if i >= args.warmup:
                latencies.setdefault(key, []).append(elapsed_ms)
                labels[key] = _label(values)
            if not bar.disable:
                bar.set_postfix_str(_label(values), refresh=False)
                bar.update()
    return latencies, labels


def _print_table(latencies: dict, labels: dict, max_rows: int) -> None:
    width = max([len("all calls"), *map(len, labels.values())])
    print(f"{'shape':<{width}}  {'calls':>6}  {'p50 ms':>9}  {'p99 ms':>9}  {'max ms':>9}")

    def row(label: str, ms: list[float]) -> None:
        ms = sorted(ms)
        print(f"{label:<{width}}  {len(ms):>6}  {percentile(ms, 50):>9.3f}  "
              f"{percentile(ms, 99):>9.3f}  {ms[-1]:>9.3f}")

    # Most-called shapes first when rows are capped, then shown in dim order.
    keys = sorted(latencies, key=lambda k: -len(latencies[k]))
    shown = sorted(keys[:max_rows] if max_rows else keys)
    for key in shown:
        row(labels[key], latencies[key])
    hidden = keys[max_rows:] if max_rows else []
    if hidden:
        calls = sum(len(latencies[k]) for k in hidden)
        print(f"... {len(hidden)} more shapes ({calls} calls); --max-rows 0 lists them all")
    row("all calls", [ms for values in latencies.values() for ms in values])
