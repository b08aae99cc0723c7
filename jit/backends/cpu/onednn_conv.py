"""Channels-last fused convolutions as oneDNN primitives built once, called through
oneDNN's C API: a pass over a region already fused and laid out channels-last.

Note [oneDNN primitives built once]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's fused entry points (`mkldnn._convolution_pointwise` and its in-place binary
form, Note [CPU conv fusion]) run oneDNN's own kernels, but every call builds what those
kernels need again inside ideep: memory descriptors, the attribute and its post-ops, the
primitive descriptor (a primitive-cache lookup keyed by all of them), the scratchpad,
the output's wrapping; 30-110 us a call on two threads at ResNet-50's sizes (docs/
bench_log.md, 2026-12-05 06:46). ONNX Runtime and OpenVINO build a primitive once per
shape and only bind data pointers per call. torch exports none of oneDNN's C API
(libtorch_cpu.so links it statically, no `dnnl_*` symbol), so dynvm calls a libdnnl of
its own, the optional `onednn` extra (onednn-cpu-gomp, oneDNN 3.2 on GNU OpenMP), through
ctypes (onednn_api): per convolution and per input shape of the kernel's family, one
primitive (conv + bias, with a sum post-op for a residual written in place and the
activation as an eltwise post-op), its weight reordered once into the layout the
primitive chose (one copy per layout, shared by every kernel with that weight:
`WeightLayouts`; ResNet-50's four kernels over batch 1, 2, 4 hold 459 MiB beyond the
program against 474 MiB with torch's packed weights). A call sets two data
handles and executes: no descriptor work.

A call holds the GIL, as torch's oneDNN calls do (Note [oneDNN holds the GIL]), through
ctypes.PyDLL; built with ctypes.CDLL it released it. Released, the compile thread's
timing runs (the layout choice runs the whole region ~8 times) overlapped the calls being
served on the same 2 cores, four OpenMP threads on two cores, where GIL-holding calls
take turns: over ResNet-50's warm-up (`bench.full_width`, in-process switch, 4
calls/shape, 15:50-16:20, load 0.8-2.9) a shape's JIT p90 over 1.1x the interpreter's
in 4 of 8 runs with the GIL released, 0 of 4 held (largest 0.98), 1 of 4 with the
primitives off; steady JIT / ONNX Runtime alike held or released (1.11-1.21 / 1.00-1.14
/ 0.91-1.13 held, 1.15-1.21 / 0.94-1.19 / 0.90-1.11 released). Other Python threads
wait for a convolution (ms) as they waited for torch's.

One OpenMP team: the extra's libdnnl needs `libgomp.so.1`, and the libgomp this torch
build vendors (torch/lib/libgomp.so.1) carries that soname, so the loader binds libdnnl
to the copy torch already mapped (`/proc/self/maps` lists one libgomp). Its parallel
regions run on torch's team with the calling thread's `torch.get_num_threads()`. Where
loading it maps a libgomp that was not there (a torch on another OpenMP runtime, or one
whose vendored copy is renamed `libgomp-<hash>.so.1`), onednn_api refuses the library:
two teams would compete for the same cores.

Measured on this 2-core host (OMP_WAIT_POLICY=PASSIVE, 2 threads, 2026-12-05 14:47,
load 2.5-2.9, scratch prototype): ResNet-50's 53 convolutions run back to back in the
model's order, torch's fused calls against the primitives, interleaved sequence by
sequence (A/A 0.994-1.004): batch 1 34.88 -> 31.60 ms (0.907), batch 2 59.58 -> 55.64
(0.926), batch 4 106.52 -> 102.70 (0.954); the same kernels (brgconv / brgconv_1x1 /
the 7x7 stem's jit:avx512_core) on both sides, results bit-equal.

What is rewritten: the channels-last forms alone (`CONV_UNARY`, and `CONV_BINARY_INPLACE`
whose residual is already written in place, Note [Residual add in place]), ungrouped,
fp32 or bf16 (a bf16 chain's, Note [bf16 convolution chains]: input, weight and result
bf16, the bias as the fused op had it), with an activation oneDNN's eltwise post-ops
compute as torch's does. The NCHW forms, grouped and not-in-place residual convolutions
keep torch's calls.
Primitives are built when the kernel is compiled, for the input shapes its probes name
(every batch of a family's range, as conv.py packs for, Note [Conv weights for one row
or many]); a shape not built (a family whose spatial dims vary) runs torch's fused call
on the packed weight kept for it: building a primitive generates code (milliseconds),
which no call waits for. Where the library does not load the pass changes nothing and
the kernel's header says why (`onednn_api.unavailable_reason()`).
"""

