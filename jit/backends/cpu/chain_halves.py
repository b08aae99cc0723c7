"""A batch-1 chain of primitives (onednn_chain's arena) as one parallel section a call:
each step's output rows cut in two pieces on one-thread primitives, run by the caller
and a helper thread of dynvm's own (native/chain_halves.c, the `_chain_halves`
library).

Note [A chain in halves, one wake a call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each primitive of a chain (Note [A chain of primitives in one call]) is one OpenMP
region; with the passive wait policy the benchmarks run (bench/_omp.py) the second
thread is woken ~15 us (fp32) to ~65 us (bf16, AMX) into each of ResNet-50's 53
(Note [bf16 convolution chains]). Here the chain's call wakes one helper once: at
batch 1 in NHWC the top and bottom halves of a step's output rows are dense
sub-tensors (a pointer offset), each a convolution over the input rows it needs with
asymmetric padding (top: the padding above only; bottom: below only; input rows
[a*s - pad, (b-1)*s - pad + kh) for output rows [a, b)), on the step's weights (the
copy in the layout a one-thread primitive of that piece chose, shared like every
copy); a residual's sum and the activation stay per piece, poolings split the same way,
the input's conversion splits by rows, the mean runs whole on whichever thread claims
it. Between two steps a barrier of our own: a thread that finished its pieces spins at
most `LATE_NS`, then sleeps on a futex (a partner preempted mid-piece gets the core);
pieces are claimed one at a time, so a late helper costs the caller at most the piece
it is inside, and a helper that wakes after the call is over finds it closed. Between
calls the helper sleeps: the process stays passive. A thread whose partner last ran on
its own CPU does not spin (the scheduler may wake the helper on the caller's CPU).

Measured first (the settled ResNet-50 batch-1 arena against the same arena in halves,
one process, interleaved call by call with an A/A, 2 threads, OMP passive, under the
bench lock; /tmp/h33r/proto.py, 2026-12-06): bf16 7.77 against 11.50 ms, **0.680** (A/A
0.994, 10:00 UTC, load 1.9; the helper ran 56 of 111 pieces a call); fp32 31.54 against
33.48, 0.945 (A/A 0.987, 10:01, load 1.8: at 7x7 the 4 / 3 row split is uneven, and the
caller waited 1.2 ms a call). Results bit-equal to the arena's. Each piece alone (one
thread, weights hot) ran 0.33-0.56x the team's step at 56-14 rows, 0.60-0.83x at 7x7.
On a host whose other core is busy it loses: whole-model windows at load 2.0-3.3 gave
1.05-1.10 with halves forced; at the same load the next window 0.768 (below): the
helper then shares its core with another process's work for whole time slices, where
the team's worker, asleep between regions, is woken ahead of it. So halves or the
team's chain is chosen per arena by its calls' measured time (`HalvesChoice`, the
team's chain the fallback), not assumed.

At batch 2-4 (an NHWC arena: bf16; fp32's are nChw16c there and stay the team's) the
pieces are the images, each the step's batch-1 primitive at its image's offset, claimed
one at a time (`MAX_BATCH`).

Whole model (ResNet-50, two Runtimes in one process, halves "measure" / "never",
interleaved call by call with an A/A; /tmp/h33r/ab.py, 2026-12-06): bf16 batch 1 9.99
against 12.99 ms, **0.768** (A/A 1.003, 10:08 UTC, load 2.8), 7.83 against 11.37, 0.679
(A/A 0.985, 10:13, load 2.0), 9.27 against 12.68, 0.732 (A/A 0.997, 10:16, load 1.7);
batch 2 by image 14.28 against 17.55, **0.826** (A/A 1.016), batch 4 25.54 against
27.93, 0.918 (A/A 0.996; 10:15, load 2.0); fp32 batch 1 0.985 (A/A 1.007, 10:09, load
2.2; the chooser still alternating).
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

from dynvm.jit import background
from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.native_linear import find_extension
from dynvm.jit.backends.cpu.one_thread import openmp_runtime
from dynvm.jit.backends.cpu.onednn_objects import DATA_TYPES, destroy, md_strides, md_tag
from dynvm.jit.backends.cpu.onednn_objects import memory as new_memory

_LIBRARY_STEM = "_chain_halves"
LATE_NS = 100_000
"""How long a thread spins at a step's end for its partner's piece before it sleeps."""
_CL = torch.channels_last
_WINDOW, _FIRST, _EXPLORE = 7, 3, 8
MAX_BATCH = 4
"""The largest batch whose NHWC arena is built in pieces (an image a piece past 1)."""
policy = "measure"
"""Halves at batch 1: "measure" (by the arena's calls, `HalvesChoice`), "always" or
"never" (an A/B's arms, and the way to turn it off)."""


class _Plan(ctypes.Structure):
    """struct plan of native/chain_halves.c."""

    _fields_ = [("steps", ctypes.c_int64), ("first_piece", ctypes.c_void_p),
                ("primitive", ctypes.c_void_p), ("nargs", ctypes.c_void_p),
                ("args", ctypes.c_void_p), ("binds", ctypes.c_int64),
                ("bind_memory", ctypes.c_void_p), ("bind_source", ctypes.c_void_p),
                ("bind_offset", ctypes.c_void_p), ("claimed", ctypes.c_void_p),
                ("done", ctypes.c_void_p), ("waiting", ctypes.c_void_p)]


class _Native:
    """The library's functions (ctypes.PyDLL: called holding the GIL), its helper
    started with a stream of its own."""

    def __init__(self, path: Path, library: api.Library, omp) -> None:
        dll = ctypes.PyDLL(str(path))
        p = ctypes.c_void_p
        self.run = dll.dynvm_chain_halves_run
        self.run.argtypes = [ctypes.POINTER(_Plan), p, p, ctypes.c_int, ctypes.c_longlong,
                             ctypes.POINTER(ctypes.c_int)]
        self.run.restype = ctypes.c_int
        self._stats = dll.dynvm_chain_halves_stats
        self._stats.argtypes, self._stats.restype = [ctypes.POINTER(ctypes.c_longlong)], None
        self.omp = omp
        self.stream = library.stream
        self._helper_stream = ctypes.c_void_p()     # alive with the process
        api.check(library.dll.dnnl_stream_create(ctypes.byref(self._helper_stream),
                                                 library.engine, api.STREAM_DEFAULT),
                  "helper stream")
        lib = library.dll
        wait = lib.dnnl_stream_wait
        wait.argtypes, wait.restype = [p], ctypes.c_int
        start = dll.dynvm_chain_halves_start
        start.argtypes = [p, p, p, p, p, p, ctypes.c_longlong]
        start.restype = ctypes.c_int
        status = start(*(ctypes.cast(f, p) for f in (
            lib.dnnl_primitive_execute, lib.dnnl_memory_set_data_handle, wait,
            omp.omp_set_num_threads, omp.omp_get_max_threads)),
            self._helper_stream, LATE_NS)
        if status != 0:
            raise api.OnednnError(f"the helper thread did not start (error {status})")
        self.yield_after_ns = int(sys.getswitchinterval() * 1e9 / 2)

    def stats(self) -> dict[str, int]:
        """Since the process started: pieces by the helper and by the caller, calls the
        helper joined and missed, futex sleeps at steps, ns the caller waited at steps."""
        out = (ctypes.c_longlong * 6)()
        self._stats(out)
        return dict(zip(("by_helper", "by_caller", "joined", "missed", "sleeps",
                         "wait_ns"), out))


_NATIVE: dict = {}
_NATIVE_LOCK = threading.Lock()


def native(library: api.Library | None, path: Path | None = None
           ) -> tuple[_Native | None, str]:
    """The halves library bound to `library` (its helper started), or None and why not."""
    if library is None:
        return None, api.unavailable_reason()
    found = path if path is not None else find_extension(_LIBRARY_STEM)
    if found is None or not found.exists():
        return None, (f"{_LIBRARY_STEM} was not built (setup.py compiles it at install; "
                      "reinstall dynvm with a C compiler present)")
    with _NATIVE_LOCK:
        if found not in _NATIVE:
            omp = openmp_runtime()
            if omp is None:
                return None, "no OpenMP runtime loaded"
            try:
                _NATIVE[found] = _Native(found, library, omp)
            except (OSError, AttributeError, api.OnednnError) as exc:
                return None, f"{found.name}: {exc}"
        return _NATIVE[found], ""


def row_pieces(out_rows: int, pieces: int = 2) -> list[tuple[int, int]]:
    """[a, b) of each piece of `out_rows` output rows: the first ones one row longer
    where they do not divide."""
    base, extra = divmod(out_rows, pieces)
    bounds, start = [], 0
    for k in range(pieces):
        end = start + base + (k < extra)
        if end > start:
            bounds.append((start, end))
        start = end
    return bounds


def parts_of(batch: int, out_rows: int, pieces: int = 2) -> list[tuple[int, int, int]]:
    """(image, a, b) of each piece of a step: at batch 1 its output rows [a, b) in
    `pieces`, at a larger batch one image each, all its rows."""
    if batch == 1:
        return [(0, a, b) for a, b in row_pieces(out_rows, pieces)]
    return [(image, 0, out_rows) for image in range(batch)]


def input_rows(a: int, b: int, size: int, stride: int, pad: int, span: int
               ) -> tuple[int, int, int, int]:
    """(first row, end row, padding above, padding below) of the input that output rows
    [a, b) of a window `span` rows tall (dilation included) read."""
    top = a * stride - pad
    bottom = (b - 1) * stride - pad + span
    first, end = max(top, 0), min(bottom, size)
    return first, end, first - top, bottom - end


class _Piece:
    """One piece: a one-thread primitive, its execute arguments, and which pointer its
    source and destination memories take (a fixed address, or a per-call pointer plus
    an offset)."""

    def __init__(self, lib, handle, args: list[tuple[int, object]], owned) -> None:
        self._lib = lib
        self.handle = handle
        self.args = (api.ExecArg * len(args))(*[api.ExecArg(a, m) for a, m in args])
        self._owned = owned      # (destroy function, handle) pairs this piece made

    def __del__(self) -> None:
        destroy(getattr(self, "_lib", None), getattr(self, "_owned", ()))


class _Where:
    """Where a value of the arena lives: a fixed address, or the call's pointer `source`
    (0 the chain's input, 1 + k result k)."""

    def __init__(self, address: int | None, source: int | None) -> None:
        self.address, self.source = address, source


def _primitive(lib, pd) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    api.check(lib.dnnl_primitive_create(ctypes.byref(handle), pd), "primitive")
    return handle


def _impl(lib, pd) -> str:
    impl = ctypes.c_char_p()
    lib.dnnl_primitive_desc_query(pd, api.QUERY_IMPL_INFO_STR, 0, ctypes.byref(impl))
    return (impl.value or b"?").decode()


class HalvesArena:
    """An onednn_chain `_Arena` (NHWC, batch 1) whose every step runs as row pieces on
    one-thread primitives, shared with the helper (Note [A chain in halves, one wake a
    call]); the buffers are the arena's."""

    def __init__(self, library: api.Library, native_: _Native, arena, steps,
                 shape: tuple, pieces: int = 2) -> None:
        self._library, self._lib = library, library.dll
        self._native = native_
        self._arena = arena
        self._pieces: list[_Piece] = []
        self._binds: list[tuple[object, int, int]] = []   # (memory, source, offset)
        self.impls: set[str] = set()
        lib = self._lib
        getter = lib.dnnl_memory_get_data_handle
        getter.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        getter.restype = ctypes.c_int
        per_call = {m.value: -1 - where for where, m in arena._per_call}
        omp = native_.omp
        previous = omp.omp_get_max_threads()
        omp.omp_set_num_threads(1)      # built for one thread: run inline
        firsts = [0]
        try:
            execs = list(arena._execs)
            dtype = steps[0].runner.by_shape[tuple(shape)].dtype
            if arena._head is not None:
                head, *execs = execs
                self._head_pieces(head, getter, per_call, tuple(shape), dtype, pieces)
                firsts.append(len(self._pieces))
            shapes = {steps[0].x: tuple(shape)}
            if len(execs) != len(steps) or arena._own:
                raise api.OnednnError("an arena with reorders or own steps")
            for step, (_, args, _) in zip(steps, execs):
                where = {}
                for arg, memory in args:
                    if arg in (api.ARG_SRC, api.ARG_DST):
                        value = memory.value
                        if value in per_call:
                            where[arg] = _Where(None, per_call[value])
                        else:
                            data = ctypes.c_void_p()
                            api.check(getter(memory, ctypes.byref(data)), "data handle")
                            where[arg] = _Where(data.value, None)
                runner, in_shape = step.runner, shapes[step.x]
                if hasattr(runner, "weight_shape"):
                    like = runner.by_shape[in_shape]
                    self._conv_pieces(runner, like, where, pieces)
                elif hasattr(runner, "spec"):
                    like = runner.by_shape[in_shape]
                    self._pool_pieces(runner, like, where, pieces)
                else:
                    like = self._mean_piece(runner, in_shape, where)
                shapes[step.dst] = like.out_shape
                firsts.append(len(self._pieces))
        finally:
            omp.omp_set_num_threads(previous)
        n, steps_n = len(self._pieces), len(firsts) - 1
        self._first = (ctypes.c_int64 * len(firsts))(*firsts)
        self._prims = (ctypes.c_void_p * n)(*[p.handle.value for p in self._pieces])
        self._nargs = (ctypes.c_int64 * n)(*[len(p.args) for p in self._pieces])
        self._args = (ctypes.c_void_p * n)(*[ctypes.addressof(p.args) for p in self._pieces])
        b = len(self._binds)
        self._bind_memory = (ctypes.c_void_p * b)(*[m.value for m, _, _ in self._binds])
        self._bind_source = (ctypes.c_int64 * b)(*[s for _, s, _ in self._binds])
        self._bind_offset = (ctypes.c_int64 * b)(*[o for _, _, o in self._binds])
        self._counters = [(ctypes.c_int * steps_n)() for _ in range(3)]
        plan = self._plan = _Plan()
        plan.steps, plan.binds = steps_n, b
        for field, array in (("first_piece", self._first), ("primitive", self._prims),
                             ("nargs", self._nargs), ("args", self._args),
                             ("bind_memory", self._bind_memory),
                             ("bind_source", self._bind_source),
                             ("bind_offset", self._bind_offset),
                             ("claimed", self._counters[0]), ("done", self._counters[1]),
                             ("waiting", self._counters[2])):
            setattr(plan, field, ctypes.addressof(array))
        self._plan_pointer = ctypes.pointer(plan)
        self._pointers = (ctypes.c_void_p * (1 + len(arena._result_specs)))()
        self._walked = ctypes.c_int()
        self.by_helper = self.by_caller = 0     # pieces, over this arena's calls
        self.starved = False                    # its last call's helper ran under a quarter
        self.steps = steps_n
        self.pieces = n

    # -- building ---------------------------------------------------------------------

    def _memory(self, md, where: _Where, offset: int) -> ctypes.c_void_p:
        """A memory object of `md` over `where` + `offset` bytes (bound per call where
        the value is the call's)."""
        if where.address is not None:
            return new_memory(self._library, md, where.address + offset)
        made = new_memory(self._library, md, None)
        self._binds.append((made, where.source, offset))
        return made

    def _add(self, pd, args, owned) -> None:
        handle = _primitive(self._lib, pd)
        self.impls.add(_impl(self._lib, pd))
        owned = [("dnnl_primitive_destroy", handle), *owned]
        self._pieces.append(_Piece(self._lib, handle, args, owned))

    def _conv_pieces(self, runner, like, where: dict, pieces: int) -> None:
        lib, spec = self._lib, runner.spec
        n, c, h, w = like.in_shape
        _, oc, oh, ow = like.out_shape
        size = torch.empty((), dtype=spec.dtype).element_size()
        oc_w, kh = runner.weight_shape[0], runner.weight_shape[2]
        (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
        for image, a, b in parts_of(n, oh, pieces):
            first, end, top, below = input_rows(a, b, h, sh, ph, dh * (kh - 1) + 1)
            mds = [md_tag(lib, (1, c, end - first, w), api.TAG_NHWC, spec.dtype),
                   md_tag(lib, runner.weight_shape, api.TAG_ANY, spec.dtype),
                   md_tag(lib, [oc_w], api.TAG_A,
                          torch.float32 if like.bias is None else like.bias.dtype),
                   md_tag(lib, (1, oc, b - a, ow), api.TAG_NHWC, spec.dtype)]
            src, weights_any, bias_md, dst = mds
            post_ops, attr, pd = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            owned = []
            try:
                api.check(lib.dnnl_post_ops_create(ctypes.byref(post_ops)), "post-ops")
                if spec.residual:
                    api.check(lib.dnnl_post_ops_append_sum(post_ops, 1.0, 0,
                                                           DATA_TYPES[spec.dtype]), "sum")
                if spec.eltwise is not None:
                    api.check(lib.dnnl_post_ops_append_eltwise(post_ops, *spec.eltwise),
                              "eltwise")
                api.check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
                api.check(lib.dnnl_primitive_attr_set_post_ops(attr, post_ops), "post-ops")
                api.check(lib.dnnl_convolution_forward_primitive_desc_create(
                    ctypes.byref(pd), self._library.engine, api.FORWARD_INFERENCE,
                    api.CONVOLUTION_DIRECT, src, weights_any,
                    bias_md if like.bias is not None else None, dst, api.Dims(sh, sw),
                    api.Dims(dh - 1, dw - 1), api.Dims(top, pw), api.Dims(below, pw), attr),
                    "convolution piece")
                wanted = lib.dnnl_primitive_desc_query_md(pd, api.QUERY_WEIGHTS_MD, 0)
                weights = runner._weights.get(self._library, wanted, None)
                x = self._memory(src, where[api.ARG_SRC], (image * h + first) * w * c * size)
                y = self._memory(dst, where[api.ARG_DST], (image * oh + a) * ow * oc * size)
                owned += [("dnnl_memory_destroy", x), ("dnnl_memory_destroy", y)]
                args = [(api.ARG_SRC, x), (api.ARG_WEIGHTS, weights.memory),
                        (api.ARG_DST, y)]
                if like.bias is not None:
                    bias = new_memory(self._library, bias_md, like.bias.data_ptr())
                    owned.append(("dnnl_memory_destroy", bias))
                    args.append((api.ARG_BIAS, bias))
                self._add(pd, args, owned)
                self._pieces[-1].keep = (weights, like)
            finally:
                destroy(lib, (("dnnl_primitive_desc_destroy", pd),
                              ("dnnl_primitive_attr_destroy", attr),
                              ("dnnl_post_ops_destroy", post_ops),
                              *(("dnnl_memory_desc_destroy", md) for md in mds)))

    def _pool_pieces(self, runner, like, where: dict, pieces: int) -> None:
        lib, spec = self._lib, runner.spec
        n, c, h, w = like.in_shape
        _, _, oh, ow = like.out_shape
        size = torch.empty((), dtype=spec.dtype).element_size()
        (kh, kw), (sh, sw), (ph, pw) = spec.kernel, spec.stride, spec.padding
        dh, dw = spec.dilation
        for image, a, b in parts_of(n, oh, pieces):
            first, end, top, below = input_rows(a, b, h, sh, ph, dh * (kh - 1) + 1)
            src = md_tag(lib, (1, c, end - first, w), api.TAG_NHWC, spec.dtype)
            dst = md_tag(lib, (1, c, b - a, ow), api.TAG_NHWC, spec.dtype)
            pd = ctypes.c_void_p()
            try:
                api.check(lib.dnnl_pooling_forward_primitive_desc_create(
                    ctypes.byref(pd), self._library.engine, api.FORWARD_INFERENCE,
                    api.POOLING_MAX, src, dst, api.Dims(sh, sw), api.Dims(kh, kw),
                    api.Dims(dh - 1, dw - 1), api.Dims(top, pw),
                    api.Dims(below, spec.right_padding(w, 1)), None), "pooling piece")
                x = self._memory(src, where[api.ARG_SRC], (image * h + first) * w * c * size)
                y = self._memory(dst, where[api.ARG_DST], (image * oh + a) * ow * c * size)
                self._add(pd, [(api.ARG_SRC, x), (api.ARG_DST, y)],
                          [("dnnl_memory_destroy", x), ("dnnl_memory_destroy", y)])
            finally:
                destroy(lib, (("dnnl_primitive_desc_destroy", pd),
                              ("dnnl_memory_desc_destroy", src),
                              ("dnnl_memory_desc_destroy", dst)))

    def _mean_piece(self, runner, shape: tuple, where: dict):
        """The global mean: whole at batch 1, an image a piece at a larger batch."""
        n, c, h, w = shape
        primitive = runner.build(self._library, (1, c, h, w), api.TAG_NHWC)  # one thread
        lib = self._lib
        size = torch.empty((), dtype=primitive.dtype).element_size()
        src = md_tag(lib, primitive.in_shape, api.TAG_NHWC, primitive.dtype)
        dst = md_tag(lib, primitive.out_shape, api.TAG_NHWC, primitive.dtype)
        try:
            for image in range(n):
                x = self._memory(src, where[api.ARG_SRC], image * c * h * w * size)
                y = self._memory(dst, where[api.ARG_DST], image * c * size)
                piece = _Piece(lib, primitive.handle, [(api.ARG_SRC, x), (api.ARG_DST, y)],
                               [("dnnl_memory_destroy", x), ("dnnl_memory_destroy", y)])
                piece.keep = primitive
                self._pieces.append(piece)
        finally:
            destroy(lib, (("dnnl_memory_desc_destroy", src),
                          ("dnnl_memory_desc_destroy", dst)))
        self.impls.add(primitive.impl)
        out = runner.by_shape[tuple(shape)]      # the team's, for its result's shape
        return out

    def _head_pieces(self, head, getter, per_call, shape: tuple, out_dtype, pieces: int
                     ) -> None:
        """The input's conversion (NCHW fp32 -> NHWC of the chain's type): by rows at
        batch 1, an image a piece at a larger batch."""
        _, args, _ = head
        memories = dict(args)
        lib = self._lib
        n, c, h, w = shape
        data = ctypes.c_void_p()
        api.check(getter(memories[api.ARG_DST], ctypes.byref(data)), "data handle")
        target = _Where(data.value, None)
        source = _Where(None, per_call[memories[api.ARG_SRC].value])
        out_size = torch.empty((), dtype=out_dtype).element_size()
        for image, a, b in parts_of(n, h, pieces):
            src = md_strides(lib, (1, c, b - a, w), (c * h * w, h * w, w, 1), torch.float32)
            dst = md_tag(lib, (1, c, b - a, w), api.TAG_NHWC, out_dtype)
            pd = ctypes.c_void_p()
            try:
                api.check(lib.dnnl_reorder_primitive_desc_create(
                    ctypes.byref(pd), src, self._library.engine, dst, self._library.engine,
                    None), "reorder piece")
                x = self._memory(src, source, (image * c * h + a) * w * 4)
                y = self._memory(dst, target, (image * h + a) * w * c * out_size)
                self._add(pd, [(api.ARG_SRC, x), (api.ARG_DST, y)],
                          [("dnnl_memory_destroy", x), ("dnnl_memory_destroy", y)])
            finally:
                destroy(lib, (("dnnl_primitive_desc_destroy", pd),
                              ("dnnl_memory_desc_destroy", src),
                              ("dnnl_memory_desc_destroy", dst)))

    # -- calling ----------------------------------------------------------------------

    def run(self, x: torch.Tensor, helped: bool = True) -> list[torch.Tensor] | None:
        """The chain on `x` as the arena's `run` takes it: its results, or None where
        another thread's call owns the helper or this thread runs one OpenMP thread
        (run the arena then)."""
        arena = self._arena
        if arena._head is not None:
            if x.dtype != arena._head:
                raise api.OnednnError(f"a chain's source of {x.dtype}")
            if not x.is_contiguous():
                x = x.contiguous()
        elif not x.is_contiguous(memory_format=_CL):
            x = x.contiguous(memory_format=_CL)
        made = [torch.empty(shape, dtype=dtype, memory_format=form)
                for shape, dtype, form in arena._result_specs]
        with arena._lock:
            self._pointers[0] = x.data_ptr()
            for k, tensor in enumerate(made):
                self._pointers[1 + k] = tensor.data_ptr()
            status = self._native.run(self._plan_pointer, self._native.stream,
                                      ctypes.cast(self._pointers, ctypes.c_void_p),
                                      1 if helped else 0, self._native.yield_after_ns,
                                      ctypes.byref(self._walked))
        if status in (-2, -3):
            return None
        api.check(status, "chain in halves")
        by_helper, by_caller = self._walked.value >> 16, self._walked.value & 0xFFFF
        self.by_helper += by_helper
        self.by_caller += by_caller
        self.starved = helped and 3 * by_helper < by_caller
        return [made[k] for k in arena._result_of]


class HalvesChoice:
    """Halves or the team's chain for one arena, by its calls' measured time: alternate
    until each way has `_FIRST` timings, then the faster by median over the last
    `_WINDOW`, the other one call in `_EXPLORE`. Two halves calls in a row whose helper
    ran under a quarter of the pieces (starved: its core busy elsewhere) send the next
    `_EXPLORE` calls to the team whatever the timings say (Note [A chain in halves, one
    wake a call]; the lesson of Note [Column halves with a helper thread])."""

    def __init__(self) -> None:
        self._times = {True: deque(maxlen=_WINDOW), False: deque(maxlen=_WINDOW)}
        self._calls = 0
        self._team_until = 0
        self._in_a_row = 0
        self.halves = True
        self.runs = {True: 0, False: 0}
        self.starved = 0

    def next(self) -> bool:
        self._calls += 1
        if self._calls <= self._team_until:
            return False
        if len(self._times[True]) < _FIRST or len(self._times[False]) < _FIRST:
            return len(self._times[True]) <= len(self._times[False])
        return (not self.halves) if self._calls % _EXPLORE == 0 else self.halves

    def record(self, halves: bool, seconds: float, starved: bool = False) -> None:
        self.runs[halves] += 1
        self._times[halves].append(seconds)
        if halves:
            self._in_a_row = self._in_a_row + 1 if starved else 0
            self.starved += starved
            if self._in_a_row >= 2:
                self._team_until = self._calls + _EXPLORE
        if len(self._times[True]) >= _FIRST and len(self._times[False]) >= _FIRST:
            self.halves = (statistics.median(self._times[True])
                           <= statistics.median(self._times[False]))


class HalvesCall:
    """One batch-1 arena's call: its halves or the arena (the team) as `choice` says
    (`policy` "always" / "never" force one; a compile worker's run, calibration and
    probation's shadow calls, runs the team: the helper serves the serving calls)."""

    def __init__(self, arena, halves: HalvesArena) -> None:
        self.arena, self.halves = arena, halves
        self.choice = HalvesChoice()
        self.refused = 0      # calls the halves could not run (another call's helper)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if policy == "never" or background.on_worker():
            return self.arena.run(x)
        use = True if policy == "always" else self.choice.next()
        start = time.perf_counter()
        out = self.halves.run(x) if use else None
        if out is None:
            if use:
                self.refused += 1
                return self.arena.run(x)     # the helper is another call's: not timed
            out = self.arena.run(x)
        self.choice.record(use, time.perf_counter() - start, use and self.halves.starved)
        return out


def halves_of(library: api.Library, steps, arenas: dict, path: Path | None = None
              ) -> dict[tuple, HalvesCall]:
    """A HalvesCall for each batch-1 NHWC arena of a chain (`arenas`: shape -> _Arena)
    whose steps all split (Note [A chain in halves, one wake a call]); none with
    `policy` "never" or where the library is not built (`path`: where it is looked
    for, as `native` takes it)."""
    if policy == "never":
        return {}
    bound, _ = native(library, path)
    if bound is None:
        return {}
    made = {}
    for shape, arena in arenas.items():
        if shape[0] > MAX_BATCH or arena.blocked or arena._own:
            continue
        try:
            made[shape] = HalvesCall(arena, HalvesArena(library, bound, arena, steps, shape))
        except api.OnednnError:
            continue      # a step that does not split: the team's chain alone
    return made
