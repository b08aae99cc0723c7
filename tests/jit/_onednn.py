"""What the tests of dynvm's oneDNN primitives need before they can run: the marks that
skip a module without oneDNN in torch or without oneDNN's C library (dynvm's `onednn`
extra), and the chain's native library, which must exist wherever a C compiler did at
install; and the blocks of ResNet that a chain of primitives is made of."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from dynvm.jit.backends.cpu import onednn_api, onednn_chain
from dynvm.jit.backends.cpu.fusion import onednn_available

NEEDS_ONEDNN_LIBRARY = [
    pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                       reason="this torch build has no oneDNN"),
    pytest.mark.skipif(onednn_api.library() is None,
                       reason=f"oneDNN's C library is not loaded: "
                              f"{onednn_api.unavailable_reason()}")]


def bound_native(module):
    """`module`'s native library (onednn_chain's, column_halves') bound to the loaded
    libdnnl; skips where no C compiler existed at install, fails where one did: a
    silently missing library would leave every kernel on its fallback."""
    bound, why = module.native(onednn_api.library())
    if bound is None and shutil.which("cc") is None:
        pytest.skip(f"no C compiler at install: {why}")
    assert bound is not None, why
    return bound


def native_chain():
    """The chain's native functions (Note [A chain of primitives in one call])."""
    return bound_native(onednn_chain)


class ChainBlocks(nn.Module):
    """A stem, a max pool and two bottlenecks (a strided one with a downsampling
    residual, then one adding its input): every primitive kind a chain holds. `trunk`
    is the chain; `forward` ends it with the global mean, as a model's head reads it."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem, self.b0 = nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.a1, self.a2 = nn.Conv2d(c, c // 2, 1), nn.Conv2d(c // 2, c // 2, 3, 2, 1)
        self.a3, self.down = nn.Conv2d(c // 2, 2 * c, 1), nn.Conv2d(c, 2 * c, 1, 2)
        self.c1, self.c2 = nn.Conv2d(2 * c, c // 2, 1), nn.Conv2d(c // 2, 2 * c, 3, 1, 1)

    def trunk(self, x):
        h = self.pool(torch.relu(self.b0(self.stem(x))))
        a = torch.relu(self.a2(torch.relu(self.a1(h))))
        y = torch.relu(self.a3(a) + self.down(h))
        return torch.relu(self.c2(torch.relu(self.c1(y))) + y)

    def forward(self, x):
        return self.trunk(x).mean((2, 3))
