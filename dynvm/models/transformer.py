"""A post-norm transformer encoder, written the way a user would write one.

Deliberately not ``nn.TransformerEncoder``: its fast path and mask handling hide the
ops, and we want the plain Linear / view / transpose / SDPA pattern that real user
models lower to, with both batch and sequence length dynamic.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from dynvm.vm.errors import ConfigError

from ._base import DemoModel, finish, generator, seeded


class EncoderLayer(nn.Module):
    """A post-norm encoder layer: fused QKV projection, scaled dot-product
    attention, residual + LayerNorm, GELU feed-forward, residual + LayerNorm."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ConfigError(f"hidden={hidden} is not divisible by heads={heads}")
        self.heads = heads
        # One fused projection for q, k and v, as most hand-written encoders do.
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.ff1 = nn.Linear(hidden, ffn)
        self.ff2 = nn.Linear(ffn, hidden)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        # [b, s, 3h] -> [b, s, 3, heads, hd] -> [3, b, heads, s, hd]; the view takes
        # symbolic b and s, so the reshape stays valid for every batch/seq length.
        qkv = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = F.scaled_dot_product_attention(q, k, v)
        attn = attn.transpose(1, 2).reshape(b, s, h)
        x = self.norm1(x + self.out(attn))
        return self.norm2(x + self.ff2(F.gelu(self.ff1(x))))


class Encoder(nn.Module):
    """A stack of EncoderLayers over [batch, seq, hidden]."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads, ffn) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def transformer(
    layers: int = 6,
    hidden: int = 256,
    heads: int = 8,
    ffn: int = 1024,
    max_batch: int = 64,
    max_seq: int = 512,
) -> DemoModel:
    """Encoder over x: float32 [batch, seq, hidden] -> same shape.

    Dims: batch in [1, max_batch], seq in [2, max_seq]. ``sample_inputs`` draws
    batch in [1, min(max_batch, 64)] and seq in [2, min(max_seq, 128)] so that eager
    reference runs stay cheap.
    """
    with seeded(0):
        module = finish(Encoder(layers, hidden, heads, ffn))
    # seq starts at 2: export would specialise a dim whose example size is 1, and a
    # sequence of one token is also the degenerate case for attention.
    batch = Dim("batch", min=1, max=max_batch)
    seq = Dim("seq", min=2, max=max_seq)
    example = (torch.randn(4, 32, hidden, generator=torch.Generator().manual_seed(1)),)

    def sample_inputs(rng: random.Random) -> tuple[torch.Tensor, ...]:
        b = rng.randint(1, min(max_batch, 64))
        s = rng.randint(2, min(max_seq, 128))
        return (torch.randn(b, s, hidden, generator=generator(rng)),)

    return DemoModel(
        name="transformer",
        module=module,
        example_inputs=example,
        dynamic_shapes=({0: batch, 1: seq},),
        sample_inputs=sample_inputs,
        description=(
            f"{layers}-layer post-norm encoder (hidden {hidden}, {heads} heads, ffn {ffn}), "
            "fused qkv + SDPA; dynamic batch and sequence length"
        ),
    )
