"""A GEMM at a few rows as column pieces on one-thread oneDNN primitives, shared between
the caller and a helper thread of dynvm's own, chosen per exact kernel by its measured
calls (native/column_halves.c, the `_column_halves` library).

Note [Column halves with a helper thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At batch 1 each linear primitive is one OpenMP region (Note [oneDNN linear primitives
built once]); with the passive wait policy the benchmarks run (bench/_omp.py) its worker
starts ~45 us into the region and the caller leaves ~38 us after the later body: 1.33
of 3.05 ms over BERT-base's 16 bf16 GEMMs at M=16. Here such a GEMM is `PIECES`
primitives over pieces of its output columns (`pieces_of`), each built and run on one
thread (oneDNN then runs it inline, no region): the caller posts the GEMM and both
threads claim its pieces one at a time (one compare-and-swap each), the caller from its
first piece on, until none is left; the caller then waits only for a piece the helper
is inside. The helper is one pthread per process that spins, at SCHED_IDLE priority,
only while a kernel call that runs halves is inside (the kernel's entry and exit:
codegen wraps the kernel, `KernelHalves`), sleeps on a futex between calls and parks
after `MAX_SPIN_NS` without a piece; it computes at normal priority. A caller whose
helper's piece is `LATE_NS` late sleeps on a futex, so a helper preempted mid-piece gets
the core. A second thread calling while a call owns the helper runs the team (the
linear's ordinary primitive), and so does a compile worker's run of a kernel
(calibration, probation's shadow calls): the helper serves the serving calls, and the
choice times only them.

Four pieces, not two halves (2026-12-06, H31LE): with two halves a helper that claimed
B late (its SCHED_IDLE spin got the core 0.2-0.6 ms after the post, beside other work)
made the caller wait for the whole of B after its A, and B then ran beside the other
work at half a core: in the bar's own loop at load 3-5 the halves calls ran 1.1-2x the
team's (1x32: 54.7 against 27.9 ms), the caller waiting 1.0-2.5 ms a call. With pieces
claimed one at a time a late helper takes only what is left, and the caller waits for
at most one piece.

The pieces' weights are reordered copies of their own ([N/4, K] each, built at one
thread; shared across kernels through the PrepackCache, key `onednn-linear-pieces`): a
second copy of each weight beside the team's. oneDNN 3.2's brgemm matmul refuses a
strided result (it falls to gemm:jit, several times slower), so each piece writes a dense
buffer of its own and its thread copies it into its columns of the result; a binary
post-op (add or multiply, fp32 result) is done there on the operand's columns, after
the primitive's bias and activation, in the order oneDNN's post-op does it: equal to
the team's result.

Halves or team is measured, not assumed: a kernel's calls alternate until each way has
three timings, then run the faster by median over the last seven, the other one call in
sixteen (an online A/B of whole kernel calls, per exact kernel, so per row count; since
Note [Halves chosen in rounds], in rounds of timings taken in turn). Timings alone did
not hold beside two busy processes: the halves' few samples went stale while the helper,
at SCHED_IDLE, was starved (6 of 2176 B halves claimed), and the choice ran the halves
at 2x16 / 2x32 for 1.22 / 1.27x the team's time. So two halves calls in a row whose
helper was starved (it ran under a quarter of the pieces, half its share) send the next
sixteen calls to the team, whatever the timings
say (a single one is a passing blip: at load 1.6 one starved call in seven held the
team for 16 calls, and the kernel's halves at 0.81-0.87 of the team's time ran in only
3-7 of 24 calls). Rows: exact kernels whose linears run at `MAX_ROWS` rows or fewer.

Measured (BERT-base width, 4 layers, in one process, interleaved call by call with the
team and an A/A; /tmp/h31ld/ab.py, 2026-12-06): with a core free (02:26 UTC, load 1.6)
the halves forced on ran 0.813 / 0.827 / 0.871 / 0.829 of the team's whole bf16 calls
at 1x16 / 1x32 / 1x64 / 2x16 (A/A 1.012-1.023; the helper ran 720 of 800 B halves).
With the other core busy (other sessions' work, load 2.1-4.0 at 01:52-02:43; two busy
processes beside it at 02:07, load 6.1-6.4) the helper at SCHED_IDLE was starved (12-35
of 700-1250 B halves; 6 of 2176 beside the busy processes) and the halves ran at one
thread's speed: forced on 1.03-1.26x the team. The adaptive choice with the two-strike
hold then stayed within its A/A (fp32 1.003-1.009, A/A 0.986-1.013; bf16 1.028-1.064
against an A/A of 1.048-1.099, 02:42 UTC, load 2.5; the halves in 3-4 of 20-28 calls).
The bar's command with the halves on (one-strike hold, 02:26-02:36 UTC, load 1.6-1.8,
margin 0.022): fp32 JIT / best peer 1x16 1.059, 2x16 1.048, every other shape within the
margin (median 0.991); jit-bf16 / OpenVINO bf16 1x16 0.935 but median 1.148 with the
bf16 seasoning unsettled after 486 s; a warm-up spike at 1x32 (JIT p90 2.92x the
interpreter's, max 172 ms). That spike is not the halves': the lead's "off" run of
02:53 had larger single warm-up calls (1x32 193 ms, 1x128 250 ms) and the "on" run
beside it none over 2.5x the interpreter's p90; in the warm-up's 12-13 calls a shape
the exact kernels (the only ones with halves) arrive late, so 0-1 of them ran halves
(H31LE's replica of the bar's loop, 04:23 UTC): the spikes are the compile worker's
work beside a call, in both arms. On against off in the bar's command, same window
(02:53 / 02:56, load 1.7-1.8): 1x16 1.127 / 1.167, 1x32 1.086 / 1.099, 1x64 1.051 /
1.021, 2x16 1.166 / 1.094, no gain beyond the runs' spread. In the bar's own loop at
load 3-5 (04:23 UTC) the helper ran 9 of 160 B halves, a B it claimed was claimed
0.2-0.6 ms after its post and cost the caller 1.0-2.5 ms of waiting a call, and the
choice ran the team in 36-54 of 40-60 seasoning calls a kernel: hence the four pieces.
Off by default until the gain holds in the bar's command beside an "off" run of the
same window (on the Intel host); on since the next Note.

Note [Column halves where the team's wake is the cost]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At narrow widths the passive team's wake is most of a GEMM's time at a few rows: the
held-out encoder (bench/heldout.py: d 256, FFN 1024, 6 layers) at batch 1 x seq 32 spent
2.66 of its 3.09 ms kernel in 24 oneDNN linears of 75-125 us each (interleaved with
eager; 2-core AMD EPYC Zen 5, no AMX, 2026-12-06 21:14 UTC) for 12.6 MFLOP at most
each, where ONNX Runtime's MatMuls took 1.87 ms with profiling on. Measured with the
halves on (JIT runtimes "off" twice, the A/A, and "on", each settled at every shape and
huge pages drained, interleaved call by call with eager; 2 threads, passive OpenMP;
/tmp/lead/s27/ab_opt.py, 21:23-21:27 UTC, load 1.5-1.7): on / off at seq 32 batch 1
0.682 and 0.777 (A/A 0.979 / 0.974), batch 2 1.044 (A/A 1.021; the choice ran the
team in 142 of 168 calls), batch 3 (a family: no halves) 1.011; at seq 16 batch 1 / 2 /
4 0.601 / 0.658 / 0.750 (A/A 0.991-1.010); the helper ran 40-45% of the pieces. Held-out
batch 1 went from 0.46 to 0.31-0.36x eager (ONNX Runtime 0.39 in the same host's runs);
in the bar's own interleaving with ONNX Runtime and OpenVINO (`bench.full_width --models
heldout`, 21:36-23:01 UTC, seven runs) it read 0.30-0.51x eager, the choice and the
halves' own time moving with the peers' calls around it.
BERT-base width (4 layers, fp32, the same way; ab_opt_bert.py, 21:24 and 21:26 UTC,
load 1.7-1.8): 1x16 1.005 / 0.990, 1x32 0.992 / 1.014, 2x16 1.019 / 1.008, 1x64 1.007 /
1.025, 2x32 1.036 / 1.014, 4x16 1.045 / 1.002 (A/A 0.974-1.028): a tie, the choice
keeping the team where its wake is a small part of a wide GEMM. So the halves are on by
default, the per-kernel choice deciding. A process that asked torch for one thread
gets the team's one-thread primitives, never the helper (the zoo's setting).
Past 64 rows (the same way, with the round chooser, Note [Halves chosen in rounds];
ab_rows.py, 21:55 UTC, load 1.7-1.9): the held-out encoder at batch 4 x seq 32 (128
rows, at most 2^25 multiply-adds a linear) with halves 0.818 (A/A 0.989; 0.355x eager,
OpenVINO ~0.40 in the bar's runs), batch 2 (64 rows, halves either way) 0.986 (A/A
0.977); BERT-base width at 128 rows (1x128, 2x64, 4x32, 8x16; 75-302M multiply-adds a
linear; ab_rows_bert.py, 21:57-21:59) fp32 1.014 / 1.024 / 0.999 / 1.016 (A/A
0.990-1.005), bf16 1.005 / 1.009 / 0.973 / 0.953 (A/A 0.984-1.009). So a linear past
`MAX_ROWS` rows gets halves where its multiply-adds are at most `SMALL_MACS`.
What moves the held-out encoder's batch 1 in the bar's runs is the host, not a peer.
The halves forced on, interleaved with eager and with no peer, ONNX Runtime, OpenVINO or
both (/tmp/lead/s28/starve.py, 60-80 rounds a run, 2026-12-06 23:25-23:28 UTC, two
helpers' builds and tests on the machine, load 1.1-1.4): in 6 of 8 runs the helper ran
half the pieces and the JIT read 0.295-0.314x eager (ONNX Runtime 0.373-0.384, OpenVINO
0.329-0.348); in two, one with no peer and one beside ONNX Runtime, it ran none (0 of
60-80 calls over a quarter; its thread 1-3 context switches over the whole loop) and the
JIT read 0.411-0.438x. A process busy on the other core starves a SCHED_IDLE helper
whatever runs in ours, and the choice then runs the team. Stop 27's reading that ONNX
Runtime's calls kept the second core (0.42-0.49x beside it alone) was taken while a
rehearsal ran. Nor does a helper at normal priority help there: beside a busy process
(`while True: pass`), the helper set to SCHED_OTHER (by the caller, call by call) against
SCHED_IDLE, both chosen by their calls, with the halves off beside them and an A/A
(/tmp/lead/s28/spin_ab.py, 100 rounds, 23:40 UTC, load 1.9-2.0): batch 1 / 4 0.981 /
0.986 (A/A 0.979 / 0.996, off 0.965 / 0.992). Under the scheduler's fair share it ran 14%
/ 25% of the pieces, and the team itself (off) ran 2.52 ms at batch 1, against ~1.8 ms
for the halves with the core free: a busy neighbour's core is not there to be had.
A kernel with convolutions gets none: ResNet-50's one linear (2048 -> 1000 at the batch's
rows) is a sliver of a call that the convolutions fill, so the whole-kernel timings that
choose the halves would choose on the chain's noise, and a chain in halves has a helper
of its own (Note [A chain in halves, one wake a call]) that the column helper's spin would
sit beside. With the halves taken there, the stop-27 bar read ResNet-50 bf16 at batch 4
1.027 of OpenVINO bf16 (22:28 UTC; 1.000 and 0.999 at the two stops before); measured
neither way beyond that one run, so left to where the halves were measured.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from pathlib import Path

import torch

from dynvm.jit import background
from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.halves_choice import RoundChoice
from dynvm.jit.backends.cpu.helper_libraries import bound_once, helper_stream
from dynvm.jit.backends.cpu.onednn_matmul import (
    LinearPrimitive,
    LinearSpec,
    LinearWeights,
    dense_operands,
)

_LIBRARY_STEM = "_column_halves"
MAX_ROWS = 64
"""The most rows a linear runs as halves (BERT-base width, Note [Column halves with a
helper thread]), whatever its weight."""
SMALL_MACS = 1 << 25
"""A linear of more rows runs as halves where its multiply-adds (rows x K x N) are at most
this many (Note [Column halves where the team's wake is the cost]: the held-out
encoder's at 128 rows, up to 2^25, gained; BERT-base's at 128 rows, 75M and more, did
not)."""


def with_convolutions(ops) -> bool:
    """Whether a kernel's ops include a convolution: its linears get no halves (Note
    [Column halves where the team's wake is the cost]: the convolutions are its time, and
    a chain of them has a helper of its own)."""
    return any("CONV" in op.opcode for op in ops)


def takes(rows: int, k: int, n: int) -> bool:
    """Whether a linear of `rows` rows over a [N, K] weight also gets column halves."""
    return rows <= MAX_ROWS or rows * k * n <= SMALL_MACS
LATE_NS = 100_000
"""How late the helper's half may be before the caller sleeps on a futex."""
MAX_SPIN_NS = 2_000_000
"""How long the helper spins inside a call without a half to run before it parks."""
PIECES = 4
"""The column pieces a GEMM is cut into, claimed one at a time by the caller and the
helper (Note [Column halves with a helper thread]: a late helper delays the call by at
most one piece)."""
_MAX_PIECES = 8      # native/column_halves.c's MAX_PIECES
_BLOCK = 16          # the pieces' split, in columns: oneDNN's blocking

_THREAD = threading.local()     # .halves: this thread's call owns the helper


class _Halves(ctypes.Structure):
    """struct halves of native/column_halves.c: one GEMM's column pieces."""

    _fields_ = [("primitive", ctypes.c_void_p * _MAX_PIECES),
                ("nargs", ctypes.c_int64 * _MAX_PIECES),
                ("args", ctypes.c_void_p * _MAX_PIECES),
                ("src_memory", ctypes.c_void_p * _MAX_PIECES),
                ("buffer", ctypes.c_void_p * _MAX_PIECES),
                ("cols", ctypes.c_int64 * _MAX_PIECES),
                ("first_col", ctypes.c_int64 * _MAX_PIECES), ("pieces", ctypes.c_int64),
                ("rows", ctypes.c_int64), ("width", ctypes.c_int64),
                ("element_size", ctypes.c_int64), ("binary", ctypes.c_int64)]


def pieces_of(columns: int, pieces: int = PIECES) -> list[tuple[int, int]]:
    """(first column, width) of each piece of a GEMM with `columns` output columns: up
    to `pieces`, each a multiple of 16 wide but the last; an empty list where fewer than
    two pieces fit."""
    width = -(-columns // pieces // _BLOCK) * _BLOCK if columns >= pieces * _BLOCK \
        else _BLOCK
    firsts = list(range(0, columns, width))
    if len(firsts) < 2:
        return []
    return [(first, min(width, columns - first)) for first in firsts]


@dataclasses.dataclass(frozen=True)
class HelperStats:
    """The helper's counters since the process started (native/column_halves.c): they
    say, in a benchmark's own process, what the helper met. Differences of two readings
    cover the calls between them."""

    by_helper: int
    """B halves the helper claimed and ran."""
    by_caller: int
    """B halves the caller took back and ran itself (the helper had not claimed)."""
    wait_ns: int
    """The caller's wait, after its A, for B halves the helper had claimed."""
    sleeps: int
    """Of those waits, how many went to sleep on the futex (B `LATE_NS` late)."""
    claim_ns: int
    """From each post to the helper's claim, summed over the claimed B halves."""
    wake_ns: int
    """From a call's entry to the helper seeing it, summed over the calls it saw."""
    wakes: int
    """The calls the helper saw."""
    parks: int
    """Times the helper parked inside a call after `MAX_SPIN_NS` without a half."""


class _Native:
    """The library's functions (ctypes.PyDLL: called holding the GIL), its helper
    started on oneDNN's execute with a stream of its own."""

    def __init__(self, path: Path, library: api.Library, omp) -> None:
        dll = ctypes.PyDLL(str(path))
        p, i = ctypes.c_void_p, ctypes.c_int
        self.run = dll.dynvm_halves_run
        self.run.argtypes, self.run.restype = [p, ctypes.POINTER(_Halves), p, p, p], i
        self.enter, self.leave = dll.dynvm_halves_enter, dll.dynvm_halves_leave
        self.enter.argtypes, self.enter.restype = [], i
        self.leave.argtypes, self.leave.restype = [], i
        self._counts = dll.dynvm_halves_counts
        self._counts.argtypes, self._counts.restype = [ctypes.POINTER(ctypes.c_longlong)], None
        self._stats = dll.dynvm_halves_stats
        self._stats.argtypes, self._stats.restype = [ctypes.POINTER(ctypes.c_longlong)], None
        self.set_claiming = dll.dynvm_halves_set_claiming
        self.set_claiming.argtypes, self.set_claiming.restype = [i], None
        self.omp = omp
        self.stream = library.stream
        self._helper_stream = helper_stream(library)
        start = dll.dynvm_halves_start
        start.argtypes, start.restype = [p, p, p, p, p, ctypes.c_longlong,
                                         ctypes.c_longlong], i
        status = start(*(ctypes.cast(f, p) for f in (
            library.dll.dnnl_primitive_execute, library.dll.dnnl_memory_set_data_handle,
            omp.omp_set_num_threads, omp.omp_get_max_threads)),
            self._helper_stream, LATE_NS, MAX_SPIN_NS)
        if status != 0:
            raise api.OnednnError(f"the helper thread did not start (error {status})")

    def counts(self) -> tuple[int, int]:
        """B halves run by the helper and by the caller since the process started."""
        out = (ctypes.c_longlong * 2)()
        self._counts(out)
        return out[0], out[1]

    def stats(self) -> HelperStats:
        """What the helper met since the process started (dynvm_halves_stats)."""
        out = (ctypes.c_longlong * 8)()
        self._stats(out)
        return HelperStats(*out)


def native(library: api.Library | None, path: Path | None = None
           ) -> tuple[_Native | None, str]:
    """The halves library bound to `library` (its helper started), or None and why not
    (`path` overrides where it is looked for: tests point it at a missing file)."""
    return bound_once(_LIBRARY_STEM, _Native, library, path)


class HalvesLinear:
    """One linear of an exact kernel at `rows` rows: its column halves while this
    thread's kernel call owns the helper, else `team` (the ordinary primitive linear,
    whose attributes it shows)."""

    def __init__(self, native_: _Native, library: api.Library, team, rows: int,
                 pieces: list[tuple[int, int]], weights: tuple[LinearWeights, ...],
                 bias: torch.Tensor | None) -> None:
        spec: LinearSpec = team.spec
        if spec.binary is not None and spec.result_dtype != torch.float32:
            raise api.OnednnError(f"a {spec.binary} post-op on a {spec.result_dtype} result")
        if not 2 <= len(pieces) <= _MAX_PIECES:
            raise api.OnednnError(f"{len(pieces)} pieces")
        self.team, self.rows, self._native = team, rows, native_
        n = spec.out_features
        previous = native_.omp.omp_get_max_threads()
        native_.omp.omp_set_num_threads(1)     # built for one thread: run inline
        try:
            self._halves = [LinearPrimitive(
                library, LinearSpec(spec.in_features, width, spec.dtype, bias is not None,
                                    spec.eltwise, None, spec.result_dtype),
                rows, piece_weights, None if bias is None else bias[first:first + width])
                for piece_weights, (first, width) in zip(weights, pieces)]
        finally:
            native_.omp.omp_set_num_threads(previous)
        self._buffers = [torch.empty((rows, w), dtype=spec.result_dtype) for _, w in pieces]
        h = self._struct = _Halves()
        for i, (half, buffer, (first, width)) in enumerate(zip(self._halves, self._buffers,
                                                               pieces)):
            h.primitive[i], h.nargs[i] = half._prim.value, half._nargs
            h.args[i], h.src_memory[i] = half._args_pointer.value, half._src.value
            h.buffer[i] = buffer.data_ptr()
            api.check(library.dll.dnnl_memory_set_data_handle(half._dst, buffer.data_ptr()),
                      "halves' buffer")
            h.cols[i], h.first_col[i] = width, first
        h.pieces, h.rows, h.width = len(pieces), rows, n
        h.element_size = torch.empty((), dtype=spec.result_dtype).element_size()
        h.binary = {None: 0, "add": 1, "mul": 2}[spec.binary]
        self._pointer = ctypes.pointer(h)
        self.spec = spec
        self.pieces = len(pieces)

    def impls(self) -> set[str]:
        return self.team.impls() | {f"{p.impl} halves" for p in self._halves}

    def __getattr__(self, name):      # by_rows, fallback, ...: the team's
        return getattr(self.__dict__["team"], name)

    def __call__(self, x: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
        if not getattr(_THREAD, "halves", False):
            return self.team(x, other)
        n = self.spec.out_features
        if x.numel() != self.rows * self.spec.in_features:
            return self.team(x, other)
        rows, other = dense_operands(self.spec, x, other)
        operand = None if other is None else other.data_ptr()
        out = torch.empty((self.rows, n), dtype=self.spec.result_dtype)
        api.check(self._native.run(self._native.stream, self._pointer, rows.data_ptr(),
                                   out.data_ptr(), operand), "column halves")
        return out.view(*x.shape[:-1], n)


def halves_of(team, library: api.Library, native_: _Native, rows: int, plain, prepacked,
              key: tuple, bias: torch.Tensor | None) -> HalvesLinear:
    """`team` (a PrimitiveLinear at `rows` rows) as column pieces (`pieces_of`), their
    weights reordered from `plain` ([N, K]) once per engine under PrepackCache `key`s."""
    n = team.spec.out_features
    pieces = pieces_of(n)
    if not pieces:
        raise api.OnednnError(f"{n} columns: no halves")
    weights = tuple(prepacked.get(
        (key[0], "onednn-linear-pieces", *key[2:], first, width),
        lambda first=first, width=width: LinearWeights(library, plain()[first:first + width]))
        for first, width in pieces)
    return HalvesLinear(native_, library, team, rows, pieces, weights, bias)


class KernelHalves:
    """A kernel's entry and exit (Note [Column halves with a helper thread]): each call
    runs halves or the team as `choice` says, owning the helper for the halves."""

    def __init__(self, native_: _Native, force: bool | None = None) -> None:
        self._native = native_
        self.choice = RoundChoice()     # Note [Halves chosen in rounds]
        self._force = force      # True / False: always halves / team (the A/B's arms)
        self.b_halves = {"helper": 0, "caller": 0}   # this kernel's, since it was built

    def enter(self):
        if getattr(background._LOCAL, "background", False):
            return None   # a compile worker's run (calibration, probation): the team
        if torch.get_num_threads() < 2:
            return None   # one thread asked for: no helper beside it (untimed)
        halves = self.choice.next() if self._force is None else self._force
        if halves:
            if not self._native.enter():
                return None       # another thread's call has the helper: the team
            _THREAD.halves = True
        return halves, time.perf_counter(), background.worker_task().running

    def leave(self, token) -> None:
        if token is None:
            return
        halves, start, compiling = token
        seconds = time.perf_counter() - start
        if compiling or background.worker_task().running:
            seconds = None        # the compile worker shared the cores: not a timing
        starved = False
        if halves:
            _THREAD.halves = False
            counts = self._native.leave()
            by_helper, by_caller = counts >> 16, counts & 0xFFFF
            self.b_halves["helper"] += by_helper
            self.b_halves["caller"] += by_caller
            # under a quarter of the pieces: under half of its share
            starved = 3 * by_helper < by_caller
        self.choice.record(halves, seconds, starved)


def kernel_halves(spec_ops, force: bool | None = None) -> KernelHalves | None:
    """The entry and exit for a kernel whose ops include a HalvesLinear, else None."""
    for op in spec_ops:
        for arg in op.args:
            linear = getattr(arg, "value", None)
            if isinstance(linear, HalvesLinear):
                return KernelHalves(linear._native, force)
    return None
