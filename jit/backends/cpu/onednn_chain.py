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

Inside an fp32 chain the values are nChw16c, not NHWC: every convolution whose input and
output channels are whole 16-blocks is built again on that layout (oneDNN 3.2 then runs
jit_1x1 / jit:avx512_core where NHWC runs brgconv_1x1 / brgconv; OpenVINO's CPU plugin
runs blocked layouts too), a pooling keeps its input's layout, a residual written in
place keeps its residual's; a reorder (built once) runs where a value is read in the
other layout (ResNet-50: the pooled stem's output in, the last block's result out into
its new NHWC tensor). Measured before building (ResNet-50's 53 convolutions back to back
in one native call, NHWC against nChw16c, interleaved with an A/A, 2 threads, passive
OpenMP, 2026-12-05 20:20-20:23, load 2.1-2.8): all 53 0.978 / 0.931 / 0.940 at batch 1 /
2 / 4 (A/A 0.999 / 0.998 / 1.001), the 36 1x1s alone 0.952 / 0.916 / 0.913, the 16 3x3s
1.066 / 0.969 / 0.984. bf16 stays NHWC: its blocked kernels are jit_bf16 without AMX,
4.3x slower at batch 1 (19.9 against 84.5 ms, same run). In the whole model (three
Runtimes in one process, chains nChw16c / chains NHWC / no chains, interleaved with an
A/A, 40 calls, 20:46-20:48, load 1.6; /tmp/h31rb/ab3.py): batch 1 0.960 / 0.928 of no
chains (A/A 0.989), batch 2 0.929 / 0.943 (A/A 0.992); at batch 4 0.942 / 0.951 (20:31,
load 3.3-3.6): so batch 1 stays NHWC inside (BLOCKED_MIN_BATCH), where the 3x3s lose
more on jit:avx512_core than the 1x1s gain. The blocked weights are one more reordered copy
per convolution (WeightLayouts, shared across kernels).

Measured, not built (2026-12-06, the settled kernel's chain rebuilt under another policy,
whole chains interleaved with an A/A; docs/bench_log.md 01:31): a 1x1 stride-1
convolution as a oneDNN matmul over the (N*H*W, C) view of its NHWC value (no copy;
bias, the residual's sum and the activation as post-ops) runs `brg:avx512_core`, the
same brgemm as brgconv_1x1: batch 1 0.998 with all 33 or stage 3-4's 17 (A/A
0.995-0.997), batch 2 / 4 0.992-1.019 against the blocked chain (A/A 0.983-1.014:
no gain); blocked only from some stage on at batch 1: from 7x7 0.991, from 14x14 1.015,
from 28x28 1.052 (A/A 1.005, load 1-3.5), again at 02:37 (load 1.8) from 7x7 1.004,
from 14x14 1.013, all blocked 1.037 (A/A 1.000); at batch 2 NHWC before 7x7 0.982,
before 14x14 0.988, NHWC throughout 1.003 of the blocked chain (A/A 1.000): within
two runs' noise, not built. At batch 1 what ONNX Runtime is ahead by is
stage 3-4's 1x1s inside the whole model (1.07-1.32x per geometry, +1.3 of +1.35 ms),
none of the three kernels faster there.

Which layout an fp32 arena at batch 2-4 runs inside (nChw16c or NHWC) is measured once
per process: Note [nChw16c or NHWC by measurement] in chain_layout_choice.

