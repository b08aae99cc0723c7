"""A BERT layer's attention as one call from its Q/K/V GEMM's result to the output
projection's input: a pass over a specialized region after `native_attention`.

Note [Attention without its views]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Between a BERT layer's Q/K/V GEMM and its output projection the region runs about ten
Python-level ops around the attention kernel: the [B, S, 3 H D] result split in three,
each part viewed [B, S, H, D] and permuted to [B, H, S, D], SDPA (on dynvm's kernel,
Note [Masked attention of our own]), and its result viewed, permuted back and viewed
[B, S, H D]. The kernel already reads q, k and v as strided views of that result and
writes torch's flash layout [B, S, H, D], so the views are only bookkeeping: each a
dispatch through torch's op machinery, together 0.22-0.24 ms a call at 1x64-1x128 in
BERT-base width's four layers (H34A's walls, 13:40 UTC).

So where the chain is exactly that -- SPLIT_WITH_SIZES of a [B, S, 3 H D] value into
three equal parts along its last dim, each read only by a VIEW to [B, S, H, D] read only
by a PERMUTE [0, 2, 1, 3] read only by the SDPA as q, k, v in that order, and the SDPA's
result read only by (a VIEW read only by) a PERMUTE [0, 2, 1, 3] (read only by a CLONE:
attention written by hand, Note [Attention written by hand on our kernel]) read only by
a VIEW to [B, S, H D] -- at every probe, with the abstract values saying the parts are those
views of the Q/K/V value's storage and the end a contiguous [B, S, H D] at offset 0 (so
the kernel's result viewed so), one op (`QKV_ATTENTION`, `qkv_attention` in
attention_native) takes the Q/K/V value and the mask and returns the [B, S, H D] view
of the kernel's result. No value in between leaves the region. Anything else stays as
it is. The same kernel on the same addresses: the same bits.

Measured in the whole model (BERT-base width, 4 layers, exact kernels, one process,
four runtimes -- two on, two off -- interleaved call by call, 80-100 rounds,
/tmp/h34v/ab.py; runtimes built later sometimes ran 2-5% slower in that script, most
likely their weights still on small pages: with calls back to back the collapser takes
a page only every 0.5 s, Note [Collapsing between calls]; so runtimes built next to each
other are compared, in three build orders). bf16 (13:43,
13:45, 13:50 UTC, load 1.4-2.7; A/A 0.943-1.006 by build position): on / off 0.951-0.967
at 1x16, 0.970-0.983 at 1x64, 0.957-0.977 at 2x16, 0.969-0.984 at 2x64, 0.969-0.984 at
1x128 (0.2-0.4 ms a call); fp32, where the kernel takes only 96 keys or more (13:46,
13:48 UTC, load 1.7-2.7): 1x128 0.985-0.995, the shapes it does not touch 0.966-1.023
(A/A 0.970-1.022). The same bits on and off at every shape.
"""

from __future__ import annotations

import dataclasses

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu.attention_native import (
    ATTENTION,
    ATTENTION_VARIANT,
    CONTIGUOUS_ATTENTION,
    QKV_ATTENTION,
)
from dynvm.jit.ir import Literal, SpecializedRegion, Var
from dynvm.jit.specialize import add_frees

_SWAP = [0, 2, 1, 3]


class _Chain:
    """Who writes and reads each register of a region."""

    def __init__(self, spec: SpecializedRegion) -> None:
        self.ops = spec.ops
        self.leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
        self.writer: dict[int, int] = {}
        self.readers: dict[int, list[int]] = {}
        for position, op in enumerate(spec.ops):
            for dst in op.dsts:
                self.writer[dst] = position
            for value in flat_values(op.args):
                if isinstance(value, Var):
                    self.readers.setdefault(value.reg, []).append(position)

    def only_reader(self, reg: int) -> int | None:
        """The position of the one op that reads `reg` once, None otherwise (or where
        `reg` leaves the region)."""
        readers = self.readers.get(reg, ())
        return readers[0] if len(readers) == 1 and reg not in self.leaving else None

    def view_of(self, reg: int, opcode: str) -> int | None:
        """Position of the op `opcode` writing `reg` from its first operand alone."""
        at = self.writer.get(reg)
        if at is None or self.ops[at].opcode != opcode or len(self.ops[at].dsts) != 1:
            return None
        return at


def _literal(arg):
    return arg.value if isinstance(arg, Literal) else arg


