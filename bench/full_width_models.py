"""The models of the full-width tier (bench/full_width.py, tests/zoo/test_full_width.py,
docs/MODELS.md): released widths, few layers, random weights (seed 0), each with the
inputs it is timed and checked on.

- BERT at bert-base width: 768 hidden, 12 heads, FFN 3072, vocab 30522 (input ids +
  attention mask, right padding).
- ResNet-50 at 224x224 (torchvision's, 1000 classes); `blocks` gives fewer bottleneck
  blocks per stage at the same widths (64-256 ... 512-2048).
- A Llama-style decoder at 2048 width: TinyLlama-1.1B's shape (Llama 2's architecture),
  2048 hidden, 32 query heads sharing 4 key/value heads (GQA), SwiGLU FFN 5632, RoPE,
  RMSNorm, vocab 32000, the LM head's logits out; input ids + attention mask.
- ViT-B/16 at 224x224 (Hugging Face ViTModel): 768 hidden, 12 heads, FFN 3072, patches
  of 16 (197 tokens); last hidden state and pooled output.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BERT_SHAPES = tuple((b, s) for b in (1, 2, 4, 8) for s in (16, 32, 64, 128))
RESNET_BATCHES = (1, 2, 4)
RESNET50_BLOCKS = (3, 4, 6, 3)


@dataclass(frozen=True)
class FullWidthModel:
    """A model at full width and the inputs it is timed on."""

    name: str
    """The row's name in the report."""

    module: torch.nn.Module
    """The model in eval mode: positional tensors in, a tensor or tuple out."""

    dynamic_shapes: tuple
    """What torch.export (and the ONNX export) take, one entry per positional input."""

    labels: tuple[str, ...]
    """One label per shape, as the report prints it."""

    inputs: tuple[tuple[torch.Tensor, ...], ...]
    """One input tuple per shape, seeded."""

    export_index: int | None
    """The input that torch.export and the ONNX export see (no dynamic dim at 1: export
    would specialize it); None where no timed shape qualifies (`export_example`)."""

    export_example: tuple[torch.Tensor, ...] | None = None
    """The input exported when no timed shape qualifies (say `--shapes 1x16`): one made
    for the export alone, never timed."""

    @property
    def export_inputs(self) -> tuple[torch.Tensor, ...]:
        """What torch.export and the ONNX export are given."""
        if self.export_index is None:
            return self.export_example
        return self.inputs[self.export_index]

    @property
    def parameters(self) -> int:
        """How many weights the model has."""
        return sum(p.numel() for p in self.module.parameters())


def _declare_schemas() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.zoo._schemas import declare_torchvision_schemas

    declare_torchvision_schemas()   # before transformers imports torchvision


class _Keywords(torch.nn.Module):
    """An HF model called with positional tensors bound to `names`; returns `outputs`
    of its ModelOutput (one tensor alone, several as a tuple)."""

    def __init__(self, model, names: tuple[str, ...], outputs: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.names, self.outputs = model, names, outputs

    # Named parameters, not *tensors: torch.export matches dynamic_shapes to them.
    def forward(self, x0, x1=None):
        out = self.model(**dict(zip(self.names, (x0, x1))))
        got = tuple(out[name] for name in self.outputs)
        return got[0] if len(got) == 1 else got


def _tokens(shapes, vocab: int) -> tuple:
    """Seeded (ids, mask) per (batch, seq); each mask row keeps at least half its tokens
    (right padding)."""
    inputs = []
    for index, (b, s) in enumerate(shapes):
        gen = torch.Generator().manual_seed(index)
        ids = torch.randint(3, vocab, (b, s), generator=gen)
        lengths = torch.randint((s + 1) // 2, s + 1, (b,), generator=gen)
        inputs.append((ids, (torch.arange(s)[None, :] < lengths[:, None]).long()))
    return tuple(inputs)


def _export_index(sizes) -> int | None:
    """The first shape with no dynamic size at 1 or at the smallest (export specializes
    a 1; Note [Full-width timing]); None if there is none."""
    return next((i for i, size in enumerate(sizes)
                 if all(d > 1 for d in (size if isinstance(size, tuple) else (size,)))), None)


def _pixels(batches, size: int) -> tuple:
    """Seeded images per batch size, and an export example at batch 2 where no timed
    batch is above 1."""
    inputs = tuple((torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(b)),)
                   for b in batches)
    example = None if _export_index(batches) is not None else \
        (torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2)),)
    return inputs, example


def _text_model(name, module, shapes, vocab, max_seq: int = 256) -> FullWidthModel:
    from torch.export import Dim

    batch, seq = Dim("batch", min=1, max=16), Dim("seq", min=2, max=max_seq)
    index = next((i for i, (b, s) in enumerate(shapes) if b > 1 and s > 16), None)
    example = _tokens(((2, 32),), vocab)[0] if index is None else None
    return FullWidthModel(name, module.eval(), ({0: batch, 1: seq}, {0: batch, 1: seq}),
                          tuple(f"{b}x{s}" for b, s in shapes), _tokens(shapes, vocab),
                          index, example)


