"""DECODE_ATTN over a chunk of T new tokens per row (Note [KV cache as state] in
dynvm.vm.ops_kv; Note [One step program for prompt and decode] in
dynvm._generation_kv): each query sees the cached prefix and the chunk causally, equal
to SDPA over each row's own prefix with a bottom-right causal band, for contiguous and
scattered slots, rows of one length or of several, grouped heads or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dynvm.vm.ops_kv import decode_attention, kv_append

SLOTS, HKV, CAP, D = 5, 2, 12, 8


def _reference(query, keys, values, slots, lengths):
    steps, rows = query.shape[2], []
    for b, (slot, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        band = torch.arange(n)[None, :] <= (n - steps + torch.arange(steps))[:, None]
        rows.append(F.scaled_dot_product_attention(
            query[b:b + 1], keys[slot:slot + 1, :, :n], values[slot:slot + 1, :, :n],
            attn_mask=band, enable_gqa=True))
    return torch.cat(rows)


@pytest.mark.parametrize("heads", [6, 2], ids=["grouped", "mha"])
@pytest.mark.parametrize("slots, lengths, steps", [
    ([0, 1, 2], [7, 7, 7], 3),      # contiguous, one length: one [T, L] band
    ([1, 2, 3], [4, 12, 3], 3),     # lengths differ: a band per row
    ([4, 0, 2], [5, 9, 2], 2),      # scattered slots: prefixes gathered
    ([3], [12], 12),                # a whole prompt in one chunk, no prefix
], ids=["same_length", "per_row_lengths", "scattered_slots", "no_prefix"])
def test_chunk_attention_is_causal_over_prefix_and_chunk(slots, lengths, steps, heads):
    gen = torch.Generator().manual_seed(steps)
    keys = torch.randn(SLOTS, HKV, CAP, D, generator=gen)
    values = torch.randn(SLOTS, HKV, CAP, D, generator=gen)
    query = torch.randn(len(slots), steps, heads, D, generator=gen).transpose(1, 2)
    slots, lengths = torch.tensor(slots), torch.tensor(lengths)
    got = decode_attention(query, keys, values, slots, lengths, None)
    torch.testing.assert_close(got, _reference(query, keys, values, slots, lengths),
                               rtol=1e-5, atol=1e-5)
    assert got.shape == (len(slots), heads, steps, D) and got.is_contiguous()


def test_chunks_then_decode_equal_one_pass():
    """A sequence written as chunks of 4, 3 and then one token at a time attends as one
    causal pass over the whole sequence does."""
    gen = torch.Generator().manual_seed(1)
    total, heads = 10, 4
    query = torch.randn(1, heads, total, D, generator=gen)
    new_keys = torch.randn(1, HKV, total, D, generator=gen)
    new_values = torch.randn(1, HKV, total, D, generator=gen)
    whole = F.scaled_dot_product_attention(query, new_keys, new_values, is_causal=True,
                                           enable_gqa=True)
    keys, values = torch.zeros(SLOTS, HKV, CAP, D), torch.zeros(SLOTS, HKV, CAP, D)
    slot, at, outs = torch.tensor([2]), 0, []
    for size in (4, 3, 1, 1, 1):
        part = slice(at, at + size)
        position = torch.tensor([at])
        kv_append(keys, new_keys[:, :, part], slot, position)
        kv_append(values, new_values[:, :, part], slot, position)
        at += size
        outs.append(decode_attention(query[:, :, part], keys, values, slot,
                                     torch.tensor([at]), None))
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, rtol=1e-5, atol=1e-5)
