"""`dynvm precompile`: compile, ahead of time, the code families a list of shapes falls
into, and publish them to the kernel store and the program's index, so that a fleet
(replicas with `JitConfig(online_compile=False)`, or any replica) starts warm.

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

Trace files (--trace-file): JSON lines, one recorded call per line, an object naming
every dynamic dim of the program with its size, e.g. `{"batch": 4, "seq": 32}`. Blank
lines are skipped; repeated shapes count once.
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

import dynvm
from dynvm._env import EnvVarError, store_settings
from dynvm._run_cmd import CliError, DimSchedule, declared_dims, input_source
from dynvm.jit.config import JitConfig
from dynvm.shape_cluster.buckets import bucket_of

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
            raise CliError(f"bad --shapes part {part.strip()!r}: expected NAME=VALUES, VALUES "
                           "a comma-separated list of sizes N or ranges LO..HI", 2)
        dim, rhs = match.groups()
        if dim in values:
            raise CliError(f"--shapes {text!r} names dim {dim!r} twice", 2)
        chosen: set[int] = set()
        for item in rhs.split(","):
            item = item.strip()
            if _INT.fullmatch(item):
                chosen.add(int(item))
            elif (span := _RANGE.fullmatch(item)) is not None:
                low, high = int(span.group(1)), int(span.group(2))
                if low > high:
                    raise CliError(f"bad --shapes part {part.strip()!r}: empty range "
                                   f"{low}..{high}", 2)
                chosen.update(sweep(low, high, ratio))
            else:
                raise CliError(f"bad --shapes part {part.strip()!r}: {item!r} is neither a "
                               "size N nor a range LO..HI", 2)
        values[dim] = sorted(chosen)
    if not values:
        raise CliError(f"--shapes {text!r} names no dims", 2)
    names = list(values)
    return [dict(zip(names, combo)) for combo in itertools.product(*values.values())]


def read_trace(path: str) -> list[dict[str, int]]:
    """A trace file's shapes (module docstring: one JSON object of {dim: size} a line)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}", 2) \
            from None
    shapes = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path}:{number}: not JSON ({exc.msg})", 2) from None
        if not isinstance(record, dict) or not all(
                isinstance(k, str) and type(v) is int and v >= 0 for k, v in record.items()):
            raise CliError(f"{path}:{number}: expected an object of dim name -> size "
                           f"(a non-negative integer), e.g. {{\"batch\": 4}}", 2)
        shapes.append(record)
    if not shapes:
        raise CliError(f"{path}: no shapes (one JSON object a line)", 2)
    return shapes


def check_shapes(shapes: Iterable[dict[str, int]], program, origin: str) -> list[dict]:
    """The distinct shapes, each naming every dynamic dim within its declared range."""
    dims = declared_dims(program)
    distinct: dict[tuple, dict[str, int]] = {}
    for shape in shapes:
        unknown = sorted(set(shape) - set(dims))
        if unknown:
            known = ", ".join(dims) or "none (all its shapes are static)"
            raise CliError(f"{origin}: {program.name} has no dynamic dim {unknown[0]!r}; its "
                           f"dynamic dims: {known}", 2)
        missing = [d for d in dims if d not in shape]
        if missing:
            raise CliError(f"{origin}: {_label(shape)} does not give {missing[0]!r}; every "
                           f"dynamic dim needs a size: "
                           + ", ".join(f"{d} ({lo}..{hi})" for d, (lo, hi) in dims.items()), 2)
        for dim, (low, high) in dims.items():
            if not low <= shape[dim] <= high:
                raise CliError(f"{origin}: {dim}={shape[dim]} is outside its declared range "
                               f"{low}..{high}", 2)
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


# -- the store ------------------------------------------------------------------------


def store_config(store_dir: str | None):
    """--store-dir, else the store the environment names (dynvm._env)."""
    from dynvm.cluster.config import StoreConfig, StoreConfigError

    try:
        if store_dir is None:
            return StoreConfig.from_env()
        return StoreConfig(secret=store_settings().secret.encode(), local_dir=store_dir)
    except (StoreConfigError, EnvVarError) as exc:
        raise CliError(str(exc), 2) from None


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
        schedules = tuple(DimSchedule(d, "cycle", (v,), f"{d}={v}") for d, v in shape.items())
        flat = input_source(program, None, schedules, seed + i)()
        try:
            runtime(*pytree.tree_unflatten(flat, in_spec))
        except dynvm.DynvmError as exc:
            raise CliError(f"the program rejects random inputs of {_label(shape)}: {exc}") \
                from None


