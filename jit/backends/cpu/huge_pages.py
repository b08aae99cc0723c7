"""Packed weights on 2 MiB pages: fewer TLB misses while a small-row GEMM streams them.

Note [Packed weights on huge pages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At a few rows a GEMM reads each weight once per call and does little with it: at
BERT-base width, batch 1 x seq 16, the 16 GEMMs of four layers read 113 MB of packed
fp32 weights for 0.9 GFLOP, and on this project's 2-core host that streaming is most of
the call (timed with the cache flushed between calls and without, the two were within
5% of each other: the weights come from memory either way). On 4 KiB pages, streaming
113 MB walks 28,000 page-table entries, more than the TLB holds, on every call. Linux
backs anonymous memory with 2 MiB pages only where asked (`transparent_hugepage` is
`madvise` on this host and on most distributions' defaults; torch asks only under the
THP_MEM_ALLOC_ENABLE environment variable, read once at start-up), and oneDNN's packed
weights are allocated inside torch, out of our reach.

So after a weight is packed, `to_huge_pages` asks the kernel to collapse the 2 MiB-aligned
part of its memory into huge pages now (`madvise(MADV_COLLAPSE)`, Linux 6.1+;
synchronous, contents unchanged: only the page tables change). The head and tail that
do not fill an aligned 2 MiB stay on small pages (about 70% of BERT-base's packed
weights were collapsed). Anything refused (another OS, an older kernel, THP set to
`never`, no memory to compact) leaves the weight as it was: the kernel runs the same
either way, only its TLB misses differ. A weight is asked once per process.

Measured (2 threads, OMP_WAIT_POLICY=PASSIVE, the 16 GEMMs of BERT-base's four layers
on oneDNN with packed weights, two packed copies in one process, one collapsed,
interleaved, cache flushed before each sequence, 30 rounds, load 2.7-3.1): M=16
collapsed / not 0.961, M=64 0.988. At BERT-base width (bench.full_width's model, two
JIT runtimes in one process, one with and one without, interleaved call by call with
eager, 40 calls a shape, load 2.3-3.0, A/A 1.000), x eager without -> with: 1x16 0.496
-> 0.475, 1x32 0.577 -> 0.562, 2x16 0.571 -> 0.560; in a run with the peers beside
(20 calls, load 3.2-3.8) 2x32, 1x64 and 8x128 were within 1% (docs/bench_log.md, issue 31).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
import weakref

import torch

MADV_COLLAPSE = 25      # linux/mman.h (Linux 6.1)
HUGE_PAGE = 2 << 20

_lock = threading.Lock()
_done: set[int] = set()      # ids of the live tensors already asked


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory `tensor` reads, opaque oneDNN tensors included."""
    if tensor.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)
    return tensor.data_ptr(), tensor.untyped_storage().nbytes()


def aligned_span(address: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned part of [address, address + nbytes): (start, length), length
    0 when no whole huge page fits inside."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(0, end - start)


def _forget(key: int) -> None:
    with _lock:
        _done.discard(key)


def to_huge_pages(tensor: torch.Tensor) -> int:
    """Note [Packed weights on huge pages]: collapse the aligned part of `tensor`'s CPU
    memory into 2 MiB pages; the bytes collapsed (0 where refused or nothing fits)."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return 0
    with _lock:
        if id(tensor) in _done:
            return 0
        _done.add(id(tensor))
    # (a set of ids, not a WeakSet: an opaque oneDNN tensor refuses `==`)
    weakref.finalize(tensor, _forget, id(tensor))
    start, length = aligned_span(*_extent(tensor))
    if length == 0:
        return 0
    return length if madvise(start, length, MADV_COLLAPSE) == 0 else 0
