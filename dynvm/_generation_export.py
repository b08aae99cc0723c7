"""A Hugging Face causal LM as dynvm programs: one step over the KV cache as state for
the prompt and decoding alike (`step`, dynvm._generation_kv; kv_state=True), or, with
the cache as plain tensors (kv_state=False, or `pure`), a prefill and a decode step:

    prefill(input_ids [B, T], attention_mask [B, T], position_ids [B, T])
        -> (last logits [B, V], keys [[B, Hkv, T, D]] per layer, values [...])
    decode(input_ids [B, 1], past_mask [B, L], position_ids [B, 1], keys, values)
        -> (last logits [B, V], keys [[B, Hkv, L + 1, D]] per layer, values [...])

The cache travels as plain tensors, one per layer; each step rebuilds a DynamicCache
around them inside the exported function, so the model's own code (masks, RoPE, cache
update) is what gets lowered. Note [Decode mask without a derived dim] says why decode
takes the past mask rather than the whole one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dynvm._lm_head_layout import store_lm_head_input_major
from dynvm.vm.errors import ConfigError
from dynvm.vm.program import Program

# Note [Decode mask without a derived dim]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Hugging Face's decode step takes the whole attention mask, [B, L + 1] for a cache of
# length L. Declaring that length needs a derived dim (L + 1), which the frontend does
# not take yet. The new token always attends to itself, so the decode program takes the
# mask of the past only ([B, L], the same dim L as the cache) and appends the column of
# ones itself: the check that mask and cache agree stays an ordinary input check.
#
# Note [The packed step by default]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The step over the KV state comes in two forms (Note [One packed call per step] in
# dynvm._generation_kv): rows of one T per call, or the packed form, the tokens of any
# rows flat in one call. The form is fixed at export and travels with a saved generator
# (generator.json's "packed"), so the default is what `dynvm serve` gets from a
# generator exported the documented way. The serving scheduler needs the packed form:
# over rows a step that carries a prompt chunk is two calls (the decode rows, then the
# chunk), and in-process its inter-token p99 was 3.3-3.8x p50 against 1.7-1.9x packed
# at a step budget of 16 (docs/bench_log.md, 2026-12-03). The library's
# Generator.generate loses nothing measurable with it: on the 768-wide Llama of `dynvm
# bench generate` (1 thread, prompt 32 + 128 new, JIT, a model exported per form,
# 2026-12-05 12:07 UTC, load 1.0-1.4) decode tokens/s packed / rows over generations 2-5
# was 1.015 at B=1, 0.971 at B=4 and 1.003 at B=16, the tokens equal, and the first
# generation's specialized decode steps 123 / 118 / 120 of 127 against 58 / 110 / 119.
# What it costs: a batch's prompts are written at most max(chunk, max_batch) tokens a
# call in all rather than chunk tokens a row, so at B=16 the 32-token prompts took 4
# calls of 128 instead of one of 512 (255 vs 218 ms). So packed is the default
# everywhere; packed=False keeps the rows form, which the scheduler still serves.

# Note [Grouped heads in decode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With fewer key/value heads than query heads, Hugging Face's SDPA path copies K and V
# to every head (repeat_kv: expand, then reshape) unless a decode step folds the heads
# into the query instead (pack_gqa: [B, H, 1, D] -> [B, Hkv, H/Hkv, D], no copy). It
# skips that fold while torch is tracing, and the copy's reshape leaves a stride guard
# (Min(...)) over the cache length that export cannot prove, so a decode step with
# grouped heads did not export at all. Exporting decode with the fold on gives a graph
# without the copy, which is also what makes long contexts cheap; the fold is exact
# (the same SDPA, the heads of a group as its queries).


class _Prefill(torch.nn.Module):
    """The prompt step: no past, a fresh cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids):
        from transformers import DynamicCache

        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=DynamicCache(
                             config=self.model.config), use_cache=True, logits_to_keep=1)
        return _step_outputs(out)


