"""One oneDNN convolution primitive for one input shape, its spec, and its weight's
reordered copies shared across kernels (Note [oneDNN primitives built once] in
onednn_conv, which builds them per fused convolution). A module of its own so that what
measures primitives (chain_layout_choice) builds them without onednn_conv, which imports
the chains."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import threading
import weakref

import torch

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.onednn_objects import (
    DATA_TYPES,
    destroy,
    destroy_build,
    md_tag,
    reorder_once,
)
from dynvm.jit.backends.cpu.onednn_objects import memory as new_memory

_CL = torch.channels_last



@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """What a primitive computes besides its shapes: conv2d(x, weight, bias, stride,
    padding, dilation) (+ the tensor it writes into, with `residual`) then `eltwise`
    (oneDNN algorithm, alpha, beta) if any."""

    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    residual: bool
    eltwise: tuple[int, float, float] | None
    dtype: torch.dtype = torch.float32        # of the input, weight and result


def eltwise_of(attr: str, scalars: list, algorithm: str) -> tuple | None | str:
    """oneDNN's eltwise post-op for torch's fused-call activation (attr, scalars,
    algorithm): (algorithm kind, alpha, beta), None for no activation, or "" when there
    is no equal one."""
    kinds = api.ELTWISE
    if attr in ("none", None):
        return None
    if attr == "relu":
        return kinds["relu"], 0.0, 0.0
    if attr == "leaky_relu" and len(scalars) == 1:
        return kinds["relu"], float(scalars[0]), 0.0
    if attr == "gelu":
        return (kinds["gelu_tanh"] if algorithm == "tanh" else kinds["gelu_erf"]), 0.0, 0.0
    if attr == "swish":
        return kinds["swish"], 1.0, 0.0
    if attr == "sigmoid":
        return kinds["logistic"], 0.0, 0.0
    if attr == "tanh":
        return kinds["tanh"], 0.0, 0.0
    if attr == "hardtanh" and len(scalars) == 2:
        return kinds["clip"], float(scalars[0]), float(scalars[1])
    return ""


class _Weights:
    """A convolution's weight reordered into one primitive layout, with the memory
    object that primitives of that layout read it through (its data handle never
    changes, so primitives share it)."""

    def __init__(self, library: api.Library, wanted, weight: torch.Tensor) -> None:
        lib = self._lib = library.dll
        self.tensor = torch.empty(lib.dnnl_memory_desc_get_size(wanted) // 4 + 1,
                                  dtype=torch.float32)
        self.memory = new_memory(library, wanted, self.tensor.data_ptr())
        self.md = ctypes.c_void_p()   # owned by the memory object
        api.check(lib.dnnl_memory_get_memory_desc(self.memory, ctypes.byref(self.md)), "md")
        if isinstance(weight, _Weights):   # another layout's copy: one reorder from it
            reorder_once(library, weight.md, weight.memory, wanted, self.memory,
                         "weight reorder")
            return
        plain = weight.detach().contiguous()
        plain_md = md_tag(lib, plain.shape, api.TAG_OIHW, plain.dtype)
        source = None
        try:
            source = new_memory(library, plain_md, plain.data_ptr())
            reorder_once(library, plain_md, source, wanted, self.memory, "weight reorder")
        finally:
            destroy(lib, (("dnnl_memory_destroy", source),
                          ("dnnl_memory_desc_destroy", plain_md)))

    def __del__(self) -> None:
        destroy(getattr(self, "_lib", None), (("dnnl_memory_destroy",
                                                getattr(self, "memory", None)),))


class WeightLayouts(list):
    """The reordered copies (`_Weights`) of one weight, one per layout primitives chose,
    shared by every kernel whose convolution has that weight: the kernels of several
    batches and families (ResNet-50's four kernels over batch 1, 2, 4 and a [2, 4]
    family held 682 MiB beyond the program with a set per kernel, two copies more
    than torch's packed weights, which PrepackCache shares). Found by the weight's
    bytes (a digest, with its shape and type); alive while a kernel holds it."""

    _registry: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    _registry_lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, plain: torch.Tensor) -> WeightLayouts:
        data = plain.detach().contiguous()
        digest = hashlib.blake2b(data.view(torch.uint8).numpy(), digest_size=16).digest()
        key = (digest, tuple(data.shape), str(data.dtype))
        with cls._registry_lock:
            found = cls._registry.get(key)
            if found is None:
                found = cls._registry[key] = cls()
            return found

    def get(self, library: api.Library, wanted, weight: torch.Tensor | None) -> _Weights:
        """The copy in layout `wanted` (a descriptor), reordered from `weight` if none
        (None: from the first copy)."""
        with self._lock:
            for copy in self:
                if library.dll.dnnl_memory_desc_equal(copy.md, wanted):
                    return copy
            copy = _Weights(library, wanted, self[0] if weight is None else weight)
            self.append(copy)
            return copy

    def repacked(self, library: api.Library, shape: tuple, pack) -> torch.Tensor:
        """`pack(weight)` of the plain OIHW fp32 weight of `shape`, made once from the
        first copy (a reorder back: exact) and shared like the copies (Note [A 1x1
        convolution of our own at a few rows]: our kernel's panels)."""
        with self._lock:
            found = getattr(self, "_repacked", None)
            if found is None:
                plain = torch.empty(shape, dtype=torch.float32)
                lib = library.dll
                plain_md = md_tag(lib, shape, api.TAG_OIHW, torch.float32)
                target = None
                try:
                    target = new_memory(library, plain_md, plain.data_ptr())
                    reorder_once(library, self[0].md, self[0].memory, plain_md, target,
                                 "weight reorder back")
                finally:
                    destroy(lib, (("dnnl_memory_destroy", target),
                                  ("dnnl_memory_desc_destroy", plain_md)))
                found = self._repacked = pack(plain)
            return found


class ConvPrimitive:
    """One oneDNN convolution primitive for one input shape (NHWC), reading its weight
    in the layout it chose (shared with the convolution's other primitives of that
    layout, `weights`)."""

    def __init__(self, library: api.Library, weight: torch.Tensor | None, bias, shape,
                 spec: ConvSpec, weights: WeightLayouts, tag: int = api.TAG_NHWC,
                 weight_shape: tuple | None = None) -> None:
        lib = self._lib = library.dll
        self._calls = library.calls
        self._stream = library.stream
        self._memories: list = []
        n, _, h, w = shape
        weight_shape = tuple(weight.shape) if weight is not None else weight_shape
        oc, _, kh, kw = weight_shape
        (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
        oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        self.in_shape, self.out_shape = tuple(shape), (n, oc, oh, ow)
        engine = library.engine
        self.dtype = dtype = spec.dtype
        # the bias as the fused op had it (fp32, or the input's type where torch cast it)
        self.bias = None if bias is None else bias.detach().contiguous()
        mds = [md_tag(lib, shape, tag, dtype),
               md_tag(lib, weight_shape, api.TAG_ANY, dtype),
               md_tag(lib, [oc], api.TAG_A, torch.float32 if bias is None else self.bias.dtype),
               md_tag(lib, self.out_shape, tag, dtype)]
        src, weights_any, bias_md, dst = mds
        post_ops, attr, pd = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._prim = ctypes.c_void_p()
        try:
            api.check(lib.dnnl_post_ops_create(ctypes.byref(post_ops)), "post-ops")
            if spec.residual:
                api.check(lib.dnnl_post_ops_append_sum(post_ops, 1.0, 0, DATA_TYPES[dtype]),
                          "sum")
            if spec.eltwise is not None:
                api.check(lib.dnnl_post_ops_append_eltwise(post_ops, *spec.eltwise), "eltwise")
            api.check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
            api.check(lib.dnnl_primitive_attr_set_post_ops(attr, post_ops), "attr post-ops")
            api.check(lib.dnnl_convolution_forward_primitive_desc_create(
                ctypes.byref(pd), engine, api.FORWARD_INFERENCE, api.CONVOLUTION_DIRECT,
                src, weights_any, bias_md if self.bias is not None else None, dst,
                api.Dims(sh, sw), api.Dims(dh - 1, dw - 1), api.Dims(ph, pw),
                api.Dims(ph, pw), attr), "convolution descriptor")
            # Note [oneDNN's reference implementation refused]
            self.impl = api.implementation(lib, pd, "convolution")
            wanted = lib.dnnl_primitive_desc_query_md(pd, api.QUERY_WEIGHTS_MD, 0)
            self.weights = weights.get(library, wanted, weight)
            api.check(lib.dnnl_primitive_create(ctypes.byref(self._prim), pd), "primitive")
            memories = {api.ARG_WEIGHTS: self.weights.memory}
            for arg, md, data in ((api.ARG_SRC, src, None), (api.ARG_DST, dst, None),
                                  (api.ARG_BIAS, bias_md, self.bias)):
                if arg == api.ARG_BIAS and data is None:
                    continue
                memory = new_memory(library, md, data.data_ptr() if data is not None else None)
                self._memories.append(memory)
                memories[arg] = memory
        finally:
            destroy_build(lib, pd, attr, post_ops, mds)
        self._src, self._dst = memories[api.ARG_SRC], memories[api.ARG_DST]
        self._args = (api.ExecArg * len(memories))(
            *[api.ExecArg(arg, memory) for arg, memory in memories.items()])
        self._args_pointer = ctypes.cast(self._args, ctypes.c_void_p)
        self._nargs = len(memories)
        self._lock = threading.Lock()   # the data handles are this primitive's state

    @property
    def handle(self) -> ctypes.c_void_p:
        """The primitive (Note [A chain of primitives in one call] executes it)."""
        return self._prim

    @property
    def nargs(self) -> int:
        return self._nargs

    @property
    def args_pointer(self) -> ctypes.c_void_p:
        """The execute-argument array (dnnl_primitive_execute's `args`)."""
        return self._args_pointer

    def arguments(self) -> list[tuple[int, ctypes.c_void_p]]:
        """(DNNL_ARG_*, memory object) of each execute argument; the source's and
        destination's handles are set per call, the others fixed."""
        return [(a.arg, ctypes.c_void_p(a.memory)) for a in self._args]

    def run(self, x: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        """conv(x) (+ `into`, written there) with the post-ops; a new channels-last
        tensor when `into` is None."""
        if not x.is_contiguous(memory_format=_CL):
            x = x.contiguous(memory_format=_CL)
        if into is not None and not into.is_contiguous(memory_format=_CL):
            into.copy_(self.run(x, into.contiguous(memory_format=_CL)))
            return into
        out = (torch.empty(self.out_shape, dtype=self.dtype, memory_format=_CL)
               if into is None else into)
        calls = self._calls     # Note [oneDNN primitives built once]: the GIL held
        with self._lock:
            calls.dnnl_memory_set_data_handle(self._src, x.data_ptr())
            calls.dnnl_memory_set_data_handle(self._dst, out.data_ptr())
            status = calls.dnnl_primitive_execute(self._prim, self._stream, self._nargs,
                                                self._args_pointer)
        api.check(status, "convolution")
        return out

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        destroy(lib, [("dnnl_primitive_destroy", getattr(self, "_prim", None)),
                      *(("dnnl_memory_destroy", m) for m in getattr(self, "_memories", ()))])
