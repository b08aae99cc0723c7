"""The KV cache as state: KV_APPEND writes a step's keys or values into a preallocated
cache in place; DECODE_ATTN attends over each row's cache slot up to its own length,
causally for a chunk of several new tokens.

Note [KV cache as state]
~~~~~~~~~~~~~~~~~~~~~~~~
A pure decode step takes the cache as an input and returns a new one one position
longer: every step re-allocates each layer's [B, Hkv, L + 1, D] with CAT. Here the
cache is state instead: one tensor per layer for keys and one for values, shaped
[slots, Hkv, capacity, D] (capacity = the program's max_length, slots = its max_batch),
allocated once by its owner (dynvm._kv_state.KvState) and passed to the program as
inputs that the program's `state` lists (Program.state; the .dvm's CODE header records
it). A row of a batch is a sequence living in slot `slots[b]`, holding `lengths[b]`
tokens: no left padding, no mask.

- KV_APPEND(cache, new [B, Hkv, T, D], slots [B], positions [B]) writes
  cache[slots[b], :, positions[b] + t] = new[b, :, t] in place and returns the cache
  itself (`returns_operand`: the JIT's alias analysis sees the result as the cache, so
  it never plans it into an arena or reuses it). The attention that follows reads the
  returned register, so the data dependency orders the write before the read.
- DECODE_ATTN(query [B, H, T, D], keys, values, slots, lengths, scale) attends over
  keys[slots[b], :, :lengths[b]], lengths[b] counting the T new tokens already
  appended: query t of row b sits at position lengths[b] - T + t and sees the keys up
  to it (the cached prefix, then causal within the chunk). One SDPA over the slots'
  prefix up to the longest row, grouped heads folded into the query (Note [Grouped
  heads without copies]). T = 1 (decode) builds a key mask only when the rows' lengths
  differ; T > 1 (a prompt chunk, Note [One step program for prompt and decode] in
  dynvm._generation_kv) needs the causal band, a [T, L] mask shared by every row when
  their lengths agree, [B, T, L] when they differ; never a copy of K or V. Contiguous
  slots (b -> first + b) are a view of the cache; any other assignment gathers the
  rows' prefixes.

Both are idempotent for the same operands (the same values written at the same
positions), so the JIT's probation shadow calls and calibration runs, which run a
region twice, leave the cache as one run does. The verifier checks that every cache
operand is a state input or a KV_APPEND result chained from one (vm/verifier.py).

Note [One row by plain indexing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A batch of one row (every B=1 decode step, and each prompt chunk written alone) takes
its slot and length as Python ints (one read each) and works on views: KV_APPEND copies
into cache[slot, :, p:p + T], DECODE_ATTN attends over cache[slot:slot + 1, :, :L]
without a mask at T = 1. The general path's advanced-index write (index_put), its
checks that the slots are contiguous, its max/any reads and its position arange cost
~10 small ATen calls per layer, which at B=1 are a visible share of a GEMV-bound step.

Note [Packed tokens]
~~~~~~~~~~~~~~~~~~~
The same two instructions take a packed batch: `new` or `query` [1, heads, N, D] with
one slot and one position per token (slots [N]; KV_APPEND's positions [N]; DECODE_ATTN's
lengths [N], each token's position + 1: the keys it sees). The form is told apart by
the operands' shapes (slots.shape[0] != new.shape[0]); at N = 1 both forms are the same
call. This is what a scheduler step of running rows' decode tokens and prompt chunks
runs as one call (Note [One packed call per step] in dynvm._generation_kv): each run of
tokens of one slot at consecutive positions is a segment; a segment of one token (a
decode row) attends as the rows of one T = 1 call, all such segments together, and a
longer one (a prompt chunk) as one row of its own, causal within it. No padding, no
[N, L] mask over the whole batch: the cost follows the tokens.

For torch.export, the two are torch.library ops (`dynvm::kv_append`,
`dynvm::decode_attention`) whose schemas declare no mutation: export would otherwise
functionalize the write into a copy of the whole cache. Their kernels are the
instructions' own implementations; only the exported decode step calls them.
"""

from __future__ import annotations

import torch

from dynvm.vm.ops_attention import sdpa_gqa
from dynvm.vm.ops_common import tensor_op

_LIB = torch.library.Library("dynvm", "FRAGMENT")
_LIB.define("kv_append(Tensor cache, Tensor new, Tensor slots, Tensor positions) -> Tensor")
_LIB.define("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor slots, "
            "Tensor lengths, float? scale=None) -> Tensor")


def kv_append(cache, new, slots, positions):
    """KV_APPEND: write `new` at each row's slot and position, in place; the cache."""
    steps = new.shape[2]
    if slots.shape[0] != new.shape[0]:  # Note [Packed tokens]
        return _append_tokens(cache, new, slots, positions)
    if new.shape[0] == 1:  # Note [One row by plain indexing]
        first = int(positions[0])
        cache[int(slots[0]), :, first:first + steps].copy_(new[0])
    elif steps == 1:
        cache[slots, :, positions] = new[:, :, 0]
    else:
        where = positions[:, None] + torch.arange(steps, device=positions.device)
        cache[slots[:, None], :, where] = new.transpose(1, 2)
    return cache


def _segments(slots: list[int], positions: list[int]) -> list[tuple[int, int]]:
    """Runs [a, b) of packed tokens of one slot at consecutive positions (Note [Packed
    tokens])."""
    runs, start = [], 0
    for i in range(1, len(slots)):
        if slots[i] != slots[i - 1] or positions[i] != positions[i - 1] + 1:
            runs.append((start, i))
            start = i
    runs.append((start, len(slots)))
    return runs


