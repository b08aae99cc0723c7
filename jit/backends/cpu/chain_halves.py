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
team's chain is chosen per arena by its calls' measured time (`RoundChoice`, the
team's chain the fallback), not assumed.

At 7x7 (fp32, batch 1; `CHANNEL_SPLIT_MAX_ROWS`) the 4 / 3 row split is uneven and
each thread would stream the whole weight, so those steps split their output channels
instead: each piece a one-thread primitive over the whole input and a copy of its half
of the weight, into a dense buffer (oneDNN 3.2 runs a strided NHWC destination on
`ref:any`, 150-900x slower), which its thread places into its columns, the residual's
sum and the ReLU done there in the primitive's order (bit-equal to the team's). In one
process (10:29 UTC, load 1.9, fp32 arena alone against the team's, A/A 1.016): rows
everywhere 0.970, channels at 7x7 0.929, at 14x14 and 7x7 0.935. bf16 keeps rows (its
sum would round differently).

At batch 2-4 (an NHWC arena: bf16, and fp32 where NHWC measured faster, Note [nChw16c
or NHWC by measurement]; fp32's nChw16c arenas stay the team's) the pieces are the images, each the
step's batch-1 primitive at its image's offset, claimed one at a time (`MAX_BATCH`).

fp32 at batch 2-4, measured, not built (ResNet-50 whole model, Runtimes in one process
against today's nChw16c team chain, interleaved call by call with an A/A, 40 rounds;
/tmp/h33p/ab2.py, 2026-12-06): NHWC arenas (BLOCKED_MIN_BATCH raised) an image a piece
0.985 / 1.013 at batch 2 / 4 (A/A 0.994 / 1.004; 11:34 UTC, load 1.8) and 0.983 / 1.012
(A/A 0.995 / 1.003; 11:55, load 2.0), their NHWC team chain 1.011 / 1.013; at load 6
(11:51) the pieces 1.045 / 1.031. The nChw16c arena itself an image a piece (each step
and the reorders in and out a one-thread primitive per image at `image * bytes per
image`, N being outermost; bit-equal to the team's; a prototype, /tmp/h33p/
chain_images_proto.py) 1.004 / 1.037 (11:55, load 2.0), 1.067 / 1.077 at load 6. The
wakes saved are ~15 us each over 56 primitives against 57-110 ms calls (under 1.5%):
a 1.5% gain at batch 2 in a quiet window only, none at 4, and the fallback under load
(the NHWC team, 1.1% behind nChw16c) loses, so fp32 keeps the blocked team chain at 2-4.
One primitive object run on both threads at once gave wrong results (the prototype's
images first shared one): each piece is a primitive of its own, as here.

Whole model (ResNet-50, two Runtimes in one process, halves "measure" / "never",
interleaved call by call with an A/A; /tmp/h33r/ab.py, 2026-12-06): bf16 batch 1 9.99
against 12.99 ms, **0.768** (A/A 1.003, 10:08 UTC, load 2.8), 7.83 against 11.37, 0.679
(A/A 0.985, 10:13, load 2.0), 9.27 against 12.68, 0.732 (A/A 0.997, 10:16, load 1.7);
batch 2 by image 14.28 against 17.55, **0.826** (A/A 1.016), batch 4 25.54 against
27.93, 0.918 (A/A 0.996; 10:15, load 2.0); fp32 batch 1 0.985 (A/A 1.007, 10:09, load
2.2; the chooser still alternating), 0.957 / 1.017 / 0.996 at 10:21 / 10:38 / 10:52.
With OpenVINO bf16 in the same process (10:20, load 1.7): jit-bf16 / OpenVINO bf16
1.001 / 0.957 / 1.023 at batch 1 / 2 / 4, the team's chain 1.276 / 1.160 / 1.113. In
windows where other work held both cores (10:45 / 10:55, load 2-2.9, the team's batch-1
call 14.5-15 ms against 11.5 quiet) the choice kept to the team's speed: 1.014 / 1.022 /
1.023 and 1.038 / 0.977 / 0.975 (A/A 0.966-1.004). The pieces' weights: bf16's are the
team's copies (44.7 MiB either way); fp32's 7x7 channel halves add 55.6 MiB (181.7 ->
237.3) for a chain 0.7-4% faster than rows there (10:29, 10:51). The final tree in a
quiet window (10:58-11:01, load 0.4-1.5): measure / never bf16 0.716 / 0.809 / 0.904
(A/A 1.004 / 1.010 / 1.027), fp32 batch 1 0.935 (A/A 0.999); beside the peers
jit-bf16 / OpenVINO bf16 0.967 / 0.962 / 1.131 (the team's 1.352 / 1.201 / 1.112; A/A
0.960-0.966), fp32 JIT / ONNX Runtime 1.046 at batch 1 (the team's 1.131).

Note [fp32 batch 4 in pieces and the chooser's held verdict]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Measured, not built (2-core AMD EPYC Zen 5, no AMX; ResNet-50 fp32, 2 threads, passive
OpenMP, under the bench lock; 2026-12-06, H38R; scripts /tmp/h38r/). Where batch 4's
time goes: the settled team arena step by step in chain order (one execute and wait
each, medians of 15 passes; steps.py, 19:42 UTC, load 1.9) 71.1 ms against 72.0 for the
whole arena; beside ONNX Runtime's per-node profile (bench.resnet_profile --batch 4,
19:16, load 1.8-2.0; its Conv nodes 70.5 ms) oneDNN's 3x3s are faster (14x14 8.71 /
9.31 ms over five, 28x28 5.39 / 5.52, 7x7 3.69 / 4.42, strided 14x14 2.02 / 2.22) and
its 1x1s slower, most the expanding ones with the residual's sum (28x28 128->512 3.97 /
3.66, 7x7 512->2048 3.21 / 2.87, 14x14 256->1024 5.46 / 5.17) and the 56x56 ones
(1.07-1.09x): +1.8 ms over the 1x1s, -1.8 over the 3x3s, a tie over all convolutions.

