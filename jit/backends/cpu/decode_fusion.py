"""A decode step's small operations onto dynvm's C kernels: a pass over the specialized IR
(Note [A decode step's small ops in C] in native_decode)."""

from __future__ import annotations

import dataclasses

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu import native_decode
from dynvm.jit.backends.cpu.fusion import NATIVE_LINEAR, FusionResult
from dynvm.jit.backends.cpu.ir_match import probe_tensors, use_counts
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, SpecOp, Var
from dynvm.jit.specialize import add_frees
from dynvm.vm.opcodes import OPCODES

NATIVE_RMS_NORM = "NATIVE_RMS_NORM"
NATIVE_SILU_MUL = "NATIVE_SILU_MUL"
NATIVE_ATTENTION_ROW = "NATIVE_ATTENTION_ROW"
NATIVE_ATTENTION_QKV = "NATIVE_ATTENTION_QKV"
NATIVE_NORM_LINEAR = "NATIVE_NORM_LINEAR"
NATIVE_SILU_MUL_LINEAR = "NATIVE_SILU_MUL_LINEAR"
NATIVE_RMS_NORM_ROWS = "NATIVE_RMS_NORM_ROWS"
NATIVE_ROTARY_TABLE = "NATIVE_ROTARY_TABLE"
NATIVE_DECODER_LAYER_ROW = "NATIVE_DECODER_LAYER_ROW"
DECODE_KERNELS = {NATIVE_DECODER_LAYER_ROW: native_decode.decoder_layer_row,
                  NATIVE_ROTARY_TABLE: native_decode.rotary_table,
                  NATIVE_RMS_NORM_ROWS: native_decode.rms_norm_rows,
                  NATIVE_NORM_LINEAR: native_decode.norm_linear,
                  NATIVE_SILU_MUL_LINEAR: native_decode.silu_mul_linear,
                  NATIVE_RMS_NORM: native_decode.rms_norm,
                  NATIVE_SILU_MUL: native_decode.silu_mul,
                  NATIVE_ATTENTION_ROW: native_decode.attention_row,
                  NATIVE_ATTENTION_QKV: native_decode.attention_qkv}
"""The callables of this pass's ops (their variant is "native", as the small-M GEMM's)."""
_VARIANT = "native"


def fuse_decode_ops(spec: SpecializedRegion, constants,
                    device: torch.device) -> FusionResult:
    """`spec` with its RMS norms, SiLU-gated products and one-row attention steps on the
    C kernels, where the library runs here and the operands fit at every probe."""
    if device.type != "cpu" or not native_decode.available() or not spec.abstract:
        return FusionResult(spec, ())
    ops = list(spec.ops)
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    uses = use_counts(ops, leaving)
    producer = {dst: i for i, op in enumerate(ops) for dst in op.dsts}
    replaced: dict[int, SpecOp] = {}
    removed: set[int] = set()
    counts = {NATIVE_RMS_NORM: 0, NATIVE_SILU_MUL: 0, NATIVE_ATTENTION_ROW: 0,
              NATIVE_ATTENTION_QKV: 0}
    for position, op in enumerate(ops):
        new = None
        if op.opcode == "DECODE_ATTN" and op.variant == "":
            group = _attention_group(ops, position, uses, producer, spec.abstract)
            if group is not None:
                new, absorbed = group
                removed |= absorbed
        elif op.opcode == "RMS_NORM" and op.variant == "" and _rms_fits(op, constants,
                                                                        spec.abstract):
            new = dataclasses.replace(op, opcode=NATIVE_RMS_NORM, variant=_VARIANT)
        elif op.opcode == "SILU_MUL" and op.variant == "" and _rows_fit(op, spec.abstract):
            new = dataclasses.replace(op, opcode=NATIVE_SILU_MUL, variant=_VARIANT)
        if new is not None:
            replaced[position] = new
            counts[new.opcode] += 1
    if not replaced:
        return FusionResult(spec, ())
    new_ops = _without_dead_views(
        [replaced.get(i, op) for i, op in enumerate(ops) if i not in removed], leaving)
    new_ops, folded = _prologues_folded(new_ops, leaving)
    new_ops, picked = _picked_norms(new_ops, leaving, spec.abstract)
    new_ops, tables = _rotary_tables(new_ops, leaving, constants, spec.abstract)
    new_ops, layers = _decoder_layers(new_ops, leaving, spec.abstract)
    new_ops = add_frees(new_ops, leaving)
    note = ("dynvm's C kernels (Note [A decode step's small ops in C]): "
            f"{counts[NATIVE_RMS_NORM]} RMS_NORM, {counts[NATIVE_SILU_MUL]} SILU_MUL, "
            f"{counts[NATIVE_ATTENTION_ROW] + counts[NATIVE_ATTENTION_QKV]} one-row "
            "attention step(s) (ROTARY x2, KV_APPEND x2, DECODE_ATTN), "
            f"{counts[NATIVE_ATTENTION_QKV]} of them read from the QKV projection's row "
            f"with their views; {folded} of the norms and products computed inside the "
            f"small-M GEMM call that reads them; {picked} norm(s) of the rows an INDEX "
            f"picks computed on those rows alone; {tables} rotary cos/sin table(s) in one "
            f"call; {layers} whole decoder layer(s) of a one-token row in one call")
    return FusionResult(dataclasses.replace(spec, ops=tuple(new_ops)), (note,))


