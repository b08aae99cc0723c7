"""Planned memory for CPU specializations: `out=` kernels writing into one arena.

Note [Arena layout]
~~~~~~~~~~~~~~~~~~~
A specialization knows (for a family: bounds) the shape of every intermediate, so its
intermediates can live at planned offsets of one buffer instead of each call asking the
allocator for each of them. Which results go to the arena:

- results of operations that have an `out=` form here (`OUT_KERNELS`), plus the
  scratch outputs some of them need (layer norm's mean and rstd);
- never a region output, nor anything a region output views: the caller keeps outputs
  after the call, and the arena is handed to the next call (DESIGN.md, Invariants);
- not an operation rewritten in place (it writes into its operand's storage already) or
  to a kernel without `out=` (SDPA): those allocate as before. SDPA
  was tried in its math form with out= buffers: its strided q/k/v views made matmul
  copy them, which allocated more than the fused kernel does.
- nothing at all in a specialization with a weak guard (Note [Guard strength]): the
  guard admits any shape of the same rank and element count, e.g. [1, 32] for a plan
  made at [4, 8], where a sum over dim 0 gives 32 elements instead of 8; the out=
  kernel would resize its block past the planned bytes, over its neighbours.

A block lives from the operation that writes it to the last use of anything sharing its
storage (its views, and the results of in-place operations over it), which is what
`dynvm.arena.plan_arena` packs. Blocks are sized at the planning probe (the family's
upper bounds, Note [Probes]); a block that would be larger at another probe is not
planned. At run time each call leases a buffer from the device's ArenaPool (Note [Arena
concurrency]) together with zero-size `out` tensors over its storage at the planned
offsets; an `out=` kernel resizes them to the actual shape in place, which never moves
them since the storage is the whole arena.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from dynvm.arena import ArenaPlan, Block, plan_arena
from dynvm.jit.aliasing import last_use_of_roots, storage_roots
from dynvm.jit.ir import SpecOp

aten = torch.ops.aten
_nn = torch._C._nn


def _unary(fn):
    return lambda x, out: fn(x, out=out)


def _binary(fn):
    return lambda a, b, out: fn(a, b, out=out)


def _layer_norm(x, shape, weight, bias, eps, _cudnn, out, mean, rstd):
    return aten.native_layer_norm.out(x, shape, weight, bias, eps, out0=out, out1=mean,
                                      out2=rstd)[0]


def _softmax(x, dim, dtype, out):
    return aten._softmax.out(x, dim, False, out=out)


def _log_softmax(x, dim, dtype, out):
    return aten._log_softmax.out(x, dim, False, out=out)


def _embedding(weight, indices, _padding_idx, out):
    rows = torch.index_select(weight, 0, indices.reshape(-1), out=out)
    return rows.view(*indices.shape, weight.shape[1])


def _sum(x, dims, keepdim, dtype, out):
    return torch.sum(x, dims, keepdim, dtype=dtype, out=out)


def _mean(x, dims, keepdim, dtype, out):
    return torch.mean(x, dims, keepdim, dtype=dtype, out=out)


@dataclass(frozen=True)
class OutKernel:
    fn: object                      # the opcode's operands..., out, scratch... -> result
    scratch: object = None          # abstract operands -> abstract scratch tensors
    accepts: object = None          # abstract operands -> whether this form applies


def _layer_norm_scratch(x, shape, weight, bias, eps, _cudnn):
    # mean and rstd keep the leading dims and a 1 per normalized dim, contiguous, in the
    # input's dtype for fp32/fp64. Computed here: the meta kernel goes through the
    # Python decomposition, 5 ms a call, and planning asks once per layer norm.
    if x.dtype in (torch.float32, torch.float64):
        stats = (*x.shape[:x.dim() - len(shape)], *(1,) * len(shape))
        return (torch.empty(stats, dtype=x.dtype, device=x.device),
                torch.empty(stats, dtype=x.dtype, device=x.device))
    _, mean, rstd = aten.native_layer_norm(x, shape, weight, bias, eps)
    return mean, rstd


def _no_dtype(x, dim, dtype):
    return dtype is None


def _with_dims(x, dims, keepdim, dtype):
    return dims is not None


OUT_KERNELS: dict[str, OutKernel] = {
    "LINEAR": OutKernel(lambda x, w, b, out: _nn.linear(x, w, b, out=out)),
    "MATMUL": OutKernel(_binary(torch.matmul)),
    "MM": OutKernel(_binary(torch.mm)),
    "BMM": OutKernel(_binary(torch.bmm)),
    "ADDMM": OutKernel(lambda bias, a, b, out: torch.addmm(bias, a, b, out=out)),
    "GELU": OutKernel(lambda x, approximate, out: _nn.gelu(x, approximate=approximate,
                                                            out=out)),
    "SILU": OutKernel(_unary(_nn.silu)),
    "RELU": OutKernel(lambda x, out: torch.clamp_min(x, 0, out=out)),
    **{name: OutKernel(_binary(fn)) for name, fn in (
        ("ADD", torch.add), ("SUB", torch.sub), ("MUL", torch.mul), ("DIV", torch.div),
        ("MAXIMUM", torch.maximum), ("MINIMUM", torch.minimum), ("POW", torch.pow))},
    **{name: OutKernel(_unary(fn)) for name, fn in (
        ("SIGMOID", torch.sigmoid), ("TANH", torch.tanh), ("EXP", torch.exp),
        ("LOG", torch.log), ("SQRT", torch.sqrt), ("RSQRT", torch.rsqrt),
        ("NEG", torch.neg), ("ABS", torch.abs), ("ERF", torch.erf),
        ("RECIPROCAL", torch.reciprocal), ("SIN", torch.sin), ("COS", torch.cos))},
    "LAYER_NORM": OutKernel(_layer_norm, scratch=_layer_norm_scratch),
    "SOFTMAX": OutKernel(_softmax, accepts=_no_dtype),
    "LOG_SOFTMAX": OutKernel(_log_softmax, accepts=_no_dtype),
    "CAT": OutKernel(lambda tensors, dim, out: torch.cat(tensors, dim, out=out)),
    "INDEX_SELECT": OutKernel(lambda x, dim, index, out: torch.index_select(x, dim, index,
                                                                           out=out)),
    "EMBEDDING": OutKernel(_embedding),
    "SUM": OutKernel(_sum, accepts=_with_dims),
    "MEAN": OutKernel(_mean, accepts=_with_dims),
    "INDEX_ADD": OutKernel(lambda x, dim, index, source, out: torch.index_add(
        x, dim, index, source, out=out)),
    "ZEROS": OutKernel(lambda size, dtype, layout, device, out: torch.zeros(size, out=out)),
    "FULL": OutKernel(lambda size, value, dtype, layout, device, out: torch.full(
        size, value, out=out)),
}


@dataclass(frozen=True)
class ArenaLayout:
    plan: ArenaPlan
    outs: dict[int, tuple[int, ...]]     # op position -> its blocks (result, scratch...)
    blocks: tuple[tuple[int, torch.dtype], ...]   # block key -> (offset, dtype), key order
    notes: tuple[str, ...]


def plan_layout(ops: list[SpecOp], probes: tuple, operand_values,
                leaving: set[int]) -> ArenaLayout | None:
    """Blocks and offsets for the ops that can write into an arena, or None if none can.

    `operand_values(op, probe)` gives an op's abstract operands at a probe."""
    roots, _ = storage_roots(ops)
    last_use = last_use_of_roots(ops, roots)
    escaping = {roots.get(reg, reg) for reg in leaving}
    blocks: list[Block] = []
    dtypes: list[torch.dtype] = []
    outs: dict[int, tuple[int, ...]] = {}
    notes: list[str] = []
    for position, op in enumerate(ops):
        kernel = OUT_KERNELS.get(op.opcode)
        if kernel is None or op.variant or len(op.dsts) != 1:
            continue
        dst = op.dsts[0]
        if dst in escaping:
            continue
        tensors = _planned_tensors(op, kernel, probes, operand_values)
        if tensors is None:
            continue
        keys = []
        for index, (nbytes, dtype) in enumerate(tensors):
            end = max(last_use.get(dst, position), position) if index == 0 else position
            keys.append(len(blocks))
            blocks.append(Block(len(blocks), max(nbytes, 1), position, end))
            dtypes.append(dtype)
        outs[position] = tuple(keys)
        notes.append(f"{op.source_pc}: {op.opcode} writes into the arena")
    if not blocks:
        return None
    plan = plan_arena(blocks)
    return ArenaLayout(plan, outs, tuple((plan.offsets[b.key], dtypes[b.key]) for b in blocks),
                       tuple(notes))


