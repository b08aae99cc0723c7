"""A generator replica's warm-up before it reports ready: synthetic sequences through its
own scheduler until the step's shapes run specialized.

Note [Warm before ready]
~~~~~~~~~~~~~~~~~~~~~~~~
The scheduler's calls take shapes that depend on the traffic: over the packed step
(Note [One packed call per step] in dynvm._generation_kv) the tokens of a call N are the
running rows plus whatever prompt tokens the step's budget leaves, and the rows whose
logits it returns R are the running rows plus the prompts it completes; over the rows
form, the rows and the chunk's T. The JIT promotes each family once it recurs (Note
[Rent or buy]), in the background: served after a warm-up of 8 requests, the mixed
trace at 8 clients still ran 146 of 958 steps interpreted, and the compile thread
(calibration included) took the host's second core while the trace ran, which the
step's own thread then waited for (a runnable wait of 1.7-2 ms a step at the median, up
to 7 ms at p99, measured in a served replica, docs/bench_log.md, issue 33, 2026-12-05).

So a replica whose JIT compiles locally (no fleet: with one, the families come from the
store before it is ready, Note [Fleet promotion]) runs rounds of synthetic sequences
through its own scheduler first, in the shapes traffic makes: some rows at once, then
the others joining while the first decode (prompt chunks beside running rows), prompt
lengths spread up to a few step budgets, outputs of different lengths so that rows
leave one by one. Rounds take turns at how many rows start at once: half of them, one,
three. With half only, no step had one or a few running rows beside a prompt chunk, and
the first pass of traffic promoted and compiled that family (the packed step's
[5..16] tokens returning [1] row) while it ran: served, a pass with 4 compiles read
ITL p99/p50 2.99 where the passes after it, with none, read 1.66-1.94 (docs/bench_log.md,
issue 33, 15:17 UTC). It stops when a round of each kind in a row ran no region
interpreted with the JIT having nothing queued or on probation (`Runtime.settled`), or
after `SchedulerConfig.warm_seconds` (probation ends on calls, so an unsettled JIT gets
another round rather than a wait). The synthetic sequences count nowhere: the scheduler's
counters are zeroed after, and metrics are off while they run; what the warm-up did is
the replica's `warm` stat. Greedy and seeded by nothing: their tokens are not read.
"""

from __future__ import annotations

import time

from dynvm.cluster.protocol._generate import GenerationRequest


def warm_scheduler(scheduler, seconds: float) -> dict:
    """Note [Warm before ready]: rounds of synthetic sequences through `scheduler` until
    one runs specialized and the JIT settles, or `seconds`. Returns what it did: rounds,
    sequences, seconds, whether the last round ran specialized, and the JIT settled."""
    generator = scheduler.generator
    runtime = generator.step if generator.step is not None else generator.decode
    jit = getattr(runtime, "jit", None)
    if seconds <= 0 or jit is None or not jit.compiles_locally() or \
            scheduler.config.max_waiting < 1:
        return {"rounds": 0, "sequences": 0, "seconds": 0.0, "specialized": False,
                "settled": runtime.settled() if runtime is not None else True}
    started = time.monotonic()
    deadline = started + seconds
    metrics, scheduler.metrics = scheduler.metrics, None
    rounds = sequences = clean = 0
    specialized = False
    try:
        while time.monotonic() < deadline:
            before = runtime.region_calls()[1]
            sequences += _round(scheduler, rounds, deadline)
            rounds += 1
            specialized = runtime.region_calls()[1] == before
            # Probation ends on calls, so an unsettled JIT gets another round, not a wait;
            # done once a round of each kind (Note [Warm before ready]) ran specialized.
            clean = clean + 1 if specialized and runtime.settled() else 0
            if clean >= len(_FIRST_GROUPS):
                break
    finally:
        scheduler.metrics = metrics
        scheduler.wait_idle(max(1.0, deadline - time.monotonic()))
        for key in scheduler.counters:
            scheduler.counters[key] = 0
    return {"rounds": rounds, "sequences": sequences,
            "seconds": round(time.monotonic() - started, 3), "specialized": specialized,
            "settled": runtime.settled()}


def _round(scheduler, index: int, deadline: float) -> int:
    """One round: some of the rows (_FIRST_GROUPS), then the others joining while they
    decode."""
    rows = max(1, min(scheduler.max_sequences, scheduler.config.max_waiting))
    config = scheduler.config
    longest_prompt = max(1, min(scheduler.max_prompt_tokens,
                                4 * max(config.step_token_budget, config.min_prompt_tokens)))
    requests = []
    for i in range(rows):
        prompt = 1 + (7 * i + 5 * index) % longest_prompt
        new = max(1, min(4 + (5 * i + 3 * index) % 29, scheduler.max_length - prompt))
        requests.append(GenerationRequest(tuple(3 + (t % 5) for t in range(prompt)), new,
                                          stop_token_ids=()))
    first = _FIRST_GROUPS[index % len(_FIRST_GROUPS)](rows)
    for request in requests[:first]:
        scheduler.submit(request, _ignore)
    _wait(lambda: not scheduler.occupancy()["prompting"] and
          not scheduler.occupancy()["waiting"], deadline)
    for request in requests[first:]:
        scheduler.submit(request, _ignore)
    scheduler.wait_idle(max(0.0, deadline - time.monotonic()))
    return rows


# How many of a round's rows start at once (the rest join while they decode): half of
# them, one, three: a step's rows returned R (the running rows plus the prompts it
# completes) then falls in each of the JIT's buckets beside prompt chunks, as traffic
# makes them (Note [Warm before ready]).
_FIRST_GROUPS = ((lambda rows: (rows + 1) // 2), (lambda rows: 1),
                 (lambda rows: min(3, rows)))


def _wait(condition, deadline: float) -> bool:
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _ignore(event) -> None:
    """The synthetic sequences' sink: their events are not read."""
