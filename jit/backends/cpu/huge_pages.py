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

So after a weight is packed, and where a GEMV streams a program's dense weight on
torch (Note [Streamed GEMVs stay on torch]), `to_huge_pages` asks for the 2 MiB-aligned
part of its memory to be collapsed into huge pages (`madvise(MADV_COLLAPSE)`, Linux 6.1+; contents
unchanged: only the page tables change). The head and tail that do not fill an aligned
2 MiB stay on small pages (about 70% of BERT-base's packed weights were collapsed).
Anything refused (another OS, an older kernel, THP set to `never`, no memory to
compact) leaves the weight as it was: the kernel runs the same either way, only its TLB
misses differ. A weight is asked once per process.

The collapse runs on a collapser thread of its own, after the compile that packed the
weight, never inside it (Note [Collapsing after the compile]).

Measured (2 threads, OMP_WAIT_POLICY=PASSIVE, the 16 GEMMs of BERT-base's four layers
on oneDNN with packed weights, two packed copies in one process, one collapsed,
interleaved, cache flushed before each sequence, 30 rounds, load 2.7-3.1): M=16
collapsed / not 0.961, M=64 0.988. At BERT-base width (bench.full_width's model, two
JIT runtimes in one process, one with and one without, interleaved call by call with
eager, 40 calls a shape, load 2.3-3.0, A/A 1.000), x eager without -> with: 1x16 0.496
-> 0.475, 1x32 0.577 -> 0.562, 2x16 0.571 -> 0.560; in a run with the peers beside
(20 calls, load 3.2-3.8) 2x32, 1x64 and 8x128 were within 1% (docs/bench_log.md, issue 31).
The bench Llama's B=1 decode step (`dynvm bench generate`, one thread; its GEMVs read
190 MiB of dense weights a token on torch, 158 MiB of it inside aligned huge pages when
collapsed in place): three copies of the model in one process, generations interleaved,
12 rounds, step medians collapsed / not 0.926 and 0.955 against an A/A of 0.970
(2026-12-05 09:55, load 1.0-1.2); the GEMV chain alone 0.91x (09:47, load 1.7-1.8).

Note [Collapsing after the compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
MADV_COLLAPSE is synchronous: the kernel allocates (and, with memory fragmented,
compacts) a huge page and copies 512 small pages into it, for every 2 MiB asked. Done
where the weight was packed, on the compile thread, it lengthened the compile that a
first generation waits for: the bench Llama's B=4 decode step packs 17 weights (190
MB, the LM head 94 MB of it), and their collapse took 0.15 s of a 0.6 s compile (2026-12-05
09:20, cProfile, load 4-5; a 94 MiB collapse alone 25-250 ms, the first in a process
the slowest), one of the two causes of that generation's 38 of 127 specialized steps
(docs/bench_log.md, "the B=4 first-generation regression bisected").

So `to_huge_pages` only queues the weight (a weak reference: a weight freed before its
turn is skipped) and returns; a daemon thread collapses the queue in order, once no
weight has been queued for `QUIET_S`: a compile packs its weights in one burst in its
fusion pass, and the rest of it (arena questions, emitting, the prewarm call) is done
and the kernel installed within that (the B=4 step above: 0.23 s of work after
promotion and 0.43 s of waits for decode calls, 09:39, load 3.4-4.2), so the collapse
runs beside the calls the new kernel serves and not beside the compile they wait for
(three threads on two cores would slow the compile by a third for the collapse's
length, up to 0.5 s for those 190 MB). A collapse a second late costs a second of TLB
misses. The madvise call releases the
GIL (ctypes). Until a weight's turn its kernel runs on small pages: the same results,
more TLB misses. `drain()` waits for the queue (tests, and a figure that needs the
pages collapsed).

Note [Collapsing between calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A collapse beside calls costs them far more than a core's share: 2-thread calls of ~9
ms (eight 32-row GEMMs) ran at a p50 of 48-59 ms while one MADV_COLLAPSE of a 256 MB
tensor they did not read ran beside them, back to back (2026-12-06 13:04 UTC, load
2.4-3.8, /tmp/lead/s24/collapse_beside.py): the kernel's work for a collapse (its
locks on the address space, its work on every CPU) stalls the calls' threads, not only
their share of a core (the mechanism was not traced). In a warm-up that is a burst of
slow calls a second after a compile's last packed weight (suspected in BERT's 1x32
warm-up p90 at 1.49x the interpreter's in one bar run of three at stop 23's end).

