"""The `dynvm` command line: lower demo models, read and hand-edit bytecode, run programs.

    dynvm compile transformer -o t.dvm        lower a built-in demo model, save it
    dynvm disasm t.dvm > t.txt                the bytecode as text
    dynvm asm t.txt --weights t.dvm -o u.dvm  edited text + the old weights -> a new file
    dynvm run u.dvm --schedule "batch=walk:1,4,16,64"   latency per input shape

Errors a user can cause print `dynvm: error: <message>` and exit with 2 (bad arguments or
input files) or 1 (the work itself failed), never with a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import dynvm
from dynvm._bench_cmd import add_parser as add_bench_parser
from dynvm._explain_cmd import explain_command
from dynvm._precompile_cmd import add_parser as add_precompile_parser
from dynvm._progress import stage_bar
from dynvm._run_cmd import CliError, run_command
from dynvm._serve_cmd import add_parser as add_serve_parser
from dynvm._top_cmd import add_parser as add_top_parser
from dynvm.models import REGISTRY
from dynvm.vm.sample_inputs import INT_HIGH

DEFAULT_MODEL = "transformer"


class _Parser(argparse.ArgumentParser):
    # argparse would say "dynvm run: error: ..."; every error reads the same way instead.
    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"dynvm: error: {message}\n")


def _known_models() -> str:
    return ", ".join(sorted(REGISTRY))


def _demo(name: str):
    builder = REGISTRY.get(name)
    if builder is None:
        raise CliError(f"unknown model {name!r}; known models: {_known_models()}", 2)
    return builder()


def _load(path: str):
    try:
        return dynvm.load(path)
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}", 2) from None
    except dynvm.DvmFormatError as exc:
        raise CliError(f"{path}: {exc}", 2) from None


def _check_output(path: str) -> None:
    # Checked before the work so that a typo in -o does not waste a long compile.
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CliError(f"cannot write {path}: directory {directory} does not exist", 2)
    if os.path.isdir(path):
        raise CliError(f"cannot write {path}: it is a directory", 2)


def _save(program, path: str) -> int:
    try:
        dynvm.save(program, path)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot write {path}: {getattr(exc, 'strerror', None) or exc}") \
            from None
    return os.path.getsize(path)


def _count_of(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _summary(program) -> str:
    return ", ".join([_count_of(len(program.code), "instruction"),
                      _count_of(len(program.regions), "region"),
                      _count_of(len(program.constants), "constant")])


def _compile_demo(name: str):
    with stage_bar(f"compile {name}", ["build model", "export + lower"]) as stage:
        stage("build model")
        demo = _demo(name)
        stage("export + lower")
        start = time.perf_counter()
        program = dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes,
                                name=name)
    return demo, program, time.perf_counter() - start


def cmd_compile(args) -> int:
    """`dynvm compile`: lower a demo model and save it as a .dvm file."""
    out = args.output or f"{args.model}.dvm"
    _check_output(out)
    start = time.perf_counter()
    _, program, _ = _compile_demo(args.model)
    size = _save(program, out)
    print(f"{out}: {args.model}: {_summary(program)}, {size:,} bytes written "
          f"in {time.perf_counter() - start:.2f} s")
    return 0


def cmd_disasm(args) -> int:
    """`dynvm disasm`: print a .dvm file's bytecode listing."""
    from dynvm.vm.asm import disassemble

    sys.stdout.write(disassemble(_load(args.file)))
    return 0


def cmd_asm(args) -> int:
    """`dynvm asm`: assemble a listing (constants from --weights) into a .dvm file."""
    from dynvm.vm.asm import assemble

    _check_output(args.output)
    try:
        with open(args.listing, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {args.listing}: {getattr(exc, 'strerror', None) or exc}",
                       2) from None
    weights = _load(args.weights) if args.weights else None
    try:
        program = assemble(text, weights.constants if weights else ())
    except dynvm.DynvmError as exc:
        hint = "" if weights else " (pass --weights FROM.dvm for the constants)"
        raise CliError(f"{args.listing}: {exc}{hint}") from None
    size = _save(program, args.output)
    same = " (same content as --weights)" if weights and \
        weights.content_hash == program.content_hash else ""
    print(f"{args.output}: {program.name}: {_summary(program)}, {size:,} bytes written, "
          f"content hash {program.content_hash[:16]}{same}")
    return 0


def _resolve_target(target: str):
    """(demo or None, program, header line) for a .dvm path or a demo model name."""
    if target.endswith(".dvm") or (target not in REGISTRY and os.path.exists(target)):
        program = _load(target)
        return None, program, f"program   {program.name} ({_summary(program)}) from {target}"
    if target in REGISTRY:
        demo, program, seconds = _compile_demo(target)
        return demo, program, (f"program   {target} ({_summary(program)}) compiled in "
                               f"{seconds:.2f} s")
    raise CliError(f"{target!r} is neither a .dvm file nor a demo model; known models: "
                   f"{_known_models()}", 2)


def cmd_run(args) -> int:
    """`dynvm run`: a demo model or .dvm file on random inputs (dynvm._run_cmd)."""
    demo, program, header = _resolve_target(args.target)
    return run_command(args, program, demo, [header])


