"""Pure decode steps one row short of a plateau row count run that count with a dummy row
(Note [Decode rows padded to a plateau] in dynvm.cluster.serving._generate_warm): the
rows table, tokens still `Generator.generate`'s, every slot freed; and the warm-up of a
replica whose max_tokens is under its rounds' lengths."""

from __future__ import annotations

import pytest

import dynvm
from dynvm.cluster.serving._generate_scheduler import (
    GenerateScheduler,
    GenerationRequest,
    SchedulerConfig,
)
from dynvm.cluster.serving._generate_warm import padded_rows, plateau_counts, warm_scheduler
from tests.cluster._generate_helpers import reference, tiny_programs
from tests.cluster.test_generate_scheduler import Collector, _requests


@pytest.fixture(scope="module")
def jit_generator():
    """The tiny generator's packed step with the JIT (padding needs one: without it no
    exact kernel waits at the plateau counts, and nothing is padded)."""
    with dynvm.Generator(tiny_programs(), compile_ahead=False) as gen:
        yield gen


def test_rows_padded_one_short_of_a_plateau():
    config = SchedulerConfig(max_sequences=16)
    assert plateau_counts(16, config) == [1, 2, 4, 8, 16]
    assert plateau_counts(12, config) == [1, 2, 4, 8]
    assert plateau_counts(16, SchedulerConfig(max_waiting=5)) == [1, 2, 4]
    table = padded_rows(16, config)
    assert [table[n] for n in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16)] == \
        [0, 1, 2, 4, 4, 5, 6, 8, 8, 9, 16, 16]
    assert padded_rows(16, SchedulerConfig(decode_pad_rows=0)) == list(range(17))
    wide = padded_rows(16, SchedulerConfig(decode_pad_rows=3))
    assert [wide[n] for n in (5, 6, 7, 9, 12, 13)] == [8, 8, 8, 9, 12, 16]
    assert padded_rows(12, config)[11] == 11   # no plateau at 12: nothing to pad to


@pytest.mark.parametrize("pad", [1, 0])
def test_padded_steps_give_generate_tokens_and_free_every_slot(jit_generator, pad):
    """Ten sequences (greedy and sampled) through 4 rows, joining and leaving: with
    padding some pure decode steps of 3 rows ran as 4, and every sequence's tokens are
    still `Generator.generate`'s; nothing is held after; without padding none ran so."""
    requests = _requests(10, seed=3)
    scheduler = GenerateScheduler(jit_generator, SchedulerConfig(
        max_sequences=4, decode_pad_rows=pad))
    try:
        sinks = []
        for i, request in enumerate(requests):
            sinks.append(Collector())
            scheduler.submit(request, sinks[-1])
            if i % 3 == 0:
                sinks[-1].first.wait(10)
        for sink in sinks:
            assert sink.ended.wait(60), "a sequence never ended"
        assert scheduler.wait_idle(10)
        for request, sink in zip(requests, sinks):
            expected = reference(request.prompt, request.max_tokens, request.sampling, ())
            assert sink.tokens == expected, (request, sink.tokens, expected)
        slots = scheduler._slots
        assert (slots.padded > 0) == (pad > 0), slots.padded
        assert len(slots) == 0 and slots.used_tokens() == 0 and not scheduler.held
        assert scheduler.counters["freed"] == 10
    finally:
        scheduler.close()


def test_warm_up_within_a_small_max_tokens(jit_generator):
    """A replica that accepts at most 6 new tokens warms up (its rounds and plateaus ask
    no more of its own scheduler than that), and serves after."""
    scheduler = GenerateScheduler(jit_generator, SchedulerConfig(max_sequences=4,
                                                                 max_tokens=6))
    try:
        warm = warm_scheduler(scheduler, 3.0)
        assert warm["rounds"] >= 1 and warm["plateaus"], warm
        sink = Collector()
        scheduler.submit(GenerationRequest((9, 10, 11), 6, stop_token_ids=()), sink)
        assert sink.ended.wait(30)
        assert sink.tokens == reference((9, 10, 11), 6, None, ())
    finally:
        scheduler.close()
