"""A chain's arena as pieces on one-thread primitives (Note [A chain in halves, one wake
a call] in chain_halves): which rows or channels each piece computes, the primitives
built for them over the arena's own buffers, and the plan native/chain_halves.c walks.
"""

from __future__ import annotations

import ctypes

import torch

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu import winograd
from dynvm.jit.backends.cpu.onednn_objects import (
    DATA_TYPES,
    destroy,
    md_strides,
    md_tag,
)
from dynvm.jit.backends.cpu.onednn_objects import memory as new_memory

_CL = torch.channels_last
CHANNEL_SPLIT_MAX_ROWS = 7
"""fp32 steps at batch 1 whose output has at most this many rows split their output
channels, not their rows (each thread reads half the weight; Note [A chain in halves,
one wake a call])."""


class _Plan(ctypes.Structure):
    """struct plan of native/chain_halves.c."""

    _fields_ = [("steps", ctypes.c_int64), ("first_piece", ctypes.c_void_p),
                ("primitive", ctypes.c_void_p), ("nargs", ctypes.c_void_p),
                ("args", ctypes.c_void_p), ("binds", ctypes.c_int64),
                ("bind_memory", ctypes.c_void_p), ("bind_source", ctypes.c_void_p),
                ("bind_offset", ctypes.c_void_p), ("claimed", ctypes.c_void_p),
                ("done", ctypes.c_void_p), ("waiting", ctypes.c_void_p),
                ("place", ctypes.c_void_p), ("pointers", ctypes.c_void_p),
                ("executes", ctypes.c_void_p)]