def _planned_tensors(op, kernel, probes, operand_values):
    """[(bytes at the planning probe, dtype)] of the result and scratch, or None when
    the op cannot use its out= form at every probe (or would outgrow its block)."""
    sizes = None
    for probe in probes:
        operands = operand_values(op, probe)
        if operands is None:
            return None
        if kernel.accepts is not None and not kernel.accepts(*operands):
            return None
        result = probe.get(op.dsts[0])
        if not isinstance(result, torch.Tensor):
            return None
        tensors = [result]
        if kernel.scratch is not None:
            tensors += list(kernel.scratch(*operands))
        here = [(t.numel() * t.element_size(), t.dtype) for t in tensors]
        if sizes is None:
            sizes = here
        elif any(n > planned or d != want for (n, d), (planned, want) in zip(here, sizes)):
            return None
    return sizes


class Lease:
    """One call's hold on an arena buffer and its out tensors."""

    __slots__ = ("buffer", "outs")

    def __init__(self, buffer: torch.Tensor, outs: tuple) -> None:
        self.buffer = buffer
        self.outs = outs


class ArenaBinding:
    """A specialization's arena: leases a pool buffer per call with out tensors over it.

    Out tensors are made once per buffer and cached with it (weakly: a buffer the pool
    frees takes its out tensors along: entries whose buffer died are pruned when a new
    buffer arrives). A family kernel's out tensors are shrunk back to
    zero elements on each lease, because an `out=` kernel warns when it must resize a
    non-empty tensor to another shape; an exact kernel's keep their one shape."""

    def __init__(self, pool, owner: str, layout: ArenaLayout, device: torch.device,
                 shapes_vary: bool) -> None:
        self.pool = pool
        self.owner = owner
        self.layout = layout
        self.device = device
        self.shapes_vary = shapes_vary
        # id(buffer) -> (weak reference to it, its out tensors). Keyed by id, not by the
        # tensor: a dict would compare tensors with ==, which is elementwise.
        self._outs: dict[int, tuple[weakref.ref, tuple]] = {}

    def acquire(self) -> Lease | None:
        buffer = self.pool.acquire(self.owner, self.layout.plan.size)
        if buffer is None:
            return None
        cached = self._outs.get(id(buffer))
        if cached is None or cached[0]() is not buffer:
            outs = self._make_outs(buffer)
            self._outs = {key: entry for key, entry in self._outs.items()
                          if entry[0]() is not None}
            self._outs[id(buffer)] = (weakref.ref(buffer), outs)
        else:
            outs = cached[1]
        if cached is not None and self.shapes_vary:
            for out in outs:
                out.resize_(0)
        return Lease(buffer, outs)

    def release(self, lease: Lease) -> None:
        self.pool.release(self.owner, lease.buffer)

    def _make_outs(self, buffer: torch.Tensor) -> tuple:
        storage = buffer.untyped_storage()
        outs = []
        for offset, dtype in self.layout.blocks:
            itemsize = torch.empty((), dtype=dtype).element_size()
            out = torch.empty(0, dtype=dtype, device=self.device)
            out.set_(storage, offset // itemsize, (0,), (1,))
            outs.append(out)
        return tuple(outs)
