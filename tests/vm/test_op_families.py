"""The op families of the core ATen opset, through the whole path: small models using
them are exported with dynamic dims, lowered, saved and loaded, and run in the
interpreter and in specialized code (promotion forced), against eager PyTorch.

Tolerance 1e-5: the VM calls the same ATen kernels (see test_frontend_models.py); the
JIT may reorder nothing here but may pick another kernel for another layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import dynvm
from tests.jit import _jit_helpers as h

RTOL = ATOL = 1e-5


class Cnn2d(nn.Module):
    """Convolutions (strided, depthwise, transposed), batch/group/instance norm, max,
    average and adaptive pooling, padding and resampling: a CNN's front end."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.gn = nn.GroupNorm(2, 8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.head = nn.Conv2d(4, 6, 1)
        with torch.no_grad():   # non-trivial running statistics
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.bn(self.stem(x))), 3, 2, 1)
        y = F.leaky_relu(self.gn(self.depthwise(y)), 0.1)
        y = F.avg_pool2d(y, 2, ceil_mode=True)
        y = self.inorm(self.up(y))
        y = F.interpolate(y, scale_factor=2.0, mode="nearest")
        y = F.interpolate(y, size=(12, 10), mode="bilinear", align_corners=False)
        y = F.pad(y, (1, 1, 2, 2), mode="reflect") + F.pad(y, (1, 1, 2, 2), mode="replicate")
        y = F.hardtanh(self.head(F.pad(y, (1, 0, 0, 1), value=0.5)))
        return F.adaptive_avg_pool2d(y, (3, 2)), F.adaptive_max_pool2d(y, 2)[0]


class Conv1d3d(nn.Module):
    """1-d and 3-d convolutions and pooling (speech front ends, video)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(4, 6, 5, stride=2, dilation=2)
        self.conv3 = nn.Conv3d(2, 3, 3, padding=1)

    def forward(self, signal, volume):
        a = F.avg_pool1d(F.elu(self.conv1(signal)), 2)
        b = F.max_pool3d(self.conv3(volume), 2)
        b = F.avg_pool3d(b, 2, ceil_mode=True) + F.adaptive_avg_pool3d(b, 1)
        return a, b, torch.linalg.vector_norm(a, dim=1)


class Indexing(nn.Module):
    """Advanced indexing, scatter/gather, sorting, cumulative ops, bitwise masks."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(20, 4))

    def forward(self, x, ids, mask):
        rows = x[ids]                                        # index.Tensor
        cols = x[:, ids.clamp(max=x.shape[1] - 1)]
        both = mask & (x > 0)                                # bitwise_and on bools
        y = x.clone()
        y[ids] = y[ids] * 2.0                                # index_put
        picked = torch.gather(x, 1, x.argsort(dim=1)[:, :2])
        top = torch.topk(x, 2, dim=1).values
        spread = torch.zeros_like(x).scatter(1, x.argmin(dim=1, keepdim=True), 1.0)
        bags = F.embedding_bag(ids % 20, self.table, torch.tensor([0, 1]), mode="mean")
        summary = torch.stack([both.any(dim=1).float(), x.max(dim=1).values,
                               x.var(dim=1), x.cumsum(1)[:, -1], x.flip(1)[:, 0]], 1)
        return (rows, cols, y, picked, top, spread, bags, summary, x.repeat(2, 1),
                torch.where(both, x, -x))


class DataDependent(nn.Module):
    """Results whose size depends on data (Note [Data-dependent sizes])."""

    def forward(self, x, mask):
        selected = x[mask]
        return selected * 2.0, torch.nonzero(mask).float().sum(0), selected.sum()


def _cases():
    batch = Dim("batch", min=1, max=8)
    length, n = Dim("length", min=20, max=80), Dim("n", min=2, max=16)
    return {
        "cnn2d": (Cnn2d(), lambda g, b: (torch.randn(b, 3, 32, 40, generator=g),),
                  ({0: batch},)),
        "conv1d3d": (Conv1d3d(), lambda g, b: (torch.randn(b, 4, 30 + 5 * b, generator=g),
                                               torch.randn(b, 2, 8, 8, 8, generator=g)),
                     ({0: batch, 2: length}, {0: batch})),
        "indexing": (Indexing(), lambda g, b: (torch.randn(b + 3, 6, generator=g),
                                               torch.randint(0, b + 3, (b,), generator=g),
                                               torch.rand(b + 3, 6, generator=g) > 0.3),
                     ({0: n}, {0: Dim("k", min=1, max=12)}, {0: n})),
        "data_dependent": (DataDependent(), lambda g, b: (
            torch.randn(b + 2, 5, generator=g), torch.rand(b + 2, 5, generator=g) > 0.5),
            ({0: n}, {0: n})),
    }


CASES = _cases()


def _eager(module, inputs):
    with torch.inference_mode():
        return module(*inputs)


def _flat(value):
    return list(value) if isinstance(value, tuple | list) else [value]


@pytest.mark.parametrize("name", sorted(CASES))
def test_family_matches_eager_in_interpreter_and_jit(name, tmp_path):
    module, make, dynamic = CASES[name]
    module = module.eval()
    gen = torch.Generator().manual_seed(0)
    program = dynvm.compile(module, make(gen, 3), dynamic)
    dynvm.save(program, tmp_path / "m.dvm")
    program = dynvm.load(tmp_path / "m.dvm")
    interpreter = dynvm.Runtime(program, jit=False)
    jit = dynvm.Runtime(program, jit=h.eager_config())
    with h.torch_threads(1):
        for b in (2, 5, 2, 5, 2):
            inputs = make(gen, b)
            want = _flat(_eager(module, inputs))
            for runtime in (interpreter, jit):
                got = _flat(runtime(*inputs))
                assert len(got) == len(want)
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL)
    stats = jit.stats()
    assert stats["specialized_region_calls"] > 0, jit.jit.event_log
    assert stats["compile_failures"] == 0 and stats["deopts"] == 0, jit.jit.event_log
