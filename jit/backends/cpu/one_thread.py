"""Small operations on the calling thread: which ops of a CPU kernel run with one
OpenMP thread, chosen by measurement.

Note [Small ops on one thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
ATen parallelizes many ops however small their input (layer norm and softmax split
their rows with a grain of one row, SDPA its batch x heads), so every such op opens an
OpenMP parallel region. Where the workers sleep between regions (OMP_WAIT_POLICY=PASSIVE,
which the benchmarks and the suite run with, bench/_omp.py and tests/conftest.py)
each region first wakes them through the kernel, and on a loaded 2-core host the wake
costs more than the op: layer norm over [1, 16, 768] took 63 us a call alone at load 5
and 4-8 us on the calling thread. ONNX Runtime's thread pool runs such ops inline by a
cost model; torch has none. Measured at BERT-base width (the layers' op sequence, four
layers, oneDNN GEMMs on two threads; 2 threads, PASSIVE, load 0.2, interleaved, 150
calls): M=16 10.68 -> 9.83 ms, M=64 18.75 -> 18.05, M=128 30.36 -> 30.08 with layer
norm and SDPA on one thread.

So `plan_one_thread` asks the calibrator (Note [Calibration]), per (opcode, variant,
size class of its largest tensor, threads), whether the op runs faster on the calling
thread alone than on torch's team, timed alone on zero operands of the planning probe's
shapes (the family's largest, so a smaller size of the family has more reason, not
less). Under an active wait policy the workers spin between the calibration's calls as
they do between a kernel's ops, and the team wins there. Only ops whose largest tensor
has at most `MAX_ELEMENTS` elements are asked (a larger op gains from the team, and
a question at that size would cost milliseconds of the compile thread); views, ops that
return an operand, GEMMs (they are oneDNN's or BLAS's to thread), ops that write state
and data-dependent ops are never asked, and views do not end a one-thread run.

The generated code switches with `omp_set_num_threads` of the OpenMP runtime torch
loaded (thread-local: the compile thread, a shadow call and other request threads are
not touched, unlike torch.set_num_threads, which also stores the count that new threads
start with), once per run of consecutive chosen ops, and restores the caller's count
in a `finally` (read at entry with `omp_get_max_threads`: torch.get_num_threads answers
the process's count, not the thread's), so a kernel that raises leaves the thread as it
found it. Where no such runtime is found (another build, another OS), nothing is
rewritten.

In the BERT-base-width model (4 layers, bench.full_width's), exact kernels of the same
process with and without this pass, interleaved call by call (40 calls a shape, 2
threads, PASSIVE, load 2.6, A/A 0.998), x eager: 1x16 0.655 -> 0.595, 1x32 0.745 ->
0.708, 2x16 0.747 -> 0.702, 2x32 0.660 -> 0.625 (layer norm and SDPA, or the
embeddings' adds and layer norm, chosen per kernel). In a run beside the peers at load
3.3 (12 calls a shape) the two were within noise of each other (1x16 0.433 / 0.435).

The cap was 2^18 elements until a verdict taken under load put SDPA and layer norm on
one thread at 1x128 (largest tensors 98,304-196,608 elements), where the team is the
right answer on a quiet host: bench.full_width's 1x128 ran 1.24-1.35x OpenVINO in the
rotation and 1.04x seasoned alone. Every askable op on one thread against none, in one
process (exact kernels, 15 rounds interleaved, 2026-12-05 21:44 UTC, load 1.4, A/A
0.987-1.008): 1x16 0.912, 1x64 0.961, 2x32 1.015, 4x32 1.010, 2x64 1.038, 1x128 1.242.
The gain ends near 2^16 elements (1x64's and 2x32's layer norm are 49,152), so that is
the cap: a larger op is never asked, whatever the host's load at compile time.

SDPA is never asked (NEVER_ASKED). Its question is timed on zero operands, and its
answer did not hold on the calls: BERT-base width's bf16 exact kernel at 2x32 ran 0.84x
the interpreter where the other shapes' ran 0.26-0.41x, each of its four SDPA calls
3.6-4.3 ms on one thread inside the kernel against 0.16 ms with the team, the same
tensors (2026-12-06 00:17 UTC, load 1.6; bench.full_width's jit-bf16 1x32 / 2x32 at
1.83 / 2.54x OpenVINO bf16 in the 00:02 run). Alone, with omp_set_num_threads(1),
SDPA at BERT's batch 1-8 x seq 16-64 shapes took 1.3-3.5x (bf16) and 1.4-2.3x (fp32)
the team's time (00:19, load 1.4). Without it the 2x32 kernel ran 0.365x the
interpreter, every other shape within noise (fp32 too: 0.67-0.91 either way, 5 calls a
shape).

Layer norm is put on the calling thread without asking above `MAX_ELEMENTS`, up to
`ALWAYS_ONE`'s bound (Note [Layer norm on one thread in the call]).

GEMMs stay on the team even where everything else of the call runs on this thread
(BERT-base width at 16-64 rows: attention and layer norm here, only the 16 linear
primitives open regions): the bf16 linears as one-thread primitives, the caller running
every piece (column halves' primitives with the helper never claiming), against the team,
whole model, one process, interleaved call by call with an A/A, runtimes seasoned and
drained (/tmp/h35t/ab.py, 2026-12-06 14:11 UTC, load 2.0, A/A 0.978-1.007): 1x16 1.214,
1x32 1.321, 2x16 1.332, 2x32 1.366, 1x64 1.335, 4x16 1.375. One core streams the
weights too slowly for the wake it saves (~0.1 ms a GEMM); splitting the columns with a
helper thread (Note [Column halves with a helper thread]) keeps the second core without
the region, and ran 0.77-0.91 of the team in the same run.

Note [Layer norm on one thread in the call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Inside BERT-base width's fp32 call at 1x128 (98,304 elements) torch's layer norm on the
team took 107-144 us each (the call's walls), alone 39 us with a warm input, 85 us right
after the GEMM that wrote its input on the team: most of the in-call cost is the input's
state (rows just written by the other core too), and the rest the passive team's wake,
which a calibration of the op alone on zero operands does not see (alone, team and one
thread tie: 85 / 84 us after the GEMM, 39 / 38 warm). On the calling thread in the call
it took 80-98 us (/tmp/h34l/where.py, 13:01 UTC, load 3.6). So LAYER_NORM over at most
2^17 elements runs on one thread whatever the calibrator says (the ops up to
`MAX_ELEMENTS` are still asked; no other op is forced). In the whole model, one process,
layer norm at 2^16-2^17 elements on one thread against the team, switched call by call
with an A/A, 30 rounds (/tmp/h34l/ab_win.py, 13:07 UTC, load 2.2-2.3): 1x128 0.980, 2x64
0.980 (A/A 0.997-1.003); dynvm's C kernel (native/layer_norm_bf16.c, fp32 alone) on one
thread there 0.997 / 0.983, and 0.978 / 0.991 in the run before (13:04, load 2.6-3.6):
no better than torch's on one thread, so torch's runs. Built, runtimes seasoned with and
without it, interleaved with an A/A (/tmp/h34l/ab_final.py): fp32 1x128 0.990 / 0.975,
2x64 0.976 / 0.986 (13:13 / 13:18 UTC, load 2.3 / 1.9; A/A 0.984-1.006), 1x16, 1x64 and
8x128 (not taken) 0.989-1.014; bf16 (the first and last layer norm only: the others are
LAYER_NORM_BF16, already one thread) 1x128 1.020 / 1.004, 2x64 1.009 / 1.002 (A/A
0.985-1.002), within the noise. At 2^17-2^18 elements (2x128, 4x64, 1x256) one thread
gained nothing (0.993-1.003, 13:16, load 1.9), nor the C kernel there (0.995-1.008), so
the bound is 2^17 and the team runs past it.

On the 2-core AMD EPYC (Zen 5, no AMX) torch's layer norm is slower alone than on the
Intel host, and the C kernel (fp32 result only) ran well ahead of it alone at BERT-base
8x64's 512 x 768 (2 threads passive, 17:14 UTC, load 3.5; us a call, torch team / torch
one thread / C team / C one thread): warm input 99 / 91 / 50 / 40, input just written
by a linear 173 / 182 / 114 / 102; at 128 rows 32 / 25 / 19 / 11 and 63 / 68 / 49 / 37.
In the whole fp32 model (BERT-base width, 4 layers, every LAYER_NORM on the C kernel,
its threads those of the call's team or one thread where this pass chose it, against
two runtimes on torch's, settled, drained, interleaved; 17:21 and 17:25 UTC, load
4.2-5.8 beside the suite): 1x16 0.962 / 1.013, 1x64 0.955 / 0.979, 2x64 0.985 / 1.003,
4x64 1.002 / 0.978, 8x64 0.984 / 1.005, 8x128 0.983 / 0.991 (A/A 0.938-1.004 /
0.991-1.011): no gain the A/A resolves (nine layer norms are ~0.6 ms of 8x64's ~70 ms
even at the alone figures), so torch's layer norm stays.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re

import torch

from dynvm.jit.backends.cpu.arena_choice import tensors_in, zeros_like_abstract
from dynvm.jit.backends.cpu.shape_constants import SHAPE_CONSTANT
from dynvm.jit.calibration import Calibrator, size_class
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, Var
from dynvm.vm.opcodes import OPCODES

TEAM, ONE = "team", "one thread"
# Ops above this many elements in their largest tensor are never asked (see the Note).
MAX_ELEMENTS = 1 << 16
NEVER_ASKED = frozenset({"SDPA"})   # Note [Small ops on one thread]: its last paragraph
# Ops put on one thread unasked up to this many elements in their largest tensor
# (Note [Layer norm on one thread in the call])
ALWAYS_ONE = {"LAYER_NORM": 1 << 17}


@functools.lru_cache(maxsize=1)
def openmp_runtime():
    """The OpenMP runtime torch runs its threads on (a ctypes library), or None. Another
    package may map one of its own beside it (CTranslate2's wheel carries its own
    libgomp, whose path sorts first): one inside torch's package is taken first, so
    that the thread counts read and set here are torch's team's."""
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:
        return None
    found = sorted(set(re.findall(r"(/\S*(?:libgomp|libiomp5|libomp)[^/\s]*\.so\S*)", text)))
    # torch/lib/... or torch.libs/... beside the package
    torch_prefix = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "torch")
    for path in sorted(found, key=lambda path: not path.startswith(torch_prefix)):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            lib.omp_set_num_threads.restype = None
            lib.omp_get_max_threads.argtypes = []
            lib.omp_get_max_threads.restype = ctypes.c_int
        except (OSError, AttributeError):
            continue
        return lib
    return None


def openmp_setter():
    """`omp_set_num_threads` of the loaded OpenMP runtime (this thread's count), or None."""
    lib = openmp_runtime()
    return None if lib is None else lib.omp_set_num_threads


def openmp_getter():
    """`omp_get_max_threads` of the loaded OpenMP runtime: this thread's own count
    (torch.get_num_threads answers the process's, not the thread's), or None."""
    lib = openmp_runtime()
    return None if lib is None else lib.omp_get_max_threads


def neutral(op) -> bool:
    """An op that moves no data (a view, or its operand back): it neither gains from
    one thread nor ends a run of ops on one."""
    if op.opcode == SHAPE_CONSTANT:   # a constant handed over (Note [Shape constants in kernels])
        return True
    spec = OPCODES.get(op.opcode)
    return spec is not None and op.variant == "" and (spec.is_view or spec.returns_operand)


def _operand(arg, probe, constants, device):
    if isinstance(arg, Var):
        return probe.get(arg.reg)
    if isinstance(arg, ConstRef):
        return constants[arg.index]
    if isinstance(arg, Literal):
        return device if isinstance(arg.value, torch.device) else arg.value
    return [_operand(item, probe, constants, device) for item in arg]


def _askable(op, probe, constants, device, limit: int = MAX_ELEMENTS):
    """(the op's run function, abstract operands, largest tensor's numel), or None."""
    spec = OPCODES.get(op.opcode)
    if (spec is None or op.opcode in NEVER_ASKED or op.variant not in ("", "inplace")
            or spec.gemm is not None
            or spec.writes_state or spec.data_dependent or spec.is_view
            or spec.returns_operand or spec.impl is None):
        return None
    fn = spec.inplace if op.variant == "inplace" else spec.impl
    if fn is None or any(isinstance(a, Var) and a.reg not in probe for a in op.args):
        return None
    operands = [_operand(a, probe, constants, device) for a in op.args]
    results = [probe.get(d) for d in op.dsts]
    tensors = list(tensors_in(operands)) + [r for r in results if isinstance(r, torch.Tensor)]
    if not any(isinstance(r, torch.Tensor) for r in results) or not tensors:
        return None
    largest = max(t.numel() for t in tensors)
    if largest > limit:
        return None
    return fn, operands, largest


def plan_one_thread(spec: SpecializedRegion, constants, device: torch.device,
                    calibrator: Calibrator | None) -> tuple[frozenset, str]:
    """Note [Small ops on one thread]: the positions in `spec.ops` to run on the calling
    thread, and a note for the kernel's header; `calibrator` None: every op that may be
    asked (tests, debugging)."""
    if device.type != "cpu" or openmp_runtime() is None or not spec.abstract:
        return frozenset(), ""
    setter, threads = openmp_setter(), openmp_getter()()
    if threads <= 1:
        return frozenset(), ""
    planning = spec.abstract[0]
    chosen = []
    for position, op in enumerate(spec.ops):
        bound = ALWAYS_ONE.get(op.opcode) if op.variant == "" else None
        found = _askable(op, planning, constants, device, max(MAX_ELEMENTS, bound or 0))
        if found is None:
            continue
        if calibrator is None or (bound is not None and found[2] > MAX_ELEMENTS):
            chosen.append(position)
            continue
        fn, operands, largest = found

        def candidates(fn=fn, operands=operands):
            real = [_real(v, device) for v in operands]

            def team():
                fn(*real)

            def alone():
                setter(1)
                try:
                    fn(*real)
                finally:
                    setter(threads)
            return {TEAM: team, ONE: alone}
        key = (op.opcode, op.variant, size_class(largest), threads)
        try:
            choice = calibrator.choose("one thread", key, candidates)
        except Exception:  # noqa: BLE001 - any op refusing zero operands keeps the team
            continue
        if choice.name == ONE:
            chosen.append(position)
    if not chosen:
        return frozenset(), ""
    how = "not measured: forced on" if calibrator is None else "measured faster so"
    names = sorted({spec.ops[p].opcode for p in chosen})
    return frozenset(chosen), (f"one thread: {len(chosen)} small op(s) on the calling "
                               f"thread ({', '.join(names)}; {how})")


def _real(value, device):
    if isinstance(value, list):
        return [_real(v, device) for v in value]
    return zeros_like_abstract(value, device)
