"""Channels-last max pooling as oneDNN primitives built once: a pass over a region whose
convolution chains already run on oneDNN primitives (onednn_conv calls it).

Note [oneDNN pooling built once]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's max pooling on a channels-last tensor (`max_pool2d_with_indices`, what the
bytecode's MAX_POOL2D runs, or `max_pool2d` without indices, no faster) is its own
vectorized loop, not oneDNN's: at ResNet-50's stem (64 x 112 x 112, 3x3 stride 2,
padding 1) 0.59-0.63 ms at batch 1 on two threads, where ONNX Runtime's pooling node
takes 0.18. oneDNN's pooling primitive (jit:avx512_core; jit:avx512_core_bf16 in a bf16
chain) on the same NHWC tensor, built once and called with two data handles as the
convolutions are (Note [oneDNN primitives built once]): 0.16-0.19 ms at batch 1,
0.33 against 0.99 at batch 2, 0.64 against 2.10 at batch 4; bf16 0.10-0.13 against
0.48-0.50 at batch 1 (2026-12-05 17:16, load 1.5-3.3, /tmp/h31r/proto.py).

What is rewritten: a MAX_POOL2D inside a channels-last chain (its input's and result's
probes NHWC, fp32 or bf16) whose indices nothing reads (the chain pass admits no other:
Note [Channels-last chains]). oneDNN's max pooling skips padded positions as torch's
does (-inf); its window geometry is torch's with the right padding chosen so that the
output has torch's size (`ceil_mode` included: a window that torch lets run past the
input's end is one whose right padding oneDNN skips; floor mode's dropped remainder is a
negative right padding). Dilation maps to oneDNN's (d - 1). Primitives are built when
the kernel is compiled, for the input shapes its probes name (every batch of a family's
range, as for the convolutions); any other shape runs torch's call.

Measured and not built (same run, and 17:44-17:55 unlocked at load ~3, relative only):
the global average pooling (ResNet's MEAN over 2048 x 7 x 7, already on one thread,
Note [Small ops on one thread]) as an average pooling primitive, fp32 0.012 ms against
0.010, bf16 0.03-0.07 against 0.04-0.13: within noise of what runs; the stem reading the
NCHW input itself (no conversion into the chain): oneDNN 3.2 offers only `ref:any` for
an NCHW source with an NHWC destination (3.2 s a call at batch 1), and with a blocked
destination (jit:avx512_core) the pooling after it has only `ref:any` from blocked to
NHWC; the conversion through a oneDNN reorder (jit:uni) runs as long as torch's
(0.109 against 0.114 ms at batch 1).

NaN: torch's max pooling returns NaN for a window holding one; oneDNN's vectorized max
keeps the other operand where it compares a NaN, so a window with a NaN may give a
number. The convolution before it propagates a NaN input to the whole of its output
either way (ResNet's pools read a convolution's result), so the model's output is NaN
in both; a NaN produced inside a window alone is where they differ.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.ir_match import probe_tensors
from dynvm.jit.backends.cpu.onednn_objects import DATA_TYPES, destroy, md_tag, memory
from dynvm.jit.ir import Literal, SpecializedRegion, Var
from dynvm.vm.opcodes import opcode

POOL_PRIMITIVE = "ONEDNN_POOL_PRIMITIVE"
_CL = torch.channels_last


def pool_arguments(given: list) -> list:
    """max_pool2d_with_indices' (kernel, stride, padding, dilation, ceil_mode) from the
    arguments after the input, the schema's defaults for those left out."""
    defaults = [[], [0], [1], False]       # stride, padding, dilation, ceil_mode
    return (list(given) + defaults[max(len(given) - 1, 0):])[:5]


