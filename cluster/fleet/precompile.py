"""Precompile: compile, ahead of time, the code families a list of shapes falls into, and
publish them to the kernel store and the program's index, so that a fleet (replicas with
`JitConfig(online_compile=False)`, or any replica) starts warm. `dynvm precompile`
(dynvm._precompile_cmd) is the command-line wrapper.

    shapes = check_shapes(parse_shapes("batch=1..64;seq=32"), program, "my shapes")
    outcome = precompile(program, dvm_bytes, shapes, StoreConfig.from_env())

Note [Precompile rounds]
~~~~~~~~~~~~~~~~~~~~~~~~
Precompile uses the compile service's own code (`FleetCompiler`): the same promotion
rule, the same families, the same keys and the same index a running fleet would
produce, only fed on purpose. A local Runtime (which never compiles) interprets each
requested shape through a replica's own FleetLink, driven here in rounds (its thread is
never started): every interpreted region call is an observation, exactly what a replica
ships. The feed runs in rounds:

  round 1: every shape once. K=2 for every region, so no single call promotes its exact
           signature; a family is promoted as soon as a second member of it is seen
           (Note [Tiering]: a family of one member is no family), hence one kernel per
           bucket, not one per shape.
  round 2: what round 1 published is installed in the local Runtime, as a replica would
           install it, and every shape runs again. Only the region calls that still miss
           are reported: shapes alone in their bucket (batch=1), now seen twice, get an
           exact specialization.
  round 3: the check: every shape again; misses are reported once more (a compile that
           failed is retried after its back-off) and counted in the summary.

Shapes are fed with the ones that make each dim vary first (`skeleton_first`): the family
index learns which dims vary from the first signatures it sees (dynvm.shape_cluster), and
a family promoted before it knows all of them would be compiled again once it does.

A range `LO..HI` becomes the bounds of every geometric bucket it overlaps plus the
geometric midpoint of each (`sweep`): two members per bucket (three where there is
room) is what makes a family, and the midpoint exercises the bucket's inside.

Trace files (`read_trace`; the CLI's --trace-file): JSON lines, one recorded call per
line, an object naming every dynamic dim of the program with its size, e.g.
`{"batch": 4, "seq": 32}`. Blank lines are skipped; repeated shapes count once.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynvm._runtime import Runtime
from dynvm.jit.config import JitConfig
from dynvm.shape_cluster.buckets import bucket_of
from dynvm.vm.errors import DynvmError
from dynvm.vm.sample_inputs import declared_dims, random_inputs


class PrecompileError(DynvmError):
    """Precompiling cannot proceed: the JIT is disabled, or the program rejects inputs of
    a requested shape."""


class ShapeSpecError(PrecompileError, ValueError):
    """A shape spec, a trace file or a shape in it is malformed or does not fit the
    program (names the part, the line or the dim, and what was expected)."""


ROUNDS = 3
# A recurrence must stay in the window across a whole round of every shape's region
# calls (round 2 counts the sightings of round 1); the profile's memory grows with it.
WINDOW = 1 << 15


def precompile_config(ratio: int = 4) -> JitConfig:
    """The compile JIT of Note [Precompile rounds]: K=2 whatever the region's size,
    compiles on the reporting thread (deterministic), and a horizon so long that every
    promotion pays (ahead of time, nothing is too small to compile)."""
    return JitConfig(sync=True, min_recurrence=2, max_recurrence=2,
                     instructions_per_recurrence_step=10**6, expected_speedup=1.0,
                     horizon_calls=10**9, window=WINDOW, families=True, bucket_ratio=ratio)


# -- shapes ---------------------------------------------------------------------------


_PART = re.compile(r"\s*([\w.]+)\s*=\s*(.+?)\s*")
_INT = re.compile(r"\d+")
_RANGE = re.compile(r"(\d+)\s*\.\.\s*(\d+)")


def sweep(low: int, high: int, ratio: int = 4) -> list[int]:
    """Points of `low..high` that make families: per geometric bucket it overlaps, the
    overlap's ends and its geometric midpoint (Note [Precompile rounds])."""
    points: set[int] = set()
    n = low
    while n <= high:
        b_low, b_high = bucket_of(n, ratio)
        lo, hi = max(low, b_low), min(high, b_high)
        points.update((lo, hi, round(math.sqrt(lo * hi))))
        n = b_high + 1
    return sorted(points)


