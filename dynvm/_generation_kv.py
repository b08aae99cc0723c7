"""A Hugging Face causal LM's one step program over the KV cache as state (Note [KV
cache as state] in dynvm.vm.ops_kv), for the prompt and for decoding alike:

    step(input_ids [B, T], slots [B], lengths [B], keys, values) -> logits [B, V]

`keys` and `values` are the cache state, one [slots, Hkv, capacity, D] tensor per layer,
written in place; row b is the sequence in slot slots[b] holding lengths[b] tokens (its
first new token's position); the logits are those of each row's last new token. No
mask: DECODE_ATTN reads each row's own length.

Note [One step program for prompt and decode]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A generator used to hold a prefill program (no past; its keys and values then copied
into the state row by row in Python) beside the decode step over the state: two
programs, two Runtimes, two JIT engines packing the same weights. Decode (T = 1) and a
prompt chunk (T > 1) are one computation over the state: KV_APPEND writes the T new
keys and values at lengths[b].., DECODE_ATTN attends from each new token over the
cached prefix and causally within the chunk. So one program with T dynamic (1..chunk)
serves both, and a prompt longer than the chunk is written chunk by chunk (a long
prompt need not stall the other sequences' next token: the serving scheduler
interleaves chunks with their decode steps). The JIT sees T as one more dim: T = 1 is
the decode shape, whole chunks recur at T = chunk, a prompt's last chunk falls in a
family over T. Rows of one call share T; rows whose prompts differ in length are
written in calls of the lengths they share (Generator._prompt), never left-padded.

Note [One packed call per step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rows of one call share T, so a serving step with running rows (T = 1) and a prompt
chunk (T > 1) was two calls, and its cost swung with the batch between them (inter-token
p99 3.3-4.6x p50 in-process at every step budget). Exported `packed`, the step takes the
tokens of any rows flat instead:

    step(input_ids [1, N], slots [N], positions [N], last [R], keys, values)
        -> logits [R, V]

token i belongs to slot slots[i] at position positions[i]; `last` picks the tokens
whose logits are returned (a decode row's token, a prompt's final one). KV_APPEND and
DECODE_ATTN take the same packed form (Note [Packed tokens] in dynvm.vm.ops_kv): each
token is written at its (slot, position) and attends its own slot up to itself. The
model's linears see one [1, N, hidden] batch, so a step's cost is bounded by its N (the
scheduler's token budget), one call, no padding; the JIT's families follow N and R
rather than (rows, T). The rows form stays (packed=False); Generator takes either
(Generator.rows_call packs [B, T] rows when the step is packed).

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
    """Hugging Face attention function: append this layer's T new keys and values to the
    state, attend over each row's slot (causal in the chunk); returns ([B, T, H, D],
    None) as its own functions do."""
    keys, values, slots, positions, seen = dynvm_kv
    layer = module.layer_idx
    key_cache = torch.ops.dynvm.kv_append(keys[layer], key, slots, positions)
    value_cache = torch.ops.dynvm.kv_append(values[layer], value, slots, positions)
    out = torch.ops.dynvm.decode_attention(query, key_cache, value_cache, slots, seen,
                                           scaling)
    return out.transpose(1, 2), None


class _Step(torch.nn.Module):
    """T new tokens per row over the cache state (Note [One step program for prompt and
    decode])."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, slots, lengths, keys, values):
        steps = torch.arange(input_ids.shape[1], device=input_ids.device)
        out = self.model(input_ids=input_ids, position_ids=lengths[:, None] + steps,
                         use_cache=False, logits_to_keep=1,
                         dynvm_kv=(keys, values, slots, lengths,
                                   lengths + input_ids.shape[1]))
        return out.logits[:, -1, :]


class _PackedStep(torch.nn.Module):
    """N tokens of any rows, flat, over the cache state (Note [One packed call per
    step])."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, slots, positions, last, keys, values):
        out = self.model(input_ids=input_ids, position_ids=positions[None, :],
                         use_cache=False, logits_to_keep=last,
                         dynvm_kv=(keys, values, slots, positions, positions + 1))
        return out.logits[0]


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


def _cache_shape(model: torch.nn.Module) -> tuple[int, int, int, torch.dtype]:
    """(layers, key/value heads, head dim, dtype) of the model's cache, from its config."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    return config.num_hidden_layers, kv_heads, head_dim, dtype


def export_step(model: torch.nn.Module, *, max_batch: int, max_length: int, chunk: int,
                name: str, packed: bool = False) -> Program:
    """The step over the cache state (Note [One step program for prompt and decode]),
    with dynamic batch (1..max_batch) and new tokens per row T (1..chunk), or `packed`
    (Note [One packed call per step]): N = 1..max(chunk, max_batch) tokens of R =
    1..max_batch rows; its state inputs declare slots 1..max_batch and capacity
    2..max_length, and the state's owner allocates their upper bounds."""
    from torch.export import Dim

    from dynvm import compile as dynvm_compile

    layers, kv_heads, head_dim, dtype = _cache_shape(model)
    batch = Dim("batch", min=1, max=max_batch)
    steps = Dim("steps", min=1, max=chunk)
    slots = Dim("slots", min=1, max=max_batch)
    capacity = Dim("capacity", min=2, max=max_length)
    # Distinct example sizes (batch 2, T 5, slots 3, capacity 13): no dim taken for
    # another; the rows write positions 4..8 and 6..10 of 13.
    state = [torch.zeros(3, kv_heads, 13, head_dim, dtype=dtype) for _ in range(layers)]
    values = [s.clone() for s in state]
    ids = torch.full((2, 5), 3, dtype=torch.long)
    rows, lengths = torch.tensor([0, 2]), torch.tensor([4, 6])
    state_dims = [{0: slots, 2: capacity}] * layers
    with torch.no_grad(), _state_attention_on(model):
        if packed:
            # 5 tokens: slot 0 at 4..6 (a chunk), slot 2 at 6, 7; 2 rows' logits.
            tokens = Dim("tokens", min=1, max=max(chunk, max_batch))
            program = dynvm_compile(
                _PackedStep(model), (ids[:1], torch.tensor([0, 0, 0, 2, 2]),
                                     torch.tensor([4, 5, 6, 6, 7]), rows + 2, state, values),
                ({1: tokens}, {0: tokens}, {0: tokens}, {0: batch}, state_dims, state_dims),
                name=f"{name}.step")
        else:
            program = dynvm_compile(_Step(model), (ids, rows, lengths, state, values),
                                    ({0: batch, 1: steps}, {0: batch}, {0: batch},
                                     state_dims, state_dims), name=f"{name}.step")
    # The token inputs, then the keys and values of every layer: the frontend marks the
    # inputs the KV instructions take as their cache as the state.
    first = 4 if packed else 3
    if program.state != tuple(range(first, first + 2 * layers)):
        raise ConfigError(f"{name}: kv_state=True: the step's state inputs are "
                          f"{program.state}, expected the {2 * layers} keys and values; "
                          f"kv_state=False exports this model with the cache as plain inputs")
    return program
