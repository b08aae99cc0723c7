"""Winograd F(2x2, 3x3) for a chain's NHWC fp32 stride-1 3x3 convolutions, as a step of
the team's chain and as pieces of the chain in halves (native/winograd.c; onednn_chain's
arenas and chain_pieces ask `own_step` / `pieces`).

Note [Winograd F(2x2, 3x3) for the 3x3s]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
oneDNN 3.x on x64 no longer offers Winograd, and neither ONNX Runtime's MLAS nor the
chains used it: ResNet-50's 13 stride-1 3x3 convolutions ran oneDNN's brgconv, 2.25x the
multiply-adds of F(2x2, 3x3). Ours: the input transform (4x4 tiles at stride 2, padding
1, 16 channels a vector) into V [16, tiles, Cin], the 16 products as ONE batched oneDNN
matmul [16, tiles, Cin] x [16, Cin, Cout] (`brg:avx512_core`) over U = G g G^T
transformed once per weight and packed in the layout the matmul asks, and the output
transform with the bias, the residual's sum and the ReLU in the store. Against torch's
fp32 conv2d over an fp64 reference its max abs error is 2-9e-6 at ResNet's widths, torch's
own fp32 error 1-5e-6.

Per step, the chain's way (the weight and the input cycled over copies so they come
from L3, Note [The own 1x1 question asked with cold weights]; medians of 30, interleaved,
A/A 0.98-1.01; 2-core AMD EPYC Zen 5, no AMX, 2026-12-06 23:26 UTC, load 0.9-1.2;
/tmp/h40r/proto.py), Winograd / oneDNN's NHWC 3x3:

| geometry | team b1 / b2 / b4 | one thread, half rows / one image |
|---|---|---|
| 56x56 64->64 | 0.748 / 0.795 / 0.861 | 0.715 / 0.729 |
| 28x28 128->128 | 0.573 / 0.590 / 0.662 | 0.572 / 0.554 |
| 14x14 256->256 | 0.601 / 0.580 / 0.572 | 0.663 / 0.577 |
| 7x7 512->512 | 0.883 / 0.921 / 0.826 | 1.121 / 0.887 |

At 56x56 the transforms are a third of the step (batch 1, one image, one thread: input
169, matmul 409, output 72 us; V and M are 3.2 MB each, four times the activation),
from 28x28 on the matmul is 80-97% of it. On this host two threads ran these steps no
faster than one (oneDNN's 944 / 921 us at 56x56), so the team's figures are one core's.
At 7x7 a half of the rows is 8 tiles, where the matmul's 8 rows lose (1.12): a piece
runs Winograd only from `MIN_PIECE_TILES` tiles up.

The team's step is chosen per geometry by the calibrator (Note [Calibration]), oneDNN's
primitive against ours with the weight, input and result cycled over copies; oneDNN kept
on a tie. The pieces (what the bar's steady calls run, Note [fp32 batch 4 in pieces and
the chooser's held verdict]) ask a question of their own: one image of the geometry at
one thread, whatever the team chose, reused by every batch (4 questions for ResNet-50,
not 12). The scratch (V and M) is one pair per arena, the size of its largest step or
pieces: the steps run one after another, and a piece writes only its tiles' part of it
(piece k's tiles are its own rows of V and M).

What it costs in memory: ResNet-50 warmed at batch 1, 2, 4 (with the family's batch-3
arenas) held 98 MiB of scratch (V and M at 56x56 are 6.4 MB an image) and 56 MiB of
packed U (one layout a weight; U itself is not kept) beyond the 346 MiB it held without
(RSS after malloc_trim, 2026-12-06 23:58 UTC; /tmp/h40r/mem.py). A scratch shared by a
chain's arenas, or tiles taken in L2-sized blocks (which would also keep V and M out of
L3 at 56x56), would take most of it back: not built.

The whole model (torchvision ResNet-50 fp32, 224 x 224; Runtimes with Winograd "never"
(A, A2) and "measure" / "always" (B) in one process, each seasoned and drained,
interleaved call by call with ONNX Runtime, 30 rounds; 2-core AMD EPYC Zen 5, no AMX;
/tmp/h40r/ab.py), B / A at batch 1 / 2 / 4:
- "measure" (23:33-23:36 UTC, load 1.4-1.9): 0.954 / 0.927 / 0.944 (paired medians
  0.940 / 0.912 / 0.939), A/A 0.999 / 0.997 / 0.987; ONNX Runtime / A 0.998 / 1.057 /
  0.971. The calibrator chose Winograd at 11 of the 13 stride-1 3x3 steps at batch 1
  and 2 (7x7 stayed oneDNN's, 1.10 and 1.02 in its question), at 5 of 13 at batch 4
  (56x56 and 28x28 read 1.11 and 0.98 there under the compile's load, where step by
  step they measured 0.86 and 0.66).
- "always" (23:36-23:40, load 1.6-2.0): 0.930 / 0.929 / 0.924 (paired 0.949 / 0.933 /
  0.933), A/A 0.970 / 1.003 / 0.988.
- "measure" with the pieces' question of their own (23:45-23:47, load 2.2-2.4): 0.906 /
  0.910 / 0.930 (paired 0.902 / 0.904 / 0.937), A/A 0.993 / 0.996 / 0.993; the pieces'
  question said Winograd at all four geometries (one image, one thread: 0.67 / 0.57 /
  0.62 / 0.92 of oneDNN's at 56 / 28 / 14 / 7), while the team's said oneDNN at 2 to 4
  of 12 geometries, run to run (its two-thread timings are the noisier).
The bar (bench.full_width --models resnet50 --jit-precisions bf16 --peers onnxruntime,
openvino,openvino-bf16 --resnet-calls 16), JIT / best fp32 peer at batch 1 / 2 / 4: the
pieces following the team (23:42 UTC, load 1.4-1.7) 0.886 / 0.920 / 0.918 (A/A margin
0.016); with their own question 0.931 / 0.892 / 1.007 (23:47, load 2.2-2.4, margin
0.010), 0.900 / 0.901 / 0.942 (23:50, load 1.7-1.8, margin 0.035), 0.898 / 0.886 /
0.913 (23:53, load 1.1-1.6, margin 0.016); at the last stop's end, before Winograd,
0.991 / 0.982 / 0.989 (margin 0.033). Fresh processes move the ratio by ~4% either way
(batch 4's 1.007 at load 2.4). The warm-up's calibration went from 1.4-3.0 s to 2.0-5.1
s (4.4-7.8 s of compile), the JIT's warm-up p90 at 0.94-1.07 of the interpreter's.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.chain_own_steps import ColdCopies, StepKernel
from dynvm.jit.backends.cpu.onednn_objects import destroy, destroy_build, md_tag, reorder_once
from dynvm.jit.backends.cpu.onednn_objects import memory as new_memory
from dynvm.jit.backends.cpu.own_1x1 import l2_bytes
from dynvm.jit.calibration import calibrator_for

QUESTION = "winograd 3x3 convolution"
MIN_PIECE_TILES = 16
"""The fewest tiles a one-thread piece runs Winograd on (7x7's half rows, 8 tiles, ran
1.12x oneDNN's; a 7x7 image, 16 tiles, 0.89x)."""
MAX_COPIES = 16
policy = "measure"
""""measure" (the calibrator chooses per geometry), "always" or "never"; tests force
it."""

_PACKING = threading.RLock()
"""Held while a weight's packed copies are looked up or made (compile threads)."""
_G = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]],
                  dtype=torch.float64)