from __future__ import annotations

import dataclasses

import torch

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.conv import PackedPerBatch, _batches_asked
from dynvm.jit.backends.cpu.conv_residual import CONV_BINARY_INPLACE, IN_PLACE_KERNELS
from dynvm.jit.backends.cpu.fusion import CONV_UNARY, FUSED_KERNELS, FUSED_VARIANT, is_fused
from dynvm.jit.backends.cpu.ir_match import probe_tensors
from dynvm.jit.backends.cpu.onednn_chain import CHAIN_KERNELS, chain_primitives
from dynvm.jit.backends.cpu.onednn_conv_primitive import (
    ConvPrimitive,
    ConvSpec,
    WeightLayouts,
    eltwise_of,
)
from dynvm.jit.backends.cpu.onednn_objects import DATA_TYPES, destroy, md_tag, reorder_once
from dynvm.jit.backends.cpu.onednn_objects import memory as new_memory
from dynvm.jit.backends.cpu.onednn_pool import POOL_KERNELS, POOL_PRIMITIVE, pool_primitives
from dynvm.jit.ir import Literal, SpecializedRegion, Var

CONV_PRIMITIVE = "ONEDNN_CONV_PRIMITIVE"
CONV_PRIMITIVE_INTO = "ONEDNN_CONV_PRIMITIVE_INTO"