def _pair(value, default) -> tuple[int, int]:
    """torch's int-or-list pooling argument as (height, width); `default` when empty."""
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return default
    if isinstance(value, int):
        return value, value
    value = [int(v) for v in value]
    return (value[0], value[0]) if len(value) == 1 else (value[0], value[1])


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """torch's max_pool2d arguments, normalized to (height, width) pairs."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    ceil_mode: bool
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, kernel, stride, padding, dilation, ceil_mode, dtype) -> PoolSpec:
        k = _pair(kernel, None)
        return cls(k, _pair(stride, k), _pair(padding, (0, 0)), _pair(dilation, (1, 1)),
                   bool(ceil_mode), dtype)

    def out_size(self, size: int, axis: int) -> int:
        """torch's pooled length along `axis` (0 height, 1 width) of an input `size`."""
        k, s, p, d = (self.kernel[axis], self.stride[axis], self.padding[axis],
                      self.dilation[axis])
        span = size + 2 * p - d * (k - 1) - 1
        out = (-(-span // s) if self.ceil_mode else span // s) + 1
        if self.ceil_mode and (out - 1) * s >= size + p:
            out -= 1   # the last window would start in the right padding
        return out

    def right_padding(self, size: int, axis: int) -> int:
        """oneDNN's right padding giving torch's output length (negative where floor
        mode drops a remainder)."""
        k, s, p, d = (self.kernel[axis], self.stride[axis], self.padding[axis],
                      self.dilation[axis])
        return (self.out_size(size, axis) - 1) * s + d * (k - 1) + 1 - size - p


class PoolPrimitive:
    """One oneDNN pooling primitive (max, or `algorithm`) for one NHWC input shape."""

    def __init__(self, library: api.Library, shape, spec: PoolSpec,
                 tag: int = api.TAG_NHWC, algorithm: int = api.POOLING_MAX) -> None:
        lib = self._lib = library.dll
        self._calls, self._stream = library.calls, library.stream
        n, c, h, w = shape
        self.in_shape = tuple(shape)
        self.out_shape = (n, c, spec.out_size(h, 0), spec.out_size(w, 1))
        self.dtype = spec.dtype
        src = md_tag(lib, shape, tag, spec.dtype)
        dst = md_tag(lib, self.out_shape, tag, spec.dtype)
        pd = ctypes.c_void_p()
        self._prim = ctypes.c_void_p()
        try:
            api.check(lib.dnnl_pooling_forward_primitive_desc_create(
                ctypes.byref(pd), library.engine, api.FORWARD_INFERENCE, algorithm,
                src, dst, api.Dims(*spec.stride), api.Dims(*spec.kernel),
                api.Dims(*(d - 1 for d in spec.dilation)), api.Dims(*spec.padding),
                api.Dims(spec.right_padding(h, 0), spec.right_padding(w, 1)), None),
                "pooling descriptor")
            impl = ctypes.c_char_p()
            lib.dnnl_primitive_desc_query(pd, api.QUERY_IMPL_INFO_STR, 0, ctypes.byref(impl))
            self.impl = (impl.value or b"?").decode()
            api.check(lib.dnnl_primitive_create(ctypes.byref(self._prim), pd), "primitive")
            self._src = memory(library, src, None)
            self._dst = memory(library, dst, None)
        finally:
            destroy(lib, (("dnnl_primitive_desc_destroy", pd),
                          ("dnnl_memory_desc_destroy", src), ("dnnl_memory_desc_destroy", dst)))
        self._args = (api.ExecArg * 2)(api.ExecArg(api.ARG_SRC, self._src),
                                       api.ExecArg(api.ARG_DST, self._dst))
        self._args_pointer = ctypes.cast(self._args, ctypes.c_void_p)
        self._lock = threading.Lock()   # the data handles are this primitive's state

    @property
    def handle(self) -> ctypes.c_void_p:
        """The primitive (Note [A chain of primitives in one call] executes it)."""
        return self._prim

    def arguments(self) -> list[tuple[int, ctypes.c_void_p]]:
        """(DNNL_ARG_*, memory object) of each execute argument (handles set per call)."""
        return [(a.arg, ctypes.c_void_p(a.memory)) for a in self._args]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """max_pool2d(x) as a new channels-last tensor."""
        if not x.is_contiguous(memory_format=_CL):
            x = x.contiguous(memory_format=_CL)
        out = torch.empty(self.out_shape, dtype=self.dtype, memory_format=_CL)
        calls = self._calls     # Note [oneDNN primitives built once]: the GIL held
        with self._lock:
            calls.dnnl_memory_set_data_handle(self._src, x.data_ptr())
            calls.dnnl_memory_set_data_handle(self._dst, out.data_ptr())
            status = calls.dnnl_primitive_execute(self._prim, self._stream, 2,
                                                  self._args_pointer)
        api.check(status, "pooling")
        return out

    def __del__(self) -> None:
        destroy(getattr(self, "_lib", None),
                [(function, getattr(self, name, None))
                 for function, name in (("dnnl_primitive_destroy", "_prim"),
                                        ("dnnl_memory_destroy", "_src"),
                                        ("dnnl_memory_destroy", "_dst"))])


class PrimitivePool:
    """One max pooling of a kernel: its primitives by input shape, built when the kernel
    is compiled; a shape not built runs torch's call (`fallback`)."""

    def __init__(self, library: api.Library, spec: PoolSpec, shapes: list[tuple],
                 fallback=None) -> None:
        self.spec = spec
        self.by_shape = {tuple(s): PoolPrimitive(library, s, spec) for s in shapes}
        self._fallback = fallback

    def impls(self) -> set[str]:
        return {p.impl for p in self.by_shape.values()}

    def build(self, library: api.Library, shape: tuple, tag: int) -> PoolPrimitive:
        """Another primitive of this pooling, in layout `tag` (Note [A chain of
        primitives in one call]: a chain's blocked layout)."""
        return PoolPrimitive(library, shape, self.spec, tag)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        primitive = self.by_shape.get(x.shape)
        if primitive is not None:
            return primitive.run(x)
        if self._fallback is None:
            # internal: a kernel's guard admits only the shapes its primitives cover
            raise api.OnednnError(f"no oneDNN pooling primitive for input shape "
                                  f"{tuple(x.shape)}")
        return self._fallback(x)


class _BuiltWhenAsked(dict):
    """Primitives by input shape, each built the first time its shape is asked for
    (a chain's arena asks for the shapes it is built for)."""

    def __init__(self, build) -> None:
        super().__init__()
        self._build = build

    def __missing__(self, shape):
        made = self[shape] = self._build(tuple(shape))
        return made

    def get(self, shape, default=None):
        return self[tuple(shape)]


class PrimitiveMean:
    """MEAN over the height and width, kept as 1 x 1 (ResNet's global average pooling
    on the last block's result), as a oneDNN average pooling over the whole plane: a
    chain's last step (Note [A chain's input conversion and global mean] in
    chain_ends). `__call__` is torch's mean (a shape its chain has no arena for)."""

    result_format = torch.contiguous_format
    """torch's mean gives [N, C, 1, 1] contiguous strides; the bytes are NHWC's."""

    def __init__(self, library: api.Library, dtype: torch.dtype) -> None:
        self._library, self.dtype = library, dtype
        self.by_shape = _BuiltWhenAsked(lambda shape: self.build(library, shape, api.TAG_NHWC))

    def build(self, library: api.Library, shape: tuple, tag: int) -> PoolPrimitive:
        """The primitive for input `shape` in layout `tag`."""
        plane = (shape[2], shape[3])
        spec = PoolSpec(plane, plane, (0, 0), (1, 1), False, self.dtype)
        primitive = PoolPrimitive(library, shape, spec, tag, api.POOLING_AVG_EXCLUDE_PADDING)
        primitive.result_format = self.result_format
        return primitive

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mean(x, [-1, -2], keepdim=True)


def pool_primitive(x, pool: PrimitivePool):
    """`ONEDNN_POOL_PRIMITIVE`: a channels-last max pooling, its values alone."""
    return pool(x)


POOL_KERNELS = {POOL_PRIMITIVE: pool_primitive}


def _torch_fallback(args):
    impl = opcode("MAX_POOL2D").impl
    rest = [a.value for a in args[1:]]

    def run(x):
        return impl(x, *rest)[0]
    return run


def _nhwc(values) -> bool:
    return bool(values) and all(
        isinstance(v, torch.Tensor) and v.dim() == 4 and v.dtype in DATA_TYPES
        and v.is_contiguous(memory_format=_CL) and v.shape[2] * v.shape[3] > 1
        for v in values)


def pool_primitives(spec: SpecializedRegion, library: api.Library, shapes_of,
                    fused_variant: str) -> tuple[SpecializedRegion, str]:
    """`spec` with its channels-last max poolings on oneDNN primitives (Note [oneDNN
    pooling built once]) and a note for the kernel's header ("" when it has none).
    `shapes_of(reg)`: the input shapes to build for and whether they are all the family
    serves (onednn_conv's, shared with the convolutions)."""
    ops = list(spec.ops)
    done, kept = 0, {}
    impls: set[str] = set()
    for position, op in enumerate(ops):
        if op.opcode != "MAX_POOL2D" or op.variant not in ("", "inplace") or not op.dsts:
            continue
        x = op.args[0]
        if not isinstance(x, Var) or not all(isinstance(a, Literal) for a in op.args[1:]):
            continue
        inputs = probe_tensors(spec.abstract, x.reg)
        results = [p.get(op.dsts[0]) for p in spec.abstract]
        if not (_nhwc(inputs) and _nhwc(results)):
            continue     # outside a channels-last chain: torch's call stays
        if _read(op.dsts[1:], ops, spec.outputs):
            continue     # its indices are read
        pool_spec = PoolSpec.of(*pool_arguments([a.value for a in op.args[1:]]),
                                inputs[0].dtype)
        shapes, covered = shapes_of(x.reg)
        try:
            pool = PrimitivePool(library, pool_spec, shapes,
                                 None if covered else _torch_fallback(op.args))
        except api.OnednnError as exc:
            kept[str(exc)] = kept.get(str(exc), 0) + 1
            continue
        impls |= pool.impls()
        done += 1
        # the indices were never read: no longer a result, nor freed
        ops[position] = dataclasses.replace(
            op, opcode=POOL_PRIMITIVE, variant=fused_variant, dsts=op.dsts[:1],
            args=(x, Literal(pool)), frees=tuple(r for r in op.frees if r not in op.dsts[1:]))
    if not done and not kept:
        return spec, ""
    note = f"; {done} max pooling(s) on oneDNN primitives"
    note += f" ({', '.join(sorted(impls))})" if impls else ""
    if kept:
        note += "; pooling on torch: " + ", ".join(f"{n} {why}" for why, n in kept.items())
    return (dataclasses.replace(spec, ops=tuple(ops)) if done else spec), note


def _read(regs, ops, outputs) -> bool:
    """Whether any of `regs` is an operand of an op or a region output."""
    regs = set(regs)
    values = [v for o in ops for v in flat_values(o.args)] + [v for _, v in outputs]
    return any(isinstance(v, Var) and v.reg in regs for v in values)