Tried at batch 2-4, whole model, Runtimes in one process interleaved call by call with
an A/A and ONNX Runtime, seasoned and drained (ab.py): (a) the 7x7 steps' output
channels split over the whole batch in pieces (each thread a one-thread primitive over
every image and half the weight, placed as at batch 1; results as the arena's, max |d|
against eager 1.37e-4 either way): pieces forced in both arms batch 2 1.014, batch 4
1.013 (A/A 0.998 / 0.993; 19:41, load 2.4-2.6); with the chooser batch 4 0.980 / 0.990
(A/A 1.008 / 0.978), batch 2 0.999 / 1.038: no gain. (b) dynvm's own 1x1 kernel forced
at the 7x7 steps (team arenas: an arena with own steps has no pieces): batch 2 0.988 /
1.022, batch 4 0.991 / 0.997 (A/A 0.995 / 0.999, 0.996 / 0.987; 19:44-19:47, load
1.9-2.3): no gain.

What does cost batch 4 is a verdict of the chooser then held the wrong way. One Runtime,
its batch-4 call driven by a fixed pattern (6 calls in pieces, 6 on the team, 12 times;
switch.py, 19:50, load 1.8): pieces 68.2-69.1 ms, the team 69.7-70.6, at every position
after a switch: pieces 2.4% faster and no cost to switching. Yet in the three-Runtime
runs one Runtime's batch-4 (or batch-2) call held the team to the end: its three pieces
samples 80.1-82.4 ms (42.2-52.4 at batch 2) against 66.1-75.4, median 68.2 (34.3-35.2)
in the Runtime beside it, taken in one burst, against seven team samples spread over the
window. Pieces forced against such a Runtime: batch 4 0.967, the A/A (a Runtime that had
settled on pieces) 0.971 (19:48, load 2.3). In fresh processes seasoned as ab.py seasons
(one JIT Runtime, batch 1, 2, 4; which.py, then 16 calls a batch as the full-width run
times them; 19:58-20:12, load 1.8-2.3) the batch-4 call ran in pieces 3, 0 and 16 times
of 16 (the rest the team, not starved); with a chooser that times the two ways in turn,
call by call, every 48 calls (3 a way) and compares only that round's
timings, 16, 16 and 16 (two runs a prototype, one the built version;
/tmp/h38r/new_chooser.patch, with its tests). Whole model, that chooser against this one
(20:08-20:10, load 2.1, 30 rounds): batch 1 / 2 / 4 0.991 / 1.003 / 0.996, A/A 1.013 /
1.019 / 1.002, the old chooser's Runtimes on pieces at batch 4 in that run: no gain
measured, so not landed. Leaving out the calls timed while a compile worker's task ran
kept a held team at batch 4 (19:54). Left: the chooser in turn A/B'd where a held
verdict shows (the full-width run's 16 timed calls after its warm-up, several fresh
processes a side), and why the explored way's burst reads slow. Seen beside it: in some
processes a kernel whose chain has no pieces for batch 2 (or 4) serves that batch (the
team alone; which.py at 20:06, load 3.3, and 20:12).

