"""Whether an fp32 chain's arena at batch 2-4 runs nChw16c or NHWC inside: measured on
this CPU, once per process.

Note [nChw16c or NHWC by measurement]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Which layout runs an fp32 arena faster at batch 2-4 is a property of the CPU and of the
kernels oneDNN 3.2 picks there, not of the layout: on the Intel host with AMX nChw16c
(jit_1x1 / jit:avx512_core) measured faster than NHWC (brgconv_1x1 / brgconv) in the
whole ResNet-50 (Note [A chain of primitives in one call]); on a 2-core AMD EPYC Zen 5
(no AMX) NHWC did, 0.905-0.949 of nChw16c (below). AMX was a
stand-in for that measured difference. So the first fp32 arena in the blocked range a
process builds asks the process's Calibrator (Note [Calibration]) instead: a small
representative piece, ResNet's 28x28 stage at the arena's batch (a 3x3 convolution 128
-> 128 then a 1x1 128 -> 512, each with its bias and ReLU, as oneDNN primitives on
random operands), built in each layout and run back to back (one native execute each,
the buffers bound once, as an arena's are), interleaved round by round, medians. NHWC
is the default candidate: nChw16c is chosen only where it is faster by the calibrator's
margin (5%), since NHWC is also what batch 1 and bf16 run and what lets an arena run an
image a piece (Note [A chain in halves, one wake a call]). The verdict is cached per
(dtype, batch, threads) for the process; each batch of the range asks once. It runs on
the compile thread with that thread's OpenMP count (the calling thread's, where the
compile is inline). nChw16c is chosen only where its fastest sample is ahead by the
margin too: the host is shared, and a median inflated by another process on one of the
two cores once chose it (below).

On the 2-core AMD EPYC Zen 5 (no AMX), 2 threads, passive OpenMP (2026-12-06): the piece
NHWC / nChw16c medians 2.76 / 2.84 ms at batch 2, 5.60 / 5.80 at batch 4, and again
2.70 / 2.86, 5.39 / 5.56 (17:13 UTC, load 2.6): NHWC both times, its 3x3 the difference
(alone 1.81 / 1.96 ms; the 1x1s 0.83-0.85 each way); cost 56-141 ms at batch 2 and
109-117 ms at batch 4, building the four primitives included, once per process. Under
load 8-10 (17:16 UTC, other processes on both cores) the calibration took 0.64 s and
its batch-4 medians read 13.61 / 11.51 ms, nChw16c, against 5.4-5.6 unloaded: hence the
fastest-sample condition. At load 5-8 (17:18-17:22, four runs) NHWC every time, the
fastest samples 1.34-2.64 / 1.42-2.76 ms. Whole ResNet-50 fp32 (three Runtimes in one
process: forced NHWC / measured / forced NHWC again, seasoned and drained, interleaved
call by call, 40 rounds, paired medians; /tmp/h37l/ab.py, 17:23-17:27 UTC, load 3-5):
the verdict NHWC at 2 and 4 (0.22 s of calibration in all), measured against forced NHWC
1.018 at batch 2 and 0.973 at batch 4, within the A/A's 1.031 / 0.976; results as
eager's to 1.1e-4 / 1.4e-4, as forced NHWC.

Before the measured choice (H36R, same day): the figures that made fp32 arenas nChw16c
at batch 2-4 (Note [A chain of primitives in one call]) were taken on the Intel host. On
the AMD EPYC oneDNN 3.2 runs blocked convolutions on jit_1x1 / jit:avx512_core and NHWC
ones on brgconv_1x1 / brgconv. The settled batch-2 arena against arenas rebuilt under
other layouts (one process, interleaved call by call, paired medians of 100 rounds, 2
threads, passive OpenMP, 16:57-17:01 UTC, load 1.8-2.1): NHWC throughout 0.938, nChw16c
only at 7x7 0.954 (A/A 1.000 / 1.003); in a loaded window (16:47-16:50, load 2.7-4) 3x3s
NHWC with 1x1s blocked 0.981-1.085, 1x1s NHWC with 3x3s blocked 1.030-1.119 (mixes pay
reorders between layouts), batch 4 NHWC 0.956 (A/A 0.989 / 1.024). Whole model (three
Runtimes in one process: nChw16c at 2-4 / NHWC / nChw16c again, seasoned and drained,
interleaved call by call, paired medians; 17:01-17:06, load 2.0-2.4): batch 2 0.905 /
0.914, batch 4 0.949 / 0.945 (A/A 1.000-1.006); results within fp32 rounding of eager as
before (max |d| 1.1e-4 / 1.4e-4 against 1.0e-4). Between those two and this Note the
choice was "nChw16c where the CPU has AMX tiles". `blocked_policy` "always" / "never"
force either layout. In NHWC at batch 2-4 an arena may run an image a
piece (Note [A chain in halves, one wake a call]) where its calls measure faster so.

A yes is asked twice (H39R, 2026-12-06, same host): in 21 fresh processes of the full-
width ResNet-50 run the one question said nChw16c 4 times, at batch 4 (load 1.1-1.3),
batch 2 (1.7-1.8) and batch 3 (2.2, 3.8), and the arena of that batch, nChw16c, ran
neither the NHWC kernels nor pieces: 8-11% of that batch's call lost (JIT / best peer
1.098-1.113 at batch 4, 1.078-1.086 at batch 2; Note [fp32 batch 4 in pieces and the
chooser's held verdict] in chain_halves). So nChw16c now needs a second question
(its own key, asked right after a yes) to say so too; a no costs nothing more. Both
questions said it once more at batch 2 (21:59, load 1.9-2.1; medians 2.82 / 3.21 and
1.76 / 1.92 ms, fastest samples 2.33 / 2.72 and 1.47 / 1.61: leads of 9-14%) and that
batch ran 1.116 of the best peer, where NHWC in pieces ran 0.96-1.00 in the processes
beside it: the piece's lead does not carry to the whole chain, and the pieces it costs
(3-7% at batch 2-4 in the bar, chain_halves' Note) are not in it. Hence
`BLOCKED_LEAD`: nChw16c needs a 15% lead, median and fastest sample, in both
questions. On the Intel host with AMX the whole model ran 6-7% faster in nChw16c than
NHWC in a team chain, and NHWC in pieces within 1.5% of it (Note [A chain in halves, one
wake a call]), so that choice costs little there. With both (three bar processes,
22:13-22:20 UTC, load 4-6 from other work): the first question said nChw16c three
times (batch 2 once, batch 3 twice), no arena was nChw16c.

Per step, the layouts differ the other way for the 1x1s (H39R; each geometry's
primitives built in both layouts, weights and residuals cycled over six copies,
interleaved, medians of 30, 21:50-21:52 UTC, load 1.7-1.8; /tmp/h39r/onex1.py).
nChw16c (jit_1x1) over NHWC (brgconv_1x1) at batch 4, two threads: the expanding ones
with the residual's sum 0.873 (56x56 64->256), 0.781 (28x28 128->512), 0.882 (14x14
256->1024), 0.983 (7x7 512->2048); 56x56 256->64 0.837, 28x28 512->128 0.910, the rest
0.96-1.04; at batch 1, one thread (a piece): 0.835, 0.778, 0.888, 0.993, and 0.98-1.05
for the rest. A oneDNN matmul over the (N*H*W, C) view with the same post-ops runs
brg:avx512_core at 0.95-1.05 of brgconv_1x1 everywhere (the A/A, a second NHWC
primitive, 0.94-1.07). The 3x3s go the other way: nChw16c (jit:avx512_core) over
NHWC (brgconv) 1.01 / 1.07 / 1.11 / 1.09 at 56 / 28 / 14 / 7 at batch 4, 1.03 / 1.10 /
1.23 / 1.46 at batch 1 on one thread. ONNX Runtime's lead at batch 4's 1x1s (Note
[fp32 batch 4 in pieces and the chooser's held verdict]) is what jit_1x1 has over
brgconv_1x1 here; a chain with each 1x1 in nChw16c and each 3x3 in NHWC pays two
reorders a block (such mixes measured 0.981-1.119 above), about what the 1x1s would
gain (~2.3 ms of batch 4's 71 at these ratios). Not built.
"""