def parse_shapes(text: str, ratio: int = 4) -> list[dict[str, int]]:
    """`batch=1,4,16;seq=32` or `batch=1..64;seq=32` -> the cartesian product of each
    dim's values (a range contributes `sweep(LO, HI)`)."""
    values: dict[str, list[int]] = {}
    for part in filter(str.strip, text.split(";")):
        match = _PART.fullmatch(part)
        if match is None:
            raise ShapeSpecError(f"bad shape spec part {part.strip()!r}: expected "
                                 "NAME=VALUES, VALUES a comma-separated list of sizes N "
                                 "or ranges LO..HI")
        dim, rhs = match.groups()
        if dim in values:
            raise ShapeSpecError(f"shape spec {text!r} names dim {dim!r} twice")
        chosen: set[int] = set()
        for item in rhs.split(","):
            item = item.strip()
            if _INT.fullmatch(item):
                chosen.add(int(item))
            elif (span := _RANGE.fullmatch(item)) is not None:
                low, high = int(span.group(1)), int(span.group(2))
                if low > high:
                    raise ShapeSpecError(f"bad shape spec part {part.strip()!r}: empty "
                                         f"range {low}..{high}")
                chosen.update(sweep(low, high, ratio))
            else:
                raise ShapeSpecError(f"bad shape spec part {part.strip()!r}: {item!r} is "
                                     "neither a size N nor a range LO..HI")
        values[dim] = sorted(chosen)
    if not values:
        raise ShapeSpecError(f"shape spec {text!r} names no dims")
    names = list(values)
    return [dict(zip(names, combo)) for combo in itertools.product(*values.values())]