Built after (H39R, 2026-12-06 21:10-22:10 UTC, same host; the bar itself in fresh
processes: bench.full_width ResNet-50 with the bf16 JIT and three peers, 16 timed calls a
batch, run through /tmp/h39r/bar.py, which counts how each steady call of the fp32 JIT
ran and times it). In the bar's steady phase (each JIT call between seven other
systems' calls) the two ways forced in turn, 8 calls each a batch, three processes
(21:21-21:25, load 1.4-2.0), pieces / team medians: batch 1 20.68 / 23.10, 19.49 /
21.18, 18.22 / 20.18 ms; batch 2 38.02 / 39.18, 36.40 / 37.85, 35.28 / 38.09; batch 4
76.94 / 79.17, 74.30 / 77.48, 70.33 / 73.22: pieces are the faster way there too (0.90-
0.92, 0.93-0.97, 0.96-0.97). Yet three timings a way are a coin with a bias: resampling
those calls, a round of three a way said the team 3-37% of the time (a 3% margin: 1-19%).
So the chooser now times the two ways in turn, call by call, in rounds (the chooser
tried above), keeps the halves unless their round's median is over the team's by 3%
(`MARGIN` in halves_choice), retakes a verdict for the team after `_RETRY` calls (a
round under the warm-up's compiles held the team into the timed calls) and leaves out
calls run while a compile worker's task ran (their round goes on). Steady fp32 calls in
pieces, of 16, at batch 1 / 2 / 4 per process, the two choosers alternated (21:12-22:05,
load 1.1-3.8; five processes in windows of load 3.2-7.6 and two of a broken arm left
out): the old one 9/16/16, 12/8/7, 16/16/12, 0/16/16, 16/16/16, 16/-/15, 13/2/12,
16/16/0, 16/10/12 (batch 4 all 16 in 3 of 9 processes, mean 11.8; batch 1 mean 12.7);
this one (`_RETRY` 16; untimed calls from 21:49) 16/7/16, 13/13/16, 16/8/-, 10/6/16,
13/16/16, 16/16/16, 16/5/16, 13/16/13, 16/-/16 (batch 4 all 16 in 7 of 8, mean 15.6;
batch 1 mean 14.3; batch 2 mean 10.9 against 12.5: its rounds in the seasoning read
samples twice their size, 70.7 / 36.3 ms, and the team stayed 8 calls into the timed
ones, hence `_RETRY` 8). Across processes JIT / ONNX Runtime moves by +-4% either way
(batch 4 medians 0.984 the old chooser, 1.012 this one; the JIT's x eager 0.438 / 0.445,
ONNX Runtime's 0.428-0.455): the bar's three-figure ratios do not resolve a 3% gain;
what the chooser decides is the count, and the per-call medians above price it. ("-": an
nChw16c arena, below.)

Why a batch-2 or -4 kernel had no pieces: its arena was nChw16c. The layout question
(Note [nChw16c or NHWC by measurement]) said nChw16c in 5 of 27 of these processes,
at batch 4 (load 1.1-1.3), batch 2 twice (1.7-2.1) and batch 3 twice (2.2, 3.8), and
that batch lost 8-14% in the bar (JIT / best peer 1.098-1.113 at batch 4, 21:38;
1.078-1.116 at batch 2, 21:43 and 21:58): hence its second question and its lead.
Seen once (21:38, load 1.1-1.7): pieces at batch 1 and 2 taking twice their time call
after call (17.5 <-> 34.6 ms, 33.2 <-> 66.3) without a starved helper, as if helper and
caller shared a CPU; the round then chose the team, rightly.
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import torch

from dynvm.jit import background
from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.chain_pieces import HalvesArena, _Plan
from dynvm.jit.backends.cpu.halves_choice import RoundChoice
from dynvm.jit.backends.cpu.helper_libraries import bound_once, helper_stream

_LIBRARY_STEM = "_chain_halves"
LATE_NS = 100_000
"""How long a thread spins at a step's end for its partner's piece before it sleeps."""
_RETRY = 8
"""Calls between a chain's rounds after a verdict for the team (Note [fp32 batch 4 in
pieces and the chooser's held verdict]: with 16 the team ran the bar's first 8 timed
calls at batch 2); the rounds themselves: Note [Halves chosen in rounds]."""
MAX_BATCH = 4
"""The largest batch whose NHWC arena is built in pieces (an image a piece past 1)."""
policy = "measure"
"""Halves at batch 1: "measure" (by the arena's calls, `RoundChoice`), "always" or
"never" (an A/B's arms, and the way to turn it off)."""


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
        self._helper_stream = helper_stream(library)
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


def native(library: api.Library | None, path: Path | None = None
           ) -> tuple[_Native | None, str]:
    """The halves library bound to `library` (its helper started), or None and why not."""
    return bound_once(_LIBRARY_STEM, _Native, library, path)


class HalvesCall:
    """One batch-1 arena's call: its halves or the arena (the team) as `choice` says
    (`policy` "always" / "never" force one; a compile worker's run, calibration and
    probation's shadow calls, runs the team: the helper serves the serving calls)."""

    def __init__(self, arena, halves: HalvesArena) -> None:
        self.arena, self.halves = arena, halves
        self.choice = RoundChoice(retry=_RETRY)   # Note [Halves chosen in rounds]
        self.refused = 0      # calls the halves could not run (another call's helper)
        self.untimed = 0      # calls run beside a compile worker's task

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if policy == "never" or background.on_worker():
            return self.arena.run(x)
        use = True if policy == "always" else self.choice.next()
        tasks = background.worker_task()
        compiling = tasks.running
        start = time.perf_counter()
        out = self.halves.run(x) if use else None
        if out is None:
            if use:
                self.refused += 1
                return self.arena.run(x)     # the helper is another call's: not timed
            out = self.arena.run(x)
        seconds = time.perf_counter() - start
        if compiling or tasks.running:   # the worker shared the cores: not a timing
            self.untimed += 1
            seconds = None
        self.choice.record(use, seconds, use and self.halves.starved)
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
        # own 1x1 steps have no pieces; Winograd's have (Note [Winograd F(2x2, 3x3) for
        # the 3x3s])
        if shape[0] > MAX_BATCH or arena.blocked or len(arena._own) > len(arena.winograd):
            continue
        try:
            made[shape] = HalvesCall(arena, HalvesArena(library, bound, arena, steps, shape))
        except api.OnednnError:
            continue      # a step that does not split: the team's chain alone
    return made
