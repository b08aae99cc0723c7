"""Note [Streamed GEMVs stay on torch] (jit/backends/cpu/streamed_gemv.py): a GEMM at one
row over a weight larger than `STREAMED_BYTES` stays on torch without a calibration
question (so without a packed copy); a smaller weight, or more rows, is still asked."""

from __future__ import annotations

import pytest
import torch

from dynvm.jit.backends.cpu import fusion as cpu_fusion
from dynvm.jit.ir import ConstRef, Literal, SpecOp, Var


class _Asked(Exception):
    pass


class _Calibrator:
    """Raises at the first question: whether one was asked is all these tests need."""

    rounds, margin = 3, 0.05

    def choose(self, *args, **kwargs):
        raise _Asked


def _decide(rows: int, out_features: int):
    weight = torch.zeros(out_features, 768)
    op = SpecOp("LINEAR", (1,), (Var(0), ConstRef(0), Literal(None)), 0)
    gemm = cpu_fusion._Gemm(Var(0), 0, False, Literal(None))
    probes = [{0: torch.empty(1, rows, 768, device="meta")}]
    return cpu_fusion._decide(op, gemm, None, [op], [weight], probes, _Calibrator())


def test_a_streamed_gemv_stays_on_torch_unasked():
    decision = _decide(rows=1, out_features=2048)    # 6 MiB
    assert not decision.fuse and "streamed from memory" in decision.note


@pytest.mark.parametrize("rows, out_features", [(1, 1024), (4, 2048)],
                         ids=["a weight that stays in cache", "four rows"])
def test_others_are_measured(rows, out_features):
    with pytest.raises(_Asked):
        _decide(rows, out_features)