class _Struct(ctypes.Structure):
    """native/winograd.c's `Winograd`."""

    _fields_ = [("images", ctypes.c_int), ("height", ctypes.c_int), ("width", ctypes.c_int),
                ("in_channels", ctypes.c_int), ("out_channels", ctypes.c_int),
                ("first_tile", ctypes.c_int), ("tiles", ctypes.c_int),
                ("v", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("sum", ctypes.c_int), ("relu", ctypes.c_int),
                ("matmul", ctypes.c_void_p), ("matmul_nargs", ctypes.c_int),
                ("matmul_args", ctypes.c_void_p), ("execute", ctypes.c_void_p),
                ("arg_src", ctypes.c_int), ("arg_dst", ctypes.c_int),
                ("get_handle", ctypes.c_void_p)]


class Kernel(StepKernel):
    """The chain library's Winograd functions (dynvm_winograd_execute), and oneDNN's
    execute, which the step calls for its matmul."""

    NAME = "winograd"

    def __init__(self, dll: ctypes.CDLL, library: api.Library) -> None:
        super().__init__(dll, library)
        self.onednn_execute = ctypes.cast(library.dll.dnnl_primitive_execute, ctypes.c_void_p)


def kernel(dll: ctypes.CDLL, library: api.Library) -> Kernel | None:
    """The Winograd functions of the chain library `dll`, or None (an older build, or a
    CPU without AVX-512F)."""
    return Kernel.bound(dll, library)


def fits(runner, shape: tuple) -> bool:
    """Whether `runner` (a PrimitiveConv) at input `shape` is a convolution the kernel
    computes: fp32, 3x3, stride 1, padding 1, no dilation, no groups, whole 16s of input
    and output channels, an fp32 bias or none, ReLU or no activation."""
    spec = getattr(runner, "spec", None)
    weight_shape = getattr(runner, "weight_shape", None)
    if spec is None or weight_shape is None or spec.dtype != torch.float32 or len(shape) != 4:
        return False
    out, cin, kh, kw = weight_shape
    primitive = runner.by_shape.get(tuple(shape))
    bias = getattr(primitive, "bias", None)
    relu = api.ELTWISE["relu"]
    return (kh, kw) == (3, 3) and spec.stride == (1, 1) and spec.padding == (1, 1) \
        and spec.dilation == (1, 1) and cin == shape[1] and cin % 16 == 0 \
        and out % 16 == 0 and (bias is None or bias.dtype == torch.float32) \
        and (spec.eltwise is None or tuple(spec.eltwise) == (relu, 0.0, 0.0))


def transform(plain: torch.Tensor) -> torch.Tensor:
    """U = G g G^T of the OIHW 3x3 weight [out, in, 3, 3] (in fp64, then fp32), as the
    matmul's plain weight [16, in, out]: product k = 4i + j is U[i, j]."""
    u = torch.einsum("ai,ocij,bj->aboc", _G, plain.double(), _G)
    out, cin = plain.shape[:2]
    return u.reshape(16, out, cin).transpose(1, 2).float().contiguous()


def tiles_of(shape: tuple) -> int:
    """Tiles of an NHWC value of `shape` (N, C, H, W): 2x2 outputs each."""
    n, _, h, w = shape
    return n * ((h + 1) // 2) * ((w + 1) // 2)


class _Packed:
    """U's copies in the matmuls' layouts, shared by every step and piece of its weight.
    U itself is not kept: each new layout derives it again from the weight's oneDNN
    copy (an exact reorder back), so a weight holds only the packed copies (ResNet-50's
    13 stride-1 3x3 weights: 58 MB a layout)."""

    def __init__(self, library: api.Library) -> None:
        self._library, self._lib = library, library.dll
        self.copies: list[tuple[torch.Tensor, ctypes.c_void_p]] = []

    def memory_for(self, wanted, runner) -> ctypes.c_void_p:
        """The copy in layout `wanted` (a descriptor), packed from `runner`'s weight
        if none."""
        lib = self._lib
        for _, memory in self.copies:
            md = ctypes.c_void_p()
            api.check(lib.dnnl_memory_get_memory_desc(memory, ctypes.byref(md)), "md")
            if lib.dnnl_memory_desc_equal(md, wanted):
                return memory
        u = transform(runner.plain_weight(self._library))
        tensor = torch.empty(lib.dnnl_memory_desc_get_size(wanted) // 4 + 1)
        memory = new_memory(self._library, wanted, tensor.data_ptr())
        plain_md = md_tag(lib, tuple(u.shape), api.TAG_ABC, torch.float32)
        source = None
        try:
            source = new_memory(self._library, plain_md, u.data_ptr())
            reorder_once(self._library, plain_md, source, wanted, memory, "Winograd weight")
        finally:
            destroy(lib, (("dnnl_memory_destroy", source),
                          ("dnnl_memory_desc_destroy", plain_md)))
        self.copies.append((tensor, memory))
        return memory

    def __del__(self) -> None:
        destroy(getattr(self, "_lib", None),
                [("dnnl_memory_destroy", m) for _, m in getattr(self, "copies", ())])


def packed(library: api.Library, runner) -> _Packed:
    """The packed copies of `runner`'s transformed weight, kept beside its oneDNN copies
    (onednn_conv_primitive's WeightLayouts, shared by the weight's kernels)."""
    layouts = runner._weights
    with _PACKING:
        found = getattr(layouts, "winograd", None)
        if found is None:
            found = layouts.winograd = _Packed(library)
        return found


class Scratch:
    """One arena's V and M, grown to its largest step; the steps and pieces over it
    re-pointed when it grows (at build time only)."""

    def __init__(self, library: api.Library) -> None:
        self._lib = library.dll
        self.v = self.m = torch.empty(0)
        self._users: list[Winograd] = []

    def use(self, step: Winograd) -> None:
        v_floats = 16 * (step.first_tile + step.tiles) * step.in_channels
        m_floats = 16 * (step.first_tile + step.tiles) * step.out_channels
        if v_floats > self.v.numel() or m_floats > self.m.numel():
            self.v = torch.empty(max(v_floats, self.v.numel()))
            self.m = torch.empty(max(m_floats, self.m.numel()))
            for user in self._users:
                user.point(self)
        self._users.append(step)
        step.point(self)


class Winograd:
    """One step (all tiles, the team's) or piece (tiles [first, first + tiles), one
    thread) of a convolution on our kernel: the batched matmul over the scratch, the
    bias, and the struct the C step reads (`handle`)."""

    def __init__(self, library: api.Library, kernel_: Kernel, runner, primitive,
                 first_tile: int = 0, tiles: int | None = None) -> None:
        lib = self._lib = library.dll
        n, cin, h, w = primitive.in_shape
        cout = runner.weight_shape[0]
        self.in_channels, self.out_channels = cin, cout
        self.first_tile = first_tile
        self.tiles = tiles_of(primitive.in_shape) - first_tile if tiles is None else tiles
        bias = primitive.bias
        self.bias = (torch.zeros(cout) if bias is None else bias.float()).contiguous()
        self.weights = packed(library, runner)
        mds = [md_tag(lib, [16, self.tiles, cin], api.TAG_ABC, torch.float32),
               md_tag(lib, [16, cin, cout], api.TAG_ANY, torch.float32),
               md_tag(lib, [16, self.tiles, cout], api.TAG_ABC, torch.float32)]
        src, weights_any, dst = mds
        pd, self.matmul = ctypes.c_void_p(), ctypes.c_void_p()
        self._memories: list = []
        try:
            api.check(lib.dnnl_matmul_primitive_desc_create(
                ctypes.byref(pd), library.engine, src, weights_any, None, dst, None),
                "Winograd matmul descriptor")
            self.impl = api.implementation(lib, pd, "matmul")   # no reference one
            wanted = lib.dnnl_primitive_desc_query_md(pd, api.QUERY_WEIGHTS_MD, 0)
            with _PACKING:
                weight_memory = self.weights.memory_for(wanted, runner)
            api.check(lib.dnnl_primitive_create(ctypes.byref(self.matmul), pd), "matmul")
            self._v = new_memory(library, src, None)
            self._m = new_memory(library, dst, None)
            self._memories += [self._v, self._m]
        finally:
            destroy_build(lib, pd, None, None, mds)
        self._args = (api.ExecArg * 3)(api.ExecArg(api.ARG_SRC, self._v),
                                       api.ExecArg(api.ARG_WEIGHTS, weight_memory),
                                       api.ExecArg(api.ARG_DST, self._m))
        spec = runner.spec
        self.struct = _Struct(n, h, w, cin, cout, self.first_tile, self.tiles, None, None,
                              self.bias.data_ptr(), int(spec.residual),
                              int(spec.eltwise is not None), self.matmul.value, 3,
                              ctypes.addressof(self._args), kernel_.onednn_execute.value,
                              api.ARG_SRC, api.ARG_DST, kernel_.get_handle.value)
        self.handle = ctypes.c_void_p(ctypes.addressof(self.struct))
        self.execute = kernel_.execute

    def point(self, scratch: Scratch) -> None:
        """Its V and M: its tiles' rows of the scratch."""
        v = scratch.v.data_ptr() + 4 * 16 * self.first_tile * self.in_channels
        m = scratch.m.data_ptr() + 4 * 16 * self.first_tile * self.out_channels
        self.struct.v, self.struct.m = v, m
        api.check(self._lib.dnnl_memory_set_data_handle(self._v, ctypes.c_void_p(v)), "V")
        api.check(self._lib.dnnl_memory_set_data_handle(self._m, ctypes.c_void_p(m)), "M")

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        destroy(lib, [("dnnl_primitive_destroy", getattr(self, "matmul", None)),
                      *(("dnnl_memory_destroy", m) for m in getattr(self, "_memories", ()))])


def own_step(library: api.Library, kernel_: Kernel | None, runner, primitive, shape: tuple,
             scratch: Scratch) -> Winograd | None:
    """Our kernel for this NHWC step where it fits and measured faster than oneDNN's
    `primitive` on its geometry (Note [Winograd F(2x2, 3x3) for the 3x3s]), over the
    arena's `scratch`; else None."""
    if kernel_ is None or policy == "never" or not fits(runner, shape):
        return None
    try:
        step = Winograd(library, kernel_, runner, primitive)
    except api.OnednnError:
        return None       # no optimized matmul for it: oneDNN's convolution
    if policy != "always":
        spec = runner.spec
        key = (tuple(primitive.in_shape), step.out_channels, spec.residual,
               spec.eltwise is not None, torch.get_num_threads())
        choice = calibrator_for("cpu").choose(
            QUESTION, key, lambda: _candidates(library, kernel_, primitive, step))
        if choice.name != "winograd":
            return None
    scratch.use(step)
    return step


def pieces(library: api.Library, kernel_: Kernel | None, runner, primitive, parts: int,
           scratch: Scratch) -> list[Winograd] | None:
    """One-thread pieces of a step on our kernel (built while the thread's OpenMP count
    is 1): `parts` shares of its tiles (at batch 1 two, past it an image each), over the
    arena's `scratch`; None where it does not fit, a share has fewer than
    MIN_PIECE_TILES tiles, or one image at one thread measured no faster on ours than
    on oneDNN's (asked once per image geometry, whatever the team chose: Note [Winograd
    F(2x2, 3x3) for the 3x3s])."""
    shape = tuple(primitive.in_shape)
    if kernel_ is None or policy == "never" or not fits(runner, shape):
        return None
    total = tiles_of(shape)
    bounds = [(total * k // parts, total * (k + 1) // parts) for k in range(parts)]
    if any(b - a < MIN_PIECE_TILES for a, b in bounds):
        return None
    try:
        if policy != "always" and not _one_image_on_one_thread(library, kernel_, runner,
                                                               shape):
            return None
        made = [Winograd(library, kernel_, runner, primitive, a, b - a) for a, b in bounds]
    except api.OnednnError:
        return None
    for piece in made:
        scratch.use(piece)
    return made


def _one_image_on_one_thread(library: api.Library, kernel_: Kernel, runner,
                             shape: tuple) -> bool:
    """The calibrator's verdict on one image of this geometry at one thread (the
    calling thread's count, 1 while pieces are built): the pieces' question."""
    _, c, h, w = shape
    spec = runner.spec
    key = ((1, c, h, w), runner.weight_shape[0], spec.residual, spec.eltwise is not None,
           "one thread")

    def candidates():
        one = runner.build(library, (1, c, h, w), api.TAG_NHWC)
        step = Winograd(library, kernel_, runner, one)
        found = _candidates(library, kernel_, one, step)
        found["winograd"].keep += (one, step)
        return found
    return calibrator_for("cpu").choose(QUESTION, key, candidates).name == "winograd"


def _candidates(library: api.Library, kernel_: Kernel, primitive, step: Winograd) -> dict:
    """oneDNN's primitive and ours on random operands, each run going once through
    `copies` sets of weight, input and result in turn so that they come from L3 as in
    the model's chain (Note [The own 1x1 question asked with cold weights])."""
    scratch = Scratch(library)
    scratch.use(step)
    n_copies = _copies(primitive, step)
    xs = [torch.randn(primitive.in_shape).contiguous(memory_format=torch.channels_last)
          for _ in range(n_copies)]
    ys = [torch.randn(primitive.out_shape).contiguous(memory_format=torch.channels_last)
          for _ in range(n_copies)]
    cold = _ColdCopies(library, primitive, step, n_copies)
    calls = library.calls
    memories = dict(primitive.arguments())
    src, dst = memories[api.ARG_SRC], memories[api.ARG_DST]

    def onednn():
        for k, arguments in enumerate(cold.onednn_args):
            calls.dnnl_memory_set_data_handle(src, xs[k].data_ptr())
            calls.dnnl_memory_set_data_handle(dst, ys[k].data_ptr())
            api.check(calls.dnnl_primitive_execute(primitive.handle, library.stream,
                                                   primitive.nargs, arguments), "convolution")

    def ours():
        for k, handle in enumerate(cold.own_handles):
            calls.dnnl_memory_set_data_handle(src, xs[k].data_ptr())
            calls.dnnl_memory_set_data_handle(dst, ys[k].data_ptr())
            api.check(kernel_.call(handle, library.stream, 2, cold.own_args), "Winograd")
    ours.keep = onednn.keep = (cold, xs, ys, scratch)   # alive while the candidates are
    return {"onednn": onednn, "winograd": ours}


def _copies(primitive, step: Winograd) -> int:
    """Sets of operands a calibration run cycles through: together twice the L2 of the
    cores it runs on."""
    n, c, h, w = primitive.in_shape
    per_set = 4 * (n * h * w * (c + step.out_channels) + 25 * c * step.out_channels)
    cores = max(1, torch.get_num_threads())
    return max(2, min(MAX_COPIES, -(-2 * l2_bytes() * cores // per_set)))


class _ColdCopies(ColdCopies):
    """`n` copies of a convolution's weight for each side: oneDNN's (ColdCopies) and
    ours (a packed U copy, a struct over each)."""

    def __init__(self, library: api.Library, primitive, step: Winograd, n: int) -> None:
        super().__init__(library, primitive, n)
        weight_memory = step._args[1].memory
        md = ctypes.c_void_p()
        api.check(self._lib.dnnl_memory_get_memory_desc(weight_memory, ctypes.byref(md)), "md")
        data = ctypes.c_void_p()
        getter = self._lib.dnnl_memory_get_data_handle
        getter.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        getter.restype = ctypes.c_int
        api.check(getter(weight_memory, ctypes.byref(data)), "data handle")
        size = self._lib.dnnl_memory_desc_get_size(md)
        packed_now = torch.empty(size // 4 + 1)
        ctypes.memmove(packed_now.data_ptr(), data.value, size)
        self._structs, self._own_tensors = [], []
        for _ in range(n):
            tensor = packed_now.clone()
            memory = new_memory(library, md, tensor.data_ptr())
            self._memories.append(memory)
            array = (api.ExecArg * 3)(step._args[0], api.ExecArg(api.ARG_WEIGHTS, memory),
                                      step._args[2])
            self._arrays.append(array)
            struct = _Struct.from_buffer_copy(step.struct)
            struct.matmul_args = ctypes.addressof(array)
            self._structs.append(struct)
            self._own_tensors.append(tensor)
        self.own_handles = [ctypes.c_void_p(ctypes.addressof(s)) for s in self._structs]