def _fp32_rows(values, width: int | None = None) -> bool:
    return values is not None and all(
        v.dtype == torch.float32 and v.dim() >= 1 and v.is_contiguous()
        and v.numel() <= native_decode.MAX_ROWS * max(1, v.shape[-1])
        and (width is None or v.shape[-1] == width) for v in values)


def _rows_fit(op: SpecOp, probes) -> bool:
    x = op.args[0] if op.args else None
    return isinstance(x, Var) and len(op.dsts) == 1 and _fp32_rows(probe_tensors(probes,
                                                                                x.reg))


def _rms_fits(op: SpecOp, constants, probes) -> bool:
    """RMS_NORM(x, [N], weight, eps) over float32 rows with a float32 [N] weight."""
    if len(op.args) != 4 or not _rows_fit(op, probes):
        return False
    x, shape, weight, eps = op.args
    if not (isinstance(shape, Literal) and isinstance(shape.value, list | tuple)
            and len(shape.value) == 1 and isinstance(eps, Literal)):
        return False
    width = shape.value[0]
    if not _fp32_rows(probe_tensors(probes, x.reg), width):
        return False
    if weight == Literal(None):
        return True
    value = constants[weight.index] if isinstance(weight, ConstRef) else None
    return (isinstance(value, torch.Tensor) and value.dtype == torch.float32
            and value.shape == (width,) and value.is_contiguous())


