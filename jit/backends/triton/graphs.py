"""CUDA graphs for exact specializations: a region's launches captured once, on the
compile thread, and replayed per call; and the output pool that keeps replayed outputs
from ever being overwritten under the caller.

Note [CUDA graph outputs]
~~~~~~~~~~~~~~~~~~~~~~~~~
A captured graph reads and writes fixed addresses: its static inputs, the intermediates
and outputs allocated while it was captured (the graph's private memory pool, which plays
the arena's part: every buffer at a planned, fixed place). Each replay overwrites them.
So nothing the graph writes may reach the caller:

* inputs are copied into the static inputs before a replay (the guard has checked that
  shape, dtype, strides and device are the captured ones, Note [Guard strength]);
* every tensor output is copied out of the graph's buffer after the replay, into a
  buffer of the `OutputPool`, and the caller gets a fresh tensor object over it.

The pool owns its buffers and hands out views. A buffer is written again only when no
tensor other than the pool's own refers to its storage: the storage's use count (every
tensor and view over it, and a NumPy array made from one, holds a reference) is back to
what it was when the pool made it. While the caller, or anything derived from what it
got, still holds it, the count is higher and the pool allocates another buffer instead.
This is correct by construction (no timing, no "the caller is done by now"): the graph
writes only its own buffers, the copy-out writes only a buffer nobody else refers to.
Work the caller queued on the buffer before dropping it is ordered before the next
copy-out, which runs on the same stream.

Capture happens where the specialization is built (the JIT's compile thread, or the
fleet link's install thread), on a side stream, after one warm-up run (lazy module loads
and library handles must not happen inside a capture); never on a request. The capture
is thread-local: requests that run meanwhile on other threads are not disturbed. A capture
that fails leaves the specialization uncaptured, with the reason as a note. Only exact
(strong-guard) specializations whose batch (first dim of the first tensor live-in) is at
most `JitConfig.cuda_graphs_max_batch` are captured: small batches are where launch
overhead dominates, and an exact guard pins every shape the graph baked in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from dynvm.jit.guards import GuardStrength


def _use_count(tensor: torch.Tensor) -> int | None:
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    return counter(tensor.untyped_storage()._cdata)


class OutputPool:
    """Buffers that replayed outputs are copied into (Note [CUDA graph outputs])."""

    def __init__(self, per_shape: int = 4) -> None:
        self.per_shape = per_shape
        self._free_count: dict[int, int] = {}
        self._buffers: dict[tuple, list[torch.Tensor]] = {}
        self.allocated = 0
        self.reused = 0

    def _free(self, buffer: torch.Tensor) -> bool:
        count = _use_count(buffer)
        return count is not None and count == self._free_count[id(buffer)]

    def take(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor the caller owns, holding a copy of `value`."""
        key = (tuple(value.shape), value.dtype, value.device)
        buffers = self._buffers.setdefault(key, [])
        buffer = next((b for b in buffers if self._free(b)), None)
        if buffer is None:
            buffer = torch.empty(value.shape, dtype=value.dtype, device=value.device)
            self.allocated += 1
            if len(buffers) < self.per_shape and _use_count(buffer) is not None:
                self._free_count[id(buffer)] = _use_count(buffer)
                buffers.append(buffer)
        else:
            self.reused += 1
        buffer.copy_(value)
        return buffer.view(buffer.shape)   # a new tensor object: its life is the caller's

    def stats(self) -> dict:
        return {"allocated": self.allocated, "reused": self.reused,
                "held": sum(len(b) for b in self._buffers.values())}


def graph_batch(signature: tuple) -> int | None:
    """The batch of an exact signature: the first dim of its first tensor live-in."""
    for entry in signature:
        if len(entry) == 5 and entry[0].dims:
            return entry[0].dims[0]
    return None


def static_tensor(entry: tuple) -> torch.Tensor:
    """A zero tensor exactly as a signature entry describes it (shape, dtype, strides,
    storage offset, device): a captured graph's static input."""
    shape, dtype, strides, offset, device = entry
    dims = tuple(shape.dims)
    extent = offset + 1 + sum((d - 1) * s for d, s in zip(dims, strides)) if all(dims) else 0
    storage = torch.zeros(max(extent, 1), dtype=dtype, device=device)
    return storage.as_strided(dims, strides, offset)


class GraphedRegion:
    """`region(regs)`: copy the live-ins into the captured inputs, replay, copy the
    outputs out through the pool (Note [CUDA graph outputs])."""

    def __init__(self, fn: Callable[[list], None], signature: tuple,
                 live_in: Sequence[int], outputs: Sequence[int], dead: Sequence[int],
                 device: torch.device, pool: OutputPool | None = None) -> None:
        self.fn = fn
        self.live_in = tuple(live_in)
        self.outputs = tuple(outputs)
        self.dead = tuple(dead)
        self.device = torch.device(device)
        self.pool = pool if pool is not None else OutputPool()
        self.replays = 0
        # One set of static buffers: concurrent calls of this specialization take turns.
        self._lock = threading.Lock()
        size = max((*self.live_in, *self.outputs, *self.dead), default=-1) + 1
        self._inputs = [static_tensor(e) if len(e) == 5 else e[1] for e in signature]
        regs = self._regs(size)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn(self._regs(size))            # warm-up: module loads, library handles
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: requests running meanwhile on other threads may allocate and
        # synchronize; only this thread's capture-unsafe calls are refused.
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            fn(regs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._static_outputs = [(reg, regs[reg]) for reg in self.outputs]

    def _regs(self, size: int) -> list:
        regs = [None] * size
        for reg, value in zip(self.live_in, self._inputs):
            regs[reg] = value
        return regs

    def __call__(self, regs: list) -> None:
        with self._lock:
            for reg, static in zip(self.live_in, self._inputs):
                if isinstance(static, torch.Tensor):
                    static.copy_(regs[reg])
            self.graph.replay()
            self.replays += 1
            outputs = [(reg, self.pool.take(value) if isinstance(value, torch.Tensor)
                        and value.device.type == "cuda" else value)
                       for reg, value in self._static_outputs]
        for reg in self.dead:
            regs[reg] = None
        for reg, value in outputs:
            regs[reg] = value


def maybe_capture(fn, strength: GuardStrength, signature: tuple, ir, device: torch.device,
                  max_batch: int) -> tuple[Callable, str | None]:
    """`fn` captured into a CUDA graph when it qualifies (Note [CUDA graph outputs]), with
    a note saying what happened (None when graphs do not apply: not CUDA, or off)."""
    device = torch.device(device)
    if device.type != "cuda" or max_batch <= 0 or ir is None:
        return fn, None
    if strength is not GuardStrength.STRONG:
        return fn, None
    batch = graph_batch(signature)
    if batch is None or batch > max_batch:
        return fn, None
    outputs = [reg for reg, _ in ir.outputs]
    try:
        graphed = GraphedRegion(fn, signature, ir.live_in, outputs, ir.dead_live_ins, device)
    except Exception as exc:  # a capture failure keeps the uncaptured code, with why
        return fn, f"cuda graph: not captured ({type(exc).__name__}: {str(exc)[:200]})"
    return graphed, f"cuda graph: captured (batch {batch}), replayed per call"
