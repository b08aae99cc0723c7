"""Dtypes end to end: int64 ids, bool masks, fp16 and bf16 weights and activations go
through compile -> save -> load -> Runtime (interpreter, and JIT with promotion forced)
and match eager; the input signature, the guards and the .dvm file keep the dtypes.

Tolerances are the dtype's: fp16/bf16 results are compared with torch.testing's
defaults for the dtype (bf16: rtol 1.6e-2, atol 1e-5; fp16: rtol 1e-3, atol 1e-5), since
the JIT may choose another kernel (another accumulation order) than eager did.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.vm.errors import ShapeError
from tests.jit._jit_helpers import eager_config, torch_threads


class Tagger(nn.Module):
    """Embedding of int64 ids, a bool padding mask, a convolution, layer norm and a
    linear head: every weight and activation in the module's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1, groups=4)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, ids, keep):
        x = self.embed(ids)
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        x = F.gelu(self.norm(x)).masked_fill(~keep.unsqueeze(-1), 0.0)
        scores = self.head(x)
        return scores, scores.argmax(-1), (keep & (ids > 3)).sum(-1)


def _inputs(gen, batch, seq):
    ids = torch.randint(0, 50, (batch, seq), generator=gen)
    keep = torch.rand(batch, seq, generator=gen) > 0.2
    return ids, keep


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_round_trips_and_matches_eager(dtype, tmp_path):
    torch.manual_seed(0)
    module = Tagger().to(dtype).eval()
    gen = torch.Generator().manual_seed(0)
    dims = {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=32)}
    program = dynvm.compile(module, _inputs(gen, 2, 6), (dims, dims))
    dynvm.save(program, tmp_path / "m.dvm")
    loaded = dynvm.load(tmp_path / "m.dvm")
    assert [spec.dtype for spec in loaded.inputs] == [torch.int64, torch.bool]
    assert {c.dtype for c in loaded.constants if c.is_floating_point()} == {dtype}
    runtimes = (dynvm.Runtime(loaded, jit=False), dynvm.Runtime(loaded, jit=eager_config()))
    with torch_threads(1), torch.inference_mode():
        for batch, seq in ((2, 6), (3, 11), (2, 6), (3, 11), (2, 6)):
            inputs = _inputs(gen, batch, seq)
            want = module(*inputs)
            for runtime in runtimes:
                got = runtime(*inputs)
                assert got[0].dtype == dtype and got[1].dtype == torch.int64
                torch.testing.assert_close(got[0], want[0])
                # argmax of near-ties may differ within the tolerance above; the count
                # of a bool mask is exact.
                assert torch.equal(got[2], want[2])
    jit = runtimes[1].stats()
    assert jit["specialized_region_calls"] > 0 and jit["compile_failures"] == 0
    with pytest.raises(ShapeError, match="dtype"):
        runtimes[0](inputs[0].int(), inputs[1])      # the signature keeps int64