So the collapser works 2 MiB at a time, each huge page in a gap between calls: no call
of the process in flight and none ended for `GAP_S` (`ServingActivity.wait_gap` in
jit.background, Note [Background work yields to calls]). One huge page takes ~0.7 ms
(up to 6-16 ms while memory is compacted), so a call that begins during one waits for
at most that. With 5 ms gaps between the same calls: alone p50 / p90 9.60 / 10.48 ms,
beside the 256 MB collapsed gap by gap 9.93 / 12.47 (13:05, load 2.1-2.3,
collapse_gap.py). A server with no gaps still gets its pages: after `GAP_WAIT_S`
without a gap one huge page is taken as the next call ends (one page beside a call,
not a whole weight).

Note [bf16 weights wholly on huge pages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch allocates a packed weight wherever its allocator finds room, so only its
2 MiB-aligned middle can be collapsed: in BERT-base's bf16 kernels (4 layers, 16 packed
weights of 1.1-4.5 MiB, all inside one 296 MiB heap mapping) 26 of 54 MiB were on huge
pages, and no 768x768 weight had a whole aligned page inside it (/proc/self/smaps,
2026-12-06, H34G). So the bf16 primitives' weights (onednn_matmul's LinearWeights) are
reordered into a buffer of their own that starts on a 2 MiB boundary and is a whole
number of huge pages long (`aligned_buffer`), all of it collapsed, instead of reading
torch's packed copy in place; torch's copy is not kept by them, so it is freed (still
one copy). The cost: the last huge page's unused tail, under 2 MiB a weight (BERT-base
4 layers: 72 MiB of packed bf16 weights against 54).

Measured in one process (BERT-base width bf16, 4 layers, exact kernels; three runtimes,
this one and two as before (the A/A), interleaved call by call, shuffled; 2 threads,
passive OpenMP; under the bench lock, 2026-12-06, H34G): 13:33 UTC, load 1.9, 100
rounds: 1x32 0.965, 1x64 0.986, 2x64 0.969, 1x128 0.977, 2x128 0.974, 8x128 0.992 (A/A
1.005-1.021); 13:37 UTC, load 1.3-1.5, 60 rounds: 0.935 / 0.952 / 0.962 / 0.959 / 0.972
/ 0.971 (A/A 0.988-1.004); 13:48, load 2.3-2.6: 0.974 / 0.974 / 0.993 / 0.993 / 0.994
/ 0.995 (A/A 1.001-1.032); this runtime made last, not first (13:50, load 1.6-1.7):
0.958 / 0.962 / 0.972 / 0.974 / 0.977 / 0.981 (A/A 0.979-1.004); the same bits. A
prototype that copied the weights there after the compile read 0.976-0.994 twice (A/A
0.980-1.015). The FFN GEMMs alone (the 4-layer chain, one copy collapsed and one not,
the weights' aligned middles only) did not show it (0.984 / 0.995 at M = 64 / 128, A/A
0.969 / 1.022): the whole model touches more pages between a weight's uses.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import os
import sys
import threading
import time
import weakref

import torch

from dynvm.jit.background import serving

MADV_COLLAPSE = 25      # linux/mman.h (Linux 6.1)
HUGE_PAGE = 2 << 20
QUIET_S = 1.0
"""Seconds without a new weight queued before the collapser starts (Note [Collapsing
after the compile]): longer than a compile's steps after its fusion pass."""
GAP_S = 0.001       # no call for this long is a gap (Note [Collapsing between calls])
GAP_WAIT_S = 0.5    # ... waited for at most this long a huge page, then taken anyway

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
    storage = tensor.untyped_storage()   # a view's whole storage, not past its end
    return storage.data_ptr(), storage.nbytes()


