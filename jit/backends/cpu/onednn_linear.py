"""Linears as oneDNN matmul primitives built once, called through oneDNN's C API: a
pass over a region after GEMM fusion (and after the bf16 lowering).

Note [oneDNN linear primitives built once]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What Note [oneDNN primitives built once] (onednn_conv) did for convolutions, for the
linears: `mkldnn._linear_pointwise` (Note [CPU fusion]) runs oneDNN's brgemm kernels
on a weight packed once, but rebuilds the memory descriptors, the attribute with its
post-ops and the primitive (a cache lookup) on every call, about 60 us a call at
BERT-base's sizes on two threads. Here each linear of an exact kernel (one row count at
every probe) is one oneDNN matmul primitive, built when the kernel is compiled: x [M, K]
times the weight (format `any`: the layout the primitive chose, reordered ONCE from the
program's constant and shared by every kernel of the engine through PrepackCache, key
`onednn-linear`), the bias, then the activation as an eltwise post-op and a residual add
or product as a binary post-op. A call binds three data handles and executes, holding
the GIL as torch's calls do (Note [oneDNN primitives built once] says why).

Which linears: those fusion put on torch's oneDNN call (unary or binary post-op; fp32,
or bf16 from the bf16 lowering, Note [Lower-precision GEMMs]: AMX brgemm on the bf16
weight), and those on dynvm's small-M kernel (Note [A small-M GEMM of our own]), whose
GELU, left apart there, is folded in as a post-op. The kernels' choice stays fusion's
(calibrated); a linear fusion left on torch's own GEMM stays there.

Memory: one copy of each weight, torch's. A primitive chooses its weight layout (format
`any`); where torch's packed copy (PrepackCache key `linear` / `linear-bf16`, Note
[Prepacked weights]) holds the weight in that layout, the primitive reads it in place
(`LinearWeights.offer`; checked at build: same size, and reordered back it equals the
plain weight element for element), and fp32 families still on torch's calls share it.
On this host's AVX-512/AMX CPU that is every BERT-base weight: matmul chooses one
layout for every M (16-1024 tried), the one torch's reorder gives fp32 with a row hint
of 16 or more and bf16 with a hint of 1 (what fusion and the bf16 lowering use; the
small-M linears pack theirs with 16); elsewhere a reordered copy of its own, and torch's
is not held. BERT-base width (2 layers, kernels at 1x16, 2x32, 4x64): 54.0 MiB of packed
fp32 weights, 27.0 MiB bf16, one copy of each weight (4 layers, a first version with
copies of its own held 216 MiB with the pass on against 108 off). Linears on the
small-M kernel read the program's constant as stored; on a primitive they read the
shared packed copy, one weight's worth more where no fused kernel had packed it.

A bf16 family whose rows vary gets one primitive per linear built for any rows
(oneDNN's runtime dim: each call makes its rows' src and dst memory, a few us), AMX
brgemm sharing the exact kernels' copy. At any rows a binary post-op cannot name its
operand, so the residual add is a sum post-op over the result, filled with the residual
first; a product, or an add after an activation, keeps fusion's call. An fp32 family
whose rows vary keeps fusion's calls (row-gated or not, Note [oneDNN at a new row
count]) on torch's packed copy, the one the primitives read: at any rows oneDNN 3.2
has only `gemm:jit:f32` for fp32 (brgemm needs its rows when built), and BERT-base's
16 GEMMs took 16.7 ms there against 10.7 on torch's calls at M=16 and 24.9 against
18.7 at M=64 (isolated chain, two threads passive, 17:42 UTC, load 2.8-3.2).

Measured (two threads, the bench's passive OpenMP, 2026-12-05): BERT-base's 16 GEMMs
back to back with their post-ops at M=16 took 9.61 ms on the primitives against 10.68
on torch's fused calls and 10.88 on the small-M kernel (M=32 12.79 / 14.08, M=64 17.30 /
18.72; bf16 M=16 3.58 / 5.78, M=64 5.58 / 7.69, M=256 11.46 / 11.95; an inner-product
primitive 9.90, no better than matmul; 17:42 UTC, load 2.8-3.2). In one process, whole
BERT-base calls with the pass on against off (interleaved, an A/A beside): fp32
0.946-0.991 over 1x16..4x32, bf16 0.874-0.921 (18:10-18:15, load 2.3-3.1). What remains
at batch 1 is OpenMP's wake: each primitive's execute is one parallel region, and with
passive waiting the second thread sleeps between them; the 16 GEMMs take 7.93 ms with
OMP_WAIT_POLICY=ACTIVE against 9.61 passive (~105 us a GEMM), 15.15 on one thread (the
weights stream; one core moves them slower). Q, K and V are one GEMM already; fewer
regions would take one region around a layer's GEMMs and small ops (as the decode pass's
C layer call does), which oneDNN's per-call regions do not give.

An exact kernel's call at rows not built (none: the guard proves the rows) would run
eager's linear on the plain weight, never a build. Where the library does not load the
pass changes nothing and the kernel's header says why; `CpuOptions.linear_primitives`
"off" skips it (the in-process A/B).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading

import torch

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.fusion import (
    FUSED_VARIANT,
    LINEAR_BINARY,
    LINEAR_UNARY,
    NATIVE_LINEAR,
    epilogue_pcs,
    is_fused,
    is_native,
)
from dynvm.jit.backends.cpu.huge_pages import to_huge_pages
from dynvm.jit.backends.cpu.ir_match import (
    probe_tensors,
    single_consumer,
    unary_post_op,
    untouched_between,
    use_counts,
)
from dynvm.jit.backends.cpu.onednn_conv import eltwise_of
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, Var
from dynvm.jit.specialize import add_frees

_DATA_TYPES = {torch.float32: api.F32, torch.bfloat16: api.BF16}
_BINARY = {"add": api.BINARY_ADD, "mul": api.BINARY_MUL}
ANY_ROWS = -(1 << 63)     # DNNL_RUNTIME_DIM_VAL: rows given with each call's memory


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """What a primitive computes besides its rows: x @ W^T + bias, then `eltwise`
    (oneDNN algorithm, alpha, beta) if any, then `binary` ("add" or "mul" with a tensor
    of the result's shape) if any; x, W and the result of `dtype`, the bias fp32, the
    result (and the binary operand) of `out_dtype` where given (a bf16 linear whose
    residual add is fp32)."""

    in_features: int
    out_features: int
    dtype: torch.dtype
    has_bias: bool
    eltwise: tuple[int, float, float] | None = None
    binary: str | None = None
    out_dtype: torch.dtype | None = None

    @property
    def result_dtype(self) -> torch.dtype:
        return self.out_dtype or self.dtype


def _md_strides(lib, dims, strides, dtype: torch.dtype) -> ctypes.c_void_p:
    md = ctypes.c_void_p()
    api.check(lib.dnnl_memory_desc_create_with_strides(
        ctypes.byref(md), len(dims), api.Dims(*dims), _DATA_TYPES[dtype],
        api.Dims(*strides)), "md")
    return md


def _md_tag(lib, dims, tag: int, dtype: torch.dtype) -> ctypes.c_void_p:
    md = ctypes.c_void_p()
    api.check(lib.dnnl_memory_desc_create_with_tag(ctypes.byref(md), len(dims),
                                                   api.Dims(*dims), _DATA_TYPES[dtype], tag),
              "md")
    return md


def _destroy(lib, handles) -> None:
    for destroy, handle in handles:
        if lib is not None and handle:
            getattr(lib, destroy)(handle)


class LinearWeights:
    """One linear weight ([N, K], as torch's linear reads it) in the layouts the
    primitives chose, one copy per layout, each with the memory object primitives read
    it through (its data handle never changes, so primitives share it): torch's packed
    copy itself where its layout is the one chosen (`offer`, checked element by
    element), else a copy reordered from the plain weight."""

    def __init__(self, library: api.Library, plain: torch.Tensor) -> None:
        self._library = library
        self.plain = plain                    # [N, K], any strides torch gives it
        self._copies: list = []               # (md, memory, buffer, made here)
        self._torch_packed = None             # Note [oneDNN linear primitives built once]
        self._lock = threading.Lock()

    def offer(self, packed: torch.Tensor) -> None:
        """torch's packed copy of this weight (an opaque mkldnn tensor), read in place
        where a primitive chooses its layout."""
        with self._lock:
            if self._torch_packed is None:
                self._torch_packed = packed

    def nbytes(self) -> int:
        """Bytes of the reordered copies made here (torch's packed copy, where read in
        place, is counted by the PrepackCache entry that holds it)."""
        return sum(t.numel() * t.element_size() for _, _, t, own in self._copies if own)

    def shared(self) -> int:
        """Layouts read in torch's packed copy (no copy of their own)."""
        return sum(1 for *_, own in self._copies if not own)

    def copies(self) -> int:
        return len(self._copies)

    def plain_md(self) -> ctypes.c_void_p:
        """A new descriptor of the plain weight as matmul's [K, N] (strides swapped)."""
        n, k = self.plain.shape
        sn, sk = self.plain.stride()
        return _md_strides(self._library.dll, [k, n], [sk, sn], self.plain.dtype)

    def memory_for(self, wanted) -> ctypes.c_void_p:
        """The memory object of the copy in layout `wanted`, reordered once if none."""
        lib = self._library.dll
        with self._lock:
            for md, memory, *_ in self._copies:
                if lib.dnnl_memory_desc_equal(md, wanted):
                    return memory
            copy = self._torch_copy_in(wanted)
            if copy is None:
                self._torch_packed = None   # not kept alive for nothing
                copy = self._reorder(wanted)
            self._copies.append(copy)
            return copy[1]

    def _torch_copy_in(self, wanted) -> tuple | None:
        """torch's packed copy as memory of layout `wanted`, if it holds the weight in
        that layout: same size, and reordered back it equals the plain weight."""
        packed, lib = self._torch_packed, self._library.dll
        if packed is None or packed.dtype != self.plain.dtype \
                or lib.dnnl_memory_desc_get_size(wanted) != \
                self.plain.numel() * self.plain.element_size():
            return None
        library = self._library
        memory = ctypes.c_void_p()
        api.check(lib.dnnl_memory_create(
            ctypes.byref(memory), wanted, library.engine,
            ctypes.c_void_p(torch.ops.mkldnn.data_ptr(packed))), "memory")
        back = torch.empty(self.plain.shape, dtype=self.plain.dtype)
        back_md = _md_strides(lib, list(back.shape[::-1]), [1, back.shape[1]], back.dtype)
        target, reorder_pd, reorder = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        try:
            api.check(lib.dnnl_memory_create(ctypes.byref(target), back_md, library.engine,
                                             ctypes.c_void_p(back.data_ptr())), "memory")
            api.check(lib.dnnl_reorder_primitive_desc_create(
                ctypes.byref(reorder_pd), wanted, library.engine, back_md, library.engine,
                None), "layout check descriptor")
            api.check(lib.dnnl_primitive_create(ctypes.byref(reorder), reorder_pd), "reorder")
            args = (api.ExecArg * 2)(api.ExecArg(api.ARG_SRC, memory),
                                     api.ExecArg(api.ARG_DST, target))
            api.check(lib.dnnl_primitive_execute(reorder, library.stream, 2,
                                                 ctypes.cast(args, ctypes.c_void_p)),
                      "layout check")
        except api.OnednnError:
            back = None
        finally:
            _destroy(lib, (("dnnl_primitive_destroy", reorder),
                           ("dnnl_primitive_desc_destroy", reorder_pd),
                           ("dnnl_memory_destroy", target),
                           ("dnnl_memory_desc_destroy", back_md)))
        if back is None or not torch.equal(back, self.plain):
            lib.dnnl_memory_destroy(memory)
            return None
        md = ctypes.c_void_p()    # owned by the memory object
        api.check(lib.dnnl_memory_get_memory_desc(memory, ctypes.byref(md)), "md")
        return md, memory, packed, False

    def _reorder(self, wanted) -> tuple:
        library, lib = self._library, self._library.dll
        size = lib.dnnl_memory_desc_get_size(wanted)
        # an opaque oneDNN tensor as torch's packed weights are (Note [A generator's
        # resident memory] counts those as packed weights)
        tensor = torch.empty(size // 4 + 1, dtype=torch.float32).to_mkldnn()
        memory = ctypes.c_void_p()
        api.check(lib.dnnl_memory_create(
            ctypes.byref(memory), wanted, library.engine,
            ctypes.c_void_p(torch.ops.mkldnn.data_ptr(tensor))), "memory")
        md = ctypes.c_void_p()    # owned by the memory object
        api.check(lib.dnnl_memory_get_memory_desc(memory, ctypes.byref(md)), "md")
        plain_md = self.plain_md()
        source, reorder_pd, reorder = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        try:
            api.check(lib.dnnl_memory_create(ctypes.byref(source), plain_md, library.engine,
                                             ctypes.c_void_p(self.plain.data_ptr())),
                      "memory")
            api.check(lib.dnnl_reorder_primitive_desc_create(
                ctypes.byref(reorder_pd), plain_md, library.engine, wanted, library.engine,
                None), "weight reorder descriptor")
            api.check(lib.dnnl_primitive_create(ctypes.byref(reorder), reorder_pd), "reorder")
            args = (api.ExecArg * 2)(api.ExecArg(api.ARG_SRC, source),
                                     api.ExecArg(api.ARG_DST, memory))
            api.check(lib.dnnl_primitive_execute(reorder, library.stream, 2,
                                                 ctypes.cast(args, ctypes.c_void_p)),
                      "weight reorder")
        finally:
            _destroy(lib, (("dnnl_primitive_destroy", reorder),
                           ("dnnl_primitive_desc_destroy", reorder_pd),
                           ("dnnl_memory_destroy", source),
                           ("dnnl_memory_desc_destroy", plain_md)))
        return md, memory, tensor, True

    def __del__(self) -> None:
        library = getattr(self, "_library", None)
        lib = library.dll if library is not None else None
        _destroy(lib, [("dnnl_memory_destroy", memory)
                       for _, memory, *_ in getattr(self, "_copies", ())])


class LinearPrimitive:
    """One oneDNN matmul primitive: `rows` rows (RUNTIME_DIM: any, given per call) of
    `spec`, its weight in the layout it chose (`weights`' shared copy), or with
    `plain_weight` the weight as `weights` holds it unreordered."""

    def __init__(self, library: api.Library, spec: LinearSpec, rows: int,
                 weights: LinearWeights, bias: torch.Tensor | None,
                 plain_weight: bool = False) -> None:
        lib = self._lib = library.dll
        self._calls = library.calls
        self._stream = library.stream
        self._memories: list = []
        self.rows, self.spec = rows, spec
        k, n, dtype = spec.in_features, spec.out_features, spec.dtype
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self._engine = engine = library.engine
        src = _md_strides(lib, [rows, k], [k, 1], dtype)
        dst = _md_strides(lib, [rows, n], [n, 1], spec.result_dtype)
        weights_md = weights.plain_md() if plain_weight else _md_tag(lib, [k, n],
                                                                       api.TAG_ANY, dtype)
        bias_md = _md_tag(lib, [1, n], api.TAG_AB, torch.float32)
        mds = [src, dst, weights_md, bias_md]
        # At any rows a binary post-op cannot name its operand's rows: the residual add
        # is a sum post-op over the result's memory, which the call fills with it first.
        self._sum = rows == ANY_ROWS and spec.binary is not None
        if self._sum and (spec.binary != "add" or spec.eltwise is not None):
            raise api.OnednnError(f"{spec.binary} after {spec.eltwise} at any rows")
        if spec.binary is not None and not self._sum:
            other_md = _md_strides(lib, [rows, n], [n, 1], spec.result_dtype)
            mds.append(other_md)
        post_ops, attr, pd = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._prim = ctypes.c_void_p()
        try:
            api.check(lib.dnnl_post_ops_create(ctypes.byref(post_ops)), "post-ops")
            if spec.eltwise is not None:
                api.check(lib.dnnl_post_ops_append_eltwise(post_ops, *spec.eltwise), "eltwise")
            binary_at = None
            if self._sum:
                api.check(lib.dnnl_post_ops_append_sum(post_ops, 1.0, 0,
                                                       _DATA_TYPES[spec.result_dtype]),
                          "sum")
            elif spec.binary is not None:
                binary_at = 1 if spec.eltwise is not None else 0
                api.check(lib.dnnl_post_ops_append_binary(post_ops, _BINARY[spec.binary],
                                                          other_md), "binary")
            api.check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
            api.check(lib.dnnl_primitive_attr_set_post_ops(attr, post_ops), "attr post-ops")
            api.check(lib.dnnl_matmul_primitive_desc_create(
                ctypes.byref(pd), engine, src, weights_md,
                bias_md if self.bias is not None else None, dst, attr), "matmul descriptor")
            impl = ctypes.c_char_p()
            lib.dnnl_primitive_desc_query(pd, api.QUERY_IMPL_INFO_STR, 0, ctypes.byref(impl))
            self.impl = (impl.value or b"?").decode()
            if plain_weight:
                weight_memory = ctypes.c_void_p()
                api.check(lib.dnnl_memory_create(
                    ctypes.byref(weight_memory), weights_md, engine,
                    ctypes.c_void_p(weights.plain.data_ptr())), "memory")
                self._memories.append(weight_memory)
            else:
                wanted = lib.dnnl_primitive_desc_query_md(pd, api.QUERY_WEIGHTS_MD, 0)
                weight_memory = weights.memory_for(wanted)
            self._weights = weights        # alive while this primitive is
            api.check(lib.dnnl_primitive_create(ctypes.byref(self._prim), pd), "primitive")
            memories = {api.ARG_WEIGHTS: weight_memory}
            operands = [(api.ARG_SRC, src, None), (api.ARG_DST, dst, None)]
            if self.bias is not None:
                operands.append((api.ARG_BIAS, bias_md, self.bias))
            if binary_at is not None:
                operands.append((api.arg_post_op(binary_at, api.ARG_SRC_1), other_md, None))
            for arg, md, data in operands:
                memory = ctypes.c_void_p()
                if rows == ANY_ROWS and data is None:
                    memories[arg] = memory    # none: each call makes its rows' memory
                    continue
                handle = ctypes.c_void_p(data.data_ptr()) if data is not None else None
                api.check(lib.dnnl_memory_create(ctypes.byref(memory), md, engine, handle),
                          "memory")
                self._memories.append(memory)
                memories[arg] = memory
        finally:
            _destroy(lib, (("dnnl_primitive_desc_destroy", pd),
                           ("dnnl_primitive_attr_destroy", attr),
                           ("dnnl_post_ops_destroy", post_ops),
                           *(("dnnl_memory_desc_destroy", md) for md in mds)))
        self._src, self._dst = memories[api.ARG_SRC], memories[api.ARG_DST]
        self._other = (memories[api.arg_post_op(binary_at, api.ARG_SRC_1)]
                       if binary_at is not None else None)
        self._args = (api.ExecArg * len(memories))(
            *[api.ExecArg(arg, memory) for arg, memory in memories.items()])
        self._args_pointer = ctypes.cast(self._args, ctypes.c_void_p)
        self._nargs = len(memories)
        self._lock = threading.Lock()   # the data handles are this primitive's state

    def run(self, rows: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
        """The [M, N] result of `rows` ([M, K], contiguous) (with `other`, [M, N]
        contiguous, for a binary post-op)."""
        out = torch.empty((rows.shape[0], self.spec.out_features),
                          dtype=self.spec.result_dtype)
        if self.rows == ANY_ROWS:
            return self._run_any_rows(rows, other, out)
        calls = self._calls     # Note [oneDNN primitives built once]: the GIL held
        with self._lock:
            calls.dnnl_memory_set_data_handle(self._src, rows.data_ptr())
            calls.dnnl_memory_set_data_handle(self._dst, out.data_ptr())
            if self._other is not None:
                calls.dnnl_memory_set_data_handle(self._other, other.data_ptr())
            status = calls.dnnl_primitive_execute(self._prim, self._stream, self._nargs,
                                                self._args_pointer)
        api.check(status, "matmul")
        return out

    def _run_any_rows(self, rows, other, out) -> torch.Tensor:
        """A primitive built for any rows reads memory objects of this call's rows (its
        own keep the runtime dim): made, executed, destroyed; the weight's and bias's stay."""
        lib, m = self._lib, rows.shape[0]
        k, n = self.spec.in_features, self.spec.out_features
        if self._sum:
            out.copy_(other)
        operands = [(api.ARG_SRC, k, rows), (api.ARG_DST, n, out)]
        args = list(self._args)
        made = []
        try:
            for arg, width, tensor in operands:
                md = _md_strides(lib, [m, width], [width, 1], tensor.dtype)
                memory = ctypes.c_void_p()
                status = lib.dnnl_memory_create(ctypes.byref(memory), md, self._engine,
                                                ctypes.c_void_p(tensor.data_ptr()))
                lib.dnnl_memory_desc_destroy(md)
                api.check(status, "memory")
                made.append(memory)
                args = [api.ExecArg(arg, memory) if a.arg == arg else a for a in args]
            packed = (api.ExecArg * len(args))(*args)
            api.check(self._calls.dnnl_primitive_execute(
                self._prim, self._stream, len(args), ctypes.cast(packed, ctypes.c_void_p)),
                "matmul")
        finally:
            _destroy(lib, [("dnnl_memory_destroy", memory) for memory in made])
        return out

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        _destroy(lib, [("dnnl_primitive_destroy", getattr(self, "_prim", None)),
                       *(("dnnl_memory_destroy", m) for m in getattr(self, "_memories", ()))])


_ACTIVATIONS = {
    "relu": lambda y, scalars, algorithm: torch.relu(y),
    "gelu": lambda y, scalars, algorithm: torch.nn.functional.gelu(
        y, approximate="tanh" if algorithm == "tanh" else "none"),
    "swish": lambda y, scalars, algorithm: torch.nn.functional.silu(y),
    "sigmoid": lambda y, scalars, algorithm: torch.sigmoid(y),
    "tanh": lambda y, scalars, algorithm: torch.tanh(y),
    "leaky_relu": lambda y, scalars, algorithm: torch.nn.functional.leaky_relu(y, scalars[0]),
    "hardtanh": lambda y, scalars, algorithm: torch.nn.functional.hardtanh(y, *scalars),
}


class PrimitiveLinear:
    """One linear of a kernel (with its activation and binary post-op): its primitives
    by row count, built when the kernel is compiled for the rows its probes name. Rows
    not built run eager PyTorch on the plain weight (`fallback`): no call waits for a
    build, and no packed copy beyond the primitives' is kept for it."""

    def __init__(self, library: api.Library, spec: LinearSpec, weights: LinearWeights,
                 bias: torch.Tensor | None, rows: list[int],
                 activation: tuple[str, list, str] | None) -> None:
        self.spec = spec
        self._weights = weights
        self._bias = bias
        self._activation = activation
        # fp32 at any rows reads the program's constant as stored (gemm:jit takes a
        # plain weight; no copy); bf16's AMX brgemm shares the reordered copy
        self.by_rows = {m: LinearPrimitive(library, spec, m, weights, bias,
                                           plain_weight=m == ANY_ROWS
                                           and spec.dtype == torch.float32)
                        for m in rows}
        self._any_rows = self.by_rows.pop(ANY_ROWS, None)

    def impls(self) -> set[str]:
        return {p.impl for p in (*self.by_rows.values(), self._any_rows) if p is not None}

    def fallback(self, rows: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
        """Eager PyTorch's linear (+ activation, + binary) on the plain weight."""
        weight = self._weights.plain
        bias = self._bias
        if weight.dtype != rows.dtype:
            weight = weight.to(rows.dtype)
        if bias is not None and bias.dtype != rows.dtype:
            bias = bias.to(rows.dtype)
        y = torch.nn.functional.linear(rows, weight, bias)
        if self._activation is not None:
            attr, scalars, algorithm = self._activation
            y = _ACTIVATIONS[attr](y, scalars, algorithm)
        if self.spec.binary == "add":
            y = y + other
        elif self.spec.binary == "mul":
            y = y * other
        return y

    def __call__(self, x: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
        k, n = self.spec.in_features, self.spec.out_features
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) != k):
            rows = rows.contiguous()       # oneDNN reads the rows as built: dense
        if other is not None:
            other = other.reshape(-1, n)
            if other.dtype != self.spec.result_dtype:
                raise api.OnednnError(f"a binary post-op's operand of {other.dtype}")
            if other.stride(-1) != 1 or (other.shape[0] > 1 and other.stride(0) != n):
                other = other.contiguous()
        primitive = self.by_rows.get(rows.shape[0], self._any_rows)
        out = (self.fallback(rows, other) if primitive is None
               else primitive.run(rows, other))
        return out.view(*x.shape[:-1], n)


def linear_primitive(x, other, linear: PrimitiveLinear):
    """`ONEDNN_LINEAR_PRIMITIVE`: linear(x) with its post-ops (`other`: the binary
    post-op's operand, or None)."""
    return linear(x, other)


LINEAR_PRIMITIVE = "ONEDNN_LINEAR_PRIMITIVE"
LINEAR_PRIMITIVE_KERNELS = {LINEAR_PRIMITIVE: linear_primitive}


@dataclasses.dataclass(frozen=True)
class _Linear:
    """What a fused or native linear op reads, in the primitive's terms."""

    x: Var
    other: object            # Var / ConstRef of the binary post-op's operand, or None
    weight_key: tuple        # the PrepackCache key of the weight's reordered copies
    plain: object            # () -> the [N, K] weight in the op's dtype (exact)
    bias: torch.Tensor | None
    activation: tuple[str, list, str] | None
    binary: str | None
    torch_packed: object = None    # fusion's packed copy of the weight, if any


def _plain_of(constants, index: int, transpose: bool, dtype: torch.dtype):
    def plain():
        weight = constants[index]
        weight = weight.t() if transpose else weight
        return weight if dtype == torch.float32 else weight.to(dtype)
    return plain


def _match(op, constants, prepacked: PrepackCache, rows: int) -> _Linear | str:
    """The linear `op` computes, or why it keeps its call."""
    value = (lambda a: constants[a.index] if isinstance(a, ConstRef)
             else a.value if isinstance(a, Literal) else None)
    if op.opcode == NATIVE_LINEAR and is_native(op):
        x, weight, bias, other, input_major = op.args
        if not isinstance(weight, ConstRef):
            return "weight not a constant"
        # torch's packed copy as fusion would make it (the hint of at least 16 rows
        # gives the blocking the primitives choose; a fused kernel shares it)
        packed = prepacked.linear_weight(weight.index, constants[weight.index],
                                         max(rows, 16), input_major.value)
        to_huge_pages(packed)   # Note [Packed weights on huge pages]: it streams
        return _Linear(x, None if other == Literal(None) else other,
                       (weight.index, "onednn-linear", input_major.value, torch.float32),
                       _plain_of(constants, weight.index, input_major.value, torch.float32),
                       value(bias), None, None if other == Literal(None) else "add",
                       packed)
    if not is_fused(op) or op.opcode not in (LINEAR_UNARY, LINEAR_BINARY):
        return ""
    if op.opcode == LINEAR_UNARY:
        x, packed, bias, attr, scalars, algorithm = op.args
        other, binary = None, None
        activation = None if attr.value == "none" else (
            attr.value, list(scalars.value or []), algorithm.value or "")
    else:
        x, other, packed, bias, attr = op.args
        binary, activation = attr.value, None
        if binary not in _BINARY:
            return f"binary post-op {binary!r}"
    key = prepacked.key_of(packed.value)
    if key is None or len(key) != 3 or key[1] not in ("linear", "linear-bf16"):
        return "weight not from this engine's packed constants"
    dtype = torch.bfloat16 if key[1] == "linear-bf16" else torch.float32
    return _Linear(x, other, (key[0], "onednn-linear", key[2], dtype),
                   _plain_of(constants, key[0], key[2], dtype), value(bias), activation,
                   binary, packed.value)


def _weights_of(library: api.Library, plain) -> LinearWeights:
    return LinearWeights(library, plain())


def linear_primitives(spec: SpecializedRegion, constants, prepacked: PrepackCache
                      ) -> tuple[SpecializedRegion, str]:
    """`spec` with its fused and native linears on oneDNN matmul primitives built once
    (Note [oneDNN linear primitives built once]), and a note saying how many or why none."""
    candidates = [i for i, op in enumerate(spec.ops)
                  if (op.opcode in (LINEAR_UNARY, LINEAR_BINARY) and is_fused(op))
                  or (op.opcode == NATIVE_LINEAR and is_native(op))]
    if not candidates:
        return spec, ""
    library = api.library()
    if library is None:
        return spec, f"; linears on torch's calls ({api.unavailable_reason()})"
    ops = list(spec.ops)
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    uses = use_counts(ops, leaving)
    kept: dict[str, int] = {}
    impls: set[str] = set()
    removed: set[int] = set()
    for position in candidates:
        op = ops[position]
        xs = probe_tensors(spec.abstract, op.args[0].reg) if isinstance(op.args[0], Var) \
            else None
        found = _match(op, constants, prepacked,
                       xs[0].numel() // max(1, xs[0].shape[-1]) if xs else 16)
        folded = None
        if not isinstance(found, str) and found.activation is None and found.other is None:
            folded = _activation_after(ops, position, uses, removed)
            if folded is not None:
                found = dataclasses.replace(found, activation=folded[1])
        residual = None
        if not isinstance(found, str) and found.weight_key[3] == torch.bfloat16 \
                and found.other is None:
            residual = _fp32_residual_after(ops, position, uses, removed, spec.abstract)
            if residual is not None:
                found = dataclasses.replace(found, other=residual[1], binary="add")
        reason = found if isinstance(found, str) else ""
        xs = probe_tensors(spec.abstract, found.x.reg) if not reason else None
        if not reason and xs is None:
            reason = "input not a tensor at every probe"
        rows = sorted({t.numel() // t.shape[-1] for t in xs}) if not reason else []
        if len(rows) > 1:     # a family whose rows vary: one primitive for any rows
            rows = [ANY_ROWS]
            if found.weight_key[3] == torch.float32:
                # fp32 has only gemm:jit at any rows, far slower than torch's brgemm
                reason = "fp32 rows vary in the family"
        if reason:
            kept[reason] = kept.get(reason, 0) + 1
            continue
        dtype = found.weight_key[3]
        try:
            weights = prepacked.get(found.weight_key, functools.partial(
                _weights_of, library, found.plain))
            if found.torch_packed is not None:
                weights.offer(found.torch_packed)
            eltwise = None
            if found.activation is not None:
                eltwise = eltwise_of(*found.activation)
                if eltwise == "":
                    raise api.OnednnError(f"activation {found.activation[0]!r}")
            n, k = weights.plain.shape
            linear_spec = LinearSpec(k, n, dtype, found.bias is not None, eltwise,
                                     found.binary,
                                     torch.float32 if residual is not None else None)
            linear = PrimitiveLinear(library, linear_spec, weights, found.bias, rows,
                                     found.activation)
        except api.OnednnError as exc:
            kept[str(exc)] = kept.get(str(exc), 0) + 1
            continue
        impls |= linear.impls()
        other = found.other if found.other is not None else Literal(None)
        pcs, dsts = epilogue_pcs(op), op.dsts
        for taken in (folded, residual):   # an activation the small-M kernel left
            if taken is not None:            # apart; a bf16 result's fp32 residual add
                removed.add(taken[0])
                pcs, dsts = (*pcs, ops[taken[0]].source_pc), ops[taken[0]].dsts
        variant = FUSED_VARIANT + "".join(f"+{pc}" for pc in pcs)
        ops[position] = dataclasses.replace(op, opcode=LINEAR_PRIMITIVE, dsts=dsts,
                                            args=(found.x, other, Literal(linear)),
                                            variant=variant)
    done = len(candidates) - sum(kept.values())
    note = (f"; {done} of {len(candidates)} linear(s) on oneDNN {library.version} "
            f"primitives built once ({', '.join(sorted(impls))})")
    if kept:
        note += "; kept: " + ", ".join(f"{n} {why}" for why, n in kept.items())
    if removed:
        note += f"; {len(removed)} activation(s) or fp32 residual add(s) folded in"
    if not done:
        return spec, note
    new_ops = add_frees([op for i, op in enumerate(ops) if i not in removed], leaving)
    return dataclasses.replace(spec, ops=tuple(new_ops)), note


def _fp32_residual_after(ops, position: int, uses, removed: set[int], probes):
    """(position, operand) of the ADD that alone reads bf16 op `position`'s result with
    an fp32 tensor of the sum's shape (computed in fp32 by type promotion, Note
    [Lower-precision GEMMs]): the primitive then writes fp32, adding it as a post-op."""
    consumer_at = single_consumer(ops, position, uses)
    if consumer_at is None or consumer_at in removed:
        return None
    consumer, mine = ops[consumer_at], Var(ops[position].dsts[0])
    if (consumer.opcode != "ADD" or consumer.variant not in ("", "inplace")
            or len(consumer.args) != 2 or len(consumer.dsts) != 1
            or not untouched_between(ops, position, consumer_at, consumer)):
        return None
    others = [a for a in consumer.args if a != mine]
    if len(others) != 1 or not isinstance(others[0], Var):
        return None
    other = others[0]
    if any(other.reg in op.dsts for op in ops[position:consumer_at]):
        return None      # made after the linear: not there when the primitive runs
    values, sums = probe_tensors(probes, other.reg), probe_tensors(probes, consumer.dsts[0])
    if values is None or sums is None or any(
            v.dtype != torch.float32 or v.shape != t.shape or t.dtype != torch.float32
            for v, t in zip(values, sums)):
        return None
    return consumer_at, other


def _activation_after(ops, position: int, uses, removed: set[int]):
    """(position, (attr, scalars, algorithm)) of the activation that alone reads op
    `position`'s result, where oneDNN computes it as a post-op; None otherwise (dynvm's
    small-M kernel leaves a GELU apart: Note [A small-M GEMM of our own])."""
    consumer_at = single_consumer(ops, position, uses)
    if consumer_at is None or consumer_at in removed:
        return None
    consumer = ops[consumer_at]
    if (len(consumer.dsts) != 1 or consumer.variant not in ("", "inplace")
            or not consumer.args or consumer.args[0] != Var(ops[position].dsts[0])
            or not untouched_between(ops, position, consumer_at, consumer)):
        return None
    post_op = unary_post_op(consumer)
    if post_op is None or eltwise_of(*post_op) in ("", None):
        return None
    return consumer_at, post_op