def _attention_group(ops, position: int, uses, producer, probes):
    """(the one-row attention op, positions of the ops it absorbs) for the DECODE_ATTN at
    `position` when its query and key come from ROTARY and its caches from KV_APPEND as
    the decode step's layer computes them, else None."""
    attend = ops[position]
    if len(attend.args) != 6:
        return None
    query, keys, values, slots, lengths, scale = attend.args
    if not (isinstance(scale, Literal) and (scale.value is None
                                            or isinstance(scale.value, float))):
        return None
    found = {}
    for name, reg, opcode in (("query", query, "ROTARY"), ("keys", keys, "KV_APPEND"),
                              ("values", values, "KV_APPEND")):
        at = producer.get(reg.reg, -1) if isinstance(reg, Var) else -1
        if at < 0 or ops[at].opcode != opcode or ops[at].variant or uses.get(reg.reg) != 1:
            return None
        found[name] = at
    key_cache, key, key_slots, positions = ops[found["keys"]].args
    value_cache, value, value_slots, value_positions = ops[found["values"]].args
    if not (key_slots == value_slots == slots and positions == value_positions):
        return None
    at = producer.get(key.reg, -1) if isinstance(key, Var) else -1
    if at < 0 or ops[at].opcode != "ROTARY" or ops[at].variant or uses.get(key.reg) != 1:
        return None
    found["key"] = at
    query_in, cos, sin = ops[found["query"]].args
    key_in, key_cos, key_sin = ops[at].args
    if (key_cos, key_sin) != (cos, sin):
        return None
    operands = (query_in, key_in, value, cos, sin, key_cache, value_cache, slots, positions,
                lengths)
    if not all(isinstance(v, Var) for v in operands) or key_cache == value_cache:
        return None
    if not _one_row_everywhere(probes, operands):
        return None
    absorbed = set(found.values())
    args = (*operands, scale)
    opcode, dsts = NATIVE_ATTENTION_ROW, attend.dsts
    qkv = _qkv_row(ops, producer, uses, probes, query_in, key_in, value)
    if qkv is not None:   # the views of the projection's row, and of cos and sin
        row, heads, kv_heads, chain = qkv
        absorbed |= chain
        cos, sin = (_unsqueezed(ops, producer, probes, v) for v in (cos, sin))
        flat = _flat_output(ops, position, uses, producer, probes)
        if flat is not None:
            dsts, chain = flat
            absorbed |= chain
        opcode = NATIVE_ATTENTION_QKV
        args = (row, cos, sin, key_cache, value_cache, slots, positions, lengths, scale,
                Literal(heads), Literal(kv_heads), Literal(flat is not None))
    reads = tuple(v for v in args if isinstance(v, Var))
    first = min(absorbed | {position})
    if not _nothing_between_touches(ops, first, position, absorbed, reads,
                                    (key_cache, value_cache)):
        return None
    later = sorted((absorbed | {position}) - {first})
    variant = "+".join([_VARIANT, *(str(ops[i].source_pc) for i in later)])
    return SpecOp(opcode, dsts, args, ops[first].source_pc, variant=variant), absorbed


_PROLOGUES = {NATIVE_RMS_NORM: NATIVE_NORM_LINEAR, NATIVE_SILU_MUL: NATIVE_SILU_MUL_LINEAR}


def _prologues_folded(ops, leaving) -> tuple[list, int]:
    """`ops` with each NATIVE_RMS_NORM or NATIVE_SILU_MUL whose one reader is the small-M
    GEMM's input computed in that GEMM's call (native_decode.norm_linear and
    silu_mul_linear), and how many were."""
    uses = use_counts(ops, leaving)
    producer = {dst: i for i, op in enumerate(ops) for dst in op.dsts}
    replaced, removed = {}, set()
    for position, op in enumerate(ops):
        if op.opcode != NATIVE_LINEAR or not isinstance(op.args[0], Var):
            continue
        at = producer.get(op.args[0].reg, -1)
        if at < 0 or ops[at].opcode not in _PROLOGUES or uses.get(op.args[0].reg) != 1:
            continue
        small = ops[at]
        source = small.args[0]
        between = ops[at + 1:position]
        if any(source.reg in d.dsts or (d.variant == "inplace" and d.args
                                        and d.args[0] == source) for d in between):
            continue
        pcs = [str(op.source_pc), *op.variant.split("+")[1:]]
        replaced[position] = SpecOp(_PROLOGUES[small.opcode], op.dsts,
                                    (*small.args, *op.args[1:]) if small.opcode ==
                                    NATIVE_RMS_NORM else (source, *op.args[1:]),
                                    small.source_pc, variant="+".join([_VARIANT, *pcs]))
        removed.add(at)
    return [replaced.get(i, op) for i, op in enumerate(ops) if i not in removed], len(removed)