class _Place(ctypes.Structure):
    """struct place of native/chain_halves.c: an output-channel piece's buffer and where
    its thread puts it."""

    _fields_ = [("buffer", ctypes.c_void_p), ("pixels", ctypes.c_int64),
                ("cols", ctypes.c_int64), ("width", ctypes.c_int64),
                ("first_col", ctypes.c_int64), ("sum", ctypes.c_int64),
                ("relu", ctypes.c_int64), ("source", ctypes.c_int64),
                ("offset", ctypes.c_int64), ("fixed", ctypes.c_void_p)]



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

    def __init__(self, library: api.Library, native_, arena, steps,
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
            if len(execs) != len(steps) or len(arena._own) > len(arena.winograd):
                raise api.OnednnError("an arena with reorders or own 1x1 steps")
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
                    if not self._winograd_pieces(arena, runner, like, where, pieces):
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
        self._places = (ctypes.c_void_p * n)(*[
            ctypes.addressof(p.place) if getattr(p, "place", None) is not None else None
            for p in self._pieces])
        self._executes = (ctypes.c_void_p * n)(*[
            p.execute.value if getattr(p, "execute", None) is not None else None
            for p in self._pieces])
        plan = self._plan = _Plan()
        plan.steps, plan.binds = steps_n, b
        for field, array in (("first_piece", self._first), ("primitive", self._prims),
                             ("nargs", self._nargs), ("args", self._args),
                             ("bind_memory", self._bind_memory),
                             ("bind_source", self._bind_source),
                             ("bind_offset", self._bind_offset),
                             ("claimed", self._counters[0]), ("done", self._counters[1]),
                             ("waiting", self._counters[2]), ("place", self._places),
                             ("executes", self._executes)):
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
        if _channel_split(spec, like):
            self._channel_pieces(runner, like, where)
            return
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

    def _winograd_pieces(self, arena, runner, like, where: dict, pieces: int) -> bool:
        """A stride-1 3x3 step on Winograd where its pieces' question says so (Note
        [Winograd F(2x2, 3x3) for the 3x3s]): its tiles in shares (two at batch 1, an
        image each past it) on one-thread matmuls, each over the whole input and result
        (a piece reads its tiles' rows and the rows around them, writes its tiles'
        rows). False where not (oneDNN's pieces then)."""
        n = like.in_shape[0]
        made = winograd.pieces(self._library, getattr(arena._native, "winograd", None),
                               runner, like, pieces if n == 1 else n, arena.scratch)
        if made is None:
            return False
        lib = self._lib
        mds = [md_tag(lib, like.in_shape, api.TAG_NHWC, torch.float32),
               md_tag(lib, like.out_shape, api.TAG_NHWC, torch.float32)]
        try:
            for step in made:
                x = self._memory(mds[0], where[api.ARG_SRC], 0)
                y = self._memory(mds[1], where[api.ARG_DST], 0)
                piece = _Piece(lib, step.handle, [(api.ARG_SRC, x), (api.ARG_DST, y)],
                               [("dnnl_memory_destroy", x), ("dnnl_memory_destroy", y)])
                piece.execute, piece.keep = step.execute, step
                self._pieces.append(piece)
        finally:
            destroy(lib, [("dnnl_memory_desc_destroy", md) for md in mds])
        self.impls.add("winograd:" + made[0].impl)
        return True

    def _channel_pieces(self, runner, like, where: dict) -> None:
        """Two pieces over halves of the output channels (Note [A chain in halves, one
        wake a call]): each a one-thread primitive over the whole input and its half of
        the weight (a copy of its own) into a dense buffer, which its thread places
        into its columns of the result (the residual's sum and ReLU done there)."""

        lib, spec = self._lib, runner.spec
        _, c, h, w = like.in_shape
        _, oc, oh, ow = like.out_shape
        plain = runner.plain_weight(self._library)
        half = oc // 2
        relu = spec.eltwise is not None
        eltwise = spec.eltwise if not spec.residual else None
        for first in (0, half):
            weight = plain[first:first + half].contiguous()
            layouts = type(runner._weights).of(weight)   # onednn_conv's WeightLayouts
            buffer = torch.empty((oh * ow, half), dtype=torch.float32)
            mds = [md_tag(lib, (1, c, h, w), api.TAG_NHWC, spec.dtype),
                   md_tag(lib, tuple(weight.shape), api.TAG_ANY, spec.dtype),
                   md_tag(lib, [half], api.TAG_A, torch.float32),
                   md_tag(lib, (1, half, oh, ow), api.TAG_NHWC, spec.dtype)]
            src, weights_any, bias_md, dst = mds
            post_ops, attr, pd = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            owned = []
            (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
            try:
                api.check(lib.dnnl_post_ops_create(ctypes.byref(post_ops)), "post-ops")
                if eltwise is not None:
                    api.check(lib.dnnl_post_ops_append_eltwise(post_ops, *eltwise), "eltwise")
                api.check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
                api.check(lib.dnnl_primitive_attr_set_post_ops(attr, post_ops), "post-ops")
                api.check(lib.dnnl_convolution_forward_primitive_desc_create(
                    ctypes.byref(pd), self._library.engine, api.FORWARD_INFERENCE,
                    api.CONVOLUTION_DIRECT, src, weights_any,
                    bias_md if like.bias is not None else None, dst, api.Dims(sh, sw),
                    api.Dims(dh - 1, dw - 1), api.Dims(ph, pw), api.Dims(ph, pw), attr),
                    "convolution channel piece")
                wanted = lib.dnnl_primitive_desc_query_md(pd, api.QUERY_WEIGHTS_MD, 0)
                weights = layouts.get(self._library, wanted, weight)
                x = self._memory(src, where[api.ARG_SRC], 0)
                y = new_memory(self._library, dst, buffer.data_ptr())
                owned += [("dnnl_memory_destroy", x), ("dnnl_memory_destroy", y)]
                args = [(api.ARG_SRC, x), (api.ARG_WEIGHTS, weights.memory),
                        (api.ARG_DST, y)]
                if like.bias is not None:
                    bias = new_memory(self._library, bias_md, like.bias.data_ptr() + 4 * first)
                    owned.append(("dnnl_memory_destroy", bias))
                    args.append((api.ARG_BIAS, bias))
                self._add(pd, args, owned)
            finally:
                destroy(lib, (("dnnl_primitive_desc_destroy", pd),
                              ("dnnl_primitive_attr_destroy", attr),
                              ("dnnl_post_ops_destroy", post_ops),
                              *(("dnnl_memory_desc_destroy", md) for md in mds)))
            out = where[api.ARG_DST]
            place = _Place(buffer.data_ptr(), oh * ow, half, oc, first, int(spec.residual),
                           int(spec.residual and relu),
                           -1 if out.address is not None else out.source, 0,
                           out.address)
            piece = self._pieces[-1]
            piece.place, piece.keep = place, (weights, layouts, buffer, like)

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
        x, made = arena.source_and_results(x)
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


def _channel_split(spec, like) -> bool:
    """Whether a convolution step splits its output channels (`CHANNEL_SPLIT_MAX_ROWS`):
    fp32 at batch 1 (the placing adds and clips in fp32), whole 32-channel halves, and
    no activation but ReLU (placed after the residual's sum)."""
    n, oc, oh, _ = like.out_shape
    relu = (api.ELTWISE["relu"], 0.0, 0.0)
    return (spec.dtype == torch.float32 and n == 1 and oh <= CHANNEL_SPLIT_MAX_ROWS
            and oc % 32 == 0 and (spec.eltwise is None or tuple(spec.eltwise) == relu)
            and (like.bias is None or like.bias.dtype == torch.float32))