def _match(chain: _Chain, at: int):
    """(positions dropped, Q/K/V register, end VIEW's position) of the chain around the
    SDPA at `at`, or None."""
    sdpa = chain.ops[at]
    if len(sdpa.args) != 7 or len(sdpa.dsts) != 1 \
            or sdpa.args[4] != Literal(0.0) or sdpa.args[5] != Literal(False):
        return None
    dropped, splits = [], []
    for arg in sdpa.args[:3]:
        if not isinstance(arg, Var) or chain.only_reader(arg.reg) != at \
                or sum(v == arg for v in sdpa.args) != 1:
            return None
        permute = chain.view_of(arg.reg, "PERMUTE")
        if permute is None or list(_literal(chain.ops[permute].args[1])) != _SWAP:
            return None
        viewed = chain.ops[permute].args[0]
        view = chain.view_of(viewed.reg, "VIEW") if isinstance(viewed, Var) else None
        if view is None or chain.only_reader(viewed.reg) != permute:
            return None
        part = chain.ops[view].args[0]
        if not isinstance(part, Var) or chain.only_reader(part.reg) != view:
            return None
        dropped += [permute, view]
        splits.append(part.reg)
    split = chain.writer.get(splits[0])
    op = chain.ops[split] if split is not None else None
    if op is None or op.opcode != "SPLIT_WITH_SIZES" or list(op.dsts) != splits \
            or not isinstance(op.args[0], Var) or _literal(op.args[2]) not in (-1, 2):
        return None
    dropped.append(split)
    reg = sdpa.dsts[0]
    first = chain.only_reader(reg)
    leading = first is not None and chain.ops[first].opcode == "VIEW"
    # the merge of heads written `.transpose(1, 2).contiguous().view(...)`: a copy into
    # a fresh contiguous value, as the one call's result is (_fits checks the end)
    cloned = first is not None and not leading and _clone_after(chain, first)
    for opcode in ("VIEW",) * leading + ("PERMUTE",) + ("CLONE",) * cloned + ("VIEW",):
        reader = chain.only_reader(reg)
        if reader is None or chain.ops[reader].opcode != opcode \
                or chain.ops[reader].args[0] != Var(reg) or len(chain.ops[reader].dsts) != 1:
            return None
        if opcode == "PERMUTE" and list(_literal(chain.ops[reader].args[1])) != _SWAP:
            return None
        dropped.append(reader)
        reg = chain.ops[reader].dsts[0]
    return dropped, op.args[0].reg, dropped[-1]


def _clone_after(chain: _Chain, at: int) -> bool:
    """Whether the op at `at` is read only by a CLONE of it."""
    if len(chain.ops[at].dsts) != 1:
        return False
    reader = chain.only_reader(chain.ops[at].dsts[0])
    return reader is not None and chain.ops[reader].opcode == "CLONE"


def _fits(probe, qkv: int, q: int, k: int, v: int, out: int) -> int | None:
    """The heads where the abstract values say q, k, v are the [B, H, S, D] views of the
    [B, S, 3 H D] value `qkv` and `out` is [B, S, H D] contiguous; else None."""
    value, parts, result = probe.get(qkv), [probe.get(r) for r in (q, k, v)], probe.get(out)
    if value is None or value.dim() != 3 or value.stride(2) != 1 or result is None \
            or any(p is None or p.dim() != 4 for p in parts):
        return None
    b, s, width = value.shape
    heads, d = parts[0].shape[1], parts[0].shape[3]
    if width != 3 * heads * d:
        return None
    for i, part in enumerate(parts):
        if tuple(part.shape) != (b, heads, s, d) or part.dtype != value.dtype \
                or part.stride() != (value.stride(0), d, value.stride(1), 1) \
                or part.storage_offset() != value.storage_offset() + i * heads * d:
            return None
    if tuple(result.shape) != (b, s, heads * d) or result.dtype != value.dtype \
            or result.stride() != (s * heads * d, heads * d, 1) or result.storage_offset():
        return None
    return heads


def qkv_attention_calls(spec: SpecializedRegion) -> tuple[SpecializedRegion, str]:
    """`spec` with each attention on dynvm's kernel whose views around it are BERT's as
    one `QKV_ATTENTION` call (Note [Attention without its views]), and a note ("" where
    none)."""
    chain = _Chain(spec)
    replaced: dict[int, object] = {}
    dropped: set[int] = set()
    for at, sdpa in enumerate(spec.ops):
        if sdpa.opcode not in (ATTENTION, CONTIGUOUS_ATTENTION) \
                or sdpa.variant != ATTENTION_VARIANT:
            continue
        found = _match(chain, at)
        if found is None:
            continue
        positions, qkv, end = found
        out = spec.ops[end].dsts[0]
        heads = {_fits(probe, qkv, *(a.reg for a in sdpa.args[:3]), out)
                 for probe in spec.abstract}
        if len(heads) != 1 or None in heads:
            continue
        mask, scale = sdpa.args[3], sdpa.args[6]
        replaced[at] = dataclasses.replace(
            sdpa, opcode=QKV_ATTENTION, dsts=(out,),
            args=(Var(qkv), mask, Literal(heads.pop()), scale), frees=())
        dropped.update(positions)
    if not replaced:
        return spec, ""
    ops = [replaced.get(i, op) for i, op in enumerate(spec.ops) if i not in dropped]
    ops = add_frees(ops, chain.leaving)
    return dataclasses.replace(spec, ops=tuple(ops)), (
        f"; {len(replaced)} attention(s) from the Q/K/V result to [B, S, H D] in one call "
        "(Note [Attention without its views])")
