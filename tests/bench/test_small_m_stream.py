"""bench.small_m_stream compares like with like: every path computes the same linear
(Note [Small-M weight streaming]), and a run reports each path at each row count."""

from __future__ import annotations

import pytest
import torch

from bench import small_m_stream
from dynvm.jit.backends.cpu import native_linear, panel_linear


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_computes_the_same_linear(rows, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for path in small_m_stream.PATHS:
        got = small_m_stream.gemm(torch, path, x, weight, bias, rows)()
        assert got.shape == (rows, 96), path
        torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance,
                                   msg=lambda m, path=path: f"{path}: {m}")
    with pytest.raises(ValueError, match="unknown path"):
        small_m_stream.gemm(torch, "nope", x, weight, bias, rows)


def test_a_run_reports_every_path_and_row_count(monkeypatch):
    monkeypatch.setattr(small_m_stream, "LAYERS", 1)
    threads = torch.get_num_threads()
    try:
        rows = small_m_stream.run([1, 2], [1], calls=1, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    seen = {(r["rows"], r["dtype"], r["path"]) for r in rows}
    assert seen == {(m, d, p) for m in (1, 2) for d in ("float32", "bfloat16")
                    for p in small_m_stream.PATHS}
    assert all(r["ms"] > 0 and r["gb_s"] > 0 and r["ceiling_gb_s"] > 0 for r in rows)


# The native kernel: 13 outputs are three blocks of 4 and a tail row, K = 37 two full
# 16-wide steps and a masked tail. The panel kernel: 16 and 17 rows are one register
# block and two, 33 outputs a masked last panel.
KERNEL_CASES = [
    pytest.param(small_m_stream.NATIVE, (1, 2, 3, 4, 5, 7, 16), (13, 37), id="native",
                 marks=pytest.mark.skipif(not native_linear.available(),
                                          reason=native_linear.unavailable_reason())),
    pytest.param(small_m_stream.PANEL, (1, 16, 17, 32), (33, 37), id="panel",
                 marks=pytest.mark.skipif(not panel_linear.available(),
                                          reason=panel_linear.unavailable_reason())),
]


@pytest.mark.parametrize("path, row_counts, odd", KERNEL_CASES)
def test_each_kernel_computes_the_linear_at_every_row_count(path, row_counts, odd):
    gen = torch.Generator().manual_seed(2)
    for rows in row_counts:
        for out, width in (odd, (64, 128)):
            x = torch.randn(rows, width, generator=gen)
            weight = torch.randn(out, width, generator=gen)
            bias = torch.randn(out, generator=gen)
            got = small_m_stream.gemm(torch, path, x, weight, bias, rows)()
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias),
                                       rtol=1e-4, atol=1e-4)
    bf16 = torch.ones(2, 16, dtype=torch.bfloat16)
    assert small_m_stream.gemm(torch, path, bf16, bf16, bf16[0], 2) is None