class _Decode(torch.nn.Module):
    """One new token per row over a cache of length L."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, past_mask, position_ids, keys, values):
        from transformers import DynamicCache

        cache = DynamicCache(list(zip(keys, values)), config=self.model.config)
        # Note [Decode mask without a derived dim]
        mask = torch.cat([past_mask, torch.ones_like(input_ids)], dim=1)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return _step_outputs(out)


def _step_outputs(out):
    layers = out.past_key_values.layers
    return (out.logits[:, -1, :], [layer.keys for layer in layers],
            [layer.values for layer in layers])


@dataclass(frozen=True)
class GeneratorPrograms:
    """The programs of a generator and what the loop needs to know about them: the step
    over the cache state, the pure prefill and decode, or both."""

    prefill: Program | None
    """input_ids, attention_mask, position_ids -> last logits, keys, values (the pure
    path; None when exported with the state's step alone)."""
    decode: Program | None
    """input_ids [B, 1], past_mask [B, L], position_ids [B, 1], keys, values -> the same
    (the pure path; None with the step alone)."""
    layers: int
    """Number of decoder layers: the length of the keys and values lists."""
    max_batch: int
    """Largest batch both programs accept."""
    max_length: int
    """Largest prompt + generated length (the cache never grows past it)."""
    eos_token_ids: tuple[int, ...]
    """The model's end-of-sequence tokens (its generation config): default stop tokens."""
    pad_token_id: int
    """Written after a row has stopped, and where the caller gives no mask."""
    step: Program | None = None
    """input_ids [B, T], slots [B], lengths [B], keys, values (the cache state, written in
    place) -> the last token's logits, T = 1..chunk (Note [One step program for prompt
    and decode] in dynvm._generation_kv); None unless exported with kv_state."""
    chunk: int = 0
    """Largest T the step takes: a longer prompt is written chunk by chunk."""
    packed: bool = False
    """The step takes packed tokens (input_ids [1, N], slots [N], positions [N], last
    [R], keys, values -> logits [R, V]; Note [One packed call per step] in
    dynvm._generation_kv) instead of rows of T tokens each."""

    def __post_init__(self) -> None:
        if self.step is None and (self.prefill is None or self.decode is None):
            raise ConfigError("GeneratorPrograms: expected the state's step, or a prefill "
                              "and a decode program")

    @property
    def weights_bytes(self) -> int:
        """Bytes of the distinct weight storages the programs hold (shared storages and
        tied weights counted once)."""
        seen: dict[int, int] = {}
        for program in (self.step, self.prefill, self.decode):
            for tensor in (program.constants if program is not None else ()):
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


@contextlib.contextmanager
def _grouped_heads_folded():
    """Note [Grouped heads in decode]: let Hugging Face's SDPA path fold grouped heads
    into the query while torch.export traces a decode step."""
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:  # an older transformers without the fold: nothing to switch
        yield
        return
    saved = sdpa_attention.is_torchdynamo_compiling
    sdpa_attention.is_torchdynamo_compiling = lambda: False
    try:
        yield
    finally:
        sdpa_attention.is_torchdynamo_compiling = saved


def export_generator(model: torch.nn.Module, *, max_batch: int = 64,
                     max_length: int = 2048, name: str | None = None,
                     kv_state: bool = False, chunk: int = 128,
                     pure: bool | None = None, packed: bool = True) -> GeneratorPrograms:
    """Lower a Hugging Face causal LM (`...ForCausalLM`, eval mode) with dynamic batch
    (1..max_batch) and lengths (1..max_length). `kv_state`: the one step over the cache
    as state (`step`; `packed`, the default: N = 1..max(chunk, max_batch) tokens of any
    rows, Note [One packed call per step] in dynvm._generation_kv, Note [The packed
    step by default]; packed=False: T = 1..chunk new tokens per row); `pure` (default:
    not kv_state): the prefill and decode programs over plain caches."""
    from torch.export import Dim

    from dynvm import compile as dynvm_compile

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise ConfigError(f"compile_generator: expected a Hugging Face causal LM with a "
                          f"config, got {type(model).__name__}")
    if max_batch < 2 or max_length < 8:
        raise ConfigError(f"compile_generator: expected max_batch >= 2 and max_length >= 8, "
                          f"got max_batch={max_batch}, max_length={max_length}")
    if chunk < 1:
        raise ConfigError(f"compile_generator: expected chunk >= 1, got {chunk}")
    chunk = min(chunk, max_length)
    pure = not kv_state if pure is None else pure
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        config._attn_implementation = "sdpa"
    model = model.eval()
    name = name or type(model).__name__
    layers = config.num_hidden_layers
    batch = Dim("batch", min=1, max=max_batch)
    prompt = Dim("prompt", min=1, max=max_length)
    past = Dim("past", min=1, max=max_length - 1)
    # Distinct example sizes, so that export cannot mistake one dim for another.
    ids = torch.arange(3, 13).reshape(2, 5) % max(3, config.vocab_size)
    ones = torch.ones(2, 5, dtype=torch.long)
    positions = torch.arange(5).expand(2, 5).contiguous()
    prefill = decode = step = None
    with torch.no_grad():
        if pure:
            prefill = dynvm_compile(_Prefill(model), (ids, ones, positions),
                                    ({0: batch, 1: prompt},) * 3, name=f"{name}.prefill")
            _, keys, values = _Prefill(model)(ids, ones, positions)
            past_dims = [{0: batch, 2: past}] * layers
            with _grouped_heads_folded():
                decode = dynvm_compile(
                    _Decode(model), (ids[:, :1], ones, positions[:, :1], list(keys),
                                     list(values)),
                    ({0: batch}, {0: batch, 1: past}, {0: batch}, past_dims, past_dims),
                    name=f"{name}.decode")
        if kv_state:
            from dynvm._generation_kv import export_step

            step = export_step(model, max_batch=max_batch, max_length=max_length,
                               chunk=chunk, name=name, packed=packed)
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    pad = getattr(generation, "pad_token_id", None)
    pad = pad if pad is not None else getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
    programs = GeneratorPrograms(prefill, decode, layers, max_batch, max_length,
                                 tuple(int(t) for t in eos_ids), int(pad), step,
                                 chunk if kv_state else 0, bool(kv_state and packed))
    # Note [LM head stored input-major] in dynvm._lm_head_layout
    return store_lm_head_input_major(programs, model)