def read_trace(path: str) -> list[dict[str, int]]:
    """A trace file's shapes (module docstring: one JSON object of {dim: size} a line)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PrecompileError(f"cannot read {path}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
    shapes = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ShapeSpecError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not all(
                isinstance(k, str) and type(v) is int and v >= 0 for k, v in record.items()):
            raise ShapeSpecError(f"{path}:{number}: expected an object of dim name -> "
                                 f"size (a non-negative integer), e.g. {{\"batch\": 4}}")
        shapes.append(record)
    if not shapes:
        raise ShapeSpecError(f"{path}: no shapes (one JSON object a line)")
    return shapes


def check_shapes(shapes: Iterable[dict[str, int]], program, origin: str) -> list[dict]:
    """The distinct shapes, each naming every dynamic dim within its declared range."""
    dims = declared_dims(program)
    distinct: dict[tuple, dict[str, int]] = {}
    for shape in shapes:
        unknown = sorted(set(shape) - set(dims))
        if unknown:
            known = ", ".join(dims) or "none (all its shapes are static)"
            raise ShapeSpecError(f"{origin}: {program.name} has no dynamic dim "
                                 f"{unknown[0]!r}; its dynamic dims: {known}")
        missing = [d for d in dims if d not in shape]
        if missing:
            raise ShapeSpecError(f"{origin}: {_label(shape)} does not give {missing[0]!r}; "
                                 "every dynamic dim needs a size: " + ", ".join(
                                     f"{d} ({lo}..{hi})" for d, (lo, hi) in dims.items()))
        for dim, (low, high) in dims.items():
            if not low <= shape[dim] <= high:
                raise ShapeSpecError(f"{origin}: {dim}={shape[dim]} is outside its declared "
                                     f"range {low}..{high}")
        distinct.setdefault(tuple(shape[d] for d in dims), {d: shape[d] for d in dims})
    return list(distinct.values())


def skeleton_first(shapes: list[dict[str, int]]) -> list[dict[str, int]]:
    """Shapes reordered so that every dim that varies does so as early as possible
    (Note [Precompile rounds])."""
    if not shapes:
        return []
    first, rest = shapes[0], list(shapes[1:])
    ordered, varied = [first], set()
    while True:
        pick = next((s for s in rest
                     if {d for d in s if s[d] != first[d]} - varied), None)
        if pick is None:
            break
        varied |= {d for d in pick if pick[d] != first[d]}
        ordered.append(pick)
        rest.remove(pick)
    return ordered + rest


def _label(shape: dict[str, int]) -> str:
    return ";".join(f"{k}={v}" for k, v in shape.items()) or "(static shapes)"


# -- the rounds -----------------------------------------------------------------------


@dataclass
class Outcome:
    """What a precompile did, for the table and for tests."""

    shapes: int
    already_indexed: int
    compiled: list[dict] = field(default_factory=list)
    """Per new index entry: region, kind, covers, key, seconds."""
    misses: int = 0
    """Region calls still interpreted in the last round."""
    region_calls: int = 0
    """Region calls of the last round (specialized + interpreted)."""
    rounds: int = 0
    seconds: float = 0.0
    failures: int = 0


def _run_shapes(runtime, program, shapes, seed: int) -> None:
    from torch.utils import _pytree as pytree

    in_spec = pytree.treespec_loads(program.in_spec)
    for i, shape in enumerate(shapes):
        flat = random_inputs(program, shape, torch.Generator().manual_seed(seed + i))
        try:
            runtime(*pytree.tree_unflatten(flat, in_spec))
        except DynvmError as exc:
            raise PrecompileError(f"the program rejects random inputs of {_label(shape)}: "
                                  f"{exc}") from None


def precompile(program, dvm_bytes: bytes, shapes: list[dict[str, int]], store,
               seed: int = 0, progress=None) -> Outcome:
    """Note [Precompile rounds]; `store` a StoreConfig. Returns what was published."""
    from dynvm.cluster.fleet._compiler import FleetCompiler
    from dynvm.cluster.fleet._link import FleetLink, FleetOptions
    from dynvm.cluster.fleet._records import portable_from_fields
    from dynvm.cluster.fleet.compile_service import LocalServiceClient

    start = time.perf_counter()
    compiler = FleetCompiler(store, precompile_config())
    # The runtime only drives shapes through the program to find what is not covered
    # yet: it does not judge kernels. With probation on, a kernel it measured as no
    # faster on this host (tiny regions) was dropped here and its shapes counted as
    # misses, though each replica judges what it installs on its own host.
    runtime = Runtime(program, "cpu", jit=JitConfig(online_compile=False, probation=False))
    try:
        if runtime.jit is None:
            raise PrecompileError(f"the JIT is disabled by {runtime.jit_disabled_by} in "
                                  "the environment; precompile needs it, unset it")
        program_hash = program.content_hash
        compiler.register(program_hash, dvm_bytes)
        before = compiler.index(program_hash)
        outcome = Outcome(shapes=len(shapes), already_indexed=len(before))
        # A replica's link driven in rounds here, its thread never started.
        link = FleetLink(runtime, dvm_bytes, FleetOptions(store, max_buffered=1 << 24),
                         LocalServiceClient(compiler))
        runtime.jit.connect(link)
        link.install_indexed()
        ordered = skeleton_first(shapes)
        # ROUNDS reporting rounds, then one that only checks (when misses remain).
        for round_number in range(1, ROUNDS + 2):
            if progress is not None:
                progress(f"round {round_number}: {len(ordered)} shapes")
            calls_before = _region_calls(runtime)
            _run_shapes(runtime, program, ordered, seed)
            outcome.rounds = round_number
            outcome.misses = link.stats()["buffered"]
            outcome.region_calls = _region_calls(runtime) - calls_before
            if not outcome.misses or round_number > ROUNDS:
                break
            link.flush()
            compiler.wait_idle(timeout_s=600)
            link.install_indexed()
        stats = compiler.stats()["programs"].get(program_hash[:12], {})
        outcome.failures = stats.get("compile_failures", 0) + compiler.publish_failures
        new = [k for k in compiler.index(program_hash) if k not in set(before)]
        for key, fields in compiler.cache.fetch(new).items():
            portable = portable_from_fields(fields, program)
            outcome.compiled.append({
                "region": portable.region,
                "kind": "family" if portable.family is not None else "exact",
                "covers": _covers(portable),
                "key": key,
                "seconds": float(fields.get("compile_seconds", 0.0))})
        outcome.compiled.sort(key=lambda row: (row["region"], row["kind"], row["covers"]))
        outcome.seconds = time.perf_counter() - start
        return outcome
    finally:
        runtime.close()
        compiler.close()


def _region_calls(runtime) -> int:
    stats = runtime.stats()
    return (stats.specialized_region_calls or 0) + (stats.interpreted_region_calls or 0)


def _covers(portable) -> str:
    """The varying dims of a family (per live-in, low..high), or an exact signature."""
    if portable.family is None:
        from dynvm.jit.guards import describe

        text = describe(portable.signature)
        return text if len(text) <= 60 else text[:57] + "..."
    parts = []
    for position, dims in enumerate(portable.family.bounds):
        if dims is None or all(low == high for low, high in dims):
            continue
        parts.append(f"in{position}[" + ", ".join(
            str(low) if low == high else f"{low}..{high}" for low, high in dims) + "]")
    # The first varying live-in says which bucket; the others follow from the same dims.
    return parts[0] + (f" (+{len(parts) - 1} live-ins)" if len(parts) > 1 else "")
