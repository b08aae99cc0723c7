"""How many rows a oneDNN GEMM question is calibrated at (jit/backends/cpu/fusion.py).

Calibration operands are at most CALIBRATION_MAX_M rows: past it the choice does not
change (oneDNN's lead grows with M), a family's upper bound (batch 64 x seq 512) would
make one calibration cost seconds of a compile thread, and each oneDNN call holds the
GIL (Note [oneDNN holds the GIL] in fusion): a few ms per call at most keeps request
threads moving. And at most CALIBRATION_MAX_MACS multiply-adds (M x N x K): at BERT-base
width a 512-row FFN GEMM (N x K = 3072 x 768) took 11-24 ms a calibration call on 2
loaded cores, each holding the GIL through oneDNN; 2**28 keeps it to about a quarter of
that (113 rows there, 455 at 768 x 768). Above the cap the verdict of the top class
measured answers (Note [oneDNN at a new row count] in row_gate). Rows stay at least
CALIBRATION_MIN_M.
"""

from __future__ import annotations

CALIBRATION_MAX_M = 512
CALIBRATION_MAX_MACS = 1 << 28
CALIBRATION_MIN_M = 16


def calibration_max_m(n: int, k: int) -> int:
    """The most rows a GEMM of N x K is calibrated at (the module's caps)."""
    return max(CALIBRATION_MIN_M,
               min(CALIBRATION_MAX_M, CALIBRATION_MAX_MACS // max(1, n * k)))
