"""A Hugging Face causal LM's decode step over the KV cache as state (Note [KV cache as
state] in dynvm.vm.ops_kv):

    decode_kv(input_ids [B, 1], slots [B], lengths [B], keys, values) -> logits [B, V]

`keys` and `values` are the cache state, one [slots, Hkv, capacity, D] tensor per layer,
written in place; row b is the sequence in slot slots[b] holding lengths[b] tokens (its
new token's position). No mask: DECODE_ATTN reads each row's own length.

The model's own code is what gets lowered, as for the pure decode step, except its
attention: the step runs the model with an attention function of ours (registered with
Hugging Face's AttentionInterface) that appends the layer's new key and value to the
state (KV_APPEND) and attends over it (DECODE_ATTN). The model sees no cache object and
builds no mask (an attention implementation without a mask function gets none).
"""

from __future__ import annotations

import contextlib

import torch

import dynvm.vm.ops_kv  # noqa: F401 - defines torch.ops.dynvm.kv_append, decode_attention
from dynvm.vm.errors import ConfigError
from dynvm.vm.program import Program

_IMPLEMENTATION = "dynvm_kv_state"


def _state_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     dynvm_kv=None, **kwargs):
    """Hugging Face attention function: append this layer's key and value to the state,
    attend over each row's slot; returns ([B, 1, H, D], None) as its own functions do."""
    keys, values, slots, lengths = dynvm_kv
    layer = module.layer_idx
    key_cache = torch.ops.dynvm.kv_append(keys[layer], key, slots, lengths)
    value_cache = torch.ops.dynvm.kv_append(values[layer], value, slots, lengths)
    out = torch.ops.dynvm.decode_attention(query, key_cache, value_cache, slots, lengths + 1,
                                           scaling)
    return out.transpose(1, 2), None


class _DecodeKv(torch.nn.Module):
    """One new token per row, over the cache state."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, slots, lengths, keys, values):
        out = self.model(input_ids=input_ids, position_ids=lengths[:, None], use_cache=False,
                         logits_to_keep=1, dynvm_kv=(keys, values, slots, lengths))
        return out.logits[:, -1, :]


@contextlib.contextmanager
def _state_attention_on(model):
    """The model's attention switched to `_state_attention` while the step is exported."""
    from transformers import AttentionInterface

    AttentionInterface.register(_IMPLEMENTATION, _state_attention)
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = _IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = saved


def export_decode_kv(model: torch.nn.Module, keys: list[torch.Tensor], *, max_batch: int,
                     max_length: int, name: str) -> Program:
    """The decode step over the cache state, with dynamic batch (1..max_batch); its state
    inputs declare slots 1..max_batch and capacity 2..max_length, and the state's owner
    allocates their upper bounds. `keys`: one layer's prefill keys per layer (their
    heads, head dim and dtype give the state's)."""
    from torch.export import Dim

    from dynvm import compile as dynvm_compile

    batch = Dim("batch", min=1, max=max_batch)
    slots = Dim("slots", min=1, max=max_batch)
    capacity = Dim("capacity", min=2, max=max_length)
    # Distinct example sizes (batch 2, slots 3, capacity 11): no dim taken for another.
    state = [torch.zeros(3, k.shape[1], 11, k.shape[3], dtype=k.dtype) for k in keys]
    values = [s.clone() for s in state]
    ids = torch.full((2, 1), 3, dtype=torch.long)
    rows, lengths = torch.tensor([0, 2]), torch.tensor([4, 6])
    state_dims = [{0: slots, 2: capacity}] * len(keys)
    with torch.no_grad(), _state_attention_on(model):
        program = dynvm_compile(_DecodeKv(model), (ids, rows, lengths, state, values),
                                ({0: batch}, {0: batch}, {0: batch}, state_dims, state_dims),
                                name=f"{name}.decode_kv")
    # input_ids, slots, lengths, then the keys and values of every layer: the frontend
    # marks the inputs the KV instructions take as their cache as the state.
    if program.state != tuple(range(3, 3 + 2 * len(keys))):
        raise ConfigError(f"{name}: kv_state=True: the decode step's state inputs are "
                          f"{program.state}, expected the {2 * len(keys)} keys and values; "
                          f"kv_state=False exports this model with the cache as plain inputs")
    return program
