"""Arena buffers at run time: one uint8 buffer per in-flight call of a specialization,
reused across calls, within a byte budget per device.

A specialization (the "owner", named by a string the JIT picks) asks for a buffer of
its plan's size when a call starts and gives it back when the call ends:

    buffer = pool.acquire(owner, plan.size)
    try:
        ...  # views of `buffer` at plan.offsets are the op's out= tensors
    finally:
        if buffer is not None:
            pool.release(owner, buffer)

Note [Arena concurrency]
~~~~~~~~~~~~~~~~~~~~~~~~
The same specialization can run on several threads at once (a replica serves
concurrent requests, and torch ops release the GIL), and one arena cannot serve two
calls: both would write their intermediates at the same offsets. The choices were:

- one arena per specialization behind a lock held for the whole call: calls of the same
  shape, which are exactly the hot ones, would queue behind each other, and a call
  would wait for milliseconds on another request's work. That breaks "no call waits".
- one arena per thread per specialization: memory grows with threads times
  specializations, and buffers of threads that went quiet are never reused.
- one buffer per in-flight call, from a pool (this module): memory follows the real
  concurrency, idle buffers serve the next call of the same owner, and the lock guards
  only a few dict operations, never a call.

When a new buffer would not fit the budget even after freeing other owners' idle
buffers, `acquire` returns None at once and the caller runs that call without an
arena (its ops allocate through torch, as the interpreter's do): slower, but it never
blocks and never shares. A buffer is always in exactly one of the idle or in-use maps,
and it enters the in-use map only in `acquire`, so no two holders ever get it at once.

Release means "the device is done with it" only where work is ordered: always on CPU,
and on CUDA when every call runs on the same stream, since the next holder's kernels
then queue behind the previous holder's. A caller that runs calls on several CUDA
streams must make the next holder's stream wait for an event recorded at release; this
pool does not do that yet.

Cost (measured on this project's 2-core CPU machine, Python 3.11, torch 2.13): a
reusing acquire plus its release takes 1.3 to 2 us in one thread (`python -m
dynvm.arena.pool` prints it); with 2 and 4 threads hammering one owner, 2.9 and 4 us
per pair in aggregate, which is the GIL's handoff more than the lock's. A pair that
allocates a new 4 KB buffer takes about 5 us; torch's allocation and the freeing of
evicted buffers run outside the lock. Running out of memory while allocating is
treated like the budget: a refusal, not an error.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from dynvm.vm.errors import ConfigError


@dataclass(slots=True, eq=False)
class _Buffer:
    owner: str
    nbytes: int
    tensor: torch.Tensor
    dropped: bool = False
    """Its owner was dropped while it was in use: free it on release, do not keep it."""


class ArenaPool:
    """Arena buffers for one device, at most `budget_bytes` held at once (idle and in
    use together). Thread-safe; see Note [Arena concurrency]."""

    def __init__(self, device: torch.device | str, budget_bytes: int) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) \
                or budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
        self._device = torch.device(device)
        self._budget = budget_bytes
        self._lock = threading.Lock()
        # id(tensor) -> buffer. Ids are unique while the pool holds the tensor, and it
        # holds every tensor in these maps.
        self._in_use: dict[int, _Buffer] = {}
        self._idle: OrderedDict[int, _Buffer] = OrderedDict()  # least recently used first
        # (owner, nbytes) -> idle buffers, most recently released last: the warmest
        # buffer (still in cache) serves the next call.
        self._idle_by_key: dict[tuple[str, int], list[_Buffer]] = {}
        self._reserved = 0   # bytes of every buffer held, plus allocations in progress
        self._idle_bytes = 0
        self._in_use_bytes = 0
        self._counts = dict.fromkeys(
            ("acquires", "reuses", "allocations", "evictions", "refusals", "dropped"), 0)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def acquire(self, owner: str, nbytes: int) -> torch.Tensor | None:
        """A 1-D uint8 tensor of exactly `nbytes` bytes on the pool's device that no
        other holder has until it is released, or None when the budget has no room.

        Its contents are whatever the previous holder left (never zeroed). An idle
        buffer of the same owner and size is reused; otherwise a new one is allocated,
        first freeing idle buffers of other owners (and this owner's idle buffers of
        other sizes) least recently used first if the budget needs it. Never waits for
        another call: see Note [Arena concurrency].
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"acquire({owner!r}, nbytes={nbytes!r}): nbytes must be an "
                             "int > 0 (a plan of size 0 needs no arena)")
        evicted: list[_Buffer] = []
        with self._lock:
            self._counts["acquires"] += 1
            stack = self._idle_by_key.get((owner, nbytes))
            if stack:
                buffer = stack.pop()
                if not stack:
                    del self._idle_by_key[(owner, nbytes)]
                del self._idle[id(buffer.tensor)]
                self._idle_bytes -= nbytes
                self._in_use[id(buffer.tensor)] = buffer
                self._in_use_bytes += nbytes
                self._counts["reuses"] += 1
                return buffer.tensor
            # Freeing every idle buffer is the most this call may do; if even that is not
            # enough, refuse without freeing anything that might serve a later call.
            if self._reserved - self._idle_bytes + nbytes > self._budget:
                self._counts["refusals"] += 1
                return None
            while self._reserved + nbytes > self._budget:
                _, victim = self._idle.popitem(last=False)
                self._forget_idle(victim)
                self._reserved -= victim.nbytes
                self._counts["evictions"] += 1
                evicted.append(victim)
            self._reserved += nbytes  # claimed now, so concurrent acquires see it
        # Outside the lock: freeing the victims and allocating can take a while.
        evicted.clear()
        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        except RuntimeError as error:
            with self._lock:
                self._reserved -= nbytes
                out_of_memory = isinstance(error, torch.OutOfMemoryError) \
                    or "can't allocate memory" in str(error)  # the CPU allocator's words
                if out_of_memory:
                    self._counts["refusals"] += 1
            if out_of_memory:
                return None  # as for the budget: the call runs without an arena
            raise
        with self._lock:
            self._in_use[id(tensor)] = _Buffer(owner, nbytes, tensor)
            self._in_use_bytes += nbytes
            self._counts["allocations"] += 1
        return tensor

    def release(self, owner: str, buffer: torch.Tensor) -> None:
        """Give back a buffer that `acquire(owner, ...)` returned. It stays allocated for
        the owner's next call unless the owner was dropped meanwhile.

        Raises ValueError for a tensor this pool did not hand out (a view of a buffer
        counts as another tensor), one already released, or another owner's buffer.
        """
        with self._lock:
            held = self._in_use.get(id(buffer))
            if held is None or held.tensor is not buffer:
                raise ValueError(
                    f"release({owner!r}, ...): tensor of {buffer.numel()} bytes at "
                    f"{buffer.data_ptr():#x} is not in use from this pool (never acquired, "
                    "already released, or a view of the acquired tensor)")
            if held.owner != owner:
                raise ValueError(f"release({owner!r}, ...): the buffer was acquired by "
                                 f"{held.owner!r}, not {owner!r}")
            del self._in_use[id(buffer)]
            self._in_use_bytes -= held.nbytes
            if held.dropped:
                self._reserved -= held.nbytes
                self._counts["dropped"] += 1
                return  # not kept: the memory goes with the caller's last reference
            self._idle[id(buffer)] = held
            self._idle_bytes += held.nbytes
            self._idle_by_key.setdefault((owner, held.nbytes), []).append(held)

    def drop(self, owner: str) -> None:
        """The owner was evicted: free its idle buffers now, and its in-use ones when
        they are released. A later `acquire` under the same name starts afresh."""
        freed: list[_Buffer] = []
        with self._lock:
            for key in [k for k in self._idle_by_key if k[0] == owner]:
                for buffer in self._idle_by_key.pop(key):
                    del self._idle[id(buffer.tensor)]
                    self._idle_bytes -= buffer.nbytes
                    self._reserved -= buffer.nbytes
                    self._counts["dropped"] += 1
                    freed.append(buffer)
            for buffer in self._in_use.values():
                if buffer.owner == owner:
                    buffer.dropped = True
        freed.clear()  # the memory goes back outside the lock

    def stats(self) -> dict[str, int]:
        """A snapshot of the pool's state and counters:

        reserved_bytes  bytes held (idle and in use, and allocations in progress)
        in_use_bytes    bytes handed out and not yet released
        idle_bytes      bytes kept for reuse
        budget_bytes    the budget
        arenas          buffers held (idle and in use)
        acquires        calls to acquire
        reuses          acquires served by an idle buffer
        allocations     acquires that allocated a new buffer
        evictions       idle buffers freed to make room for another allocation
        refusals        acquires that returned None
        dropped         buffers freed because their owner was dropped
        """
        with self._lock:
            return {"reserved_bytes": self._reserved, "in_use_bytes": self._in_use_bytes,
                    "idle_bytes": self._idle_bytes, "budget_bytes": self._budget,
                    "arenas": len(self._in_use) + len(self._idle), **self._counts}

    def __repr__(self) -> str:
        s = self.stats()
        return (f"ArenaPool({self._device}, budget={s['budget_bytes']}, "
                f"reserved={s['reserved_bytes']}, in_use={s['in_use_bytes']}, "
                f"arenas={s['arenas']})")

    def _forget_idle(self, buffer: _Buffer) -> None:
        # Caller holds the lock and has already removed `buffer` from self._idle.
        key = (buffer.owner, buffer.nbytes)
        stack = self._idle_by_key[key]
        stack.remove(buffer)
        if not stack:
            del self._idle_by_key[key]
        self._idle_bytes -= buffer.nbytes


def _measure_cost(rounds: int = 200_000) -> float:
    """Microseconds for one reusing acquire plus its release, in one thread."""
    pool = ArenaPool(torch.device("cpu"), budget_bytes=1 << 20)
    pool.release("m", pool.acquire("m", 4096))  # type: ignore[arg-type]
    start = time.perf_counter()
    for _ in range(rounds):
        buffer = pool.acquire("m", 4096)
        pool.release("m", buffer)  # type: ignore[arg-type]
    return (time.perf_counter() - start) / rounds * 1e6


if __name__ == "__main__":
    print(f"acquire + release (reuse): {_measure_cost():.2f} us")