def _append_tokens(cache, new, slots, positions):
    """KV_APPEND of packed tokens: new [1, Hkv, N, D], token i at (slots[i], positions[i])."""
    where = positions.tolist()
    runs = _segments(slots.tolist(), where)
    if len(runs) == 1:   # one slot's consecutive positions: a view
        first = where[0]
        cache[int(slots[0]), :, first:first + new.shape[2]].copy_(new[0])
    else:
        cache[slots, :, positions] = new[0].transpose(0, 1)
    return cache


def _kv_append_abstract(cache, new, slots, positions):
    return cache


def _rows(cache, slots, length: int):
    """cache[slots, :, :length]: a view when the slots are first, first + 1, ..."""
    batch = slots.shape[0]
    first = int(slots[0])
    if first + batch <= cache.shape[0] and bool(
            (slots == torch.arange(first, first + batch, device=slots.device)).all()):
        return cache[first:first + batch, :, :length]
    return cache[:, :, :length].index_select(0, slots)


def decode_attention(query, keys, values, slots, lengths, scale=None):
    """DECODE_ATTN: each row's T queries over its slot's first lengths[b] keys and
    values, query t seeing positions up to lengths[b] - T + t (causal in the chunk)."""
    if slots.shape[0] != query.shape[0]:  # Note [Packed tokens]
        return _token_attention(query, keys, values, slots, lengths, scale)
    if query.shape[0] == 1:  # Note [One row by plain indexing]
        return _one_row_attention(query, keys, values, int(slots[0]), int(lengths[0]),
                                  scale)
    longest = int(lengths.max())
    k, v = _rows(keys, slots, longest), _rows(values, slots, longest)
    steps = query.shape[2]
    same = not bool((lengths != longest).any())
    mask = None
    positions = torch.arange(longest, device=lengths.device)
    if steps > 1:
        if same:   # one [T, L] band for every row: position j seen by query t if j <= last
            last = positions[longest - steps:]
            mask = (positions[None, :] <= last[:, None])[None, None]
        else:
            last = lengths[:, None] - steps + torch.arange(steps, device=lengths.device)
            mask = (positions[None, None, :] <= last[:, :, None])[:, None]
    elif not same:
        mask = (positions < lengths[:, None])[:, None, None]
    return sdpa_gqa(query, k, v, mask, 0.0, False, scale).contiguous()


def _one_row_attention(query, keys, values, slot: int, length: int, scale):
    """DECODE_ATTN for one row: its slot's prefix is a view, and only a chunk (T > 1)
    needs a mask, the causal band of its T queries over the prefix."""
    k, v = keys[slot:slot + 1, :, :length], values[slot:slot + 1, :, :length]
    steps = query.shape[2]
    mask = None
    if steps > 1:
        positions = torch.arange(length, device=query.device)
        mask = (positions[None, :] <= positions[length - steps:, None])[None, None]
    return sdpa_gqa(query, k, v, mask, 0.0, False, scale).contiguous()


def _token_attention(query, keys, values, slots, lengths, scale):
    """DECODE_ATTN of packed tokens (Note [Packed tokens]): query [1, H, N, D], token i of
    slot slots[i] seeing its first lengths[i] positions. Segments of one token attend as
    the rows of one decode call, longer ones each as one row, causal within it."""
    seen = lengths.tolist()
    runs = _segments(slots.tolist(), seen)
    if len(runs) == 1:
        return _one_row_attention(query, keys, values, int(slots[0]), seen[-1], scale)
    singles = [a for a, b in runs if b - a == 1]
    rows = query[0].transpose(0, 1)   # [N, H, D]
    if len(singles) == len(seen):     # decode rows only
        out = decode_attention(rows[:, :, None], keys, values, slots, lengths, scale)
        return out[:, :, 0].transpose(0, 1)[None].contiguous()
    out = query.new_empty((*query.shape[:-1], values.shape[-1]))
    if singles:
        index = torch.tensor(singles, device=slots.device)
        rows_out = decode_attention(rows.index_select(0, index)[:, :, None], keys, values,
                                    slots.index_select(0, index),
                                    lengths.index_select(0, index), scale)
        out[0].index_copy_(1, index, rows_out[:, :, 0].transpose(0, 1))
    for a, b in runs:
        if b - a > 1:
            out[:, :, a:b] = _one_row_attention(query[:, :, a:b], keys, values,
                                                int(slots[a]), seen[b - 1], scale)
    return out


def _decode_attention_abstract(query, keys, values, slots, lengths, scale):
    return query.new_empty((*query.shape[:-1], values.shape[-1]))


_LIB.impl("kv_append", kv_append, "CompositeExplicitAutograd")
_LIB.impl("decode_attention", decode_attention, "CompositeExplicitAutograd")
torch.library.register_fake("dynvm::kv_append", lib=_LIB)(
    lambda cache, new, slots, positions: torch.empty_like(cache))
torch.library.register_fake("dynvm::decode_attention", lib=_LIB)(
    lambda query, keys, values, slots, lengths, scale=None: query.new_empty(
        (*query.shape[:-1], values.shape[-1])))

KV_OPS = (
    tensor_op("KV_APPEND", torch.ops.dynvm.kv_append.default,
              "write a step's keys or values into the cache state in place",
              impl=kv_append, custom_shape_fn=_kv_append_abstract,
              returns_operand=True, writes_state=True),
    tensor_op("DECODE_ATTN", torch.ops.dynvm.decode_attention.default,
              "attention of each row's queries over its cache slot's first lengths[b] "
              "positions, causal within a chunk of several", impl=decode_attention,
              custom_shape_fn=_decode_attention_abstract),
)

KV_CACHE_OPERANDS = {"KV_APPEND": (0,), "DECODE_ATTN": (1, 2)}
"""Which operands of each KV instruction must hold cache state (checked by the verifier)."""