def cmd_explain(args) -> int:
    """`dynvm explain`: guards, rewrites and code for one shape (dynvm._explain_cmd)."""
    demo, program, _ = _resolve_target(args.target)
    return explain_command(args, program, demo)


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The `dynvm` argument parser with every command's subparser."""
    parser = _Parser(prog="dynvm", description=__doc__.split("\n\n")[0],
                     epilog="`dynvm COMMAND --help` describes each command.")
    parser.add_argument("--version", action="version", version=f"dynvm {dynvm.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("compile", help="lower a built-in demo model to a .dvm file",
                       description="Lower a built-in demo model with dynvm.compile (through "
                       "torch.export, with its declared dynamic dims) and save the program.")
    p.add_argument("model", metavar="MODEL", help=f"demo model: {_known_models()}")
    p.add_argument("-o", "--output", metavar="OUT.dvm", help="file to write (default MODEL.dvm)")
    p.set_defaults(handler=cmd_compile)

    p = sub.add_parser("disasm", help="print a .dvm program as text",
                       description="Print the program in a .dvm file as an assembly listing "
                       "(header directives, then one instruction a line). The listing "
                       "round-trips through `dynvm asm`.")
    p.add_argument("file", metavar="FILE.dvm")
    p.set_defaults(handler=cmd_disasm)

    p = sub.add_parser("asm", help="assemble a listing into a .dvm file",
                       formatter_class=raw, description="""\
Assemble a listing (as `dynvm disasm` prints it, possibly edited by hand) into a
verified program and save it. A listing holds no weights: --weights names the .dvm file
whose constants it uses; they must match the listing's .const lines.

  dynvm disasm m.dvm > m.txt && $EDITOR m.txt && dynvm asm m.txt --weights m.dvm -o m2.dvm""")
    p.add_argument("listing", metavar="LISTING.txt")
    p.add_argument("--weights", metavar="FROM.dvm", help="take the constants from this file")
    p.add_argument("-o", "--output", metavar="OUT.dvm", required=True, help="file to write")
    p.set_defaults(handler=cmd_asm)

    p = sub.add_parser("run", help="run a program on random inputs and report latency",
                       formatter_class=raw, description=f"""\
Call a program on random inputs and print, per distinct input shape, the number of
calls and p50/p99/max latency, then overall figures and runtime.stats().

Inputs: a demo model draws them with its own sampler. A .dvm file (or a demo model
with --schedule) gets inputs built from the program's signature: floats from randn,
integers uniform in [0, {INT_HIGH}) (the signature does not say how large an index
may be, so programs that need other integer values may fail), bools 0/1.

--schedule sets dynamic dims per call; parts are separated by ';':
  batch=1,4,16,64        cycle through these values
  batch=1..64            uniform in [1, 64]
  batch=walk:1,4,16,64   random walk, each call moves to a neighbouring value
Dims it does not name follow the demo model's sampler, or for a .dvm file stay at
their declared lower bound (at least 1).""")
    p.add_argument("target", metavar="MODEL_OR_FILE", nargs="?", default=DEFAULT_MODEL,
                   help=f"a .dvm file or a demo model ({_known_models()}); "
                   f"default {DEFAULT_MODEL}")
    p.add_argument("--calls", type=_count(1), default=100, metavar="N",
                   help="timed calls (default 100)")
    p.add_argument("--warmup", type=_count(0), default=5, metavar="N",
                   help="untimed calls first (default 5)")
    p.add_argument("--schedule", metavar="SPEC", help="dynamic dims per call (see above)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the inputs and schedules (default 0)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--threads", type=_count(1), metavar="T",
                   help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--no-jit", action="store_true",
                   help="run the interpreter only, never specialized code")
    p.add_argument("--max-rows", type=_count(0), default=40, metavar="N",
                   help="show the N most-called shapes (default 40; 0: all)")
    p.add_argument("--trace", action="store_true",
                   help="print every span (call, promotion, compile, install) as JSON on "
                   "stderr; without it, tracing follows the OTEL_* environment")
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser("explain", help="show the code the JIT generates for one shape",
                       formatter_class=raw, description="""\
Run a program once on random inputs of the given shape, with the JIT compiling at first
sight, and print for each specialized region its guard, the specializer's rewrites
(folded shape instructions, dropped views, fused attention, in-place reuse, arena
placement) and the generated source.

  dynvm explain transformer --shape "batch=4;seq=32"
  dynvm explain model.dvm --shape "batch=16\"""")
    p.add_argument("target", metavar="MODEL_OR_FILE", nargs="?", default=DEFAULT_MODEL,
                   help=f"a .dvm file or a demo model; default {DEFAULT_MODEL}")
    p.add_argument("--shape", metavar="SPEC",
                   help="dynamic dims, e.g. 'batch=4;seq=32' (others: as `run` draws them)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the inputs")
    p.add_argument("--trace", action="store_true",
                   help="print the call, promotion, compile and install spans on stderr")
    p.set_defaults(handler=cmd_explain)

    add_bench_parser(sub)
    add_top_parser(sub)
    add_precompile_parser(sub)
    add_serve_parser(sub)
    return parser


def _fail(message: str, code: int) -> int:
    print(f"dynvm: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else 2
    with warnings.catch_warnings():
        if not sys.warnoptions:
            # torch.export's deprecation chatter is not something a CLI user can act on.
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return args.handler(args)
        except CliError as exc:
            return _fail(str(exc), exc.code)
        except dynvm.DynvmError as exc:
            return _fail(str(exc), 1)
        except KeyboardInterrupt:
            return _fail("interrupted", 130)
        except BrokenPipeError:
            # The reader (`| head`) left; point stdout at devnull so the exit-time flush
            # does not complain, as the Python docs recommend.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1


if __name__ == "__main__":
    sys.exit(main())
