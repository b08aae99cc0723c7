"""Geometric buckets for the varying dims of a code family.

Note [Geometric buckets]
~~~~~~~~~~~~~~~~~~~~~~~~
A family's kernel takes its varying dims as runtime parameters, but it was tiled, and its
memory planned, for some range of them. Buckets whose width grows with their values keep
that range "alike": within [17, 64] the largest dim is under four times the smallest, so
a tile size, a loop order or a split that suits one end still suits the other, and an
arena sized for the upper bound wastes at most a bounded factor at the lower one. Equal-
width buckets would either be too wide at the small end ([1, 64] mixes a matrix-vector
product with a matrix multiply) or too many at the large end.

Geometric buckets also bound the number of families: a dim ranging over 1..N falls into
about log_ratio(N) buckets, so the compiles grow with the log of the range, not with the
number of distinct shapes.

The default ratio is 4: a batch ranging over 1..64 gives 4 buckets ([1,1], [2,4], [5,16],
[17,64]), so 4 compiles serve 64 shapes (under a tenth of them), while within a bucket
the dims still differ by at most 4x. Ratio 2 would double the compiles for little gain in
kernel fit; ratio 8 would mix shapes whose best tilings differ.

The edges: 1 gets a bucket of its own because a dim of size 1 changes the code (a
broadcast, a squeezed loop, a matrix-vector instead of a matrix-matrix product), and 0
gets one because a tensor with no elements runs no kernel at all.
"""

from __future__ import annotations

import operator

from dynvm.vm.errors import ConfigError


def check_ratio(ratio: int) -> int:
    """`ratio` as an int, or ValueError when it cannot make geometric buckets."""
    ratio = operator.index(ratio)
    if ratio < 2:
        raise ConfigError(f"bucket ratio must be an int >= 2, got {ratio}")
    return ratio


def bucket_of(n: int, ratio: int = 4) -> tuple[int, int]:
    """The bucket `(low, high)` holding the dim `n`; see Note [Geometric buckets].

    The buckets are [0,0], [1,1], [2,ratio], [ratio+1, ratio**2], [ratio**2+1, ratio**3],
    ...: every non-negative int lies in exactly one, and each starts right after the
    previous one ends. A negative `n`, or a ratio under 2, raises ValueError.
    """
    ratio = check_ratio(ratio)
    n = operator.index(n)
    if n < 0:
        raise ValueError(f"a dim must be >= 0, got {n}")
    if n <= 1:
        return (n, n)
    low, high = 2, ratio
    while n > high:
        low, high = high + 1, high * ratio
    return (low, high)