def precompile(program, dvm_bytes: bytes, shapes: list[dict[str, int]], store,
               seed: int = 0, progress=None) -> Outcome:
    """Note [Precompile rounds]; `store` a StoreConfig. Returns what was published."""
    from dynvm.cluster.compile_service import LocalServiceClient
    from dynvm.cluster.fleet_compiler import FleetCompiler
    from dynvm.cluster.fleet_link import FleetLink, FleetOptions
    from dynvm.cluster.fleet_records import portable_from_fields

    start = time.perf_counter()
    compiler = FleetCompiler(store, precompile_config())
    runtime = dynvm.Runtime(program, "cpu", jit=JitConfig(online_compile=False))
    try:
        if runtime.jit is None:
            raise CliError(f"the JIT is disabled by {runtime.jit_disabled_by} in the "
                           "environment; precompile needs it, unset it")
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
    return stats.get("specialized_region_calls", 0) + stats.get("interpreted_region_calls", 0)


def _covers(portable) -> str:
    """The varying dims of a family (per live-in, low..high), or an exact signature."""
    if portable.family is None:
        from dynvm.jit.signature import describe

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


# -- the command ----------------------------------------------------------------------


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("precompile", help="compile the families of given shapes into the "
                       "kernel store", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="""\
Compile, ahead of time, the code families the given shapes fall into and publish them to
the kernel store and the program's index: replicas install them at start (warm start),
including replicas that may not compile (JitConfig(online_compile=False)).

--shapes SPEC names every dynamic dim; parts are separated by ';', values by ',':
  batch=4;seq=32            one shape
  batch=1,4,16,64;seq=32    four shapes (the product over dims)
  batch=1..64;seq=32        a sweep: each geometric bucket's bounds and midpoint
--trace-file FILE: JSON lines, one recorded call a line: {"batch": 4, "seq": 32}

The store: --store-dir DIR, else DYNVM_REDIS_URL or DYNVM_STORE_DIR (see the README's
environment variables); DYNVM_STORE_SECRET must be the fleet's.

  dynvm precompile model.dvm --shapes "batch=1..64;seq=32" --store-dir /tmp/kernels""")
    p.add_argument("file", metavar="MODEL.dvm")
    p.add_argument("--shapes", metavar="SPEC", action="append", default=[],
                   help="shapes to compile for (repeatable; see above)")
    p.add_argument("--trace-file", metavar="FILE", help="recorded shapes, JSON lines")
    p.add_argument("--store-dir", metavar="DIR",
                   help="a local-directory store (default: as the environment says)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the inputs")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.set_defaults(handler=precompile_command)


def precompile_command(args) -> int:
    if not args.shapes and not args.trace_file:
        raise CliError("give --shapes SPEC or --trace-file FILE (what to compile for)", 2)
    path = Path(args.file)
    try:
        dvm_bytes = path.read_bytes()
        program = dynvm.load(path)
    except OSError as exc:
        raise CliError(f"cannot read {args.file}: {exc.strerror or exc}", 2) from None
    except dynvm.DvmFormatError as exc:
        raise CliError(f"{args.file}: {exc}", 2) from None
    shapes: list[dict] = []
    for spec in args.shapes:
        shapes += check_shapes(parse_shapes(spec), program, f"--shapes {spec!r}")
    if args.trace_file:
        shapes += check_shapes(read_trace(args.trace_file), program, args.trace_file)
    shapes = check_shapes(shapes, program, "shapes")  # distinct across all sources
    store = store_config(args.store_dir)
    where = f"directory {store.local_dir}" if store.local_dir else "Redis"
    quiet = args.json
    outcome = precompile(program, dvm_bytes, shapes, store, args.seed,
                         progress=None if quiet else lambda line: print(line, flush=True))
    if args.json:
        print(json.dumps({"program": program.name, "program_hash": program.content_hash,
                          **{k: v for k, v in vars(outcome).items()}}, indent=2))
        return 0
    print(f"\n{program.name} ({program.content_hash[:12]}): {outcome.shapes} shapes, "
          f"store: {where}, {outcome.already_indexed} entries already indexed")
    if outcome.compiled:
        width = max(len(r["covers"]) for r in outcome.compiled)
        print(f"{'region':>6}  {'kind':<6}  {'covers':<{width}}  {'key':<16}  {'seconds':>7}")
        for row in outcome.compiled:
            print(f"{row['region']:>6}  {row['kind']:<6}  {row['covers']:<{width}}  "
                  f"{row['key'][:16]}  {row['seconds']:>7.3f}")
    families = sum(r["kind"] == "family" for r in outcome.compiled)
    print(f"\ncompiled {len(outcome.compiled)} ({families} families, "
          f"{len(outcome.compiled) - families} exact) in {outcome.seconds:.1f} s; "
          f"check round: {outcome.region_calls - outcome.misses}/{outcome.region_calls} "
          f"region calls specialized"
          + (f", {outcome.failures} compile/publish failures" if outcome.failures else ""))
    if outcome.misses:
        # Not an error: a region the specializer refuses stays interpreted everywhere.
        print(f"note: {outcome.misses} region calls of these shapes are still interpreted "
              "(regions that cannot be specialized, or failed compiles)")
    return 0
