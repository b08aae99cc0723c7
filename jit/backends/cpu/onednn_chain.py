"""A run of oneDNN primitives (convolutions, max poolings) as one native call over an
arena of the chain's values: a pass over a region whose chains already run on
primitives (onednn_conv calls it last).

Note [A chain of primitives in one call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With every convolution and max pool of ResNet-50 on a primitive built once (Note
[oneDNN primitives built once], Note [oneDNN pooling built once]), what a call still
pays around oneDNN's execution is Python: per primitive, the kernel's line, a dict
lookup by shape, `torch.empty` of the result, two data handles and the ctypes call,
25-65 us each, ~2 ms of a 16.6 ms bf16 call at batch 1 over its 54 primitives (docs/
bench_log.md, 2026-12-05 17:15). ONNX Runtime and OpenVINO plan their intermediate
buffers once and bind nothing per node.

So a run of consecutive primitive ops whose only input from outside is the first one's
(`x`) becomes one op (`CHAIN_PRIMITIVES`) whose call, for each input shape the
primitives were built for, is:
- an arena: every value of the run that nothing after it reads lives in a buffer
  allocated once per shape (a buffer is reused once the values in it are dead: ResNet-50
  at batch 1 holds ~4 buffers, not 53), and each primitive's memory objects and
  execute-argument array are built once with those buffers' data handles fixed;
- per call, `x`'s handle (converted to channels-last first if it is not) and a new
  tensor for each value read after the run (the results never alias the arena, so a
  tensor returned by one call is not changed by the next);
- one C call (native/onednn_chain.c, the `_onednn_chain` library) that sets those
  handles, executes every primitive in order and waits on the stream.
A residual written in place (CONV_PRIMITIVE_INTO) writes into its residual's buffer, as
it wrote into its tensor.

Two threads calling one kernel: the chain of each shape has a lock, held from the
handles to the results; no second arena per thread. The call holds the GIL as each
primitive call did (Note [oneDNN primitives built once]: the warm-up's calls take turns
with the compile thread's timing runs), so two chains would not overlap anyway and a
second arena would only hold memory; between two primitives the C loop lets the GIL go
and takes it back, where the interpreter would have switched between two calls.

A shape without primitives (a family whose spatial dims vary) runs the ops one by one as
before (their own fallbacks). Where `_onednn_chain` was not built (no C compiler at
install) or libdnnl does not load, the pass changes nothing and the note says why.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.machinery
import threading
from pathlib import Path

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.onednn_objects import destroy
from dynvm.jit.backends.cpu.onednn_objects import memory as new_memory
from dynvm.jit.ir import Literal, SpecializedRegion, SpecOp, Var

CHAIN_PRIMITIVES = "ONEDNN_CHAIN_PRIMITIVES"
_CL = torch.channels_last
_LIBRARY_STEM = "_onednn_chain"
_MIN_STEPS = 2     # a run of one primitive gains nothing from a chain


def _find_library() -> Path | None:
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"{_LIBRARY_STEM}{suffix}"
        if candidate.exists():
            return candidate
    return None


class _Native:
    """The chain library's function, called holding the GIL (ctypes.PyDLL), with the
    oneDNN functions it calls as pointers into the libdnnl `library` loaded."""

    def __init__(self, path: Path, library: api.Library) -> None:
        self.run = ctypes.PyDLL(str(path)).dynvm_onednn_chain_run
        p, pp, i = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int
        self.run.argtypes = [p, p, p, p, i, pp, pp, i, pp, ctypes.POINTER(i), pp, i,
                             ctypes.POINTER(i)]
        self.run.restype = i
        dll = library.dll
        wait = dll.dnnl_stream_wait      # declared here: onednn_api does not list it
        wait.argtypes, wait.restype = [p], i
        self.functions = [ctypes.cast(f, p) for f in (
            dll.dnnl_primitive_execute, dll.dnnl_memory_set_data_handle, wait)]
        self.stream = library.stream


def native(library: api.Library | None, path: Path | None = None) -> tuple[_Native | None, str]:
    """The chain library bound to `library`, or None and why not (`path` overrides
    where it is looked for: tests point it at a missing file)."""
    if library is None:
        return None, api.unavailable_reason()
    found = path if path is not None else _find_library()
    if found is None or not found.exists():
        return None, (f"{_LIBRARY_STEM} was not built (setup.py compiles it at install; "
                      "reinstall dynvm with a C compiler present)")
    try:
        return _Native(found, library), ""
    except (OSError, AttributeError) as exc:
        return None, f"{found.name} did not load: {exc}"


@dataclasses.dataclass(frozen=True)
class Step:
    """One primitive op of a run: `dst = op(x[, into])` on `runner` (a PrimitiveConv or
    PrimitivePool, whose `by_shape` holds its primitives)."""

    runner: object
    x: int
    into: int | None
    dst: int


class _Arena:
    """The chain for one input shape: buffers, memory objects and argument arrays built
    once; `run` binds the input and the results and makes the one native call."""

    def __init__(self, library: api.Library, native_: _Native, steps: list[Step],
                 shape: tuple, results: tuple[int, ...], frees: list[tuple]) -> None:
        self._library, self._lib = library, library.dll
        self._native = native_
        self._made: list = []          # memory objects this arena owns
        self.buffers: list[torch.Tensor] = []
        # a residual written in place shares its residual's storage: one group of names
        group = {steps[0].x: steps[0].x}
        for step in steps:
            group[step.dst] = group[step.into] if step.into is not None else step.dst
        per_call_groups = list(dict.fromkeys(group[r] for r in results))
        self._result_of = [per_call_groups.index(group[r]) for r in results]
        self._result_specs: list = [None] * len(per_call_groups)
        # group -> where it lives: a buffer index (>= 0), -1 the input, -2 - k result k
        where = {steps[0].x: -1}
        free: list[int] = []
        holders: dict[int, set[int]] = {}               # buffer -> names alive in it
        per_call: list[tuple[int, object]] = []
        prims, nargs, arrays = [], [], []
        shapes = {steps[0].x: tuple(shape)}
        for position, step in enumerate(steps):
            primitive = step.runner.by_shape.get(shapes[step.x])
            if primitive is None:
                raise api.OnednnError(f"no primitive for {shapes[step.x]}")
            shapes[step.dst] = primitive.out_shape
            root = group[step.dst]
            if root not in where:
                if root in per_call_groups:
                    k = per_call_groups.index(root)
                    where[root] = -2 - k
                    self._result_specs[k] = (primitive.out_shape, primitive.dtype)
                else:
                    where[root] = self._buffer(primitive, free)
            if where[root] >= 0:
                holders.setdefault(where[root], set()).add(step.dst)
            args = []
            for arg, memory in primitive.arguments():
                if arg in (api.ARG_SRC, api.ARG_DST):
                    reg = step.x if arg == api.ARG_SRC else step.dst
                    memory = self._memory(memory, where[group[reg]], per_call)
                args.append(api.ExecArg(arg, memory))
            arrays.append((api.ExecArg * len(args))(*args))
            prims.append(primitive.handle)
            nargs.append(len(args))
            # names dead after this step: a buffer none lives in serves later steps
            for reg in frees[position]:
                buffer = where.get(group.get(reg, reg), -1)
                if buffer >= 0 and reg in holders.get(buffer, ()):
                    holders[buffer].discard(reg)
                    if not holders[buffer]:
                        free.append(buffer)
        self._arrays = arrays          # the argument arrays the pointers below name
        n = len(steps)
        self._prims = (ctypes.c_void_p * n)(*prims)
        self._nargs = (ctypes.c_int * n)(*nargs)
        self._args = (ctypes.c_void_p * n)(*[ctypes.cast(a, ctypes.c_void_p)
                                             for a in arrays])
        self._bind = [k for k, _ in per_call]
        self._memories = (ctypes.c_void_p * len(per_call))(*[m for _, m in per_call])
        self._handles = (ctypes.c_void_p * len(per_call))()
        self._failed = ctypes.c_int()
        self._lock = threading.Lock()

    def _buffer(self, primitive, free: list[int]) -> int:
        need = _nbytes(primitive.out_shape, primitive.dtype)
        fits = sorted((self.buffers[b].numel(), b) for b in free
                      if self.buffers[b].numel() >= need)
        if fits:
            free.remove(fits[0][1])
            return fits[0][1]
        self.buffers.append(torch.empty(need, dtype=torch.uint8))
        return len(self.buffers) - 1

    def _memory(self, like, where: int, per_call: list) -> ctypes.c_void_p:
        """A memory object of `like`'s descriptor over buffer `where` (>= 0), or bound
        per call (-1 the input, -2 - k result k)."""
        md = ctypes.c_void_p()
        api.check(self._lib.dnnl_memory_get_memory_desc(like, ctypes.byref(md)), "md")
        pointer = self.buffers[where].data_ptr() if where >= 0 else None
        made = new_memory(self._library, md, pointer)
        self._made.append(made)
        if where < 0:
            per_call.append((where, made))
        return made

    def run(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The chain on `x` (NHWC, this arena's shape): its results, new tensors."""
        if not x.is_contiguous(memory_format=_CL):
            x = x.contiguous(memory_format=_CL)
        made = [torch.empty(shape, dtype=dtype, memory_format=_CL)
                for shape, dtype in self._result_specs]
        with self._lock:
            for k, where in enumerate(self._bind):
                tensor = x if where == -1 else made[-2 - where]
                self._handles[k] = tensor.data_ptr()
            execute, set_handle, wait = self._native.functions
            status = self._native.run(
                execute, set_handle, wait, self._native.stream, len(self._bind),
                self._memories, self._handles, len(self._prims), self._prims, self._nargs,
                self._args, 1, ctypes.byref(self._failed))
        api.check(status, f"chain step {self._failed.value}")
        return [made[k] for k in self._result_of]

    def __del__(self) -> None:
        destroy(getattr(self, "_lib", None),
                [("dnnl_memory_destroy", m) for m in getattr(self, "_made", ()) if m])


