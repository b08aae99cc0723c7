"""The opportunistic batcher (dynvm.cluster.serving._batcher) under real asyncio concurrency, in
process: a worker thread that blocks on an event stands for a busy model."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dynvm.cluster.serving import _batcher as batcher_module
from dynvm.cluster.serving._batcher import OpportunisticBatcher, Overloaded, plan_batch
from dynvm.cluster.serving.serving_config import BatchingOptions
from dynvm.vm.errors import DynvmError


class Model:
    """execute(): each item's answer is ("out", item); batches are logged; `gate`
    (a threading.Event) blocks the worker until set, so tests decide when it is busy."""

    def __init__(self, fail_on=None) -> None:
        self.batches: list[list] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail_on = fail_on

    def __call__(self, items: list) -> list:
        self.batches.append(list(items))
        self.started.set()
        self.gate.wait(10)
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError("model failed")
        return [("out", item) for item in items]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _started(model: Model) -> None:
    while not model.started.is_set():
        await asyncio.sleep(0.001)


def test_lone_request_runs_at_once_not_after_the_delay():
    model = Model()
    batcher = OpportunisticBatcher(model, BatchingOptions(max_delay_s=1.0,
                                                          preferred_sizes=(4,)))

    async def main():
        start = time.monotonic()
        result = await batcher.submit("a", rows=1, key="k")
        return result, time.monotonic() - start

    result, seconds = run(main())
    assert result == ("out", "a")
    assert model.batches == [["a"]]
    assert batcher.counters.held_batches == 0
    assert seconds < 0.5  # the hold (1 s) was never waited out; margin for a loaded host


def test_requests_arriving_while_busy_form_the_next_batch_in_order():
    model = Model()
    batcher = OpportunisticBatcher(model, BatchingOptions(max_delay_s=0))

    async def main():
        model.gate.clear()
        first = asyncio.ensure_future(batcher.submit(0, rows=1, key="k"))
        await _started(model)
        rest = [asyncio.ensure_future(batcher.submit(i, rows=1, key="k"))
                for i in range(1, 6)]
        await asyncio.sleep(0.01)
        model.gate.set()
        return await asyncio.gather(first, *rest)

    results = run(main())
    assert results == [("out", i) for i in range(6)]
    assert model.batches == [[0], [1, 2, 3, 4, 5]]


def test_many_clients_get_their_own_outputs_in_their_order():
    model = Model()
    batcher = OpportunisticBatcher(model, BatchingOptions(max_batch_size=4, max_delay_s=0))
    finished: dict[int, list[int]] = {c: [] for c in range(8)}

    async def client(c: int) -> None:
        # Each client pipelines its requests (all in flight at once): its answers
        # must still come back in the order it sent them.
        async def one(k: int):
            result = await batcher.submit((c, k), rows=1 + (c + k) % 3, key="k")
            assert result == ("out", (c, k))
            finished[c].append(k)

        tasks = []
        for k in range(6):
            tasks.append(asyncio.ensure_future(one(k)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)

    async def main():
        await asyncio.gather(*(client(c) for c in range(8)))

    run(main())
    assert all(order == list(range(6)) for order in finished.values()), finished
    flat = [item for batch in model.batches for item in batch]
    assert sorted(flat) == sorted((c, k) for c in range(8) for k in range(6))
    assert max(len(b) for b in model.batches) <= 4
    assert any(len(b) > 1 for b in model.batches)


def test_batches_keep_to_keys_bytes_and_rows():
    options = BatchingOptions(max_batch_size=8, max_batch_bytes=100, max_delay_s=0)
    never = lambda rows: False  # noqa: E731
    # A different shape key ends the batch (requests stay in arrival order).
    assert plan_batch([1, 1, 1], ["a", "a", "b"], [1, 1, 1], options, None, never).count == 2
    # No key: never batched with another.
    assert plan_batch([1, 1], [None, None], [1, 1], options, None, never).count == 1
    # Bytes and the declared row bound.
    assert plan_batch([1, 1, 1], ["a"] * 3, [60, 30, 30], options, None, never).count == 2
    assert plan_batch([3, 3, 3], ["a"] * 3, [1] * 3, options, 7, never).count == 2
    assert plan_batch([1] * 12, ["a"] * 12, [1] * 12, options, None, never).count == 8


def test_shape_aware_plans_split_and_hold():
    options = BatchingOptions(max_batch_size=8, max_delay_s=0.01)
    hot = {4, 6}.__contains__
    # 2+2+1 = 5 rows is cold; 4 rows (the first two requests) is hot: split there.
    plan = plan_batch([2, 2, 1], ["a"] * 3, [1] * 3, options, None, hot)
    assert (plan.count, plan.split, plan.hold) == (2, True, False)
    # 2+3 = 5 cold, no hot prefix, one more request of 3 rows could reach 6: hold.
    plan = plan_batch([2, 3], ["a"] * 2, [1] * 2, options, None, hot)
    assert plan.hold and plan.count == 2
    # A lone request is never held, however close a hot size is.
    assert not plan_batch([3], ["a"], [1], options, None, hot).hold
    # Without shape awareness only the preferred sizes count.
    blind = BatchingOptions(max_batch_size=8, max_delay_s=0.01, shape_aware=False)
    assert plan_batch([2, 2, 1], ["a"] * 3, [1] * 3, blind, None, hot).count == 3
    preferring = BatchingOptions(max_delay_s=0.01, shape_aware=False, preferred_sizes=(4,))
    assert plan_batch([2, 2, 1], ["a"] * 3, [1] * 3, preferring, None, hot).count == 2
    # A hot prefix with less than half the rows is not worth a split.
    assert plan_batch([1, 4, 4], ["a"] * 3, [1] * 3, options, None, {1}.__contains__
                      ).count == 3


def test_held_batch_runs_after_the_delay_or_when_the_request_comes():
    model = Model()
    options = BatchingOptions(max_delay_s=0.2, preferred_sizes=(3,))
    batcher = OpportunisticBatcher(model, options)

    async def main():
        model.gate.clear()
        first = asyncio.ensure_future(batcher.submit("x", rows=1, key="k"))
        await _started(model)
        two = [asyncio.ensure_future(batcher.submit(i, rows=1, key="k")) for i in (1, 2)]
        await asyncio.sleep(0.01)
        model.started.clear()
        model.gate.set()          # [1, 2] is 2 rows, 3 is preferred: held
        await asyncio.sleep(0.02)
        third = asyncio.ensure_future(batcher.submit(3, rows=1, key="k"))
        await asyncio.gather(first, third, *two)

    run(main())
    assert model.batches == [["x"], [1, 2, 3]]
    assert batcher.counters.held_batches == 1


def test_overload_is_refused_not_queued():
    model = Model()
    batcher = OpportunisticBatcher(model, BatchingOptions(max_queued=2, max_delay_s=0))

    async def main():
        model.gate.clear()
        first = asyncio.ensure_future(batcher.submit(0, rows=1, key="k"))
        await _started(model)
        queued = [asyncio.ensure_future(batcher.submit(i, rows=1, key="k")) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            await batcher.submit(3, rows=1, key="k")
        model.gate.set()
        return refused.value, await asyncio.gather(first, *queued)

    error, results = run(main())
    assert isinstance(error, DynvmError)
    assert results == [("out", 0), ("out", 1), ("out", 2)]
    assert batcher.counters.rejected_overload == 1


def test_cancelled_request_is_dropped_and_failures_reach_each_caller():
    model = Model(fail_on="bad")
    batcher = OpportunisticBatcher(model, BatchingOptions(max_delay_s=0))

    async def main():
        model.gate.clear()
        first = asyncio.ensure_future(batcher.submit(0, rows=1, key="k"))
        await _started(model)
        gone = asyncio.ensure_future(batcher.submit("gone", rows=1, key="k"))
        bad = [asyncio.ensure_future(batcher.submit(x, rows=1, key="k"))
               for x in ("bad", "other")]
        await asyncio.sleep(0)
        gone.cancel()
        model.gate.set()
        await first
        return await asyncio.gather(*bad, return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, RuntimeError) for r in results)
    assert model.batches == [[0], ["bad", "other"]]


def test_record_reports_the_specialized_share():
    batcher = OpportunisticBatcher(Model(), BatchingOptions())
    batcher.record(4, True)
    batcher.record(5, False)
    batcher.record(4, True)
    stats = batcher.stats()
    assert stats["specialized_batch_ratio"] == round(2 / 3, 4)
    assert stats["hot_sizes"] == [4]
    assert batcher.is_hot(4) and not batcher.is_hot(5)
    batcher.close()


@pytest.mark.parametrize("bad", [{"max_batch_size": 0}, {"max_delay_s": -1},
                                 {"max_delay_s": float("nan")}, {"preferred_sizes": (0,)},
                                 {"max_queued": 1.5}, {"inline_run_s": -0.001},
                                 {"inline_run_s": 1.0}])
def test_options_are_checked(bad):
    with pytest.raises(ValueError):
        BatchingOptions(**bad)


def test_next_batch_waits_for_requests_on_their_way_only():
    model = Model()
    batcher = OpportunisticBatcher(model, BatchingOptions(max_delay_s=0.5))

    async def main():
        model.gate.clear()
        first = asyncio.ensure_future(batcher.submit(0, rows=1, key="k"))
        await _started(model)
        second = asyncio.ensure_future(batcher.submit(1, rows=1, key="k"))
        batcher.arriving(1)      # a third is being parsed
        batcher.arriving(1)      # and a fourth, which will turn out malformed
        await asyncio.sleep(0.01)
        model.gate.set()
        await first
        await asyncio.sleep(0.02)
        assert model.batches == [[0]]   # [1] waits for the requests on their way
        batcher.arriving(-1)
        third = asyncio.ensure_future(batcher.submit(2, rows=1, key="k"))
        await asyncio.sleep(0.02)
        assert model.batches == [[0]]   # still one on its way
        start = time.monotonic()
        batcher.arriving(-1)             # dropped (a 400): the batch runs now
        await asyncio.gather(second, third)
        return time.monotonic() - start

    seconds = run(main())
    assert model.batches == [[0], [1, 2]]
    assert seconds < 0.4  # released by the drop, not by the 0.5 s bound


def test_fast_row_counts_run_on_the_loop_slow_and_new_ones_on_the_worker():
    threads: list[tuple[int, str]] = []

    def execute(items: list) -> list:
        threads.append((len(items), threading.current_thread().name))
        if "slow" in items:
            time.sleep(0.02)   # past inline_run_s: stays on the worker
        return [("out", item) for item in items]

    async def main(batcher, sequence):
        return [await batcher.submit(item, rows=rows, key="k") for item, rows in sequence]

    batcher = OpportunisticBatcher(execute, BatchingOptions(inline_run_s=0.005),
                                   name="model-worker")
    sequence = [("a", 1), ("b", 1), ("slow", 2), ("slow", 2), ("c", 3)]
    assert run(main(batcher, sequence)) == [("out", item) for item, _ in sequence]
    loop_thread = threading.current_thread().name   # asyncio.run's loop: this thread
    where = [name for _, name in threads]
    # Row count 1: first timed on the worker, then fast enough for the loop; 2: too slow
    # both times; 3: never seen, so the worker.
    assert where[0].startswith("model-worker") and where[1] == loop_thread
    assert all(name.startswith("model-worker") for name in where[2:])
    assert batcher.counters.inline_batches == 1
    batcher.close()

    threads.clear()
    never = OpportunisticBatcher(execute, BatchingOptions(inline_run_s=0), name="worker")
    run(main(never, [("a", 1)] * 3))
    assert all(name.startswith("worker") for _, name in threads)
    assert never.counters.inline_batches == 0
    never.close()


def _where_batches_ran(batcher, sequence) -> list[str]:
    """The thread each (item, rows, signature) of `sequence` ran on, in order."""
    threads: list[str] = []
    batcher._execute = lambda items: (threads.append(threading.current_thread().name)
                                      or [("out", item) for item in items])

    async def main():
        for item, rows, signature in sequence:
            await batcher.submit(item, rows=rows, key="k", signature=signature)

    run(main())
    return threads


def test_a_signature_that_ran_fast_does_not_vouch_for_another_of_the_same_rows():
    # Rows alone do not say how long a call takes: [2, 8] and [2, 512] inputs have the
    # same row count (Note [Inline fast batches]).
    batcher = OpportunisticBatcher(None, BatchingOptions(inline_run_s=0.05), name="worker")
    loop_thread = threading.current_thread().name
    where = _where_batches_ran(batcher, [("a", 2, (8,)), ("b", 2, (8,)), ("c", 2, (512,)),
                                         ("d", 2, (512,))])
    assert where[0].startswith("worker") and where[1] == loop_thread
    assert where[2].startswith("worker") and where[3] == loop_thread
    batcher.close()


def test_a_program_whose_data_decides_its_time_never_runs_on_the_loop():
    batcher = OpportunisticBatcher(None, BatchingOptions(inline_run_s=0.05), name="worker",
                                   inline=False)
    where = _where_batches_ran(batcher, [("a", 1, None)] * 4)
    assert all(name.startswith("worker") for name in where), where
    assert batcher.counters.inline_batches == 0
    batcher.close()


def test_run_times_are_bounded(monkeypatch):
    monkeypatch.setattr(batcher_module, "RUN_TIMES", 3)
    batcher = OpportunisticBatcher(None, BatchingOptions(inline_run_s=0.05), name="worker")
    _where_batches_ran(batcher, [(i, 1, (i,)) for i in range(10)])
    assert list(batcher._run_seconds) == [(1, (7,)), (1, (8,)), (1, (9,))]
    batcher.close()
