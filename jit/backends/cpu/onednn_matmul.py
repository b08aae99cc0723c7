"""oneDNN matmul primitives for linears, called through oneDNN's C API: a weight in
the layouts its primitives chose (torch's packed copy read in place where it fits), one
primitive per row count (or for any rows), and a linear of a kernel over them. Note
[oneDNN linear primitives built once] in onednn_linear says why and what is measured;
onednn_linear's pass builds them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading

import torch

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.huge_pages import aligned_buffer, to_huge_pages
from dynvm.jit.backends.cpu.onednn_objects import (
    DATA_TYPES,
    destroy,
    destroy_build,
    md_strides,
    md_tag,
    reorder_once,
)
from dynvm.jit.backends.cpu.onednn_objects import memory as new_memory

BINARY_ALGORITHMS = {"add": api.BINARY_ADD, "mul": api.BINARY_MUL}
"""oneDNN's binary post-op algorithm for a fused linear's binary attribute."""
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


class LinearWeights:
    """One linear weight ([N, K], as torch's linear reads it) in the layouts the
    primitives chose, one copy per layout, each with the memory object primitives read
    it through (its data handle never changes, so primitives share it): torch's packed
    copy itself where its layout is the one chosen (`offer`, checked element by
    element), else a copy reordered from the plain weight. A weight of a dtype in
    `ALIGNED_DTYPES` (bf16) is always reordered, into a buffer wholly on 2 MiB pages
    (Note [bf16 weights wholly on huge pages])."""

    ALIGNED_DTYPES = frozenset({torch.bfloat16})

    def __init__(self, library: api.Library, plain: torch.Tensor) -> None:
        self._library = library
        self.plain = plain                    # [N, K], any strides torch gives it
        self._copies: list = []               # (md, memory, buffer, made here)
        self._torch_packed = None             # Note [oneDNN linear primitives built once]
        self._lock = threading.Lock()

    def offer(self, packed: torch.Tensor) -> None:
        """torch's packed copy of this weight (an opaque mkldnn tensor), read in place
        where a primitive chooses its layout."""
        if self.plain.dtype in self.ALIGNED_DTYPES:
            return        # never read in place: not kept alive for nothing
        with self._lock:
            if self._torch_packed is None:
                self._torch_packed = packed

    def nbytes(self) -> int:
        """Bytes of the reordered copies made here (torch's packed copy, where read in
        place, is counted by the PrepackCache entry that holds it)."""
        return sum(t.numel() * t.element_size() for _, _, t, own in self._copies if own)

    def buffers(self) -> list[torch.Tensor]:
        """The tensors holding the copies (torch's packed copy where read in place)."""
        return [t for *_, t, _ in self._copies]

    def shared(self) -> int:
        """Layouts read in torch's packed copy (no copy of their own)."""
        return sum(1 for *_, own in self._copies if not own)

    def copies(self) -> int:
        return len(self._copies)

    def plain_md(self) -> ctypes.c_void_p:
        """A new descriptor of the plain weight as matmul's [K, N] (strides swapped)."""
        n, k = self.plain.shape
        sn, sk = self.plain.stride()
        return md_strides(self._library.dll, [k, n], [sk, sn], self.plain.dtype)

    def memory_for(self, wanted) -> ctypes.c_void_p:
        """The memory object of the copy in layout `wanted`, reordered once if none."""
        lib = self._library.dll
        with self._lock:
            for md, memory, *_ in self._copies:
                if lib.dnnl_memory_desc_equal(md, wanted):
                    return memory
            copy = (None if self.plain.dtype in self.ALIGNED_DTYPES
                    else self._torch_copy_in(wanted))
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
        memory = new_memory(library, wanted, torch.ops.mkldnn.data_ptr(packed))
        back = torch.empty(self.plain.shape, dtype=self.plain.dtype)
        back_md = md_strides(lib, list(back.shape[::-1]), [1, back.shape[1]], back.dtype)
        target = None
        try:
            target = new_memory(library, back_md, back.data_ptr())
            reorder_once(library, wanted, memory, back_md, target, "layout check")
        except api.OnednnError:
            back = None
        finally:
            destroy(lib, (("dnnl_memory_destroy", target),
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
        if self.plain.dtype in self.ALIGNED_DTYPES:
            tensor = aligned_buffer(size)    # Note [bf16 weights wholly on huge pages]
            address = tensor.data_ptr()
        else:
            # an opaque oneDNN tensor as torch's packed weights are (Note [A generator's
            # resident memory] counts those as packed weights)
            tensor = torch.empty(size // 4 + 1, dtype=torch.float32).to_mkldnn()
            address = torch.ops.mkldnn.data_ptr(tensor)
        memory = new_memory(library, wanted, address)
        md = ctypes.c_void_p()    # owned by the memory object
        api.check(lib.dnnl_memory_get_memory_desc(memory, ctypes.byref(md)), "md")
        plain_md = self.plain_md()
        source = None
        try:
            source = new_memory(library, plain_md, self.plain.data_ptr())
            reorder_once(library, plain_md, source, wanted, memory, "weight reorder")
        finally:
            destroy(lib, (("dnnl_memory_destroy", source),
                          ("dnnl_memory_desc_destroy", plain_md)))
        if not tensor.is_mkldnn:
            to_huge_pages(tensor)
        return md, memory, tensor, True

    def __del__(self) -> None:
        library = getattr(self, "_library", None)
        lib = library.dll if library is not None else None
        destroy(lib, [("dnnl_memory_destroy", memory)
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
        src = md_strides(lib, [rows, k], [k, 1], dtype)
        dst = md_strides(lib, [rows, n], [n, 1], spec.result_dtype)
        weights_md = weights.plain_md() if plain_weight else md_tag(lib, [k, n],
                                                                       api.TAG_ANY, dtype)
        bias_md = md_tag(lib, [1, n], api.TAG_AB, torch.float32)
        mds = [src, dst, weights_md, bias_md]
        # At any rows a binary post-op cannot name its operand's rows: the residual add
        # is a sum post-op over the result's memory, which the call fills with it first.
        self._sum = rows == ANY_ROWS and spec.binary is not None
        if self._sum and (spec.binary != "add" or spec.eltwise is not None):
            raise api.OnednnError(f"{spec.binary} after {spec.eltwise} at any rows")
        if spec.binary is not None and not self._sum:
            other_md = md_strides(lib, [rows, n], [n, 1], spec.result_dtype)
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
                                                       DATA_TYPES[spec.result_dtype]),
                          "sum")
            elif spec.binary is not None:
                binary_at = 1 if spec.eltwise is not None else 0
                api.check(lib.dnnl_post_ops_append_binary(post_ops, BINARY_ALGORITHMS[spec.binary],
                                                          other_md), "binary")
            api.check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
            api.check(lib.dnnl_primitive_attr_set_post_ops(attr, post_ops), "attr post-ops")
            api.check(lib.dnnl_matmul_primitive_desc_create(
                ctypes.byref(pd), engine, src, weights_md,
                bias_md if self.bias is not None else None, dst, attr), "matmul descriptor")
            # Note [oneDNN's reference implementation refused]
            self.impl = api.implementation(lib, pd, "matmul")
            if plain_weight:
                weight_memory = new_memory(library, weights_md, weights.plain.data_ptr())
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
                if rows == ANY_ROWS and data is None:
                    memories[arg] = ctypes.c_void_p()   # each call makes its rows' memory
                    continue
                memory = new_memory(library, md, data.data_ptr() if data is not None else None)
                self._memories.append(memory)
                memories[arg] = memory
        finally:
            destroy_build(lib, pd, attr, post_ops, mds)
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
                md = md_strides(lib, [m, width], [width, 1], tensor.dtype)
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
            destroy(lib, [("dnnl_memory_destroy", memory) for memory in made])
        return out

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        destroy(lib, [("dnnl_primitive_destroy", getattr(self, "_prim", None)),
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
        self.by_rows = {}
        for m in rows:
            try:
                self.by_rows[m] = LinearPrimitive(library, spec, m, weights, bias,
                                                  plain_weight=m == ANY_ROWS
                                                  and spec.dtype == torch.float32)
            except api.ReferenceOnly:
                # Note [oneDNN's reference implementation refused]: the rows that have
                # no primitive run `fallback`; the exact rows keep theirs
                if m != ANY_ROWS:
                    raise
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
        n = self.spec.out_features
        rows, other = dense_operands(self.spec, x, other)
        primitive = self.by_rows.get(rows.shape[0], self._any_rows)
        out = (self.fallback(rows, other) if primitive is None
               else primitive.run(rows, other))
        return out.view(*x.shape[:-1], n)


def dense_operands(spec: LinearSpec, x: torch.Tensor, other: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x` as [rows, in_features] and the binary post-op's `other` as [rows,
    out_features], each dense (copied only where it is not): oneDNN reads them as its
    primitives were built."""
    k, n = spec.in_features, spec.out_features
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) != k):
        rows = rows.contiguous()
    if other is not None:
        other = other.reshape(-1, n)
        if other.dtype != spec.result_dtype:
            raise api.OnednnError(f"a binary post-op's operand of {other.dtype}")
        if other.stride(-1) != 1 or (other.shape[0] > 1 and other.stride(0) != n):
            other = other.contiguous()
    return rows, other