from __future__ import annotations

import ctypes

import torch

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.onednn_conv_primitive import ConvPrimitive, ConvSpec, WeightLayouts
from dynvm.jit.calibration import Calibrator, calibrator_for

NHWC, BLOCKED = "NHWC", "nChw16c"
QUESTION = "chain_layout"
TAG_BLOCKED = 78      # dnnl_nChw16c (dnnl_aBcd16b) in oneDNN 3.2's dnnl_format_tag_t
_SIDE, _WIDTH, _EXPANDED = 28, 128, 512     # ResNet-50's 28x28 stage
_RELU = (api.ELTWISE["relu"], 0.0, 0.0)
BLOCKED_DTYPES = (torch.float32,)
"""The chains whose convolutions may run on nChw16c values inside (Note [A chain of
primitives in one call] in onednn_chain): fp32; in bf16 oneDNN 3.2 has no AMX kernel for
that layout."""
BLOCKED_MIN_BATCH = 2
"""The smallest batch whose fp32 arena is nChw16c inside: at batch 1 NHWC measured
faster in the whole model (Note [A chain of primitives in one call])."""

BLOCKED_LEAD = 0.15
"""How far ahead of NHWC the piece must run in nChw16c, median and fastest sample, in
both questions: an nChw16c arena loses its pieces, and leads of 9-14% in the piece came
with that batch 12-16% slower in the bar (Note [nChw16c or NHWC by measurement])."""