def _picked_norms(ops, leaving, probes) -> tuple[list, int]:
    """`ops` with each NATIVE_RMS_NORM of [1, N, W] whose one reader is INDEX(normed,
    (False, True), [pick]) (the rows a step returns logits for) as one NATIVE_RMS_NORM_ROWS
    at the INDEX's place, and how many were."""
    uses = use_counts(ops, leaving)
    producer = {dst: i for i, op in enumerate(ops) for dst in op.dsts}
    replaced, removed = {}, set()
    for position, op in enumerate(ops):
        if (op.opcode != "INDEX" or op.variant or len(op.args) != 3
                or op.args[1] != Literal((False, True)) or not isinstance(op.args[0], Var)
                or not isinstance(op.args[2], list) or len(op.args[2]) != 1
                or not isinstance(op.args[2][0], Var)):
            continue
        normed, pick = op.args[0], op.args[2][0]
        at = producer.get(normed.reg, -1)
        if at < 0 or ops[at].opcode != NATIVE_RMS_NORM or uses.get(normed.reg) != 1:
            continue
        norm = ops[at]
        rows, picks = probe_tensors(probes, norm.args[0].reg), probe_tensors(probes, pick.reg)
        if rows is None or picks is None or any(
                r.dim() != 3 or r.shape[0] != 1 or p.dim() != 1 or p.dtype != torch.int64
                for r, p in zip(rows, picks)):
            continue
        if any(norm.args[0] == Var(d) or d == pick.reg for o in ops[at + 1:position]
               for d in o.dsts) or any(o.variant == "inplace" and o.args
                                      and o.args[0] == norm.args[0]
                                      for o in ops[at + 1:position]):
            continue
        replaced[position] = SpecOp(NATIVE_RMS_NORM_ROWS, op.dsts, (*norm.args, pick),
                                    norm.source_pc, variant=f"{_VARIANT}+{op.source_pc}")
        removed.add(at)
    return [replaced.get(i, op) for i, op in enumerate(ops) if i not in removed], len(removed)


def _rotary_tables(ops, leaving, constants, probes) -> tuple[list, int]:
    """`ops` with each rotary table, UNSQUEEZE(UNSQUEEZE(positions, 0), 2) -> TO_COPY
    float32 -> MUL by the constant inverse frequencies -> CAT([f, f], -1) -> COS and SIN
    (each then times a scalar), as one NATIVE_ROTARY_TABLE at the last of them, and how
    many were (Llama-style rotary embeddings, computed once a step)."""
    uses = use_counts(ops, leaving)
    producer = {dst: i for i, op in enumerate(ops) for dst in op.dsts}
    readers: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        for v in flat_values(op.args):
            if isinstance(v, Var):
                readers.setdefault(v.reg, []).append(i)
    replaced, removed = {}, set()
    for position in range(len(ops)):
        found = _rotary_chain(ops, position, uses, producer, readers, constants, probes)
        if found is None:
            continue
        chain, new = found
        last = max(chain)
        replaced[last] = new
        removed |= chain - {last}
    return [replaced.get(i, op) for i, op in enumerate(ops) if i not in removed], len(replaced)


