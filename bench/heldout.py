"""The held-out encoder of issue 14: a 6-layer encoder written differently from the demo
transformer (dynvm.models.transformer), to check that what the JIT does for the demo
also holds for a layout it was not tuned on.

Differences from the demo: pre-norm; separate q, k and v projections; attention written
out by hand (q @ k.transpose(-2, -1) * scale, softmax, @ v: the pattern the specializer
fuses into SDPA, Note [Probes] in dynvm.jit.specialize) with heads split by view +
transpose and merged by transpose + contiguous + view; tanh-approximated GELU. Bench
only (not shipped): it is a workload, not a demo.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from dynvm.models._base import DemoModel, finish, seeded


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def _split(self, t: torch.Tensor, b: int, s: int) -> torch.Tensor:
        return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.ln1(x)
        q, k, v = (self._split(p(y), b, s) for p in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        attn = torch.matmul(torch.softmax(scores, dim=-1), v)
        x = x + self.o(attn.transpose(1, 2).contiguous().view(b, s, h))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class HeldOutEncoder(nn.Module):
    def __init__(self, layers: int = 6, hidden: int = 256, heads: int = 8,
                 ffn: int = 1024) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def heldout_encoder(hidden: int = 256) -> DemoModel:
    """The held-out encoder over float32 [batch 1..64, seq 2..512, hidden]."""
    with seeded(1):
        module = finish(HeldOutEncoder(hidden=hidden))
    example = (torch.randn(4, 32, hidden, generator=torch.Generator().manual_seed(2)),)
    return DemoModel(
        name="heldout-encoder", module=module, example_inputs=example,
        dynamic_shapes=({0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=512)},),
        sample_inputs=lambda rng: (torch.randn(rng.randint(1, 64), 32, hidden),),
        description="held-out 6-layer pre-norm encoder (hand-written attention: view, "
                    "transpose, matmul, softmax; separate q/k/v Linear; tanh GELU)")