def _nbytes(shape, dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


class PrimitiveChain:
    """A run of primitive ops as one call per input shape (Note [A chain of primitives
    in one call]); a shape without an arena runs the ops one by one (`steps`)."""

    def __init__(self, library: api.Library, native_: _Native, steps: list[Step],
                 results: tuple[int, ...], frees: list[tuple], run_step) -> None:
        self.steps = steps
        self.results = results
        self._run_step = run_step
        self.by_shape: dict[tuple, _Arena] = {}
        for shape in steps[0].runner.by_shape:
            try:
                self.by_shape[tuple(shape)] = _Arena(library, native_, steps, shape,
                                                     results, frees)
            except api.OnednnError:
                continue        # that shape runs step by step

    def arena_bytes(self) -> int:
        """Bytes of the arenas' buffers, all shapes."""
        return sum(b.numel() for a in self.by_shape.values() for b in a.buffers)

    def __call__(self, x: torch.Tensor):
        arena = self.by_shape.get(tuple(x.shape))
        if arena is not None:
            out = arena.run(x)
        else:
            values = {self.steps[0].x: x}
            for step in self.steps:
                values[step.dst] = self._run_step(step, values)
            out = [values[r] for r in self.results]
        return out[0] if len(out) == 1 else tuple(out)


def chain_primitive(x, chain: PrimitiveChain):
    """`CHAIN_PRIMITIVES`: a run of primitive ops on `x`, its results read after it."""
    return chain(x)


CHAIN_KERNELS = {CHAIN_PRIMITIVES: chain_primitive}


def _runs(ops, kinds: dict[str, str]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of consecutive primitive ops."""
    runs, start = [], None
    for position, op in enumerate(list(ops) + [None]):
        inside = op is not None and op.opcode in kinds
        if inside and start is None:
            start = position
        elif not inside and start is not None:
            runs.append((start, position))
            start = None
    return runs


def _steps(ops, kinds) -> list[Step] | None:
    steps = []
    for op in ops:
        kind = kinds[op.opcode]
        into = op.args[1] if kind == "into" else None
        if not isinstance(op.args[0], Var) or (into is not None and not isinstance(into, Var)) \
                or len(op.dsts) != 1:
            return None
        steps.append(Step(op.args[-1].value, op.args[0].reg,
                          into.reg if into is not None else None, op.dsts[0]))
    return steps


def chain_primitives(spec: SpecializedRegion, library: api.Library, kinds: dict[str, str],
                     run_step, variant: str,
                     native_path: Path | None = None) -> tuple[SpecializedRegion, str]:
    """`spec` with each run of primitive ops (`kinds`: opcode -> "conv", "into" or
    "pool") as one CHAIN_PRIMITIVES op (Note [A chain of primitives in one call]), and
    a note for the kernel's header. `run_step(step, values)` runs one step in Python
    (a shape without an arena)."""
    runs = [r for r in _runs(spec.ops, kinds) if r[1] - r[0] >= _MIN_STEPS]
    if not runs:
        return spec, ""
    bound, why = native(library, native_path)
    if bound is None:
        return spec, f"; primitives called one by one ({why})"
    ops = list(spec.ops)
    after_reads = _reads_after(ops, spec.outputs)
    chains, kept, steps_total, arena_bytes = [], 0, 0, 0
    for start, end in reversed(runs):
        inner = ops[start:end]
        steps = _steps(inner, kinds)
        defined = {s.dst for s in steps or ()}
        if steps is None or any(s.into is not None and s.into not in defined for s in steps) \
                or any(s.x not in defined and s.x != steps[0].x for s in steps):
            kept += 1       # reads a second value from outside, or writes one
            continue
        results = tuple(r for r in dict.fromkeys(s.dst for s in steps)
                        if any(reg == r and pos >= end for reg, pos in after_reads))
        try:
            chain = PrimitiveChain(library, bound, steps, results,
                                   [op.frees for op in inner], run_step)
        except api.OnednnError:
            kept += 1
            continue
        if not chain.by_shape:
            kept += 1
            continue
        frees = tuple(r for op in inner for r in op.frees if r not in defined)
        ops[start:end] = [SpecOp(CHAIN_PRIMITIVES, results,
                                 (Var(steps[0].x), Literal(chain)), inner[0].source_pc,
                                 frees, variant)]
        chains.append(len(steps))
        steps_total += len(steps)
        arena_bytes += chain.arena_bytes()
    if not chains:
        return spec, f"; primitives called one by one ({kept} run(s) not chained)"
    note = (f"; {steps_total} primitive(s) in {len(chains)} native call(s) "
            f"(arenas {arena_bytes / 2**20:.1f} MiB)")
    return dataclasses.replace(spec, ops=tuple(ops)), note


def _reads_after(ops, outputs) -> list[tuple[int, int]]:
    """(register, position) of every read of a register by an op, or by the region's
    outputs (position len(ops)); frees count as reads (the register is alive until)."""
    reads = []
    for position, op in enumerate(ops):
        for value in flat_values(op.args):
            if isinstance(value, Var):
                reads.append((value.reg, position))
        reads.extend((reg, position) for reg in op.frees)
    for reg, value in outputs:
        reads.append((reg, len(ops)))
        if isinstance(value, Var):
            reads.append((value.reg, len(ops)))
    return reads