def _rotary_chain(ops, position, uses, producer, readers, constants, probes):
    cat = ops[position]
    if (cat.opcode != "CAT" or cat.variant or len(cat.args) != 2 or cat.args[1] != Literal(-1)
            or not isinstance(cat.args[0], list) or len(cat.args[0]) != 2
            or cat.args[0][0] != cat.args[0][1] or not isinstance(cat.args[0][0], Var)):
        return None
    freqs = cat.args[0][0]
    mul = producer.get(freqs.reg, -1)
    if mul < 0 or uses.get(freqs.reg) != 2 or ops[mul].opcode != "MUL" or ops[mul].variant:
        return None
    floats, inv = ops[mul].args
    inv_value = constants[inv.index] if isinstance(inv, ConstRef) else None
    if not (isinstance(inv_value, torch.Tensor) and inv_value.dtype == torch.float32
            and inv_value.is_contiguous()):
        return None
    chain = [position, mul]
    value = floats
    for opcode, check in (("TO_COPY", lambda o: o.args[1:] == (
            Literal(torch.float32), Literal(None), Literal(None))),
            ("UNSQUEEZE", lambda o: o.args[1] == Literal(2)),
            ("UNSQUEEZE", lambda o: o.args[1] == Literal(0))):
        at = _single_producer(ops, producer, uses, value, opcode)
        if at is None or not check(ops[at]):
            return None
        chain.append(at)
        value = ops[at].args[0]
    positions = value
    both = Var(cat.dsts[0])
    if not isinstance(positions, Var) or uses.get(both.reg) != 2:
        return None
    outs, scales = {}, {}
    for reader in readers.get(both.reg, []):
        trig = ops[reader]
        if trig.opcode not in ("COS", "SIN") or len(trig.args) != 1 or trig.variant not in (
                "", "inplace") or trig.opcode in outs:
            return None
        chain.append(reader)
        result, scale = trig.dsts[0], 1.0
        after = readers.get(result, [])
        if uses.get(result) == 1 and len(after) == 1 and ops[after[0]].opcode == "MUL" \
                and ops[after[0]].variant in ("", "inplace") \
                and ops[after[0]].args[0] == Var(result) \
                and isinstance(ops[after[0]].args[1], Literal) \
                and isinstance(ops[after[0]].args[1].value, int | float):
            chain.append(after[0])
            result, scale = ops[after[0]].dsts[0], float(ops[after[0]].args[1].value)
        outs[trig.opcode], scales[trig.opcode] = result, scale
    if set(outs) != {"COS", "SIN"}:
        return None
    tables = probe_tensors(probes, both.reg)
    points = probe_tensors(probes, positions.reg)
    if tables is None or points is None or any(
            p.dim() != 1 or p.dtype != torch.int64 or t.dtype != torch.float32
            or t.shape != (1, p.shape[0], 2 * inv_value.numel())
            for t, p in zip(tables, points)):
        return None
    span = set(chain)
    if any(positions.reg in ops[i].dsts or (ops[i].variant == "inplace" and ops[i].args
                                            and ops[i].args[0] == positions)
           for i in range(min(span), max(span)) if i not in span):
        return None
    # the two results come out of one op: nothing may read either before the last
    last = max(span)
    if any(i < last and i not in span for r in outs.values() for i in readers.get(r, [])):
        return None
    new = SpecOp(NATIVE_ROTARY_TABLE, (outs["COS"], outs["SIN"]),
                 (positions, inv, Literal(scales["COS"]), Literal(scales["SIN"])),
                 ops[min(span)].source_pc,
                 variant="+".join([_VARIANT, *(str(ops[i].source_pc)
                                               for i in sorted(span - {min(span)}))]))
    return span, new


def _decoder_layers(ops, leaving, probes) -> tuple[list, int]:
    """`ops` with each run of five consecutive calls that is one decoder layer of a
    one-token row (norm + QKV GEMV, attention step, output GEMV + residual, norm +
    gate/up GEMV, gated product + down GEMV + residual) as one NATIVE_DECODER_LAYER_ROW,
    and how many were."""
    uses = use_counts(ops, leaving)
    out, layers, position = [], 0, 0
    while position < len(ops):
        group = ops[position:position + 5]
        args = _layer_args(group, uses, probes) if len(group) == 5 else None
        if args is None:
            out.append(ops[position])
            position += 1
            continue
        pcs = [pc for op in group for pc in (str(op.source_pc), *op.variant.split("+")[1:])]
        out.append(SpecOp(NATIVE_DECODER_LAYER_ROW, (group[2].dsts[0], group[4].dsts[0]),
                          args, group[0].source_pc,
                          variant="+".join([_VARIANT, *pcs[1:]])))
        layers += 1
        position += 5
    return out, layers