Two threads calling one kernel: the chain of each shape has a lock, held from the
handles to the results; no second arena per thread. The call holds the GIL as each
primitive call did (Note [oneDNN primitives built once]: the warm-up's calls take turns
with the compile thread's timing runs), so two chains would not overlap anyway and a
second arena would only hold memory; between two primitives, once half a switch
interval (`sys.getswitchinterval()`) has passed since it last did, the C loop lets the
GIL go and takes it back, where the interpreter would have switched between two calls.

In a bf16 chain the input's conversion and a global mean after it are steps too (Note
[A chain's input conversion and global mean] in chain_ends).

A shape without primitives (a family whose spatial dims vary) runs the ops one by one as
before (their own fallbacks). Where `_onednn_chain` was not built (no C compiler at
install) or libdnnl does not load, the pass changes nothing and the note says why.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from pathlib import Path

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu import (
    chain_ends,
    chain_halves,
    chain_layout_choice,
    own_1x1,
    winograd,
)
from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.chain_library import ChainLibrary, native
from dynvm.jit.backends.cpu.ir_match import probe_tensors
from dynvm.jit.backends.cpu.onednn_objects import destroy, md_tag
from dynvm.jit.backends.cpu.onednn_objects import memory as new_memory
from dynvm.jit.backends.cpu.onednn_pool import PrimitiveMean
from dynvm.jit.ir import Literal, SpecializedRegion, SpecOp, Var

CHAIN_PRIMITIVES = "ONEDNN_CHAIN_PRIMITIVES"
_CL = torch.channels_last
_MIN_STEPS = 2     # a run of one primitive gains nothing from a chain
_BLOCKED = chain_layout_choice.TAG_BLOCKED
_BLOCK = 16
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
    once; `run` binds the input and the results and makes the one native call. With
    `blocked`, the convolutions whose channels are whole blocks run on nChw16c values
    (Note [A chain of primitives in one call]), reorders inserted where a value is read
    in the other layout; results are NHWC."""

    def __init__(self, library: api.Library, native_: ChainLibrary, steps: list[Step],
                 shape: tuple, results: tuple[int, ...], frees: list[tuple],
                 blocked: bool = False, head: torch.dtype | None = None) -> None:
        self._library, self._lib = library, library.dll
        self._native = native_
        self._made: list = []          # memory objects this arena owns
        self._owned: list = []         # primitives built for it (blocked ones, reorders)
        self.buffers: list[torch.Tensor] = []
        self._free: list[int] = []
        self._per_call: list[tuple[int, object]] = []   # (-1 input | result k, memory)
        # (primitive, [(arg, memory)], its execute function or None for oneDNN's)
        self._execs: list[tuple[object, list, object]] = []
        self._own: list = []           # our own steps (Own1x1, Winograd), kept alive here
        # Note [Winograd F(2x2, 3x3) for the 3x3s]: its steps by handle, and their V and M
        self.winograd: dict[int, winograd.Winograd] = {}
        self.scratch = winograd.Scratch(library)
        # a residual written in place shares its residual's storage: one group of names
        group = {steps[0].x: steps[0].x}
        for step in steps:
            group[step.dst] = group[step.into] if step.into is not None else step.dst
        result_groups = list(dict.fromkeys(group[r] for r in results))
        self._result_of = [result_groups.index(group[r]) for r in results]
        self._result_specs: list = [None] * len(result_groups)
        x = steps[0].x
        # (group, layout) -> (where, memory): where >= 0 a buffer, -1 the input, -2 - k
        # result k; each group's first layout is its home
        self._versions: dict[tuple[int, int], tuple[int, object]] = {}
        home = {x: api.TAG_NHWC}
        shapes = {x: tuple(shape)}
        dtype = steps[0].runner.by_shape[tuple(shape)].dtype
        input_md = md_tag(self._lib, shape, api.TAG_NHWC, dtype)
        # Note [A chain's input conversion and global mean]: with `head` the call binds
        # the NCHW source, and a reorder writes `x` into a buffer
        source_md = md_tag(self._lib, shape, api.TAG_NCHW, head) if head else None
        try:
            if head is None:
                self._versions[(x, api.TAG_NHWC)] = (-1, self._memory_over(input_md, -1))
            else:
                source = self._memory_over(source_md, -1)
                self._versions[(x, api.TAG_NHWC)] = self._new_version(input_md, None)
                self._reorder(source, self._versions[(x, api.TAG_NHWC)][1])
        finally:
            self._lib.dnnl_memory_desc_destroy(input_md)
            if source_md is not None:
                self._lib.dnnl_memory_desc_destroy(source_md)
        self._head = head
        alive, dead = {x: {x}}, set()
        for position, step in enumerate(steps):
            src = group[step.x]
            tag = self._layout(step, shapes[step.x], home, group, blocked)
            base = step.runner.by_shape.get(shapes[step.x])
            if base is None:
                raise api.OnednnError(f"no primitive for {shapes[step.x]}")
            primitive = base if tag == api.TAG_NHWC else \
                step.runner.build(library, shapes[step.x], tag)
            if primitive is not base:
                self._owned.append(primitive)
            # Note [A 1x1 convolution of our own at a few rows]: where it measured faster
            own = own_1x1.own_step(library, native_.own, step.runner, primitive,
                                   shapes[step.x]) if tag == api.TAG_NHWC else None
            if own is None and tag == api.TAG_NHWC:
                own = winograd.own_step(library, native_.winograd, step.runner, primitive,
                                        shapes[step.x], self.scratch)
                if own is not None:
                    self.winograd[own.handle.value] = own
            if own is not None:
                self._own.append(own)
            shapes[step.dst] = primitive.out_shape
            source = self._version(src, tag, primitive.arguments())
            root = group[step.dst]
            if (root, tag) not in self._versions:     # a new value (into: its residual's)
                home[root] = tag
                alive[root] = set()
                k = result_groups.index(root) if root in result_groups else None
                if k is not None:
                    self._result_specs[k] = (primitive.out_shape, primitive.dtype,
                                             getattr(primitive, "result_format", _CL))
                where = -2 - k if k is not None and tag == api.TAG_NHWC else None
                self._versions[(root, tag)] = self._new_version(
                    _md_of(self._lib, dict(primitive.arguments())[api.ARG_DST]), where)
            alive[root].add(step.dst)
            args = []
            for arg, memory in primitive.arguments():
                if arg == api.ARG_SRC:
                    memory = self._memory_like(memory, source[0])
                elif arg == api.ARG_DST:
                    memory = self._memory_like(memory, self._versions[(root, tag)][0])
                args.append((arg, memory))
            self._execs.append((own.handle, args, own.execute) if own is not None
                               else (primitive.handle, args, None))
            for reg in frees[position]:     # a group none of whose names lives frees
                name = group.get(reg, reg)
                alive.get(name, set()).discard(reg)
                if not alive.get(name, True) and name not in result_groups \
                        and name not in dead:
                    dead.add(name)
                    self._free.extend(w for (g, _), (w, _) in self._versions.items()
                                      if g == name and w >= 0)
        for k, root in enumerate(result_groups):     # results blocked: NHWC at the end
            if home[root] != api.TAG_NHWC:
                out_md = md_tag(self._lib, shapes[root], api.TAG_NHWC, dtype)
                try:
                    made = self._new_version(out_md, -2 - k)
                finally:
                    self._lib.dnnl_memory_desc_destroy(out_md)
                self._reorder(self._versions[(root, home[root])][1], made[1])
        self._arrays = [(api.ExecArg * len(a))(*[api.ExecArg(arg, m) for arg, m in a])
                        for _, a, _ in self._execs]
        n = len(self._execs)
        self._prims = (ctypes.c_void_p * n)(*[h for h, _, _ in self._execs])
        self._nargs = (ctypes.c_int * n)(*[len(a) for _, a, _ in self._execs])
        onednn_execute = native_.functions[0]
        self._executes = (ctypes.c_void_p * n)(
            *[e if e is not None else onednn_execute for _, _, e in self._execs]) \
            if self._own else None
        self._args = (ctypes.c_void_p * n)(*[ctypes.cast(a, ctypes.c_void_p)
                                             for a in self._arrays])
        self._bind = [k for k, _ in self._per_call]
        self._memories = (ctypes.c_void_p * len(self._per_call))(
            *[m for _, m in self._per_call])
        self._handles = (ctypes.c_void_p * len(self._per_call))()
        self._failed = ctypes.c_int()
        self._lock = threading.Lock()
        self.reorders = sum(1 for p in self._owned if isinstance(p, _Reorder))
        self.blocked = any(tag == _BLOCKED for _, tag in self._versions)

    @staticmethod
    def _layout(step, shape, home, group, blocked: bool) -> int:
        if not blocked:
            return api.TAG_NHWC
        if step.into is not None:          # written into its residual, in its layout
            return home[group[step.into]]
        if not hasattr(step.runner, "weight_shape"):
            return home[group[step.x]]     # a pooling keeps its input's layout
        whole = shape[1] % _BLOCK == 0 and step.runner.weight_shape[0] % _BLOCK == 0
        return _BLOCKED if whole else api.TAG_NHWC

    def _version(self, root: int, tag: int, arguments) -> tuple[int, object]:
        """(where, memory) of group `root` in layout `tag`, reordered from its home
        layout the first time it is read so."""
        found = self._versions.get((root, tag))
        if found is not None:
            return found
        home = next(v for (g, _), v in self._versions.items() if g == root)
        made = self._new_version(_md_of(self._lib, dict(arguments)[api.ARG_SRC]), None)
        self._reorder(home[1], made[1])
        self._versions[(root, tag)] = made
        return made

    def _new_version(self, md, where: int | None) -> tuple[int, object]:
        """A value of descriptor `md`: over a free or new buffer (`where` None) or bound
        per call (-1 the input, -2 - k result k)."""
        if where is None:
            where = self._buffer(self._lib.dnnl_memory_desc_get_size(md))
        return where, self._memory_over(md, where)

    def _reorder(self, source, target) -> None:
        reorder = _Reorder(self._library, _md_of(self._lib, source), _md_of(self._lib, target))
        self._owned.append(reorder)
        self._execs.append((reorder.handle, [(api.ARG_SRC, source), (api.ARG_DST, target)],
                            None))

    def _buffer(self, need: int) -> int:
        fits = sorted((self.buffers[b].numel(), b) for b in self._free
                      if self.buffers[b].numel() >= need)
        if fits:
            self._free.remove(fits[0][1])
            return fits[0][1]
        self.buffers.append(torch.empty(need, dtype=torch.uint8))
        return len(self.buffers) - 1

    def _memory_like(self, like, where: int) -> ctypes.c_void_p:
        """A memory object of `like`'s descriptor over `where` (a buffer, or bound per
        call: -1 the input, -2 - k result k)."""
        return self._memory_over(_md_of(self._lib, like), where)

    def _memory_over(self, md, where: int) -> ctypes.c_void_p:
        pointer = self.buffers[where].data_ptr() if where >= 0 else None
        made = new_memory(self._library, md, pointer)
        self._made.append(made)
        if where < 0:
            self._per_call.append((where, made))
        return made

    def source_and_results(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`x` in the layout the chain reads (NHWC, or with a head NCHW of its dtype),
        and new tensors for the chain's results (shared with the chain in pieces)."""
        if self._head is not None:
            if x.dtype != self._head:
                raise api.OnednnError(f"a chain's source of {x.dtype}")
            if not x.is_contiguous():
                x = x.contiguous()
        elif not x.is_contiguous(memory_format=_CL):
            x = x.contiguous(memory_format=_CL)
        return x, [torch.empty(shape, dtype=dtype, memory_format=form)
                   for shape, dtype, form in self._result_specs]

    def run(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The chain on `x` (this arena's shape; NHWC, or with a head NCHW of its
        dtype): its results, new tensors."""
        x, made = self.source_and_results(x)
        with self._lock:
            for k, where in enumerate(self._bind):
                tensor = x if where == -1 else made[-2 - where]
                self._handles[k] = tensor.data_ptr()
            execute, set_handle, wait = self._native.functions
            run = self._native.run
            if self._executes is not None:     # some steps ours
                run, execute = self._native.run_steps, self._executes
            status = run(
                execute, set_handle, wait, self._native.stream, len(self._bind),
                self._memories, self._handles, len(self._prims), self._prims, self._nargs,
                self._args, self._native.yield_after_ns, ctypes.byref(self._failed))
        api.check(status, f"chain step {self._failed.value}")
        return [made[k] for k in self._result_of]

    def __del__(self) -> None:
        destroy(getattr(self, "_lib", None),
                [("dnnl_memory_destroy", m) for m in getattr(self, "_made", ()) if m])


def _md_of(lib, memory) -> ctypes.c_void_p:
    """The descriptor of a memory object (owned by it)."""
    md = ctypes.c_void_p()
    api.check(lib.dnnl_memory_get_memory_desc(memory, ctypes.byref(md)), "md")
    return md


class _Reorder:
    """A reorder primitive between two layouts of one value, built once."""

    def __init__(self, library: api.Library, source_md, target_md) -> None:
        lib = self._lib = library.dll
        descriptor, self.handle = ctypes.c_void_p(), ctypes.c_void_p()
        try:
            api.check(lib.dnnl_reorder_primitive_desc_create(
                ctypes.byref(descriptor), source_md, library.engine, target_md,
                library.engine, None), "reorder descriptor")
            api.check(lib.dnnl_primitive_create(ctypes.byref(self.handle), descriptor),
                      "reorder")
        finally:
            destroy(lib, (("dnnl_primitive_desc_destroy", descriptor),))

    def __del__(self) -> None:
        destroy(getattr(self, "_lib", None),
                (("dnnl_primitive_destroy", getattr(self, "handle", None)),))


class PrimitiveChain:
    """A run of primitive ops as one call per input shape (Note [A chain of primitives
    in one call]); a shape without an arena runs the ops one by one (`steps`)."""

    def __init__(self, library: api.Library, native_: ChainLibrary, steps: list[Step],
                 results: tuple[int, ...], frees: list[tuple], run_step,
                 head: chain_ends.Head | None = None) -> None:
        self.steps = steps
        self.results = results
        self._run_step = run_step
        self.head = head     # Note [A chain's input conversion and global mean]
        self.by_shape: dict[tuple, _Arena] = {}
        for shape in steps[0].runner.by_shape:
            blocked = chain_layout_choice.blocked_inside(
                steps[0].runner.by_shape[shape].dtype, shape[0])
            for layout in ((True, False) if blocked else (False,)):
                try:
                    self.by_shape[tuple(shape)] = _Arena(
                        library, native_, steps, shape, results, frees, layout,
                        head.source_dtype if head is not None else None)
                    break
                except api.OnednnError:
                    continue        # NHWC inside, or that shape runs step by step
        # Note [A chain in halves, one wake a call]: batch 1's arenas, by measured calls
        self.halves = chain_halves.halves_of(library, steps, self.by_shape)

    def layouts(self) -> set[str]:
        """The layouts inside its arenas ("nChw16c", "NHWC")."""
        return {"nChw16c" if a.blocked else "NHWC" for a in self.by_shape.values()}

    def reorders(self) -> int:
        """Reorders its arenas run, all shapes."""
        return sum(a.reorders for a in self.by_shape.values())

    def own_steps(self) -> int:
        """Steps on our own 1x1 kernel (Note [A 1x1 convolution of our own at a few
        rows]), all shapes."""
        return sum(len(a._own) - len(a.winograd) for a in self.by_shape.values())

    def winograd_steps(self) -> int:
        """Steps on Winograd (Note [Winograd F(2x2, 3x3) for the 3x3s]), all shapes."""
        return sum(len(a.winograd) for a in self.by_shape.values())

    def arena_bytes(self) -> int:
        """Bytes of the arenas' buffers, all shapes."""
        return sum(b.numel() for a in self.by_shape.values() for b in a.buffers)

    def __call__(self, x: torch.Tensor):
        shape = tuple(x.shape)
        arena = self.by_shape.get(shape)
        if arena is not None:
            halves = self.halves.get(shape)
            out = halves(x) if halves is not None else arena.run(x)
        else:
            values = {self.steps[0].x: self.head.convert(x) if self.head else x}
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
                     run_step, variant: str, native_path: Path | None = None,
                     ends: bool = True) -> tuple[SpecializedRegion, str]:
    """`spec` with each run of primitive ops (`kinds`: opcode -> "conv", "into" or
    "pool") as one CHAIN_PRIMITIVES op (Note [A chain of primitives in one call]), and
    a note for the kernel's header. `run_step(step, values)` runs one step in Python
    (a shape without an arena). With `ends`, the conversion into a run and a global mean
    after it become steps of it too (Note [A chain's input conversion and global mean])."""
    runs = [r for r in _runs(spec.ops, kinds) if r[1] - r[0] >= _MIN_STEPS]
    if not runs:
        return spec, ""
    bound, why = native(library, native_path)
    if bound is None:
        return spec, f"; primitives called one by one ({why})"
    ops = list(spec.ops)
    after_reads = _reads_after(ops, spec.outputs)
    chains, kept, steps_total, arena_bytes = [], 0, 0, 0
    layouts: set[str] = set()
    reorders, heads, means, own, halves, wino = 0, 0, 0, 0, 0, 0
    for start, end in reversed(runs):
        inner = ops[start:end]
        steps = _steps(inner, kinds)
        defined = {s.dst for s in steps or ()}
        if steps is None or any(s.into is not None and s.into not in defined for s in steps) \
                or any(s.x not in defined and s.x != steps[0].x for s in steps):
            kept += 1       # reads a second value from outside, or writes one
            continue
        head = tail = None
        if ends:
            head = chain_ends.head(ops, start, end, steps[0].x, after_reads, spec.abstract)
            tail = chain_ends.mean_after(ops, end, defined, after_reads, spec.abstract)
        step_frees = [op.frees for op in inner]
        if tail is not None:
            dtype = probe_tensors(spec.abstract, tail[0])[0].dtype
            steps = [*steps, Step(PrimitiveMean(library, dtype), tail[0], None, tail[1])]
            step_frees.append(ops[end].frees)
            end += 1
            defined.add(tail[1])
        if head is not None:
            defined.add(steps[0].x)
            start = head.position
        results = tuple(r for r in dict.fromkeys(s.dst for s in steps)
                        if any(reg == r and pos >= end for reg, pos in after_reads))
        try:
            chain = PrimitiveChain(library, bound, steps, results, step_frees, run_step, head)
        except api.OnednnError:
            kept += 1
            continue
        if not chain.by_shape:
            kept += 1
            continue
        frees = tuple(r for op in ops[start:end] for r in op.frees if r not in defined)
        source = head.source if head is not None else steps[0].x
        ops[start:end] = [SpecOp(CHAIN_PRIMITIVES, results, (Var(source), Literal(chain)),
                                 ops[start].source_pc, frees, variant)]
        chains.append(len(steps))
        steps_total += len(steps)
        arena_bytes += chain.arena_bytes()
        layouts |= chain.layouts()
        reorders += chain.reorders()
        own += chain.own_steps()
        wino += chain.winograd_steps()
        halves += len(chain.halves)
        heads, means = heads + (head is not None), means + (tail is not None)
    if not chains:
        return spec, f"; primitives called one by one ({kept} run(s) not chained)"
    note = (f"; {steps_total} primitive(s) in {len(chains)} native call(s) "
            f"({'/'.join(sorted(layouts))} inside, {reorders} reorder(s); arenas "
            f"{arena_bytes / 2**20:.1f} MiB)")
    if heads or means:
        note += f"; into them {heads} input conversion(s) and {means} global mean(s)"
    if own:
        note += f"; {own} 1x1 step(s) on dynvm's own kernel"
    if wino:
        note += f"; {wino} 3x3 step(s) on Winograd F(2x2, 3x3)"
    if halves:
        note += f"; {halves} arena(s) in row halves with a helper, by measured calls"
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
