"""Hugging Face transformers entries of the zoo: encoders, decoders (no KV cache),
encoder-decoders, speech and vision transformers, tiny configs, random weights.

HF models take keyword inputs and return ModelOutput objects; `_Positional` gives them
the positional-tensors-in, tensors-out interface a server calls. Token inputs carry an
explicit attention mask with right padding (every row keeps at least half its tokens),
so the model never takes its "no mask given" path and padding is really exercised.
"""

from __future__ import annotations

import torch
import transformers as hf

from tests.zoo._zoo import Built, ZooEntry, dim, generator

HIDDEN, LAYERS, HEADS, FFN, VOCAB, POSITIONS = 32, 2, 2, 64, 128, 64
BATCH = dim("batch", 1, 8)
SEQ = dim("seq", 2, 48)
TOKEN_POINTS = ({"batch": 1, "seq": 5}, {"batch": 3, "seq": 13}, {"batch": 4, "seq": 32})


class _Positional(torch.nn.Module):
    """Calls an HF model with positional tensors bound to its keyword names and returns
    the named outputs as a tuple."""

    def __init__(self, model: torch.nn.Module, inputs: tuple[str, ...],
                 outputs: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.inputs = inputs
        self.outputs = outputs

    # Named parameters, not *tensors: torch.export matches dynamic_shapes to the
    # forward's signature, and would see one tuple input behind a *args.
    def forward(self, x0, x1=None, x2=None):
        tensors = (x0, x1, x2)[:len(self.inputs)]
        out = self.model(**dict(zip(self.inputs, tensors)))
        return tuple(out[name] for name in self.outputs)


def _seeded(make_model, config) -> torch.nn.Module:
    torch.manual_seed(0)
    config.use_cache = False
    return make_model(config).eval()


def _tokens(point, seed: int, vocab: int = VOCAB, seq_name: str = "seq"):
    gen = generator(seed)
    batch, seq = point["batch"], point[seq_name]
    ids = torch.randint(3, vocab, (batch, seq), generator=gen)
    lengths = torch.randint((seq + 1) // 2, seq + 1, (batch,), generator=gen)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return ids, mask


def _text(name: str, model_cls, config, note: str = "", outputs=("last_hidden_state",),
          **tolerance) -> ZooEntry:
    def build() -> Built:
        config._attn_implementation = config._attn_implementation or "sdpa"
        module = _Positional(_seeded(model_cls, config), ("input_ids", "attention_mask"),
                             outputs)
        return Built(module.eval(), ({0: BATCH, 1: SEQ}, {0: BATCH, 1: SEQ}),
                     lambda point, seed: _tokens(point, seed))

    return ZooEntry(name, "transformers", build, {"batch": 2, "seq": 8}, TOKEN_POINTS,
                    note=note, **tolerance)


# Special token ids inside the tiny vocabulary (the libraries' defaults lie past it).
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_SIZES = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
              intermediate_size=FFN, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
              **TOKENS)


def _decoder_sizes(**extra):
    return dict(_SIZES, num_key_value_heads=HEADS, **extra)


def _seq2seq(name: str, model_cls, config) -> ZooEntry:
    src, tgt = dim("src", 2, 48), dim("tgt", 2, 48)

    def make_inputs(point, seed):
        ids, mask = _tokens(point, seed, seq_name="src")
        dec, _ = _tokens(point, seed + 1, seq_name="tgt")
        return ids, mask, dec

    def build() -> Built:
        config._attn_implementation = "eager"
        module = _Positional(_seeded(model_cls, config),
                             ("input_ids", "attention_mask", "decoder_input_ids"),
                             ("last_hidden_state", "encoder_last_hidden_state"))
        return Built(module.eval(), ({0: BATCH, 1: src}, {0: BATCH, 1: src}, {0: BATCH, 1: tgt}),
                     make_inputs)

    points = ({"batch": 1, "src": 5, "tgt": 3}, {"batch": 3, "src": 13, "tgt": 9},
              {"batch": 4, "src": 32, "tgt": 20})
    return ZooEntry(name, "transformers", build, {"batch": 2, "src": 8, "tgt": 6}, points)


def _images(name: str, model_cls, config, size: int, outputs=("last_hidden_state",),
            note: str = "image size fixed by the model (position embeddings): batch only"):
    def build() -> Built:
        config._attn_implementation = "sdpa"
        module = _Positional(_seeded(model_cls, config), ("pixel_values",), outputs)
        return Built(module.eval(), ({0: BATCH},), lambda point, seed: (
            torch.randn(point["batch"], 3, size, size, generator=generator(seed)),))

    return ZooEntry(name, "transformers", build, {"batch": 2},
                    ({"batch": 1}, {"batch": 3}, {"batch": 5}), note=note)


def _whisper() -> ZooEntry:
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = hf.WhisperConfig(d_model=HIDDEN, encoder_layers=LAYERS, encoder_attention_heads=HEADS,
                              encoder_ffn_dim=FFN, num_mel_bins=16, max_source_positions=16,
                              vocab_size=VOCAB, decoder_start_token_id=3, **TOKENS)
    frames = 2 * config.max_source_positions

    def build() -> Built:
        config._attn_implementation = "sdpa"
        module = _Positional(_seeded(WhisperEncoder, config), ("input_features",),
                             ("last_hidden_state",))
        return Built(module.eval(), ({0: BATCH},), lambda point, seed: (
            torch.randn(point["batch"], 16, frames, generator=generator(seed)),))

    return ZooEntry("whisper-encoder", "transformers", build, {"batch": 2},
                    ({"batch": 1}, {"batch": 3}, {"batch": 5}),
                    note="audio length fixed: the encoder rejects any input but its "
                    "window (2 x max_source_positions frames); batch only")


def _wav2vec2() -> ZooEntry:
    config = hf.Wav2Vec2Config(hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                               num_attention_heads=HEADS, intermediate_size=FFN,
                               conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                               vocab_size=VOCAB)

    def build() -> Built:
        config._attn_implementation = "sdpa"
        module = _Positional(_seeded(hf.Wav2Vec2Model, config), ("input_values",),
                             ("last_hidden_state",))
        return Built(module.eval(), ({0: BATCH, 1: dim("samples", 400, 4000)},),
                     lambda point, seed: (torch.randn(point["batch"], point["samples"],
                                                      generator=generator(seed)),))

    return ZooEntry("wav2vec2", "transformers", build, {"batch": 2, "samples": 800},
                    ({"batch": 1, "samples": 480}, {"batch": 3, "samples": 1111},
                     {"batch": 2, "samples": 3200}))


def _entries() -> tuple[ZooEntry, ...]:
    vision = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=FFN, image_size=32, patch_size=8)
    return (
        _text("bert", hf.BertModel, hf.BertConfig(**_SIZES)),
        _text("roberta", hf.RobertaModel,
              hf.RobertaConfig(**dict(_SIZES, max_position_embeddings=POSITIONS + 2))),
        _text("distilbert", hf.DistilBertModel, hf.DistilBertConfig(
            dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN, vocab_size=VOCAB,
            max_position_embeddings=POSITIONS)),
        _text("albert", hf.AlbertModel, hf.AlbertConfig(embedding_size=16, **_SIZES)),
        _text("gpt2", hf.GPT2Model, hf.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                                  n_inner=FFN, vocab_size=VOCAB,
                                                  n_positions=POSITIONS, **TOKENS)),
        _text("gpt-neox", hf.GPTNeoXModel, hf.GPTNeoXConfig(**_SIZES)),
        _text("opt", hf.OPTModel, hf.OPTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                               num_attention_heads=HEADS, ffn_dim=FFN,
                                               word_embed_proj_dim=HIDDEN, vocab_size=VOCAB,
                                               max_position_embeddings=POSITIONS)),
        _text("llama", hf.LlamaModel, hf.LlamaConfig(**_decoder_sizes())),
        _text("mistral", hf.MistralModel, hf.MistralConfig(**_decoder_sizes(sliding_window=None))),
        _text("qwen2", hf.Qwen2Model, hf.Qwen2Config(**_decoder_sizes())),
        _text("gemma", hf.GemmaModel, hf.GemmaConfig(head_dim=HIDDEN // HEADS, **_decoder_sizes())),
        _text("phi", hf.PhiModel, hf.PhiConfig(**_decoder_sizes())),
        # Mixture of experts: transformers' MoE integration exports its experts as the
        # custom op transformers::grouped_mm_fallback (Note [Custom ops] in
        # dynvm.vm.ops_custom), routed by data (top-k, histc, sort).
        _text("mixtral", hf.MixtralModel, hf.MixtralConfig(
            num_local_experts=4, num_experts_per_tok=2, **_decoder_sizes(sliding_window=None)),
              note="experts through the custom op transformers::grouped_mm_fallback"),
        _text("qwen2-moe", hf.Qwen2MoeModel, hf.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=FFN // 2,
            shared_expert_intermediate_size=FFN, **_decoder_sizes()),
              note="experts through the custom op transformers::grouped_mm_fallback; a "
              "shared expert"),
        # ALiBi: no position embeddings, a per-head linear bias on attention scores
        # built from the mask's cumulative sum (transformers has no SDPA path for it).
        _text("bloom", hf.BloomModel, hf.BloomConfig(
            attn_implementation="eager", hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
            vocab_size=VOCAB, **TOKENS), note="ALiBi attention biases; eager attention "
              "(transformers has no SDPA path for BLOOM)"),
        # Disentangled attention: content-to-position and position-to-content scores over
        # log-bucketed relative positions, gathered per query (DeBERTa-v2/v3).
        _text("deberta-v2", hf.DebertaV2Model, hf.DebertaV2Config(
            attn_implementation="eager", relative_attention=True, position_buckets=16,
            max_relative_positions=32, pos_att_type=["p2c", "c2p"], **_SIZES),
              note="relative-position (disentangled) attention; eager attention "
              "(transformers has no SDPA path for DeBERTa-v2)"),
        _text("t5-encoder", hf.T5EncoderModel, hf.T5Config(
            d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS,
            num_heads=HEADS, vocab_size=VOCAB)),
        _seq2seq("t5", hf.T5Model, hf.T5Config(d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN,
                                              num_layers=LAYERS, num_heads=HEADS,
                                              vocab_size=VOCAB)),
        _seq2seq("bart", hf.BartModel, hf.BartConfig(
            d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
            encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
            encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, vocab_size=VOCAB,
            max_position_embeddings=POSITIONS)),
        _whisper(),
        _wav2vec2(),
        _images("vit", hf.ViTModel, hf.ViTConfig(**vision), 32,
                outputs=("last_hidden_state", "pooler_output")),
        _images("deit", hf.DeiTModel, hf.DeiTConfig(**vision), 32),
        _images("swin", hf.SwinModel, hf.SwinConfig(
            image_size=32, patch_size=2, embed_dim=16, depths=(1, 1), num_heads=(2, 2),
            window_size=4), 32, note="image size fixed: batch only"),
        _text("clip-text", hf.CLIPTextModel, hf.CLIPTextConfig(**_SIZES),
              outputs=("last_hidden_state", "pooler_output")),
        _images("clip-vision", hf.CLIPVisionModel, hf.CLIPVisionConfig(**vision), 32,
                outputs=("last_hidden_state", "pooler_output")),
    )


ENTRIES = _entries()