def _layer_args(group, uses, probes):
    norm_qkv, attend, o_proj, norm_gate_up, down = group
    if [op.opcode for op in group] != [NATIVE_NORM_LINEAR, NATIVE_ATTENTION_QKV,
                                       NATIVE_LINEAR, NATIVE_NORM_LINEAR,
                                       NATIVE_SILU_MUL_LINEAR]:
        return None
    h, shape1, norm1, eps1, qkv_w, qkv_b, qkv_add, qkv_im = norm_qkv.args
    qkv, *attention, flat = attend.args
    attended, o_w, o_b, residual, o_im = o_proj.args
    h2, shape2, norm2, eps2, gu_w, gu_b, gu_add, gu_im = norm_gate_up.args
    gated, d_w, d_b, residual2, d_im = down.args
    produced = [Var(op.dsts[0]) for op in group]
    if not (qkv == produced[0] and attended == produced[1] and h2 == produced[2]
            and gated == produced[3] and residual == h and residual2 == produced[2]
            and flat == Literal(True) and qkv_add == gu_add == Literal(None)
            and qkv_im == o_im == gu_im == d_im == Literal(False)):
        return None
    if [uses.get(v.reg) for v in produced[:4]] != [1, 1, 2, 1] or not isinstance(h, Var):
        return None
    rows = probe_tensors(probes, h.reg)
    if rows is None or any(r.numel() != r.shape[-1] for r in rows):
        return None
    return (h, shape1, norm1, eps1, qkv_w, qkv_b, *attention, o_w, o_b, shape2, norm2, eps2,
            gu_w, gu_b, d_w, d_b)


def _single_producer(ops, producer, uses, value, opcode):
    """The position of the op `opcode` (no variant) whose result `value` is, read once."""
    at = producer.get(value.reg, -1) if isinstance(value, Var) else -1
    if at < 0 or ops[at].opcode != opcode or ops[at].variant or uses.get(value.reg) != 1:
        return None
    return at


def _ints(arg) -> list | None:
    if isinstance(arg, Literal) and isinstance(arg.value, list | tuple):
        values = list(arg.value)
    elif isinstance(arg, list) and all(isinstance(a, Literal) for a in arg):
        values = [a.value for a in arg]
    else:
        return None
    return values if all(isinstance(v, int) for v in values) else None


def _qkv_row(ops, producer, uses, probes, query, key, value):
    """(the projection's row, H, Hkv, positions of its views) when query, key and value
    are PERMUTE(VIEW(part)) of SPLIT_WITH_SIZES(row, [H*D, Hkv*D, Hkv*D], -1) over a
    contiguous [1, 1, (H + 2 Hkv) D] row, each view read once, else None."""
    chain, parts = set(), []
    for head_major in (query, key, value):
        permute = _single_producer(ops, producer, uses, head_major, "PERMUTE")
        if permute is None or _ints(ops[permute].args[1]) != [0, 2, 1, 3]:
            return None
        view = _single_producer(ops, producer, uses, ops[permute].args[0], "VIEW")
        if view is None:
            return None
        chain |= {permute, view}
        parts.append(ops[view].args[0])
    split = {producer.get(p.reg, -1) if isinstance(p, Var) else -1 for p in parts}
    if len(split) != 1 or -1 in split:
        return None
    at = split.pop()
    op = ops[at]
    if (op.opcode != "SPLIT_WITH_SIZES" or op.variant or len(op.args) != 3
            or [Var(d) for d in op.dsts] != parts or any(uses.get(d) != 1 for d in op.dsts)
            or op.args[2] not in (Literal(-1), Literal(2)) or not isinstance(op.args[0], Var)):
        return None
    rows = probe_tensors(probes, op.args[0].reg)
    queries = probe_tensors(probes, query.reg)
    keys = probe_tensors(probes, key.reg)
    if rows is None or queries is None or keys is None:
        return None
    heads, kv_heads, dim = queries[0].shape[1], keys[0].shape[1], queries[0].shape[-1]
    if _ints(op.args[1]) != [heads * dim, kv_heads * dim, kv_heads * dim]:
        return None
    width = (heads + 2 * kv_heads) * dim
    if any(r.shape != (1, 1, width) or not r.is_contiguous() or r.dtype != torch.float32
           for r in rows):
        return None
    return op.args[0], heads, kv_heads, chain | {at}


def _unsqueezed(ops, producer, probes, value):
    """The tensor under UNSQUEEZE `value` when it holds the same D floats, its last dim
    contiguous (cos and sin, whose head dim is added for broadcasting), else `value`."""
    at = producer.get(value.reg, -1)
    if at < 0 or ops[at].opcode != "UNSQUEEZE" or ops[at].variant:
        return value
    source = ops[at].args[0]
    under = probe_tensors(probes, source.reg) if isinstance(source, Var) else None
    over = probe_tensors(probes, value.reg)
    if under is None or over is None or any(
            u.numel() != o.numel() or u.stride(-1) != 1 for u, o in zip(under, over)):
        return value
    return source


