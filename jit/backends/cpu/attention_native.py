"""Masked attention over short sequences in dynvm's own C kernel: a pass over a
specialized region (after fusion and the bf16 lowering's attention pass), and the
kernel's wrapper.

Note [Masked attention of our own]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A BERT layer's SDPA runs torch's CPU flash kernel: per (batch, head, block of 32
queries) two small BLAS calls, the mask added per block (a boolean one first made an
additive tensor on every call), and the softmax between. At BERT-base's heads (12 x 64)
and 16-128 tokens each call is a few microseconds of work for each of many calls:
measured alone (2 threads, passive OpenMP, 2026-12-06 10:01 UTC, load 1.3-1.8), SDPA
with a boolean mask took 0.25 / 0.36 / 0.63 / 1.39 / 3.86 ms at 1x64 / 2x64 / 1x128 /
8x64 / 8x128 in fp32, about 80-100 GFLOP/s of two cores' ~300; the same maths as
torch's batched GEMMs (baddbmm, softmax, bmm) was slower still (0.54-7.3 ms).

So here each (batch, head) is one piece of work on torch's OpenMP team
(native/attention.c): K packed transposed once ([D][L], 16-key vectors), then blocks of
8 queries take their scores 32 keys at a time in 16 AVX-512 accumulators, the mask read
as it is (boolean: false is -inf; or additive, fp32 or bf16), the row's softmax in place
(a vectorized exp, relative error ~1e-7), and P V in blocks of 4 rows x D in
accumulators; bf16 operands are widened to fp32 on the way in (scores, softmax and P V
in fp32, the result rounded to bf16 once). A row masked everywhere gives 0, as torch's
kernel does. The result has the strides torch's flash kernel gives it (`empty_like` of
the query: BERT's [B, S, H, D] layout, which the output projection then reads as a
view), so the region's abstract values stay true.

A block of 8 queries computes scores and P V only up to the last key any of its rows
keeps (right padding: BERT's masked tail costs nothing), which torch's kernel cannot
know.

Measured in the whole model (BERT-base width, 4 layers, exact fp32 kernels in one
process on / off with an A/A of two "off" runtimes, interleaved call by call, 30 rounds,
2 threads passive; 2026-12-06 10:10-10:28 UTC, load 1.5-2.3, three runs): 1x128 0.991 /
0.986 / 0.986, 2x128 0.985, 8x128 0.980 / 0.990 / 0.978 (A/A 0.994-1.007); at 64 keys
1x64 1.004 / 1.008 / 1.017, 2x64 1.008 / 0.997 / 0.999, 4x64 0.986 / 1.002 / 0.999 (A/A
0.986-1.011): a tie, so on Intel the pass takes 96 keys or more (`INTEL_MIN_KEYS`;
elsewhere Note [fp32 attention where MKL runs its generic code]). Alone, SDPA at
BERT-base's heads with a quarter of the keys masked (10:22, load 1.7-1.9): 0.72-0.96 of
torch's fp32 kernel; in bf16 1.1-1.7x torch's, whose flash kernel runs its GEMMs on
AMX (before the masked-tail skip; 10:09, load 2.3): bf16 has its own version on AMX
tiles (Note [bf16 attention on AMX tiles]). With
the passive OpenMP wait the second thread wakes late (~50-100 us), so the pairs are
taken one at a time: the caller never waits for its share.

Which: an fp32 SDPA (no dropout, not causal) whose q, k and v are [B, H, rows, D] with
the same B and H, D a multiple of 16, the last dim contiguous, `MIN_KEYS` to `MAX_KEYS`
keys, and a mask absent, boolean or of q's dtype broadcasting to the scores, at every
probe (bf16: Notes [bf16 attention on AMX tiles], [bf16 attention with AVX512-BF16 dot
products]); at run time the operands are checked
again and torch's SDPA runs where the kernel does not read them (or where the library
is missing). The numbers: the same maths in another order (sums over D and over keys
in other orders, exp to ~1 ulp), so results differ from torch's by float rounding; in
bf16 (off the tiles) the probabilities are not rounded to bf16 before P V, as the flash
kernel rounds them.

Note [fp32 attention where MKL runs its generic code]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Note [Masked attention of our own]'s figures are from an Intel host (AMX). torch's fp32
flash kernel runs its per-block GEMMs in MKL, which picks its code by the CPU's vendor:
on a 2-core AMD EPYC (Zen 5, AVX-512, no AMX) MKL_VERBOSE names its generic "Intel(R)
Architecture processors" branch and a one-thread sgemm ran 85 / 110 GFLOP/s at 64^3 / 256^3 (17:10
UTC, load 1.8). There the kernel, alone, at BERT-base's heads (12 x 64, q/k/v views of
one [B, S, 2304] tensor, right padding keeping half to all of each row, 2 threads
passive, interleaved with an A/A of torch against itself, 2026-12-06 17:05 UTC, load
2.2-2.3) ran 0.30-0.55x torch's SDPA from 16 to 64 keys at batch 1-8 with an additive
fp32 mask ([B, 1, S, S] expanded from [B, 1, 1, S]): 1x16 0.550, 8x16 0.314, 1x32 0.497,
8x32 0.428, 1x64 0.485, 8x64 0.403; with a boolean mask 0.29-0.49 (torch 0.27 / 0.42 /
1.94 ms at 8x16 / 8x32 / 8x64); A/A 0.918-1.008; max |out - torch| 2.4e-7-4.8e-7. In the
whole model (BERT-base width, 4 layers, fp32 JIT runtimes in one process: the pass from
16 keys / from 96 / from 96 again, each settled at every shape and huge pages drained,
interleaved call by call, same host; two runs, 30 rounds at 17:07 UTC, load 2.1, and 60
rounds at 17:09, load 2.2-2.4): 1x16 0.958 / 0.957, 2x16 0.974 / 0.952, 8x32 0.980 /
0.972, 1x64 0.980 / 0.957, 4x64 0.970 / 0.946, 8x64 0.945 / 0.966 (A/A 0.982-1.027);
max |out - eager| 2.7e-6-4.9e-6 from 16 keys, 2.5e-6-4.4e-6 from 96. So on a CPU
whose vendor is not Intel the pass takes fp32 SDPAs from `NOT_INTEL_MIN_KEYS` (16)
keys, on Intel (or where /proc/cpuinfo names no vendor) from `INTEL_MIN_KEYS` (96), as
measured there. Below 16 keys nothing was measured. Small fp32 calls on the calling
thread alone (as the bf16 versions take them) gained nothing there: whole model, one
runtime, at most 12,288 / 49,152 scores on one thread over the team, 40 rounds, 17:12
UTC, load 2.0-2.7: 0.987-1.012 at 1x16..8x16, 1x32..4x32 and 1x64 (A/A 0.994-1.010),
so fp32 calls keep the team.

Note [Attention written by hand on our kernel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Attention written out by hand (q @ k^T, a scale, softmax, @ v) reaches this pass as an
SDPA the specializer fused (Note [Probes] in dynvm.jit.specialize), but its result's
abstract value is the last matmul's: contiguous [B, H, S, D], not torch's flash layout
([B, S, H, D] under the [B, H, S, D] view) that `empty_like` of a query gives. The
pass asked for the flash layout alone, so these SDPAs all stayed on torch's kernel: the
held-out encoder's (bench/heldout.py, 8 heads of 32, 32 keys) at 76 us a call at batch 1
against the kernel's 50 (alone, 2 threads, 2-core AMD EPYC Zen 5, 2026-12-06 21:10 UTC).
The kernel writes any layout whose last dim is dense (its result strides are
arguments), so where every probe's result is contiguous the SDPA becomes
`CONTIGUOUS_ATTENTION`, the kernel writing that layout (torch's SDPA, where it does not
read the operands, made contiguous after); the region's abstract values stay true.
The heads' merge written `.transpose(1, 2).contiguous().view(...)` (or `.reshape`,
which export lowers to the same clone and view) then folds into one call from the
Q/K/V result (Note [Attention without its views]): the copy's fresh contiguous result
is what that call returns.
Measured (the held-out encoder, seq 32, JIT runtimes with the pass taking only the
flash layout (two: the A/A) and with this, each settled at every batch and huge pages
drained, interleaved call by call with eager and ONNX Runtime, 30 rounds; 2 threads,
passive OpenMP; 2-core AMD EPYC Zen 5, no AMX; 21:12 UTC, load 1.0-1.3;
/tmp/lead/s27/ab_attn.py): this / before 0.954 / 0.865 / 0.879 / 0.893 at batch 1 / 4 /
16 / 64 (A/A 1.028 / 0.994 / 1.012 / 0.997); x eager 0.511 / 0.423 / 0.376 / 0.426,
ONNX Runtime 0.386 / 0.443 / 0.419 / 0.506 in the same run. Every output within 1e-3
of eager's (tests: within 1e-5 over random shapes and offset inputs).
At batch 1 (8 x 32 x 32 scores) the call then runs on the calling thread alone
(`FP32_ONE_THREAD_SCORES`): one JIT runtime, the threshold alternated call by call with
eager between (21:18-21:19 UTC, load 1.5-1.8; /tmp/lead/s27/ab_knob.py), alone / team
0.961 and 0.967 (A/A 1.003, 1.010), batch 2 and 4 (over it) 0.997-1.003; BERT-base width
the same way (21:21, load 1.8; ab_knob_bert.py) 1x16 0.999, 1x32 0.994, 2x16 1.002, 4x16
0.997 (A/A 0.988-1.006): a tie there, as Note [fp32 attention where MKL runs its generic
code] found.

Note [bf16 attention on AMX tiles]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under precision "bf16" a BERT layer's SDPA reads bf16 views of its Q/K/V GEMM's result
with a bf16 bias (Notes [bf16 attention between bf16 GEMMs], [One bf16 mask bias a
call]), and torch's flash kernel runs its two products as AMX brgemm calls. The AVX-512
kernel above, widening bf16 to fp32, ran 1.3-2.0x torch's there at 64-128 keys; with
AVX512-BF16 dot products (vdpbf16ps: 32 products an instruction) 1.6-2.6x, because here
a vdpbf16ps costs 1.65x an fp32 FMA (1.71 against 1.04 ns a 16-lane instruction, 16
independent chains), so it gains only 1.2x over FMAs. So bf16 operands with D a
multiple of 32 go to a version on AMX tiles (`dynvm_attention_amx` in native/attention.c):
per (batch, head), taken one at a time on torch's team as above, K packed once into
tdpbf16ps's pair layout (a 16 x 16 transpose of 32-bit pairs) and V into pairs of keys;
per block of 16 queries the scores 64 keys at a time in four fp32 tiles (Q's rows read
in place), up to the last key a row of the block keeps; scale, mask and softmax in
AVX-512 fp32; the unnormalized probabilities rounded to bf16, as torch's flash kernel
rounds them for its P V GEMM (the sum from the fp32 values); P V into four tiles of 16
columns; the result scaled by 1 / sum and rounded to bf16 once, in torch's layout.
The process asks the kernel for the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM, once;
where it is refused the AVX-512 kernel runs); each call's threads load the tile
configuration and release the tiles at the end, as torch's brgemm users do.

Measured alone (BERT-base heads 12 x 64, bf16 q/k/v views of one [B, S, 2304] tensor, a
[B, 1, S, S] bf16 bias with right padding, 2 threads passive, interleaved with an A/A
of torch against itself, 2026-12-06 13:05:52 UTC, load 2.3): AMX / torch's flash
0.818 / 0.624 / 0.775 / 0.783 at 1x16 / 1x32 / 1x64 / 1x128, 0.730 / 0.560 / 0.703 /
0.815 at 2x, 0.557 / 0.500 / 0.673 / 0.779 at 4x, 0.522 / 0.476 / 0.701 / 0.704 at 8x
(A/A 0.984-1.062). In the whole model (BERT-base width, 4 layers, exact bf16 kernels,
`native_attention` on / off / off again, interleaved call by call, 30 rounds, 13:08
UTC, load 2.0-2.2): 1x16 0.962, 1x64 0.941, 2x64 0.924, 1x128 0.922, 2x128 0.945, 8x128
0.961 (A/A 0.994-1.030); max |out - fp32 eager| 1.01e-2-1.23e-2 on, 1.01e-2-1.26e-2
off. So the pass takes bf16 SDPAs of `AMX_MIN_KEYS` (16) to `MAX_KEYS` keys. Inside the
model the kernel's calls cost more than alone (its operands fresh from the GEMM, half in
the other core's cache, and the passive team to wake): timed in the kernel (13:16 UTC,
load 1.7-1.9) 0.63 / 0.55 / 0.60 / 0.55 ms a call at 1x16 / 1x32 / 1x64 / 2x16 with the
team, 0.33 / 0.37 / 0.51 / 0.36 on the calling thread alone, whole calls one / two
threads 0.960 / 0.970 / 0.991 / 0.981, 2x64 1.002, 1x128 1.001, 4x64 0.999, 8x128 1.054
(A/A 0.990-1.012): so at most `AMX_ONE_THREAD_SCORES` scores (1x64's) run on the
calling thread (at its edge a tie: 4x32 1.007, 8x16 0.996, A/A 1.007 / 0.995, 13:33).
With it, on / off (13:19 and 13:33 UTC, load 1.6-1.9): 1x16 0.931, 1x32 0.963, 1x64
0.947, 2x16 0.963, 2x32 0.962, 4x16 0.972, 4x32 0.945, 8x16 0.953, 8x32 0.975, 4x128
0.948 (A/A 1.008-1.033). Rounding P
to bf16 or not moved the distance from fp32 SDPA little next to the result's own bf16
rounding (alone, max |out - fp32 SDPA| at 2x64 4.07e-3 rounded, 3.74e-3 fp32 P; torch's
flash 4.26e-3).

Note [bf16 attention with AVX512-BF16 dot products]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a CPU with AVX512-BF16 but no AMX (measured on a 2-core AMD EPYC, Zen 5) torch's
flash kernel runs a bf16 SDPA slowly: in the whole model (BERT-base width, 4 layers,
bf16, `bench.width_profile --walls`, 2026-12-06 16:44 UTC, load 1.8) SDPA took 3.45 of
20.92 ms at 2x128 and 16.80 of 82.99 ms at 8x128, ~96 GFLOP/s, where the same calls'
bf16 GEMMs ran ~930 GFLOP/s (so vdpbf16ps runs at full rate there, unlike the Intel
host above). There bf16 operands with D a multiple of 32 go to `dynvm_attention_bf16dot`
(native/attention.c): K and V packed in pairs as for the tiles; per block of 8 queries
the scores 32 keys at a time in 16 AVX-512 accumulators by vdpbf16ps (a query's bf16
pair broadcast from where it lies, times 16 keys' pairs), up to the last key a row of
the block keeps; scale, mask and softmax in fp32; the unnormalized probabilities
rounded to bf16, as torch's flash kernel and the tiles round them; P V by vdpbf16ps
over pairs of keys in blocks of 4 rows x 64 columns; scaled by 1 / sum, rounded to bf16
once. The (batch, head) pairs are taken one at a time on torch's team, and calls of at
most `DOT_ONE_THREAD_SCORES` scores run on the calling thread (the AMX threshold; on
this host, whole bf16 model, the threshold set per call, 30 rounds, 16:58-17:01 UTC,
load 2.0-2.5: the team at every size / this one 1.065 at 1x16, 1.015 at 1x32 and 1x64,
0.981-1.011 from 2x32 to 8x32; one thread up to 200,000 scores / this one 0.986-1.021;
A/A 0.991-1.020: this threshold holds).

Measured alone (BERT-base heads 12 x 64, bf16 q/k/v views of one [B, S, 2304] tensor, a
[B, 1, S, S] bf16 bias with right padding, 2 threads passive, interleaved with an A/A of
torch against itself, 16:48 UTC, load 2.8-4.2, 2-core AMD EPYC Zen 5, no AMX): dot
products / torch's flash 0.409 / 0.272 / 0.247 at 1x16 / 1x64 / 1x128, 0.227 at 2x128,
0.223 at 4x128, 0.239 at 8x64, 0.254 at 8x128 (A/A 0.991-1.016); max |out - fp32 SDPA|
the same as torch's bf16 kernel's at each shape (2.3e-3-4.9e-3). In the whole model
(BERT-base width, 4 layers, bf16, `native_attention` on / off / on again, interleaved
call by call, 24 rounds, each runtime settled, 16:49-16:51 UTC, load 2.0-3.3, same
host): on / off 1x16 0.896, 1x128 0.869, 2x128 0.854, 4x128 0.854, 8x64 0.914, 8x128
0.866 (A/A 0.988-1.029); max |out - fp32 eager| 1.26e-2 on, 1.25e-2 off.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from dynvm.jit.backends.cpu.ir_match import probe_tensors
from dynvm.jit.backends.cpu.native_linear import find_extension
from dynvm.jit.backends.cpu.one_thread import openmp_getter
from dynvm.jit.ir import Literal, SpecializedRegion, SpecOp, Var

ATTENTION = "MASKED_ATTENTION"
CONTIGUOUS_ATTENTION = "MASKED_ATTENTION_CONTIGUOUS"
ATTENTION_VARIANT = "native-attention"
MAX_KEYS = 256
"""Past 256 keys nothing was measured (the Note); the kernel itself reads up to MAX_KEYS."""

INTEL_MIN_KEYS = 96
"""On an Intel CPU the pass takes fp32 SDPAs of this many keys to MAX_KEYS: there (with
MKL's AVX-512 GEMMs under torch's kernel) the whole model ties torch's at 64 keys (Note
[Masked attention of our own])."""

NOT_INTEL_MIN_KEYS = 16
"""On another vendor's CPU the pass takes fp32 SDPAs of this many keys to MAX_KEYS: MKL
runs its generic code there, and the kernel beat torch's from 16 keys on (Note [fp32
attention where MKL runs its generic code])."""


def _cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def fp32_min_keys(vendor: str) -> int:
    """The fewest keys of an fp32 SDPA the pass takes on a CPU of `vendor` (an unknown
    vendor gets the Intel figure, the one that holds where torch's GEMMs are fast)."""
    return INTEL_MIN_KEYS if vendor in ("GenuineIntel", "") else NOT_INTEL_MIN_KEYS


MIN_KEYS = fp32_min_keys(_cpu_vendor())
"""The pass takes fp32 SDPAs of MIN_KEYS to MAX_KEYS keys on this CPU."""

AMX_MIN_KEYS = 16
"""The pass takes bf16 SDPAs of this many keys to MAX_KEYS on AMX tiles (Note [bf16
attention on AMX tiles]): BERT's 16-128 measured faster than torch's flash kernel."""

AMX_ONE_THREAD_SCORES = 12 * 64 * 64
"""bf16 attention on AMX tiles with at most this many scores (B x H x S x L) runs on the
calling thread alone (Note [bf16 attention on AMX tiles]: the team's passive wake costs
more than the second core gives at BERT-base's 1x16..1x64)."""

FP32_ONE_THREAD_SCORES = 12 * 32 * 32
"""fp32 attention with at most this many scores (B x H x S x L) runs on the calling thread
alone (Note [Attention written by hand on our kernel]: the held-out encoder's batch 1,
8 x 32 x 32, gained; BERT-base's 1x16..1x32, up to this, tied, Note [fp32 attention where
MKL runs its generic code])."""

DOT_MIN_KEYS = 16
"""The pass takes bf16 SDPAs of this many keys to MAX_KEYS on AVX512-BF16 dot products
(Note [bf16 attention with AVX512-BF16 dot products])."""

DOT_ONE_THREAD_SCORES = AMX_ONE_THREAD_SCORES
"""As AMX_ONE_THREAD_SCORES, for the AVX512-BF16 version."""

_MASKS = {None: 0, torch.bool: 1, torch.float32: 2, torch.bfloat16: 3}
_DTYPES = (torch.float32, torch.bfloat16)


def _load():
    path = find_extension("_attention")
    if path is None:
        return None, False, ("_attention was not built (setup.py compiles it at install; "
                             "reinstall dynvm with a C compiler present)")
    try:
        library = ctypes.PyDLL(str(path))   # called holding the GIL, as torch's ops are
    except OSError as exc:
        return None, False, f"{path.name} did not load: {exc}"
    if not library.dynvm_attention_supported():
        return None, False, "this CPU has no AVX-512F"
    p, n, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    strides = ctypes.POINTER(ctypes.c_long)
    library.dynvm_attention.argtypes = [p, strides, p, strides, p, strides, i, n, n, n, n, n,
                                        p, i, strides, f, p, strides, i]
    library.dynvm_attention.restype = ctypes.c_int
    library.dynvm_attention_amx.argtypes = [p, strides, p, strides, p, strides, n, n, n, n,
                                            n, p, i, strides, f, p, strides, i]
    library.dynvm_attention_amx.restype = ctypes.c_int
    library.dynvm_attention_bf16dot.argtypes = library.dynvm_attention_amx.argtypes
    library.dynvm_attention_bf16dot.restype = ctypes.c_int
    # Note [bf16 attention on AMX tiles]: asks the kernel for the tiles' state too
    return library, bool(library.dynvm_attention_amx_supported()), ""


_LIBRARY, _AMX, _WHY_NOT = _load()
_BF16_DOT = _LIBRARY is not None and not _AMX \
    and bool(_LIBRARY.dynvm_attention_bf16dot_supported())
"""Whether bf16 attention runs on AVX512-BF16 dot products (a CPU without AMX; Note
[bf16 attention with AVX512-BF16 dot products])."""
_THREADS = openmp_getter()


def available() -> bool:
    """Whether the C kernel runs in this process."""
    return _LIBRARY is not None


def amx_available() -> bool:
    """Whether bf16 attention runs on AMX tiles in this process (Note [bf16 attention on
    AMX tiles])."""
    return _AMX


def _on_tiles(q) -> bool:
    """Whether bf16 operands that the kernel reads go to its AMX version."""
    return _tiles_take(q.dtype, q.shape[-1])


def _tiles_take(dtype, d: int) -> bool:
    """Whether operands of `dtype` with heads of `d` run on the AMX version (bf16, D a
    multiple of 32: a tile's 32 bf16 a row)."""
    return _AMX and dtype == torch.bfloat16 and d % 32 == 0


def bf16_dot_available() -> bool:
    """Whether bf16 attention runs on AVX512-BF16 dot products in this process (Note
    [bf16 attention with AVX512-BF16 dot products])."""
    return _BF16_DOT


def _on_dots(q) -> bool:
    """Whether bf16 operands that the kernel reads go to its AVX512-BF16 version."""
    return _dots_take(q.dtype, q.shape[-1])


def _dots_take(dtype, d: int) -> bool:
    """Whether operands of `dtype` with heads of `d` run on the AVX512-BF16 version (bf16,
    D a multiple of 32: the keys' pairs packed 16 pairs at a time, as for the tiles)."""
    return _BF16_DOT and dtype == torch.bfloat16 and d % 32 == 0


def _reads(q, k, v, mask, dropout_p, is_causal) -> bool:
    """Whether the C kernel reads these operands as they are (else torch's SDPA runs);
    q, k, v real or meta tensors."""
    if dropout_p != 0.0 or is_causal or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return False
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype \
            or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    b, h, s, d = q.shape
    if k.shape != (b, h, k.shape[2], d) or v.shape != k.shape or d % 16 or d == 0 \
            or s == 0 or not 0 < k.shape[2] <= MAX_KEYS \
            or any(t.stride(-1) != 1 for t in (q, k, v)):
        return False
    return _mask_reads(mask, q.dtype, (b, h, s, k.shape[2]))


def _mask_reads(mask, dtype, scores) -> bool:
    """Whether the C kernel reads `mask` (absent, boolean or of the operands' dtype,
    broadcasting to the `scores` [B, H, S, L])."""
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or mask.dtype not in (torch.bool, dtype) \
            or mask.dim() > 4:
        return False
    return all(m in (1, n) for m, n in zip(mask.shape[::-1], scores[::-1]))


def _strides(values) -> ctypes.Array:
    return (ctypes.c_long * len(values))(*values)


def masked_attention(q, k, v, mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """`ATTENTION`: SDPA's result, from dynvm's C kernel where it reads the operands
    (Note [Masked attention of our own]), else from torch's SDPA; laid out as torch's
    flash kernel lays it out (`empty_like` of the query)."""
    return _attention(q, k, v, mask, dropout_p, is_causal, scale, contiguous=False)


def masked_attention_contiguous(q, k, v, mask=None, dropout_p=0.0, is_causal=False,
                                scale=None):
    """`CONTIGUOUS_ATTENTION`: `masked_attention`'s result laid out contiguously, as the
    batched matmul of attention written by hand lays it out (Note [Attention written
    by hand on our kernel])."""
    return _attention(q, k, v, mask, dropout_p, is_causal, scale, contiguous=True)


def _attention(q, k, v, mask, dropout_p, is_causal, scale, contiguous: bool):
    if _LIBRARY is not None and q.device.type == "cpu" \
            and _reads(q, k, v, mask, dropout_p, is_causal):
        out = torch.empty(q.shape, dtype=q.dtype) if contiguous else torch.empty_like(q)
        if _run((q, k, v), (q.stride()[:3], k.stride()[:3], v.stride()[:3]), q.dtype,
                (*q.shape[:3], k.shape[2], q.shape[3]), mask, scale, out, out.stride()[:3]):
            return out
        # its scratch could not be allocated (nothing written): torch's SDPA computes
        # the same result, or raises torch's own out-of-memory error
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, mask, dropout_p, is_causal, scale=scale)
    return out.contiguous() if contiguous else out


def _run(operands, strides, dtype, dims, mask, scale, out, out_strides) -> bool:
    """The C kernel over q, k and v (`operands`: tensors or addresses) with these
    [B, H, rows] strides, `dims` (B, H, S, L, D); False where its scratch could not be
    allocated (nothing written)."""
    b, h, s, keys, d = dims
    q, k, v = (t.data_ptr() if isinstance(t, torch.Tensor) else t for t in operands)
    if mask is None:
        mask_ptr, mask_strides = None, _strides((0, 0, 0, 0))
    else:
        full = mask.expand(b, h, s, keys)
        mask_ptr, mask_strides = full.data_ptr(), _strides(full.stride())
    small = dtype == torch.float32 and b * h * s * keys <= FP32_ONE_THREAD_SCORES
    threads = 1 if _THREADS is None or small else _THREADS()
    kind = _MASKS[None if mask is None else mask.dtype]
    scale = d ** -0.5 if scale is None else scale
    qs, ks, vs, os_ = (_strides(x) for x in (*strides, out_strides))
    if _tiles_take(dtype, d):   # Note [bf16 attention on AMX tiles]
        if b * h * s * keys <= AMX_ONE_THREAD_SCORES:
            threads = 1
        status = _LIBRARY.dynvm_attention_amx(q, qs, k, ks, v, vs, b, h, s, keys, d, mask_ptr,
                                              kind, mask_strides, scale, out.data_ptr(), os_,
                                              threads)
    elif _dots_take(dtype, d):   # Note [bf16 attention with AVX512-BF16 dot products]
        if b * h * s * keys <= DOT_ONE_THREAD_SCORES:
            threads = 1
        status = _LIBRARY.dynvm_attention_bf16dot(q, qs, k, ks, v, vs, b, h, s, keys, d,
                                                  mask_ptr, kind, mask_strides, scale,
                                                  out.data_ptr(), os_, threads)
    else:
        status = _LIBRARY.dynvm_attention(q, qs, k, ks, v, vs, int(dtype == torch.bfloat16),
                                          b, h, s, keys, d, mask_ptr, kind, mask_strides,
                                          scale, out.data_ptr(), os_, threads)
    return status == 0


def qkv_attention(qkv, mask, heads, scale):
    """`QKV_ATTENTION`: a [B, S, 3 H D] Q/K/V result split into heads, SDPA over them and
    the result as [B, S, H D] in one call (Note [Attention without its views] in
    attention_qkv); the result is a view of the kernel's [B, S, H, D] result."""
    b, s, width = qkv.shape
    d = width // (3 * heads)
    if _LIBRARY is None or qkv.device.type != "cpu" or qkv.dtype not in _DTYPES \
            or qkv.stride(2) != 1 or width != 3 * heads * d or d % 16 or d == 0 \
            or not 0 < s <= MAX_KEYS or not _mask_reads(mask, qkv.dtype, (b, heads, s, s)):
        return _qkv_attention_views(qkv, mask, heads, scale)
    out = torch.empty((b, s, heads, d), dtype=qkv.dtype)
    base, step = qkv.data_ptr(), heads * d * qkv.element_size()
    strides = (qkv.stride(0), d, qkv.stride(1))
    if not _run((base, base + step, base + 2 * step), (strides,) * 3, qkv.dtype,
                (b, heads, s, s, d), mask, scale, out, (s * heads * d, d, heads * d)):
        return _qkv_attention_views(qkv, mask, heads, scale)
    return out.view(b, s, heads * d)


def _qkv_attention_views(qkv, mask, heads, scale):
    """`qkv_attention` as the region's ops compute it: views, SDPA, views."""
    b, s, width = qkv.shape
    q, k, v = (t.view(b, s, heads, -1).permute(0, 2, 1, 3)
               for t in qkv.split(width // 3, -1))
    out = masked_attention(q, k, v, mask, scale=scale)
    return out.permute(0, 2, 1, 3).reshape(b, s, width // 3)


QKV_ATTENTION = "QKV_ATTENTION"
ATTENTION_KERNELS = {ATTENTION: masked_attention,
                     CONTIGUOUS_ATTENTION: masked_attention_contiguous,
                     QKV_ATTENTION: qkv_attention}


def _value(arg, probe):
    return probe.get(arg.reg) if isinstance(arg, Var) else \
        arg.value if isinstance(arg, Literal) else arg


def native_attention(spec: SpecializedRegion) -> tuple[SpecializedRegion, str]:
    """`spec` with each SDPA the C kernel reads at every probe on that kernel (Note
    [Masked attention of our own]), and a note ("" where the region has no SDPA)."""
    sdpas = [i for i, op in enumerate(spec.ops) if op.opcode == "SDPA" and op.variant == ""]
    if not sdpas:
        return spec, ""
    if _LIBRARY is None:
        return spec, f"; SDPA on torch's kernel ({_WHY_NOT})"
    ops = list(spec.ops)
    taken = 0
    for at in sdpas:
        op = ops[at]
        if len(op.args) != 7 or len(op.dsts) != 1:
            continue
        results = probe_tensors(spec.abstract, op.dsts[0])
        if results is None:
            continue
        layouts = {"query", "contiguous"}
        for probe, result in zip(spec.abstract, results):
            layouts &= _fits(op, probe, result)
        if not layouts:
            continue
        # Note [Attention written by hand on our kernel]: the result as the region's
        # abstract values lay it out (torch's flash layout where both are the same)
        opcode = ATTENTION if "query" in layouts else CONTIGUOUS_ATTENTION
        ops[at] = dataclasses.replace(op, opcode=opcode, variant=ATTENTION_VARIANT)
        taken += 1
    if not taken:
        # (kept short: the kernel's header line stays under the readable width)
        return spec, (f"; {len(sdpas)} SDPA(s) on torch's kernel (keys: fp32 "
                      f"{MIN_KEYS}-{MAX_KEYS}, bf16 {AMX_MIN_KEYS}-{MAX_KEYS}, or operands "
                      "not read: Note [Masked attention of our own])")
    return dataclasses.replace(spec, ops=tuple(ops)), (
        f"; {taken} of {len(sdpas)} SDPA(s) on dynvm's masked attention "
        "(Note [Masked attention of our own])")


def _fits(op: SpecOp, probe, result) -> set[str]:
    """The layouts the kernel can give `op`'s result at this probe as its abstract value
    lays it out: "query" (torch's flash layout, `empty_like` of the query), "contiguous"
    (Note [Attention written by hand on our kernel]); empty where the kernel does not
    take it."""
    q, k, v, mask, dropout_p, is_causal, scale = (_value(a, probe) for a in op.args)
    if (mask is not None and not isinstance(mask, torch.Tensor)) \
            or not (scale is None or isinstance(scale, (int, float))):
        return set()
    if not _reads(q, k, v, mask, dropout_p, is_causal):
        return set()
    if not (q.dtype == torch.float32 and k.shape[2] >= MIN_KEYS
            or _on_tiles(q) and k.shape[2] >= AMX_MIN_KEYS
            or _on_dots(q) and k.shape[2] >= DOT_MIN_KEYS):
        return set()
    if result.dtype != q.dtype or result.shape != q.shape or result.storage_offset():
        return set()
    layouts = set()
    if result.stride() == torch.empty_like(q, device="meta").stride():
        layouts.add("query")
    if result.is_contiguous():
        layouts.add("contiguous")
    return layouts