blocked_policy = "measured"
"""Whether fp32 arenas from BLOCKED_MIN_BATCH are nChw16c inside: "measured" (where a
representative piece ran faster so on this CPU, once per process and batch; Note
[nChw16c or NHWC by measurement]), "always" or "never" (tests, an A/B's arms)."""


def blocked_inside(dtype: torch.dtype, batch: int) -> bool:
    """Whether an arena of `dtype` at `batch` runs its whole-block convolutions on
    nChw16c values (Note [A chain of primitives in one call] in onednn_chain, Note
    [nChw16c or NHWC by measurement])."""
    if dtype not in BLOCKED_DTYPES or batch < BLOCKED_MIN_BATCH or blocked_policy == "never":
        return False
    return blocked_policy == "always" or blocked_measures_faster(dtype, batch)


def blocked_measures_faster(dtype: torch.dtype, batch: int,
                            calibrator: Calibrator | None = None) -> bool:
    """Whether nChw16c ran the representative piece faster than NHWC on this CPU, at
    `batch` and this thread's thread count, in two questions (the second asked only
    where the first said so; Note [nChw16c or NHWC by measurement]); False where the
    oneDNN library is absent (no arena either)."""
    calibrator = calibrator if calibrator is not None else calibrator_for("cpu")
    key = (str(dtype), batch, torch.get_num_threads())
    return all(_says_blocked(calibrator, dtype, batch, (*key, *again))
               for again in ((), ("again",)))


def _says_blocked(calibrator: Calibrator, dtype: torch.dtype, batch: int, key) -> bool:
    """One question's verdict for nChw16c (asked once per process and key)."""
    known = calibrator.known(QUESTION, key)
    if known is None:
        library = api.library()
        if library is None:
            return False
        try:
            known = calibrator.choose(QUESTION, key, lambda: {
                NHWC: _Piece(library, dtype, batch, api.TAG_NHWC),
                BLOCKED: _Piece(library, dtype, batch, TAG_BLOCKED)})
        except api.OnednnError:
            return False        # a layout oneDNN would not build: NHWC, as before
    # the fastest samples must agree (a median a busy core inflated is not a verdict),
    # and both lead by more than the pieces an NHWC arena would run
    lead = 1.0 - max(calibrator.margin, BLOCKED_LEAD)
    return known.name == BLOCKED and known.fastest[BLOCKED] < known.fastest[NHWC] * lead \
        and known.seconds[BLOCKED] < known.seconds[NHWC] * lead


class _Piece:
    """The two convolutions in one layout over buffers bound once; a call runs both."""

    def __init__(self, library: api.Library, dtype: torch.dtype, batch: int,
                 tag: int) -> None:
        generator = torch.Generator().manual_seed(0)

        def conv(c_in: int, c_out: int, k: int, padding: int):
            weight = torch.randn(c_out, c_in, k, k, generator=generator) / (c_in * k * k)
            spec = ConvSpec((1, 1), (padding, padding), (1, 1), False, _RELU, dtype)
            return ConvPrimitive(library, weight.to(dtype), torch.zeros(c_out), (
                batch, c_in, _SIDE, _SIDE), spec, WeightLayouts(), tag)

        self.convs = [conv(_WIDTH, _WIDTH, 3, 1), conv(_WIDTH, _EXPANDED, 1, 0)]
        # the same element counts in both layouts: every channel count is whole 16-blocks
        self.buffers = [torch.randn(batch * c * _SIDE * _SIDE, generator=generator).to(dtype)
                        for c in (_WIDTH, _WIDTH, _EXPANDED)]
        self._calls = library.calls
        self._stream = library.stream
        wait = library.dll.dnnl_stream_wait     # onednn_api does not declare it
        wait.argtypes, wait.restype = [ctypes.c_void_p], ctypes.c_int
        self._wait = wait
        for conv_, source, target in zip(self.convs, self.buffers, self.buffers[1:]):
            memories = dict(conv_.arguments())
            for arg, buffer in ((api.ARG_SRC, source), (api.ARG_DST, target)):
                api.check(library.dll.dnnl_memory_set_data_handle(
                    memories[arg], ctypes.c_void_p(buffer.data_ptr())), "data handle")

    def __call__(self) -> None:
        for conv in self.convs:
            api.check(self._calls.dnnl_primitive_execute(
                conv.handle, self._stream, conv.nargs, conv.args_pointer), "convolution")
        api.check(self._wait(self._stream), "stream wait")