def _flat_output(ops, position, uses, producer, probes):
    """(the dsts, positions) of PERMUTE [0, 2, 1, 3] -> CLONE -> VIEW [1, 1, H*D] over
    the attention's [1, H, 1, D] result, each read once: its result is then written
    flat, [1, 1, H*D], the same floats in the same order. None otherwise."""
    dst = Var(ops[position].dsts[0])
    chain, current = [], dst
    for opcode in ("PERMUTE", "CLONE", "VIEW"):
        if uses.get(current.reg) != 1:
            return None
        reader = next((i for i in range(position + 1, len(ops))
                       if current in ops[i].args), None)
        if reader is None or ops[reader].opcode != opcode or ops[reader].variant:
            return None
        chain.append(reader)
        current = Var(ops[reader].dsts[0])
    permute, clone, view = (ops[i] for i in chain)
    if _ints(permute.args[1]) != [0, 2, 1, 3]:
        return None
    if len(clone.args) > 1 and clone.args[1] not in (
            Literal(None), Literal(torch.contiguous_format)):
        return None
    outs, results = probe_tensors(probes, current.reg), probe_tensors(probes, dst.reg)
    if outs is None or results is None or any(
            o.shape != (1, 1, r.shape[1] * r.shape[3]) for o, r in zip(outs, results)):
        return None
    return view.dsts, set(chain)


def _without_dead_views(ops, leaving):
    """`ops` less the views (and splits) no op reads any more."""
    while True:
        uses = use_counts(ops, leaving)
        dead = [i for i, op in enumerate(ops)
                if OPCODES.get(op.opcode) is not None and OPCODES[op.opcode].is_view
                and not op.variant and not any(uses.get(d) for d in op.dsts)]
        if not dead:
            return ops
        ops = [op for i, op in enumerate(ops) if i not in dead]


def _one_row_everywhere(probes, operands) -> bool:
    query, key, value, cos, sin, key_cache, value_cache, slots, positions, lengths = (
        probe_tensors(probes, v.reg) for v in operands)
    if any(v is None for v in (query, key, value, cos, sin, key_cache, value_cache, slots,
                               positions, lengths)):
        return False
    for i, q in enumerate(query):
        if q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != 1:
            return False
        heads, dim = q.shape[1], q.shape[3]
        kc = key_cache[i]
        if kc.dim() != 4 or kc.shape[-1] != dim or not kc.is_contiguous():
            return False
        kv_heads = kc.shape[1]
        if value_cache[i].shape != kc.shape or not value_cache[i].is_contiguous():
            return False
        if key[i].shape != (1, kv_heads, 1, dim) or value[i].shape != (1, kv_heads, 1, dim):
            return False
        if kv_heads == 0 or heads % kv_heads:
            return False
        if cos[i].numel() != dim or sin[i].numel() != dim:
            return False
        tensors = (q, key[i], value[i], cos[i], sin[i], kc, value_cache[i])
        if any(t.dtype != torch.float32 or t.stride(-1) != 1 for t in tensors):
            return False
        if any(t[i].shape != (1,) or t[i].dtype != torch.int64
               for t in (slots, positions, lengths)):
            return False
    return True


def _nothing_between_touches(ops, first: int, last: int, absorbed: set[int], reads,
                             cache_values) -> bool:
    """No op between the group's first and its DECODE_ATTN (other than the group's own)
    writes what the group reads, or reads or writes a cache: the fused call, at the
    DECODE_ATTN's place, then computes what the ops did in their places."""
    read = {v.reg for v in reads}
    caches = {v.reg for v in cache_values}
    for at in range(first + 1, last):
        if at in absorbed:
            continue
        op = ops[at]
        args = {v.reg for v in flat_values(op.args) if isinstance(v, Var)}
        if set(op.dsts) & read or args & caches:
            return False
        if op.variant == "inplace" and args & read:
            return False
    return True
