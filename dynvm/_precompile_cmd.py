"""`dynvm precompile`: the command-line wrapper of dynvm.cluster.fleet.precompile (Note
[Precompile rounds] there): reads the .dvm file, the shapes (--shapes, --trace-file) and
the store, runs `precompile`, prints its outcome. Library errors (DynvmError) become
`dynvm: error:` lines; a malformed shape spec is a usage error (exit status 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import dynvm
from dynvm._env import EnvVarError, store_settings
from dynvm._run_cmd import CliError

# -- the store ------------------------------------------------------------------------


def store_config(store_dir: str | None):
    """--store-dir, else the store the environment names (dynvm._env)."""
    from dynvm.cluster.store._store_config import StoreConfig, StoreConfigError

    try:
        if store_dir is None:
            return StoreConfig.from_env()
        return StoreConfig(secret=store_settings().secret.encode(), local_dir=store_dir)
    except (StoreConfigError, EnvVarError) as exc:
        raise CliError(str(exc), 2) from None


# -- the command ----------------------------------------------------------------------


def add_parser(sub) -> None:
    """Register `dynvm precompile` and its options on the CLI's subparsers."""
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
    """`dynvm precompile`: read the program and the shapes, run
    `dynvm.cluster.fleet.precompile.precompile`, print its outcome; the exit status."""
    # Imported here: `dynvm --help` need not load the cluster package (Redis, signing).
    from dynvm.cluster.fleet.precompile import (
        PrecompileError,
        ShapeSpecError,
        check_shapes,
        parse_shapes,
        precompile,
        read_trace,
    )

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
    try:
        shapes: list[dict] = []
        for spec in args.shapes:
            shapes += check_shapes(parse_shapes(spec), program, f"--shapes {spec!r}")
        if args.trace_file:
            shapes += check_shapes(read_trace(args.trace_file), program, args.trace_file)
        shapes = check_shapes(shapes, program, "shapes")  # distinct across all sources
    except PrecompileError as exc:  # what the user typed or named: a usage error
        raise CliError(str(exc), 2) from None
    store = store_config(args.store_dir)
    where = f"directory {store.local_dir}" if store.local_dir else "Redis"
    quiet = args.json
    try:
        outcome = precompile(program, dvm_bytes, shapes, store, args.seed,
                             progress=None if quiet else lambda line: print(line, flush=True))
    except PrecompileError as exc:
        raise CliError(str(exc), 2 if isinstance(exc, ShapeSpecError) else 1) from None
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
