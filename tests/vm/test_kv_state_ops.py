"""KV_APPEND and DECODE_ATTN (Note [KV cache as state] in dynvm.vm.ops_kv): the write
lands at each row's slot and position only, attention over per-row lengths equals SDPA
over each row's own prefix, the frontend marks the cache inputs as state, the .dvm
keeps it, the verifier refuses a cache operand that is not state, and the JIT never
drops the in-place write."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import dynvm
from dynvm.vm.dvm_file import dumps, loads
from dynvm.vm.ops_kv import decode_attention, kv_append
from tests.jit._jit_helpers import eager_config

SLOTS, HKV, CAP, D, H = 5, 2, 12, 8, 6


def _cache(seed=0):
    return torch.randn(SLOTS, HKV, CAP, D, generator=torch.Generator().manual_seed(seed))


def _reference(query, keys, values, slots, lengths):
    rows = []
    for b, (slot, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        rows.append(F.scaled_dot_product_attention(
            query[b:b + 1], keys[slot:slot + 1, :, :n], values[slot:slot + 1, :, :n],
            enable_gqa=True))
    return torch.cat(rows)


@pytest.mark.parametrize("slots, lengths", [
    ([0, 1, 2], [7, 7, 7]),        # contiguous slots, one length: a view, no mask
    ([1, 2, 3], [3, 12, 1]),       # contiguous from 1, lengths differ: a key mask
    ([4, 0, 2], [5, 9, 2]),        # any assignment: the rows' prefixes gathered
], ids=["same_length", "per_row_lengths", "scattered_slots"])
def test_decode_attention_is_sdpa_over_each_rows_prefix(slots, lengths):
    query = torch.randn(len(slots), 1, H, D).transpose(1, 2)   # HF's layout
    keys, values = _cache(1), _cache(2)
    slots, lengths = torch.tensor(slots), torch.tensor(lengths)
    got = decode_attention(query, keys, values, slots, lengths, None)
    torch.testing.assert_close(got, _reference(query, keys, values, slots, lengths),
                               rtol=1e-5, atol=1e-5)
    assert got.is_contiguous()


@pytest.mark.parametrize("steps", [1, 3])
def test_kv_append_writes_its_positions_only(steps):
    cache = _cache()
    before = cache.clone()
    new = torch.randn(2, HKV, steps, D)
    slots, positions = torch.tensor([3, 1]), torch.tensor([0, 7])
    assert kv_append(cache, new, slots, positions) is cache
    expected = before.clone()
    for b, (slot, at) in enumerate(zip(slots.tolist(), positions.tolist())):
        expected[slot, :, at:at + steps] = new[b]
    assert torch.equal(cache, expected)


class _Step(torch.nn.Module):
    """A decode-like step: project, append to the state, attend."""

    def forward(self, x, slots, lengths, keys, values):
        q = (x * 2.0).view(x.shape[0], 1, H, D).transpose(1, 2)
        kv = x[:, :HKV * D].view(x.shape[0], HKV, 1, D)
        keys = torch.ops.dynvm.kv_append(keys, kv, slots, lengths)
        values = torch.ops.dynvm.kv_append(values, kv + 1.0, slots, lengths)
        out = torch.ops.dynvm.decode_attention(q, keys, values, slots, lengths + 1, None)
        return out.transpose(1, 2).reshape(x.shape[0], H * D) + x


@pytest.fixture(scope="module")
def program():
    batch, slots, capacity = Dim("batch", max=4), Dim("slots", max=SLOTS), Dim("cap", max=CAP)
    state = {0: slots, 2: capacity}
    examples = (torch.randn(2, H * D), torch.tensor([0, 2]), torch.tensor([1, 3]),
                torch.zeros(3, HKV, 7, D), torch.zeros(3, HKV, 7, D))
    return dynvm.compile(_Step(), examples, ({0: batch}, {0: batch}, {0: batch}, state, state))


def _run(runtime, steps=4):
    keys, values = torch.zeros(SLOTS, HKV, CAP, D), torch.zeros(SLOTS, HKV, CAP, D)
    slots, lengths = torch.tensor([2, 3]), torch.tensor([0, 2])
    gen = torch.Generator().manual_seed(5)
    outs = []
    for _ in range(steps):
        outs.append(runtime(torch.randn(2, H * D, generator=gen), slots, lengths, keys,
                            values))
        lengths = lengths + 1
    return outs, keys, values


def test_state_is_marked_kept_in_the_file_and_verified(program):
    assert program.state == (3, 4)
    assert [i.op for i in program.code].count("KV_APPEND") == 2
    loaded = loads(dumps(program))
    assert loaded.state == (3, 4) and loaded.content_hash == program.content_hash
    with pytest.raises(dynvm.VerifyError, match="must be cache state"):
        dataclasses.replace(program, state=(), _cache={})
    with pytest.raises(dynvm.VerifyError, match="rank 1"):
        dataclasses.replace(program, state=(1, 3, 4), _cache={})


def test_jit_keeps_the_in_place_write(program):
    with dynvm.Runtime(program, jit=False) as interpreter:
        want, want_keys, want_values = _run(interpreter)
    with dynvm.Runtime(program, jit=eager_config()) as runtime:
        got, keys, values = _run(runtime)
        assert runtime.stats()["specialized_region_calls"] >= 2
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert keys[2:4].abs().sum() > 0 and keys[:2].abs().sum() == 0