class PrimitiveConv:
    """One fused convolution of a kernel: its primitives by input shape, built when the
    kernel is compiled, for the shapes its family serves. A shape not built (a family
    whose spatial dims vary, or wider than the batches asked: Note [Conv weights for one
    row or many]) runs torch's fused call (`fallback`, on the packed weight it keeps):
    building a primitive takes milliseconds (oneDNN generates its code), which no call
    waits for."""

    def __init__(self, library: api.Library, source, bias, spec: ConvSpec,
                 shapes: list[tuple], fallback=None) -> None:
        self.spec = spec
        plain = _plain_weight(source)
        self.weight_shape = tuple(plain.shape)
        self._weights = WeightLayouts.of(plain)
        self.by_shape = {s: ConvPrimitive(library, plain, bias, s, spec, self._weights)
                         for s in shapes}
        self._fallback = fallback    # holds torch's packed copy only where it may run

    def impls(self) -> set[str]:
        return {p.impl for p in self.by_shape.values()}

    def build(self, library: api.Library, shape: tuple, tag: int) -> ConvPrimitive:
        """Another primitive of this convolution, its source and result in layout `tag`
        (Note [A chain of primitives in one call]: a chain's blocked layout), its weight
        reordered from a copy this convolution holds."""
        like = next(iter(self.by_shape.values()))
        return ConvPrimitive(library, None, like.bias, shape, self.spec, self._weights, tag,
                             self.weight_shape)

    def repacked(self, library: api.Library, pack) -> torch.Tensor:
        """`pack` of this convolution's plain weight, made once per weight (Note [A 1x1
        convolution of our own at a few rows])."""
        return self._weights.repacked(library, self.weight_shape, pack)

    def copies(self) -> int:
        """Distinct reordered copies of this weight alive in the process."""
        return len(self._weights)

    def plain_weight(self, library: api.Library) -> torch.Tensor:
        """The plain OIHW fp32 weight, reordered back from this convolution's first copy
        (exact): what a step built from it anew starts from (chain pieces, Winograd)."""
        plain = torch.empty(self.weight_shape, dtype=torch.float32)
        lib = library.dll
        plain_md = md_tag(lib, self.weight_shape, api.TAG_OIHW, torch.float32)
        target = None
        try:
            target = new_memory(library, plain_md, plain.data_ptr())
            copy = self._weights[0]
            reorder_once(library, copy.md, copy.memory, plain_md, target,
                         "weight reorder back")
        finally:
            destroy(lib, (("dnnl_memory_destroy", target),
                          ("dnnl_memory_desc_destroy", plain_md)))
        return plain

    def _unbuilt(self, x, other):
        if self._fallback is None:
            # internal: a kernel's guard admits only the shapes its primitives cover
            raise api.OnednnError(f"no oneDNN primitive for input shape {tuple(x.shape)}")
        return self._fallback(x, other)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.residual:   # its sum post-op reads the tensor it writes
            raise api.OnednnError("a convolution with a residual runs through into()")
        primitive = self.by_shape.get(x.shape)
        return self._unbuilt(x, None) if primitive is None else primitive.run(x, None)

    def into(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        primitive = self.by_shape.get(x.shape)
        return self._unbuilt(x, other) if primitive is None else primitive.run(x, other)


def torch_fallback(op):
    """The fused op's own torch call, as a function of (x, other): what a shape without
    a primitive runs."""
    into = op.opcode == CONV_BINARY_INPLACE
    weight_at = 2 if into else 1
    source = op.args[weight_at].value
    rest = [a.value for a in op.args[weight_at + 1:]]
    by_batch = source.packs if isinstance(source, PackedPerBatch) else None
    kernel = IN_PLACE_KERNELS[CONV_BINARY_INPLACE] if into else FUSED_KERNELS[CONV_UNARY]

    def run(x, other):
        weight = source if by_batch is None else by_batch[x.shape[0]]
        return kernel(x, other, weight, *rest) if into else kernel(x, weight, *rest)
    return run


def conv_primitive(x, conv: PrimitiveConv):
    """`CONV_PRIMITIVE`: a fused channels-last convolution, a new result."""
    return conv(x)


def conv_primitive_into(x, other, conv: PrimitiveConv):
    """`CONV_PRIMITIVE_INTO`: conv(x) + other, written into `other` (returned)."""
    return conv.into(x, other)


PRIMITIVE_KERNELS = {CONV_PRIMITIVE: conv_primitive, CONV_PRIMITIVE_INTO: conv_primitive_into,
                     **POOL_KERNELS,   # Note [oneDNN pooling built once]
                     **CHAIN_KERNELS}  # Note [A chain of primitives in one call]
_STEP_KINDS = {CONV_PRIMITIVE: "conv", CONV_PRIMITIVE_INTO: "into", POOL_PRIMITIVE: "pool"}


def _run_step(step, values: dict):
    """One step of a chain in Python (a shape its arenas were not built for)."""
    x = values[step.x]
    return step.runner(x) if step.into is None else step.runner.into(x, values[step.into])


def _plain_weight(packed) -> torch.Tensor:
    """The folded fp32 OIHW weight back from torch's packed copy (exact: a reorder)."""
    if isinstance(packed, PackedPerBatch):
        packed = next(p for p in packed.packs if p is not None)
    return packed.to_dense() if packed.is_mkldnn else packed


def _weight_dtype(packed) -> torch.dtype | None:
    if isinstance(packed, PackedPerBatch):
        packed = next((p for p in packed.packs if p is not None), None)
    return packed.dtype if isinstance(packed, torch.Tensor) else None


def _shapes(probes, reg: int) -> tuple[list[tuple], bool]:
    """The input shapes to build primitives for, and whether they are all the family
    serves (only the batch varies and every batch of its range is among them)."""
    seen = sorted({tuple(t.shape) for t in probe_tensors(probes, reg)})
    rest = {s[1:] for s in seen}
    if len(rest) != 1:
        return seen, False
    batches = {s[0] for s in seen}
    asked = _batches_asked(batches)
    tail = next(iter(rest))
    covered = len(asked) == max(batches) - min(batches) + 1
    return [(b, *tail) for b in asked], covered


def _spec_of(op) -> ConvSpec | str:
    """The primitive's ConvSpec for a channels-last fused op, or why it stays on torch."""
    into = op.opcode == CONV_BINARY_INPLACE
    rest = op.args[3:] if not into else op.args[4:]
    values = [a.value if isinstance(a, Literal) else a for a in rest]
    if into:
        padding, stride, dilation, groups, binary, alpha, unary, scalars, algorithm = values
        if binary != "add" or alpha not in (None, 1, 1.0):
            return f"residual {binary!r} (alpha {alpha})"
    else:
        padding, stride, dilation, groups, unary, scalars, algorithm = values
    if groups != 1:
        return "grouped"
    eltwise = eltwise_of(unary, list(scalars or []), algorithm or "")
    if eltwise == "":
        return f"activation {unary!r}"
    return ConvSpec(tuple(stride), tuple(padding), tuple(dilation), into, eltwise)


def conv_primitives(spec: SpecializedRegion) -> tuple[SpecializedRegion, str]:
    """`spec` with its channels-last fused convolutions on oneDNN primitives built once
    (Note [oneDNN primitives built once]), its chains' max poolings too (Note [oneDNN
    pooling built once]), and a note saying how many or why none."""
    candidates = [i for i, op in enumerate(spec.ops)
                  if op.opcode in (CONV_UNARY, CONV_BINARY_INPLACE) and is_fused(op)]
    if not candidates:
        return spec, ""
    library = api.library()
    if library is None:
        return spec, f"; convolutions on torch's oneDNN calls ({api.unavailable_reason()})"
    ops = list(spec.ops)
    kept: dict[str, int] = {}
    impls: set[str] = set()
    copies = 0
    for position in candidates:
        op = ops[position]
        into = op.opcode == CONV_BINARY_INPLACE
        x, weight, bias = op.args[0], op.args[2 if into else 1], op.args[3 if into else 2]
        conv_spec = _spec_of(op)
        reason = conv_spec if isinstance(conv_spec, str) else ""
        dtype = _weight_dtype(weight.value) if isinstance(weight, Literal) else None
        if not reason and dtype not in DATA_TYPES:
            reason = f"weight {dtype}"
        if not reason and not isinstance(x, Var):
            reason = "input not a register"
        if not reason and any(t.dtype != dtype for t in probe_tensors(spec.abstract, x.reg)):
            reason = "input and weight of other types"
        if not reason and isinstance(bias.value, torch.Tensor) \
                and bias.value.dtype not in (torch.float32, dtype):
            reason = f"bias {bias.value.dtype}"
        if reason:
            kept[reason] = kept.get(reason, 0) + 1
            continue
        shapes, covered = _shapes(spec.abstract, x.reg)
        try:
            conv = PrimitiveConv(library, weight.value, bias.value,
                                 dataclasses.replace(conv_spec, dtype=dtype), shapes,
                                 None if covered else torch_fallback(op))
        except api.OnednnError as exc:
            kept[str(exc)] = kept.get(str(exc), 0) + 1
            continue
        impls |= conv.impls()
        copies += conv.copies()
        args = (x, op.args[1], Literal(conv)) if into else (x, Literal(conv))
        ops[position] = dataclasses.replace(
            op, opcode=CONV_PRIMITIVE_INTO if into else CONV_PRIMITIVE, args=args)
    done = len(candidates) - sum(kept.values())
    note = (f"; {done} of {len(candidates)} convolution(s) on oneDNN {library.version} "
            f"primitives built once ({', '.join(sorted(impls))}; {copies} weight copies)")
    if kept:
        note += "; on torch: " + ", ".join(f"{n} {why}" for why, n in kept.items())
    if done:
        spec = dataclasses.replace(spec, ops=tuple(ops))
    # Note [oneDNN pooling built once]: the chains' max poolings, for the same shapes
    probes = spec.abstract
    spec, pool_note = pool_primitives(spec, library, lambda reg: _shapes(probes, reg),
                                      FUSED_VARIANT)
    # Note [A chain of primitives in one call]: each run of them as one native call
    spec, chain_note = chain_primitives(spec, library, _STEP_KINDS, _run_step, FUSED_VARIANT)
    return spec, note + pool_note + chain_note