def bert(hidden: int = 768, layers: int = 4, heads: int = 12, ffn: int = 3072,
         vocab: int = 30522, shapes=BERT_SHAPES) -> FullWidthModel:
    """BERT at the given width (bert-base by default), random weights (seed 0), each
    row of the mask keeping at least half its tokens (right padding)."""
    _declare_schemas()
    import transformers as hf

    config = hf.BertConfig(hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, intermediate_size=ffn,
                           vocab_size=vocab, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    module = _Keywords(hf.BertModel(config), ("input_ids", "attention_mask"),
                       ("last_hidden_state",))
    return _text_model(f"bert-h{hidden}-l{layers}", module, shapes, vocab)


def llama(layers: int = 2, shapes=((1, 16), (2, 32), (4, 64)), hidden: int = 2048,
          heads: int = 32, kv_heads: int = 4, ffn: int = 5632,
          vocab: int = 32000) -> FullWidthModel:
    """A Llama-style decoder at TinyLlama-1.1B's width (GQA: `heads` query heads over
    `kv_heads` key/value heads), random weights (seed 0), no KV cache: input ids +
    attention mask -> the LM head's logits."""
    _declare_schemas()
    import transformers as hf

    config = hf.LlamaConfig(hidden_size=hidden, intermediate_size=ffn,
                            num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, vocab_size=vocab,
                            max_position_embeddings=2048, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    module = _Keywords(hf.LlamaForCausalLM(config), ("input_ids", "attention_mask"),
                       ("logits",))
    return _text_model(f"llama-h{hidden}-l{layers}", module, shapes, vocab)


def vit(layers: int = 2, batches=(1, 2, 4), size: int = 224) -> FullWidthModel:
    """ViT-B/16 (Hugging Face ViTModel) at size x size with `layers` encoder layers,
    random weights (seed 0): pixels -> (last hidden state, pooled output)."""
    _declare_schemas()
    import transformers as hf
    from torch.export import Dim

    config = hf.ViTConfig(hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
                          intermediate_size=3072, image_size=size, patch_size=16)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    module = _Keywords(hf.ViTModel(config), ("pixel_values",),
                       ("last_hidden_state", "pooler_output")).eval()
    inputs, example = _pixels(batches, size)
    return FullWidthModel(f"vit-b16-l{layers}-{size}", module,
                          ({0: Dim("batch", min=1, max=16)},),
                          tuple(f"batch {b}" for b in batches), inputs, _export_index(batches),
                          example)


def resnet50(batches=RESNET_BATCHES, size: int = 224,
             blocks: tuple[int, ...] = RESNET50_BLOCKS) -> FullWidthModel:
    """torchvision ResNet-50 (1000 classes, random weights, seed 0) at size x size;
    `blocks` other than (3, 4, 6, 3): as many bottleneck blocks per stage, at ResNet-50's
    widths."""
    _declare_schemas()
    import torchvision
    from torch.export import Dim
    from torchvision.models.resnet import Bottleneck, ResNet

    torch.manual_seed(0)
    blocks = tuple(blocks)
    module = (torchvision.models.resnet50() if blocks == RESNET50_BLOCKS
              else ResNet(Bottleneck, list(blocks))).eval()
    inputs, example = _pixels(batches, size)
    name = f"resnet50-{size}" if blocks == RESNET50_BLOCKS else \
        f"resnet50-blocks{''.join(map(str, blocks))}-{size}"
    return FullWidthModel(name, module, ({0: Dim("batch", min=1, max=16)},),
                          tuple(f"batch {b}" for b in batches), inputs,
                          _export_index(batches), example)


def heldout(batches=(1, 4, 16, 64), seq: int = 32) -> FullWidthModel:
    """Issue 14's held-out encoder (bench/heldout.py: 6 pre-norm layers, hidden 256,
    attention written by hand) at seq `seq`, on the design article's batch walk's
    sizes: the narrow model where per-op overhead, not the GEMMs, decides."""
    from bench.heldout import heldout_encoder

    demo = heldout_encoder()
    inputs = tuple((torch.randn(b, seq, 256, generator=torch.Generator().manual_seed(b)),)
                   for b in batches)
    example = None if _export_index(batches) is not None else \
        (torch.randn(2, seq, 256, generator=torch.Generator().manual_seed(2)),)
    return FullWidthModel("heldout-encoder-h256-l6", demo.module.eval(), demo.dynamic_shapes,
                          tuple(f"batch {b}" for b in batches), inputs,
                          _export_index(batches), example)


def tier() -> dict:
    """The zoo's full-width tier as docs/MODELS.md times it (`python -m bench.full_width
    --tier`): per model, what its row says it is and how to build it, three shapes each
    (a few steady calls per shape keep a run to minutes)."""
    return {
        "bert": ("BERT, bert-base width (768 hidden, 12 heads, FFN 3072, vocab 30522), "
                 "4 layers; ids + mask", lambda: bert(shapes=((1, 32), (4, 64), (8, 128)))),
        "resnet50": ("ResNet-50 (torchvision, all 16 bottleneck blocks) at 224x224",
                     lambda: resnet50(batches=(1, 2, 4))),
        "llama": ("Llama-style decoder at 2048 width (TinyLlama-1.1B's shape: GQA 32 "
                  "query / 4 key-value heads, SwiGLU 5632, vocab 32000), 2 layers, "
                  "logits out; ids + mask",
                  lambda: llama(layers=2, shapes=((1, 32), (2, 64), (4, 128)))),
        "vit": ("ViT-B/16 at 224x224 (768 hidden, 12 heads, FFN 3072, 197 tokens), "
                "4 layers", lambda: vit(layers=4, batches=(1, 2, 4))),
    }