def aligned_span(address: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned part of [address, address + nbytes): (start, length), length
    0 when no whole huge page fits inside."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(0, end - start)


def _forget(key: int) -> None:
    with _lock:
        _done.discard(key)


def collapse(tensor: torch.Tensor) -> int:
    """Collapse the aligned part of `tensor`'s memory now, on this thread: the bytes
    collapsed (0 where refused or nothing fits). The collapser's step; callers queue
    with `to_huge_pages`."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return 0
    start, length = aligned_span(*_extent(tensor))
    if length == 0:
        return 0
    return length if madvise(start, length, MADV_COLLAPSE) == 0 else 0


def collapse_between_calls(tensor: torch.Tensor) -> int:
    """Collapse the aligned part of `tensor`'s memory one huge page at a time, each in a
    gap between the process's calls (Note [Collapsing between calls]): the bytes
    collapsed. The collapser thread's step."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return 0
    start, length = aligned_span(*_extent(tensor))
    activity, collapsed = serving(), 0
    for offset in range(0, length, HUGE_PAGE):
        if not activity.wait_gap(GAP_S, GAP_WAIT_S):
            activity.wait_idle(GAP_WAIT_S)   # no gap: right after a call ends
        if madvise(start + offset, HUGE_PAGE, MADV_COLLAPSE) == 0:
            collapsed += HUGE_PAGE
    return collapsed


class _Collapser:
    """The queue of weights to collapse and the daemon thread that works it (Note
    [Collapsing after the compile])."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque = collections.deque()
        self._last_queued = 0.0
        self._busy = False
        self._thread: threading.Thread | None = None
        self._closed = False
        self.collapsed_bytes = 0    # bytes collapsed so far (diagnostics, tests)
        self.collapses = 0          # weights asked of the kernel so far

    def put(self, tensor: torch.Tensor) -> None:
        with self._cond:
            if self._closed:   # the process is exiting (Note [Collapser stopped at exit])
                return
            self._queue.append(weakref.ref(tensor))
            self._last_queued = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True,
                                                name="dynvm-huge-pages")
                self._thread.start()
            self._cond.notify_all()

    def _next(self) -> torch.Tensor | None:
        """The next live weight, once the queue has been quiet for QUIET_S; None once
        closed."""
        with self._cond:
            self._busy = False
            self._cond.notify_all()
            while True:
                if self._closed:
                    return None
                if not self._queue:
                    self._cond.wait()
                    continue
                left = self._last_queued + QUIET_S - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                tensor = self._queue.popleft()()
                if tensor is not None:
                    self._busy = True
                    return tensor

    def _work(self) -> None:
        while True:
            tensor = self._next()
            if tensor is None:
                return
            collapsed = collapse_between_calls(tensor)   # ctypes releases the GIL
            del tensor
            with self._cond:
                self.collapsed_bytes += collapsed
                self.collapses += 1

    def drain(self, timeout: float) -> bool:
        """Wait until every queued weight was collapsed (or skipped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Stop the collapser thread after the weight it is collapsing, dropping the rest
        (Note [Collapser stopped at exit]); False if it still ran after `timeout` s."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _after_fork(self) -> None:
        # The child has no collapser thread: a fresh state starts one on its first ask.
        self.__init__()


# Note [Collapser stopped at exit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The collapser is a daemon thread, and a `madvise` call releases the GIL: left running,
# it could still be inside a collapse, or start one on a weight, while the interpreter
# finalizes and the native libraries' destructors run. At exit it is stopped and joined
# (at most EXIT_WAIT_S: one collapse of a model's weights takes well under a second);
# the weights still queued stay on small pages, which costs an exiting process nothing.
EXIT_WAIT_S = 5.0

_COLLAPSER = _Collapser()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_COLLAPSER._after_fork)
atexit.register(lambda: _COLLAPSER.close(EXIT_WAIT_S))


def to_huge_pages(tensor: torch.Tensor) -> bool:
    """Note [Packed weights on huge pages]: queue `tensor`'s CPU memory for collapse into
    2 MiB pages on the collapser thread (Note [Collapsing after the compile]); whether
    it was queued (False: asked before, off Linux, or no whole huge page inside it)."""
    if _madvise() is None or tensor.device.type != "cpu":
        return False
    with _lock:
        if id(tensor) in _done:
            return False
        _done.add(id(tensor))
    # (a set of ids, not a WeakSet: an opaque oneDNN tensor refuses `==`)
    weakref.finalize(tensor, _forget, id(tensor))
    if aligned_span(*_extent(tensor))[1] == 0:
        return False
    _COLLAPSER.put(tensor)
    return True


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` rounded up to whole huge pages, starting on a
    2 MiB boundary (Note [bf16 weights wholly on huge pages]); its storage's aligned
    span is exactly the tensor, so `to_huge_pages` collapses all of it. (The allocator
    aligns to 64 bytes: the storage is 64 bytes short of one more huge page, so no
    page past the tensor is collapsed.)"""
    length = -(-max(1, nbytes) // HUGE_PAGE) * HUGE_PAGE
    storage = torch.empty(length + HUGE_PAGE - 64, dtype=torch.uint8)
    offset = -storage.data_ptr() % HUGE_PAGE
    return storage[offset:offset + length]


def drain(timeout: float = 30.0) -> bool:
    """Wait until the queued weights are collapsed; False if `timeout` passed first."""
    return _COLLAPSER.drain(timeout)


def collapsed_bytes() -> int:
    """Bytes collapsed into huge pages in this process so far."""
    return _COLLAPSER.collapsed_bytes
