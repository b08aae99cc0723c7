"""Layer norm writing its bf16 copy in the same pass: a pass over a region after the bf16
lowering (Note [Lower-precision GEMMs]), and the C kernel's wrapper.

Note [Layer norm writing bf16 too]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under the bf16 lowering the residual stream stays fp32 (Note [Lower-precision GEMMs]):
each layer norm's fp32 result is the next residual add's operand, and a TO_BF16 of it is
the next GEMM's input. That is two passes over the rows and two OpenMP regions (layer
norm's and the cast's, each waking the team under a passive wait policy), and the cast
reads back what layer norm has just written. BERT-base's four layers have nine layer
norms, eight of them read by a cast (the last one is the output).

So where a TO_BF16 of the lowering reads a LAYER_NORM's result (over the last dim, fp32,
contiguous rows, a constant fp32 weight and bias or none, N a multiple of 16), the two
become one `LAYER_NORM_BF16` op in layer norm's place with two results, the fp32 one and
its bf16 rounding (dynvm's C kernel, native/layer_norm_bf16.c: one pass per row, its
rows split over the team only above `ONE_THREAD_ELEMENTS`, where a wake pays). The cast
is gone; nothing is rewritten where an op between the two writes into the norm's result
or a view of it. Where the kernel cannot run (no library, no AVX-512F, operands it does
not read at run time: a strided input, another dtype), the op runs torch's layer norm and
its cast, exactly the pair it replaced.

What changes in the numbers: the kernel's mean and variance are summed in another order
than torch's (two passes over the row, in 16 lanes), so its fp32 result differs from
torch's by float32 rounding (a few ulp) and a value at a bf16 rounding boundary may round
to the neighbouring bf16 value; the bf16 copy is that fp32 result rounded to nearest
even, as torch's conversion rounds. Within the lowering's own distance from fp32 (Note
[Lower-precision GEMMs]).

Measured (BERT-base width, 4 layers, exact bf16 kernels in one process, with and
without this pass, interleaved call by call with an A/A of two runtimes without it, 25
rounds, 2 threads passive; 2026-12-06 05:30 UTC, load 1.9-2.1): 2x64 0.955, 4x64 0.972,
8x64 0.962 (A/A 1.011 / 1.032 / 0.992), 15.61 -> 14.86, 20.56 -> 20.04, 32.56 -> 30.73 ms.
Max |out - fp32 eager| there 1.10e-2 / 1.29e-2 / 1.28e-2 against 1.22e-2 / 1.08e-2 /
1.19e-2 without it (OpenVINO bf16's 1.1e-2 to 1.5e-2 in earlier runs). Alone (2 threads
passive, load 9, not under the bench lock: indicative only), us a call, the kernel on one
thread / two / torch's layer norm and cast: M=32 25 / 30 / 96, M=128 61 / 67 / 155,
M=256 141 / 151 / 261, M=1024 512 / 550 / 915; `ONE_THREAD_ELEMENTS` awaits a quiet
measurement (the other core was busy there, which favours one thread).
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from dynvm.jit.backends.cpu.native_linear import find_extension
from dynvm.jit.backends.cpu.one_thread import openmp_getter
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, SpecOp, Var
from dynvm.jit.specialize import add_frees

LAYER_NORM_BF16 = "LAYER_NORM_BF16"
ONE_THREAD_ELEMENTS = 1 << 17
"""Rows of at most this many elements in all are normalized on the calling thread: below
it waking the team costs more than the second thread saves (the Note)."""

_VIEWS = frozenset({"SPLIT_WITH_SIZES", "SPLIT", "VIEW", "RESHAPE_IF", "PERMUTE",
                    "TRANSPOSE", "UNSQUEEZE", "SQUEEZE", "EXPAND", "SLICE", "SELECT"})


def _load():
    path = find_extension("_layer_norm_bf16")
    if path is None:
        return None
    try:
        library = ctypes.PyDLL(str(path))   # called holding the GIL, as torch's ops are
    except OSError:
        return None
    if not library.dynvm_layer_norm_bf16_supported():
        return None
    p, n = ctypes.c_void_p, ctypes.c_long
    library.dynvm_layer_norm_bf16.argtypes = [p, n, n, n, p, p, ctypes.c_float, p, p,
                                              ctypes.c_int]
    library.dynvm_layer_norm_bf16.restype = None
    return library


_LIBRARY = _load()
_THREADS = openmp_getter()


def available() -> bool:
    """Whether the C kernel runs in this process."""
    return _LIBRARY is not None


def _reads(x: torch.Tensor, weight, bias, n: int) -> bool:
    """Whether the C kernel reads these operands as they are (else torch runs)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1 \
            or x.shape[-1] != n or n % 16 or not x.is_contiguous():
        return False
    return all(t is None or (t.dtype == torch.float32 and t.shape == (n,)
                             and t.is_contiguous()) for t in (weight, bias))


