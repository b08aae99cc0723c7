"""The oneDNN calibration's row cap by work (jit/backends/cpu/calibration_rows.py):
each calibration call holds the GIL (Note [oneDNN holds the GIL]), so at full width the
rows it is measured at shrink with N x K, never below the floor nor above the row cap."""

from __future__ import annotations

from dynvm.jit.backends.cpu import calibration_rows as rows
from dynvm.jit.backends.cpu import fusion as cpu_fusion


def test_rows_shrink_with_the_gemm_width():
    # BERT-base's FFN (3072 x 768) and attention projections (768 x 768)
    assert rows.calibration_max_m(3072, 768) == (1 << 28) // (3072 * 768) == 113
    assert rows.calibration_max_m(768, 768) == 455
    # the zoo's and the demo models' widths keep the row cap
    assert rows.calibration_max_m(256, 256) == rows.CALIBRATION_MAX_M
    # a GEMM too wide for the budget still gets the floor, never zero rows
    assert rows.calibration_max_m(1 << 16, 1 << 14) == rows.CALIBRATION_MIN_M


def test_per_class_verdicts_stop_at_the_cap():
    from dynvm.jit.calibration import Choice

    asked = []

    def ask(m):
        asked.append(m)
        return Choice(cpu_fusion.ONEDNN, {cpu_fusion.TORCH: 2.0, cpu_fusion.ONEDNN: 1.0,
                                          cpu_fusion.ONEDNN_NEW_ROWS: 1.0},
                      cpu_fusion.TORCH)

    decision = cpu_fusion._decide_per_size_class(ask, {16, 1024}, 0.05, cap=113)
    assert asked == [16, 32, 64] and max(asked) <= 113
    assert decision.fuse
