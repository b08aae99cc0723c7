"""dynvm's own fp32 1x1 convolution as a step of a chain of primitives, where it measures
faster than oneDNN's (native/own_1x1.c; onednn_chain's arenas ask `own_step`).

Note [A 1x1 convolution of our own at a few rows]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At batch 1 ResNet-50's JIT was 32.1 ms against ONNX Runtime's 28.3, and +1.29 of the
+1.35 ms were stage 3 and 4's 1x1 convolutions (49 and 196 rows of output pixels),
1.07-1.32x ONNX Runtime's per geometry; oneDNN 3.2 offers three kernels there
(brgconv_1x1 on NHWC, jit_1x1 on nChw16c, brg matmul), none faster in a whole chain
(docs/bench_log.md, 2026-12-06 01:31). Timed alone per geometry, oneDNN's primitive
against ONNX Runtime's Conv node (one ONNX model of K such convolutions with distinct
weights, run in turn so that the weights come from L3 as in the model; spinning off;
interleaved; 2026-12-06 04:16, load 1-6): at ONE thread oneDNN is already 1.20 / 1.24 /
1.20 / 1.06 / 1.06 / 1.03x ONNX Runtime at 2048->512 @7, 512->2048 @7, 256->1024 @14,
1024->256 @14, 1024->512 @14, 1024->2048 s2 @14, and at two threads about the same
ratio: the loss is the kernel, not how two threads split the rows or wake.

So a kernel of our own, fp32, for NHWC 1x1 stride-1 convolutions whose output channels
are whole panels of 64: the (rows, in) x (in, out) product in a 7 x 64 register tile
(28 zmm accumulators; 49 and 196 rows are 7 and 28 tiles), the weight packed once per
convolution into 64-column panels, each panel taken in chunks of 256 input channels that
every 7-row block reuses from L1 / L2 while the next chunk is prefetched into L2; the
bias, the residual's sum (the residual is the first chunk's starting value) and the ReLU
in the last chunk's store; two threads take halves of the panels, each reading half of
the weight, in one OpenMP region (torch's team) as oneDNN's primitive does. At one
thread, weights from L3 (04:25, load 3.5-4.6): 0.77-0.80x oneDNN's at 7x7, 0.93-1.02x
at 14x14.

It is chosen per geometry by measurement (Note [Calibration]): when a chain's arena is
built, for each NHWC fp32 1x1 step that fits, the calibrator times oneDNN's primitive
against ours on that geometry (rows, in, out, the residual, the ReLU, the thread count)
and the verdict is reused for every arena and kernel after; oneDNN is the default, kept
on a tie. The step is called by the chain's C loop with dnnl_primitive_execute's
signature, so a chain mixes the two freely. Where the chain library predates it, the
CPU lacks AVX-512F, or the value is nChw16c (fp32 batch >= 2) or bf16, nothing changes.

Off by default (`policy = "never"`): in the whole model it measured no gain. ResNet-50
at batch 1 in one process, measured against never, interleaved (2026-12-06 05:44 UTC,
load 0.5-0.7): 0.995, the A/A 0.994; the calibrator chose ours at 2 of 16 geometries
(2048->512 @7 0.826, 512->2048 @7 without the residual 0.897) and oneDNN at the rest
(up to 1.77x ours at 3136 rows), so a compile asked 16 questions to gain ~0.2 ms of
33. "measure" turns it on.

Note [The own 1x1 question asked with cold weights]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Why the win alone did not reach the model (2026-12-06 07:10-07:45 UTC, load 1.3-2.2,
ResNet-50 batch 1, two threads; scratch /tmp/h32r/steps.py, steps2.py, ab.py). Each step
of the model's chain run one at a time in chain order (the previous steps' traffic in
the caches), ours forced against oneDNN's, interleaved: ours 0.78-0.87x oneDNN's at the
five 7x7 steps (3.09 -> 2.56 ms), 0.98-1.05x at 14x14, 1.11-1.38x at 784 rows and
1.03-1.79x at 3136. The old question (one convolution called again and again, its weight
hot) said 0.93-0.95 at 7x7, 1.01-1.07 at 14x14: a 4 MB weight split over two cores sits
in their 2 MB L2s when called again, where in the model it comes from L3. With 48 MB
touched between calls it said 0.81-0.91 at 7x7, as the chain does. So the question now
cycles each run through copies of the weight (both sides, `copies`: together twice the
L2 of the cores it runs on, at most MAX_COPIES), and it is asked only up to MAX_ROWS
rows (7 questions at batch 1, not 16; 0.42 s of calibration at load 1.3).

What it did not change: the whole model. Forced on at the five 7x7 steps alone, the
chain run back to back was 0.997 of oneDNN's (A/A 1.005; step by step 35.27 against
35.74 ms), the whole model 1.004 (A/A 1.005), and with the new question 1.006: a gain of
~0.5 ms of 34 (the 3x3 step after each of ours ran 3% slower, ~0.04 ms) that two-core
whole-model timings at load ~2 do not resolve. And seven rounds at load 2 still flip
14x14's verdicts between runs (256->1024 with the residual 1.178 in one run, 0.842 in the
next). The default stays "never".

The two threads' split is not what holds ours back (/tmp/h32r/split.py, 08:06, load 2.2,
cold copies as the question runs them): at two threads ours takes 0.48-0.53 of its
one-thread time at 49 and 196 rows (each core reads half the weight), and stands at
0.85-0.90x oneDNN's at 7x7, 0.97-1.08x at 14x14. oneDNN's primitive took the same time
with torch at one thread as at two (0.93-1.00): it runs the team it was built for.
At batch 2 / 4 on the AMD EPYC (forced at the 7x7 steps, 196 rows at batch 4): no gain
in the whole model (Note [fp32 batch 4 in pieces and the chooser's held verdict]).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.chain_own_steps import ColdCopies, StepKernel
from dynvm.jit.calibration import calibrator_for

PANEL = 64
"""Output channels per packed panel (the kernel's tile width)."""
QUESTION = "own 1x1 convolution"
MAX_ROWS = 256
"""The most output pixels (rows) at which the calibrator is asked: the kernel's register
tile is for a few rows, and at 784 and 3136 rows it ran 1.11-1.79x oneDNN's in the model's
chain (Note [The own 1x1 question asked with cold weights])."""
MAX_COPIES = 16
"""The most weight copies one calibration run cycles through (`copies`)."""
policy = "never"
""""measure" (the calibrator chooses per geometry), "always" or "never" (the default: no
gain in the whole model, Note [A 1x1 convolution of our own at a few rows]); tests force
it."""


class _Own1x1(ctypes.Structure):
    """native/own_1x1.c's `Own1x1`."""

    _fields_ = [("rows", ctypes.c_int), ("in_channels", ctypes.c_int),
                ("out_channels", ctypes.c_int), ("weight", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("sum", ctypes.c_int), ("relu", ctypes.c_int),
                ("arg_src", ctypes.c_int), ("arg_dst", ctypes.c_int),
                ("get_handle", ctypes.c_void_p)]


class Kernel(StepKernel):
    """The chain library's own-1x1 functions (dynvm_own_1x1_execute)."""

    NAME = "own_1x1"


def kernel(dll: ctypes.CDLL, library: api.Library) -> Kernel | None:
    """The own-1x1 functions of the chain library `dll`, or None (an older build)."""
    return Kernel.bound(dll, library)


def fits(runner, shape: tuple) -> bool:
    """Whether `runner` (a PrimitiveConv) at input `shape` is a convolution the kernel
    computes: fp32, 1x1, stride 1, no padding, whole panels of output channels, ReLU or
    no activation."""
    spec = getattr(runner, "spec", None)
    weight_shape = getattr(runner, "weight_shape", None)
    if spec is None or weight_shape is None or spec.dtype != torch.float32:
        return False
    out, _, kh, kw = weight_shape
    relu = api.ELTWISE["relu"]
    return (kh, kw) == (1, 1) and spec.stride == (1, 1) and spec.padding == (0, 0) \
        and spec.dilation == (1, 1) and out % PANEL == 0 and len(shape) == 4 \
        and (spec.eltwise is None or tuple(spec.eltwise) == (relu, 0.0, 0.0))


def panels(plain: torch.Tensor) -> torch.Tensor:
    """The OIHW 1x1 weight [out, in, 1, 1] in panels: [out / 64, in, 64], panel p the
    output channels [64p, 64p + 64) of every input channel."""
    out, cin = plain.shape[:2]
    return plain.reshape(out, cin).t().reshape(cin, out // PANEL, PANEL) \
        .permute(1, 0, 2).contiguous()


class Own1x1:
    """One convolution at one input shape on our kernel: the packed weight, the bias,
    and the struct the C step reads (`handle`)."""

    def __init__(self, library: api.Library, kernel_: Kernel, runner, primitive) -> None:
        out, cin = runner.weight_shape[:2]
        n, _, h, w = primitive.in_shape
        self.rows, self.in_channels, self.out_channels = n * h * w, cin, out
        self.weight = runner.repacked(library, panels)   # shared by the weight's kernels
        bias = primitive.bias
        self.bias = (torch.zeros(out) if bias is None else bias.float()).contiguous()
        spec = runner.spec
        self.struct = _Own1x1(self.rows, cin, out, self.weight.data_ptr(),
                              self.bias.data_ptr(), int(spec.residual),
                              int(spec.eltwise is not None), api.ARG_SRC, api.ARG_DST,
                              kernel_.get_handle)
        self.handle = ctypes.c_void_p(ctypes.addressof(self.struct))
        self.execute = kernel_.execute


def own_step(library: api.Library, kernel_: Kernel | None, runner, primitive,
             shape: tuple) -> Own1x1 | None:
    """Our kernel for this NHWC step where it fits and measured faster than oneDNN's
    `primitive` on its geometry (Note [A 1x1 convolution of our own at a few rows]),
    else None."""
    if kernel_ is None or policy == "never" or not fits(runner, shape):
        return None
    n, _, h, w = primitive.in_shape
    if policy != "always" and n * h * w > MAX_ROWS:
        return None
    own = Own1x1(library, kernel_, runner, primitive)
    if policy == "always":
        return own
    key = (own.rows, own.in_channels, own.out_channels, runner.spec.residual,
           runner.spec.eltwise is not None, torch.get_num_threads())
    choice = calibrator_for("cpu").choose(
        QUESTION, key, lambda: _candidates(library, kernel_, primitive, own))
    return own if choice.name == "own" else None


def _candidates(library: api.Library, kernel_: Kernel, primitive, own: Own1x1) -> dict:
    """oneDNN's primitive and ours on random operands, each call running the geometry
    once per copy of its weight in turn, so that every run reads its weight from L3 as
    the model's call does (Note [The own 1x1 question asked with cold weights]); both
    through one ctypes call per run over the same source and destination."""
    x = torch.randn(primitive.in_shape).contiguous(memory_format=torch.channels_last)
    y = torch.randn(primitive.out_shape).contiguous(memory_format=torch.channels_last)
    cold = _ColdCopies(library, primitive, own, copies(own))
    calls = library.calls
    memories = dict(primitive.arguments())

    def bind():
        calls.dnnl_memory_set_data_handle(memories[api.ARG_SRC], x.data_ptr())
        calls.dnnl_memory_set_data_handle(memories[api.ARG_DST], y.data_ptr())

    def onednn():
        bind()
        for arguments in cold.onednn_args:
            api.check(calls.dnnl_primitive_execute(primitive.handle, library.stream,
                                                   primitive.nargs, arguments),
                      "convolution")

    def ours():
        bind()
        for handle in cold.own_handles:
            api.check(kernel_.call(handle, None, 2, cold.own_args), "own 1x1 convolution")
    ours.keep = onednn.keep = (cold, x, y)    # alive while the candidates are
    return {"onednn": onednn, "own": ours}


def l2_bytes() -> int:
    """One core's L2 cache in bytes (Linux sysfs), or 2 MiB where it cannot be read."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
        return int(text.rstrip("KkMm")) * scale
    except (OSError, ValueError):
        return 2 << 20


def copies(own: Own1x1) -> int:
    """Copies of the weight a calibration run cycles through: together twice the L2 of
    the cores the kernel runs on, so that none is still there when it is read again."""
    weight = own.in_channels * own.out_channels * 4
    cores = max(1, torch.get_num_threads())
    return max(1, min(MAX_COPIES, -(-2 * l2_bytes() * cores // weight)))


class _ColdCopies(ColdCopies):
    """`n` copies of a convolution's weight for each side: oneDNN's (ColdCopies) and
    ours (the panels, an Own1x1 over each copy)."""

    def __init__(self, library: api.Library, primitive, own: Own1x1, n: int) -> None:
        super().__init__(library, primitive, n)
        self._panels = [own.weight.clone() for _ in range(n)]
        self._structs = []
        for panel in self._panels:
            struct = _Own1x1.from_buffer_copy(own.struct)
            struct.weight = panel.data_ptr()
            self._structs.append(struct)
        self.own_handles = [ctypes.c_void_p(ctypes.addressof(s)) for s in self._structs]
