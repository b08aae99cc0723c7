"""Note [Streamed GEMVs stay on torch] and Note [Few rows over a streamed weight]
(jit/backends/cpu/streamed_gemv.py): a GEMM at one row over a weight larger than
`STREAMED_BYTES` stays on torch without a calibration question (so without a packed
copy; its dense weight goes on huge pages), at 4..16 rows it goes to oneDNN without
one (to dynvm's small-M kernel where it runs, Note [A small-M GEMM of our own], at
2..16 rows; else to oneDNN at 4..16); a smaller weight, or other row counts, are still
asked."""

from __future__ import annotations

import pytest
import torch

from dynvm.jit.backends.cpu import fusion as cpu_fusion
from dynvm.jit.backends.cpu import native_linear
from dynvm.jit.ir import ConstRef, Literal, SpecOp, Var


class _Asked(Exception):
    pass


class _Calibrator:
    """Raises at the first question: whether one was asked is all these tests need."""

    rounds, margin = 3, 0.05

    def choose(self, *args, **kwargs):
        raise _Asked


def _decide(rows: int, out_features: int, beside: int = 0):
    """The decision on a LINEAR over an [out_features, 768] weight at `rows` rows, in a
    kernel with another LINEAR over a [beside, 768] weight where `beside`."""
    weight = torch.zeros(out_features, 768)
    op = SpecOp("LINEAR", (1,), (Var(0), ConstRef(0), Literal(None)), 0)
    gemm = cpu_fusion._Gemm(Var(0), 0, False, Literal(None))
    ops, constants = [op], [weight]
    if beside:
        ops.append(SpecOp("LINEAR", (2,), (Var(0), ConstRef(1), Literal(None)), 1))
        constants.append(torch.zeros(beside, 768))
    probes = [{0: torch.empty(1, rows, 768, device="meta")}]
    return cpu_fusion._decide(op, gemm, None, ops, constants, probes, _Calibrator())


@pytest.mark.parametrize("ours", [True, False], ids=["with dynvm's kernel", "without"])
def test_a_streamed_gemv_is_decided_unasked_with_its_weight_on_huge_pages(monkeypatch, ours):
    asked = []
    monkeypatch.setattr(cpu_fusion, "to_huge_pages", asked.append)
    if not ours:
        monkeypatch.setattr(native_linear, "available", lambda: False)
    elif not native_linear.available():
        pytest.skip(native_linear.unavailable_reason())
    decision = _decide(rows=1, out_features=2048)    # 6 MiB, stored [N, K]
    # dynvm's kernel where it runs (its residual add folded in), else torch's GEMV
    assert decision.fuse == decision.native == ours and "streamed from memory" in decision.note
    assert [t.shape for t in asked] == [(2048, 768)]  # the dense weight torch streams


@pytest.mark.parametrize("rows", [4, 16])
def test_a_few_rows_over_a_streamed_weight_are_decided_unasked(rows):
    decision = _decide(rows=rows, out_features=2048)
    assert decision.fuse and decision.after is None
    assert f"not measured: M={rows}" in decision.note
    assert decision.native == native_linear.available()


def test_without_the_native_kernel_a_few_rows_go_to_onednn_and_two_rows_are_asked(
        monkeypatch):
    monkeypatch.setattr(native_linear, "available", lambda: False)
    decision = _decide(rows=4, out_features=2048)
    assert decision.fuse and not decision.native and "oneDNN's packed weight" in decision.note
    with pytest.raises(_Asked):
        _decide(rows=2, out_features=2048)


@pytest.mark.skipif(not native_linear.available(), reason=native_linear.unavailable_reason())
def test_two_rows_over_a_streamed_weight_go_to_the_native_kernel_unasked():
    decision = _decide(rows=2, out_features=2048)
    assert decision.fuse and decision.native and "small-M kernel" in decision.note


def test_a_small_weight_streams_where_its_kernels_weights_together_do():
    decision = _decide(rows=4, out_features=1024, beside=2048)   # 3 + 6 MiB
    assert decision.fuse and "9.0 MiB of the kernel's" in decision.note
    decision = _decide(rows=1, out_features=1024, beside=2048)   # one row: unasked too
    assert "9.0 MiB of the kernel's" in decision.note


@pytest.mark.parametrize("rows, out_features", [(1, 1024), (4, 1024), (32, 2048)],
                         ids=["a GEMV whose weight stays in cache", "four rows, in cache",
                              "32 rows"])
def test_others_are_measured(rows, out_features):
    with pytest.raises(_Asked):
        _decide(rows, out_features)