def torch_pair(x, normalized_shape, weight, bias, eps):
    """Layer norm then its cast to bf16, as the unfused kernel ran them."""
    y = torch.layer_norm(x, normalized_shape, weight, bias, eps, False)
    return y, y.to(torch.bfloat16, memory_format=torch.contiguous_format)


def layer_norm_bf16(x: torch.Tensor, normalized_shape, weight, bias, eps: float):
    """(layer norm of `x` over its last dim in fp32, the same rounded to bf16): one pass
    in dynvm's C kernel where it reads the operands, else torch's pair (Note [Layer norm
    writing bf16 too])."""
    n = normalized_shape[-1] if len(normalized_shape) == 1 else -1
    if _LIBRARY is None or not _reads(x, weight, bias, n) or x.numel() == 0:
        return torch_pair(x, normalized_shape, weight, bias, eps)
    y = torch.empty(x.shape, dtype=torch.float32)
    y16 = torch.empty(x.shape, dtype=torch.bfloat16)
    rows = x.numel() // n
    threads = 1 if x.numel() <= ONE_THREAD_ELEMENTS or _THREADS is None else _THREADS()
    _LIBRARY.dynvm_layer_norm_bf16(
        x.data_ptr(), n, rows, n, 0 if weight is None else weight.data_ptr(),
        0 if bias is None else bias.data_ptr(), eps, y.data_ptr(), y16.data_ptr(), threads)
    return y, y16


def _constant_vector(arg, constants, n: int) -> bool:
    if arg == Literal(None):
        return True
    if not isinstance(arg, ConstRef):
        return False
    value = constants[arg.index]
    return (isinstance(value, torch.Tensor) and value.dtype == torch.float32
            and value.shape == (n,) and value.is_contiguous())


def _written_between(ops, reg: int, start: int, end: int) -> bool:
    """An op strictly between `start` and `end` writes in place into `reg` or a view."""
    viewed = {reg}
    for op in ops[start + 1:end]:
        if op.opcode in _VIEWS and op.args and isinstance(op.args[0], Var) \
                and op.args[0].reg in viewed:
            viewed.update(op.dsts)
        if "inplace" in op.variant and op.args and isinstance(op.args[0], Var) \
                and op.args[0].reg in viewed:
            return True
    return False


def fuse_norm_casts(spec: SpecializedRegion, constants, *, cast: str, variant: str
                    ) -> tuple[SpecializedRegion, str]:
    """`spec` with each LAYER_NORM whose result a `cast` op (of `variant`) makes bf16 as
    one LAYER_NORM_BF16 op (Note [Layer norm writing bf16 too]), and a note ("" if none)."""
    if _LIBRARY is None:
        return spec, ""
    ops = list(spec.ops)
    producer = {d: i for i, op in enumerate(ops) for d in op.dsts}
    fused: dict[int, SpecOp] = {}
    dropped: set[int] = set()
    for at, op in enumerate(ops):
        if op.opcode != cast or op.variant != variant or not isinstance(op.args[0], Var):
            continue
        source = op.args[0].reg
        norm_at = producer.get(source)
        if norm_at is None or norm_at in fused:
            continue
        norm = ops[norm_at]
        if norm.opcode != "LAYER_NORM" or norm.variant != "" or len(norm.args) < 5:
            continue
        x, shape, weight, bias, eps = norm.args[:5]
        if not (isinstance(shape, Literal) and isinstance(shape.value, (list, tuple))
                and len(shape.value) == 1 and isinstance(shape.value[0], int)
                and isinstance(eps, Literal) and isinstance(x, Var)):
            continue
        n = shape.value[0]
        values = [probe.get(x.reg) for probe in spec.abstract]
        if n % 16 or not all(isinstance(v, torch.Tensor) and v.dtype == torch.float32
                             and v.dim() >= 1 and v.shape[-1] == n for v in values):
            continue
        if not (_constant_vector(weight, constants, n) and _constant_vector(bias, constants, n)):
            continue
        if _written_between(ops, source, norm_at, at):
            continue
        fused[norm_at] = SpecOp(LAYER_NORM_BF16, (source, op.dsts[0]),
                                (x, shape, weight, bias, eps), norm.source_pc,
                                variant=variant)
        dropped.add(at)
    if not fused:
        return spec, ""
    new_ops = [fused.get(i, op) for i, op in enumerate(ops) if i not in dropped]
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    new_ops = add_frees(new_ops, leaving)
    note = (f"; {len(fused)} layer norm(s) writing their bf16 copy in the same pass, "
            f"{len(dropped)} cast(s) gone (Note [Layer norm writing bf16 too])")
    return dataclasses.replace(spec, ops=tuple(new_ops)), note
