"""The generator replica's continuous batching (dynvm.cluster.serving._generate_scheduler) on the
tiny Llama-style generator: tokens equal to `Generator.generate` while sequences join
and leave between steps, admission (waiting, 503), cancellation and time budgets, and
every sequence's cache freed at the end."""

from __future__ import annotations

import threading

import pytest
import torch

import dynvm
from dynvm.cluster.serving._generate_scheduler import (
    GenerateBusy,
    GenerateScheduler,
    GenerateTimeout,
    GenerationRequest,
    SchedulerConfig,
)
from dynvm.vm.errors import InputError
from tests.cluster._generate_helpers import reference, tiny_programs


class Collector:
    """A sink per sequence: its tokens, how it ended, and a latch on the end."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.end = None
        self.ended = threading.Event()
        self.first = threading.Event()

    def __call__(self, event) -> None:
        if event[0] == "token":
            self.tokens.append(event[1])
            self.first.set()
        else:
            self.end = event
            self.ended.set()


@pytest.fixture(scope="module", params=["plain", "slots", "packed"])
def generator(request):
    """The decode step over plain caches (joins and leaves copy them), the step over
    the KV state in its rows form (a slot per sequence, Note [Slots instead of copies],
    prompts written in chunks, Note [Prompt chunks between decode steps]), or in its
    packed form, the default (decode rows and prompt chunks in one call a step, Note
    [One packed call per step])."""
    from tests.generation._tiny import tiny_rows_programs

    programs = tiny_rows_programs() if request.param == "slots" else tiny_programs()
    with dynvm.Generator(programs, jit=False, compile_ahead=False,
                         kv_state=request.param != "plain") as gen:
        yield gen


def _requests(count: int, seed: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(3, 128, (int(torch.randint(1, 20, (1,), generator=gen)),),
                               generator=gen).tolist()
        sampling = None if i % 2 else dynvm.Sampling(temperature=1.3, top_k=20, top_p=0.9,
                                                     seed=100 + i)
        out.append(GenerationRequest(tuple(prompt), int(torch.randint(2, 24, (1,),
                                                                      generator=gen)),
                                     sampling, stop_token_ids=()))
    return out


def test_joins_and_leaves_give_generate_tokens_and_free_every_sequence(generator):
    """Ten sequences with different prompts, lengths and sampling, arriving while others
    decode, three rows at most and a cache too small for all: each one's tokens are
    `Generator.generate`'s for its prompt and seed; at the end nothing is held."""
    requests = _requests(10, seed=1)
    scheduler = GenerateScheduler(generator, SchedulerConfig(
        max_sequences=3, cache_tokens=100, prefill_length_multiple=8))
    try:
        sinks = []
        for i, request in enumerate(requests):
            sinks.append(Collector())
            scheduler.submit(request, sinks[-1])
            if i % 3 == 0:  # the next ones arrive while this one decodes
                sinks[-1].first.wait(10)
        for sink in sinks:
            assert sink.ended.wait(30), "a sequence never ended"
        assert scheduler.wait_idle(10)
        for request, sink in zip(requests, sinks):
            expected = reference(request.prompt, request.max_tokens, request.sampling, ())
            assert sink.tokens == expected, (request, sink.tokens, expected)
            assert sink.end == ("end", "length")
        counters, occupancy = scheduler.counters, scheduler.occupancy()
        assert counters["admitted"] == counters["freed"] == counters["finished"] == 10
        assert not scheduler.held and occupancy["reserved_tokens"] == 0
        assert occupancy["cache_rows"] == 0 and occupancy["running"] == 0
        if occupancy["cache"] == "plain":
            assert counters["copies"] > 0 and counters["copy_bytes"] > 0  # joins copied
        else:
            assert counters["copies"] == 0 and generator.state is not None
        assert counters["prefill_calls"] < 10 or counters["decode_steps"] > 0
    finally:
        scheduler.close()


