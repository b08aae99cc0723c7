"""How a generator replica's scheduler hands tokens over and warms up, on the tiny
Llama-style generator's step over the KV state (the export the other generation serving
tests share, in the default packed form; the rows form's steps hand over the same way):
a sequence submitted with its event loop gets a step's events in one hop on that loop
(Note [One hop per step]), a closed loop cancels its sequences, and the warm-up before
ready (Note [Warm before ready]) leaves nothing held or counted behind it."""

from __future__ import annotations

import asyncio
import threading

import pytest

import dynvm
from dynvm.cluster.serving._generate_scheduler import (
    GenerateScheduler,
    GenerationRequest,
    SchedulerConfig,
)
from dynvm.cluster.serving._generate_warm import warm_scheduler
from tests.cluster._generate_helpers import reference, tiny_programs


class LoopSink:
    """A sequence's sink on a loop: its tokens, its end, and the threads it ran on."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.end = None
        self.threads: set[int] = set()
        self.ended = threading.Event()

    def __call__(self, event) -> None:
        self.threads.add(threading.get_ident())
        if event[0] == "token":
            self.tokens.append(event[1])
        else:
            self.end = event
            self.ended.set()


@pytest.fixture(scope="module")
def step_programs():
    return tiny_programs()


@pytest.fixture()
def loop():
    """An asyncio loop running on a thread of its own; its call_soon_threadsafe counted."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    calls = []
    plain = loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):
        calls.append(callback)
        return plain(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted
    loop.hops = calls
    yield loop, thread
    plain(loop.stop)
    thread.join(10)
    loop.close()


def test_a_steps_events_reach_their_loop_in_one_hop(step_programs, loop):
    """Four sequences decoding together, submitted with a loop: every event runs on the
    loop's thread, tokens equal `Generator.generate`'s, each ends once, and the loop is
    woken once per step at most (fewer hops than events)."""
    loop, thread = loop
    requests = [GenerationRequest((5 + i, 9, 11 + i), 6 + 2 * i, stop_token_ids=())
                for i in range(4)]
    with dynvm.Generator(step_programs, jit=False, compile_ahead=False) as generator:
        scheduler = GenerateScheduler(generator, SchedulerConfig(max_sequences=4))
        try:
            sinks = [LoopSink() for _ in requests]
            for request, sink in zip(requests, sinks):
                scheduler.submit(request, sink, loop=loop)
            for sink in sinks:
                assert sink.ended.wait(30), "a sequence never ended"
            assert scheduler.wait_idle(10)
            counters = dict(scheduler.counters)
        finally:
            scheduler.close()
    for request, sink in zip(requests, sinks):
        assert sink.tokens == reference(request.prompt, request.max_tokens, None, ())
        assert sink.end == ("end", "length")
        assert sink.threads == {thread.ident}
    events = sum(len(sink.tokens) + 1 for sink in sinks)
    steps = counters["decode_steps"] + counters["prefill_calls"]
    assert len(loop.hops) <= steps + 1 and len(loop.hops) < events, (len(loop.hops), steps,
                                                                      events)
    assert counters["admitted"] == counters["freed"] == 4 and not scheduler.held


def test_a_closed_loop_cancels_its_sequences(step_programs):
    """A sequence whose loop has closed (its client went away with it) is cancelled at
    the step after its events could not be handed over, and its slot is freed."""
    closed = asyncio.new_event_loop()
    closed.close()
    with dynvm.Generator(step_programs, jit=False, compile_ahead=False) as generator:
        scheduler = GenerateScheduler(generator, SchedulerConfig(max_sequences=2))
        try:
            seq = scheduler.submit(GenerationRequest((5, 6, 7), 40, stop_token_ids=()),
                                   LoopSink(), loop=closed)
            assert scheduler.wait_idle(30)
            assert seq.finish_reason == "cancelled" and len(seq.tokens) < 40
            assert scheduler.counters["cancelled"] == scheduler.counters["freed"] == 1
            assert not scheduler.held and generator.state is not None
            assert scheduler.occupancy()["reserved_tokens"] == 0
        finally:
            scheduler.close()


def test_warm_up_leaves_nothing_held_or_counted(step_programs):
    """The warm-up runs synthetic sequences through the scheduler (JIT on), then its
    counters are zero, no slot or reservation is held, and a request after it gets
    `Generator.generate`'s tokens; without the JIT there is nothing to warm."""
    with dynvm.Generator(step_programs, jit=False, compile_ahead=False) as generator:
        scheduler = GenerateScheduler(generator, SchedulerConfig(max_sequences=4))
        try:
            assert warm_scheduler(scheduler, 5.0)["rounds"] == 0
        finally:
            scheduler.close()
    with dynvm.Generator(step_programs, compile_ahead=False) as generator:
        scheduler = GenerateScheduler(generator, SchedulerConfig(
            max_sequences=4, step_token_budget=8, min_prompt_tokens=4))
        try:
            warm = warm_scheduler(scheduler, 6.0)
            assert warm["plateaus"] == [1, 2, 4], warm   # Note [Decode plateaus before ready]
            assert warm["rounds"] >= 1 and warm["sequences"] >= 4 * warm["rounds"] // 2, warm
            assert all(value == 0 for value in scheduler.counters.values())
            assert not scheduler.held and scheduler.occupancy()["reserved_tokens"] == 0
            assert scheduler.occupancy()["cache_rows"] == 0
            sink = LoopSink()
            scheduler.submit(GenerationRequest((9, 10, 11, 12), 8, stop_token_ids=()), sink)
            assert sink.ended.wait(30)
            assert sink.tokens == reference((9, 10, 11, 12), 8, None, ())
            assert scheduler.counters["admitted"] == scheduler.counters["freed"] == 1
        finally:
            scheduler.close()
