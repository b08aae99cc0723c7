"""`OpportunisticBatcher`: forms batches of requests for one model worker, without timers
on the lone request's path (Note [Opportunistic batching]).

    batcher = OpportunisticBatcher(execute, BatchingOptions(), high_rows=64)
    result = await batcher.submit(item, rows=3, key=shape_key, nbytes=1200)

`execute(items) -> results` (one per item, in order) runs on the batcher's own worker
thread, one batch at a time; `submit` raises `Overloaded` when `max_queued` requests
already wait. The replica (dynvm.cluster.serving._replica) reports what each VM call ran with
`record(rows, specialized)`, which is what shape-aware sizing learns from.

Note [Opportunistic batching]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Serve's `@serve.batch` waits up to `batch_wait_timeout_s` for a batch to fill, so a lone
request pays the whole timeout (10 of the 25 ms a lone recommender request took). Here,
as in vLLM's continuous batching and Triton's dynamic batcher with no queue delay, the
model's own busy time is the batching window: a request that finds the worker idle runs
at once; requests that arrive while it runs queue, and when it is free they form the next
batch, a prefix of the queue (arrival order is kept, so a client's responses are never
reordered, and each request gets exactly its own outputs back). A batch stops at
`max_batch_size` requests, `max_batch_bytes` input bytes, the declared row bound, or the
first request whose non-batch dims differ (its shape key).

Shape-aware sizing: a batch's row count decides which specialization it hits; a count
the JIT never specialized runs in the interpreter. The batcher keeps, per row count,
whether the last VM call with that many rows ran entirely specialized (`record`, fed by
the replica from the JIT's region counters; it learns family buckets and demotions the
same way, since it observes what ran). Among the prefixes it may take, it prefers the
longest whose row count is hot or preferred, taking fewer requests (the rest start the
next batch) when that keeps at least half the rows. When no prefix is hot and one more
request of the batch's largest size would reach a hot or preferred count, a batch of two
or more requests is held up to `max_delay_s` for it; a lone request is never held.
`stats()` reports the share of formed batches that ran specialized.

Requests on their way: the replica tells the batcher (`arriving(+1)` / `arriving(-1)`)
how many requests it has accepted but not yet submitted (their bodies are being read or
parsed). When the worker is free and such requests exist, the next batch waits for them,
event-driven, at most `max_delay_s`: on a small shared host (2 cores running proxy,
replica and clients) running each request the moment it lands made batches of ~2 at 8
clients, and the CPU went to many small calls. A request alone in the replica never
waits: with nothing on its way, it runs at once.

Note [Inline fast batches]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Handing a batch to the worker thread costs two thread hops and the GIL hand-offs
between the loop and the worker, on a small model more than the model call itself
(the recommender: ~0.3 ms a call). So a batch whose signature last ran in at most
`inline_run_s` (default 2 ms) runs on the event loop itself, as a plain Serve handler
runs its model; a signature never seen, or one whose last run took longer (a cold
shape, a big model, a loaded host), runs on the worker and is timed there. After an
inline batch the loop yields once, so that requests that arrived meanwhile are read
before the next batch is formed. Measured (issue 17, one cluster, recommender, JSON,
8 clients, 4 alternating 6 s runs, load 10-11): 228 req/s, 3.20 ms of replica CPU per
request inline against 188 req/s and 3.73 ms on the worker thread.

What bounds the loop's wait is that a call's time follows from what the batcher knows
before it runs: the signature (the batch's row count and each input's other dims,
`submit`'s `signature`), not the row count alone, and only for a program whose work
the shapes decide (`inline=False` otherwise: the replica passes that for a program with
a loop, a branch or an op whose output size depends on values, where a client's data
could make one call of a fast signature run to its budget, 30 s, on the loop and stall
every other request and /ready with it). The loop is then never blocked longer than
about `inline_run_s` plus one slower-than-last call of a signature that ran fast.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dynvm.cluster._counters import BatcherCounters, as_dict
from dynvm.cluster.serving.serving_config import BatchingOptions
from dynvm.vm.errors import DynvmError

RUN_TIMES = 4096
"""Signatures whose last run time a batcher remembers (the least recently run go)."""


class Overloaded(DynvmError):
    """Too many requests wait for the model already; the client should retry later
    (the replica answers 503 with Retry-After)."""


@dataclass(eq=False)
class _Pending:
    item: object
    rows: int
    key: Hashable | None   # None: never batched with another request
    nbytes: int
    future: asyncio.Future
    signature: Hashable    # with the batch's rows, what its call time follows from


@dataclass(frozen=True)
class Plan:
    """What to do with the head of the queue: run its first `count` requests now, or
    (`hold`) wait a little for one more first."""

    count: int
    hold: bool = False
    split: bool = False


def plan_batch(rows: Sequence[int], keys: Sequence[Hashable | None], nbytes: Sequence[int],
               options: BatchingOptions, high_rows: int | None,
               hot: Callable[[int], bool]) -> Plan:
    """The plan for a queue whose requests have these row counts, shape keys and sizes
    (Note [Opportunistic batching]). Pure, for tests."""
    if not rows:
        return Plan(0)
    totals = [rows[0]]
    size = nbytes[0]
    head = keys[0]
    limit = min(len(rows), options.max_batch_size)
    if head is not None:
        for i in range(1, limit):
            total = totals[-1] + rows[i]
            size += nbytes[i]
            if (keys[i] != head or size > options.max_batch_bytes
                    or (high_rows is not None and total > high_rows)):
                break
            totals.append(total)
    count = len(totals)
    preferred = options.preferred_sizes

    def good(total: int) -> bool:
        return total in preferred or (options.shape_aware and hot(total))

    if count == 1 or good(totals[-1]):
        return Plan(count)
    for k in range(count - 1, 0, -1):
        if good(totals[k - 1]) and 2 * totals[k - 1] >= totals[-1]:
            return Plan(k, split=True)
    if (options.max_delay_s > 0 and count == len(rows) and count < options.max_batch_size):
        reach = totals[-1] + max(rows[:count])
        if any(good(t) for t in range(totals[-1] + 1, reach + 1)
               if high_rows is None or t <= high_rows):
            return Plan(count, hold=True)
    return Plan(count)


class OpportunisticBatcher:
    """Batches submitted requests for `execute` (see the module docstring). Lives on one
    event loop; `execute` and `record` run on its worker thread."""

    def __init__(self, execute: Callable[[list], list], options: BatchingOptions,
                 high_rows: int | None = None, name: str = "dynvm-model",
                 inline: bool = True) -> None:
        self._execute = execute
        self.options = options
        # False: no batch runs on the loop, whatever it measured (Note [Inline fast
        # batches]).
        self._inline = inline and options.inline_run_s > 0
        self.high_rows = high_rows
        self._queue: deque[_Pending] = deque()
        self._running = False
        self._task: asyncio.Task | None = None   # the loop keeps only weak references
        self._arrived: asyncio.Event | None = None
        self._incoming = 0   # accepted by the replica, not yet submitted
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._hot: dict[int, bool] = {}
        # (rows, signature) -> the last batch's wall time; at most RUN_TIMES entries.
        self._run_seconds: dict[tuple, float] = {}
        self._lock = threading.Lock()
        self.counters = BatcherCounters()

    # ------------------------------------------------------------------ requests

    async def submit(self, item, rows: int, key: Hashable | None, nbytes: int = 0,
                     signature: Hashable = None):
        """`execute`'s result for `item`, once its batch has run; Overloaded when
        `max_queued` requests are waiting already. `signature`: with the batch's row
        count, what its call time follows from (the inputs' other dims; `key` when
        None, Note [Inline fast batches])."""
        if len(self._queue) >= self.options.max_queued:
            self.counters.rejected_overload += 1
            raise Overloaded(f"{len(self._queue)} requests are waiting for the model, the "
                             f"limit is {self.options.max_queued}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append(_Pending(item, int(rows), key, int(nbytes), future,
                                    key if signature is None else signature))
        if self._arrived is not None:
            self._arrived.set()
        if not self._running:
            self._running = True
            self._task = loop.create_task(self._drain())
        return await future

    async def _run(self, batch: list[_Pending], loop) -> list:
        """`execute`'s results for `batch`: on the loop itself when its signature last
        ran fast enough, else on the worker thread (Note [Inline fast batches])."""
        items = [p.item for p in batch]
        signature = (sum(p.rows for p in batch), batch[0].signature)
        last = self._run_seconds.get(signature) if self._inline else None
        if last is not None and last <= self.options.inline_run_s:
            results = self._timed(signature, items)
            self.counters.inline_batches += 1
            await asyncio.sleep(0)   # the loop reads what arrived meanwhile
            return results
        return await loop.run_in_executor(self._worker, self._timed, signature, items)

    def _timed(self, signature: tuple, items: list) -> list:
        start = time.perf_counter()
        try:
            return self._execute(items)
        finally:
            times = self._run_seconds
            times.pop(signature, None)   # re-inserted last: the oldest go first
            times[signature] = time.perf_counter() - start
            if len(times) > RUN_TIMES:
                del times[next(iter(times))]

    def arriving(self, change: int) -> None:
        """The replica accepted (+1) a request it will submit, or submitted or dropped
        it (-1); a batch waiting for it re-plans (module docstring)."""
        self._incoming += change
        if change < 0 and self._arrived is not None:
            self._arrived.set()

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                batch = await self._take()
                if not batch:
                    return
                try:
                    results = await self._run(batch, loop)
                except BaseException as exc:  # execute's own failure: each caller sees it
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for p, result in zip(batch, results, strict=True):
                    if not p.future.done():
                        p.future.set_result(result)
        finally:
            self._running = False
            if self._queue:  # only when cancelled mid-way: fail what is left
                while self._queue:
                    p = self._queue.popleft()
                    if not p.future.done():
                        p.future.set_exception(Overloaded("the batcher stopped"))

    def _live(self) -> list[_Pending]:
        """The queue without requests whose caller went away (cancelled futures)."""
        while self._queue and self._queue[0].future.done():
            self._queue.popleft()
        if any(p.future.done() for p in self._queue):
            self._queue = deque(p for p in self._queue if not p.future.done())
        return list(self._queue)

    async def _take(self) -> list[_Pending]:
        deadline = None
        while True:
            queue = self._live()
            if not queue:
                return []
            plan = plan_batch([p.rows for p in queue], [p.key for p in queue],
                              [p.nbytes for p in queue], self.options, self.high_rows,
                              self.is_hot)
            if (not plan.hold and self._incoming > 0 and not plan.split
                    and plan.count == len(queue) < self.options.max_batch_size
                    and self.options.max_delay_s > 0):
                plan = Plan(plan.count, hold=True)   # requests on their way: wait for them
            if plan.hold:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.options.max_delay_s
                    self.counters.held_batches += 1
                if now < deadline and await self._wait_arrival(deadline - now):
                    continue
                plan = Plan(plan.count)
            batch = [self._queue.popleft() for _ in range(plan.count)]
            counters = self.counters
            counters.batches += 1
            counters.batched_requests += len(batch)
            if len(batch) > counters.max_batch_requests:
                counters.max_batch_requests = len(batch)
            if plan.split:
                counters.split_batches += 1
            return batch

    async def _wait_arrival(self, seconds: float) -> bool:
        """True when a request arrived within `seconds`."""
        self._arrived = asyncio.Event()
        try:
            await asyncio.wait_for(self._arrived.wait(), seconds)
            return True
        except TimeoutError:
            return False
        finally:
            self._arrived = None

    # ------------------------------------------------------------------ shapes

    def record(self, rows: int, specialized: bool) -> None:
        """What a VM call with `rows` rows ran: entirely specialized or not (the worker
        thread reports it after each call; Note [Opportunistic batching])."""
        with self._lock:
            self._hot[int(rows)] = bool(specialized)
            self.counters.recorded_batches += 1
            if specialized:
                self.counters.specialized_batches += 1

    def is_hot(self, rows: int) -> bool:
        """Whether the last VM call with `rows` rows ran entirely specialized."""
        return self._hot.get(rows, False)

    def stats(self) -> dict:
        """Counters, the hot row counts and the specialized share of recorded batches."""
        counters = as_dict(self.counters)
        recorded = counters["recorded_batches"]   # from the one copy, consistent
        counters["specialized_batch_ratio"] = (
            round(counters["specialized_batches"] / recorded, 4) if recorded else None)
        counters["hot_sizes"] = sorted(r for r, hot in list(self._hot.items()) if hot)
        counters["queued"] = len(self._queue)
        return counters

    def close(self) -> None:
        """Stop the worker thread once the batch it runs (if any) ends."""
        self._worker.shutdown(wait=False)