def test_waiting_room_full_is_busy_and_cancel_frees_at_the_next_step(generator):
    scheduler = GenerateScheduler(generator, SchedulerConfig(max_sequences=1, max_waiting=1))
    try:
        long = GenerationRequest((5, 6, 7), max_tokens=60, stop_token_ids=())
        first, second = Collector(), Collector()
        running = scheduler.submit(long, first)
        assert first.first.wait(10)
        waiting = scheduler.submit(GenerationRequest((9,), max_tokens=3, stop_token_ids=()),
                                   second)
        with pytest.raises(GenerateBusy, match="waiting"):
            scheduler.submit(GenerationRequest((9,), max_tokens=3), Collector())
        waiting.cancel()  # freed while the first still runs
        assert second.ended.wait(10) and second.end == ("end", "cancelled")
        assert not second.tokens and not first.ended.is_set()
        third = Collector()
        scheduler.submit(GenerationRequest((9,), max_tokens=3, stop_token_ids=()), third)
        running.cancel()
        assert first.ended.wait(10) and first.end == ("end", "cancelled")
        assert len(first.tokens) < 60
        assert third.ended.wait(10) and third.end == ("end", "length")
        assert third.tokens == reference((9,), 3, None, ())
        assert scheduler.wait_idle(10)
        counters = scheduler.counters
        assert counters["rejected"] == 1 and counters["cancelled"] == 2
        assert counters["admitted"] == counters["freed"] == 3 and not scheduler.held
    finally:
        scheduler.close()


def test_requests_that_can_never_run_are_refused(generator):
    scheduler = GenerateScheduler(generator, SchedulerConfig(max_prompt_tokens=16,
                                                             max_tokens=32))
    try:
        for request, match in (
                (GenerationRequest(tuple(range(3, 20)), 4), "prompt: expected 1..16"),
                (GenerationRequest((), 4), "prompt"),
                (GenerationRequest((5,), 33), "max_tokens: expected 1..32"),
                (GenerationRequest((5, 200), 4), r"token ids must be in 0\.\.127"),
                (GenerationRequest(tuple(range(3, 19)), 32), None)):
            if match is None:  # 16 + 32 <= 64 fits
                scheduler.submit(request, Collector())
                continue
            with pytest.raises(InputError, match=match):
                scheduler.submit(request, Collector())
        assert scheduler.wait_idle(10) and not scheduler.held
    finally:
        scheduler.close()


def test_a_sequence_past_its_time_budget_ends_in_an_error(generator):
    scheduler = GenerateScheduler(generator, SchedulerConfig(request_seconds=0.001))
    try:
        sink = Collector()
        scheduler.submit(GenerationRequest((5,), max_tokens=62, stop_token_ids=()), sink)
        assert sink.ended.wait(10)
        assert sink.end[0] == "error" and isinstance(sink.end[1], GenerateTimeout)
        assert scheduler.wait_idle(10) and not scheduler.held
        assert scheduler.counters["timeouts"] == 1
    finally:
        scheduler.close()


def test_a_long_prompt_is_written_in_chunks_between_decode_steps(generator):
    """Note [Prompt chunks between decode steps]: with a budget of 8 tokens a step, a
    40-token prompt arriving while another sequence decodes is written 7 tokens a step
    (the budget less the running row), and the running sequence gets a token in every
    one of those steps instead of waiting for the whole prompt; both get
    `Generator.generate`'s tokens. Over plain caches the prompt is prefilled whole."""
    scheduler = GenerateScheduler(generator, SchedulerConfig(
        step_token_budget=8, min_prompt_tokens=4))
    try:
        log: list[str] = []

        class Logged(Collector):
            def __init__(self, name):
                super().__init__()
                self.name = name

            def __call__(self, event):
                log.append(self.name)
                super().__call__(event)

        running, long = Logged("running"), Logged("long")
        first = GenerationRequest((5, 6, 7), max_tokens=40, stop_token_ids=())
        prompt = tuple(int(t) for t in torch.randint(
            3, 128, (40,), generator=torch.Generator().manual_seed(3)))
        second = GenerationRequest(prompt, max_tokens=4, stop_token_ids=())
        scheduler.submit(first, running)
        assert running.first.wait(10)
        scheduler.submit(second, long)
        assert running.ended.wait(30) and long.ended.wait(30)
        assert scheduler.wait_idle(10) and not scheduler.held
        assert running.tokens == reference(first.prompt, 40, None, ())
        assert long.tokens == reference(prompt, 4, None, ())
        before_first = log[log.index("running"):log.index("long")].count("running")
        if scheduler.occupancy()["cache"] == "slots":
            # ceil(40 / 7) = 6 prompt calls: 5 steps' tokens of the running one before.
            assert scheduler.counters["prefill_calls"] == 1 + 6
            assert before_first >= 6, log
        else:
            assert scheduler.counters["prefill_calls"] == 2
    finally:
        scheduler.close()
