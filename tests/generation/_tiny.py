"""Tiny Hugging Face causal LMs with random weights (nothing downloaded), their generator
programs (exported once per session), and prompts."""

from __future__ import annotations

import functools

import torch

from tests.zoo._schemas import declare_torchvision_schemas

declare_torchvision_schemas()  # before transformers can import torchvision

import transformers as hf  # noqa: E402

VOCAB = 128
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_DECODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                max_position_embeddings=256, **TOKENS)

ARCHITECTURES = ("llama", "gpt2", "qwen2", "mistral")


def tiny_causal_lm(kind: str) -> torch.nn.Module:
    """A seeded tiny `...ForCausalLM` of the given kind; grouped heads where the kind has
    them (Llama, Qwen2, Mistral: 4 query heads over 2 key/value heads)."""
    torch.manual_seed(0)
    if kind == "llama":
        model = hf.LlamaForCausalLM(hf.LlamaConfig(**_DECODER))
    elif kind == "qwen2":
        model = hf.Qwen2ForCausalLM(hf.Qwen2Config(**_DECODER))
    elif kind == "mistral":
        model = hf.MistralForCausalLM(hf.MistralConfig(**_DECODER, sliding_window=None))
    elif kind == "gpt2":
        model = hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=32, n_layer=2, n_head=2,
                                                 n_positions=256, vocab_size=VOCAB, **TOKENS))
    else:
        raise ValueError(kind)
    model.config._attn_implementation = "sdpa"
    return model.eval()


MAX_BATCH, MAX_LENGTH = 8, 64


@functools.cache
def tiny_generator(kind: str):
    """(model, its generator's programs) for `kind`: the step over the KV cache as state,
    in compile_generator's default packed form (Note [The packed step by default] in
    dynvm._generation_export), and the pure prefill and decode programs (`pure`, for
    kv_state=False), exported once per session: the export is most of a generation
    test's time, and tests/generation and the serving tests
    (tests/cluster/_generate_helpers.py) take the same one. The programs hold this
    model's own weight tensors."""
    import dynvm

    model = tiny_causal_lm(kind)
    programs = dynvm.compile_generator(model, max_batch=MAX_BATCH, max_length=MAX_LENGTH,
                                       jit=False, kv_state=True, pure=True).programs
    assert programs.packed
    return model, programs


def left_padded(lengths: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask for prompts of these lengths, left-padded with the pad
    token to the longest; tokens avoid the special ids."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=gen)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1
    return ids.masked_fill(mask == 0, TOKENS["pad_token_id"]), mask


def hf_greedy(model, ids, mask, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """Hugging Face's own greedy generate (its cache, its mask and positions)."""
    with torch.inference_mode():
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=TOKENS["pad_token_id"], **kwargs)


@functools.cache
def tiny_rows_programs(kind: str = "llama"):
    """The rows form of `kind`'s step (packed=False: rows of T tokens each per call, Note
    [One packed call per step] in dynvm._generation_kv) over the same model as
    tiny_generator(kind), exported once per session; its tokens are comparable with
    that generator's."""
    import dynvm

    model = tiny_generator(kind)[0]
    return dynvm.compile_generator(model, max_batch=MAX_BATCH, max_length=MAX_LENGTH,
                                   jit=False, kv_state=True, packed=False).programs
