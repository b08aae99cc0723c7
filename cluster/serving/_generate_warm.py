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

Note [Decode plateaus before ready]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The rounds above make every family the traffic makes, but not the exact kernels (tier 2,
Note [Tiering] in dynvm.jit.region_jit): those are promoted when one signature keeps
hitting its family kernel, and in the rounds rows leave one by one, so no row count
lasts. Traffic does make one last: 8 clients keep 8 rows decoding together for most of
a trace, and every first pass of the mixed trace served after the rounds promoted and
compiled the exact kernel of the 8-row pure decode while it ran (2 compiles in each of
the 2026-12-05 first passes, where the later passes had none; that pass's ITL p99 7.51
ms against 5.53 in the next, in process; docs/bench_log.md, issue 33, 17:14-18:40).

So before the rounds, the warm-up holds plateaus: for each power of two up to the rows
a step can run (1, 2, 4, 8, 16, ...), that many sequences with one-token prompts and
the same output length start together and decode together for `PLATEAU_STEPS` steps,
long enough for the tier check (every 32 family hits) to see one signature recur. The
row counts are powers of two, as a GPU server captures its graphs at batch sizes 1, 2,
4, 8, ...: a replica cannot know how many clients will come, and a count between two
plateaus still runs its family kernel. Measured (the bench's model, in process,
/tmp/h33/warmgap.py, 2026-12-05 19:05): the warm-up took 5.9 s (17 rounds after the
plateaus 1-16), and the first pass compiled one exact kernel where it had compiled two:
the 7-row pure decode (one of 8 clients between requests) is still made by traffic.
Served (`bench.serve_generate`, 19:02, load 1.3-1.6): 1 compile in the first pass, ITL
p99/p50 2.15 there and 1.70 / 1.68 in the next two.

Note [Decode rows padded to a plateau]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The plateaus make exact kernels at powers of two only; the region's 16 specializations
cannot hold one per row count. With 8 clients the commonest row count after 8 is 7 (one
client between requests), and its pure decode ran the family kernel until traffic made
it hot and promoted its exact kernel: the one compile left in the first pass, with two
steps of 12 and 27 ms beside it (compile and probation on the other thread), where the
pass's step p50 was 4.3 ms. In the scheduler the 7-row step on the family kernel took
4.71 ms of CPU (p50) against 3.81 for the 8-row step on its exact kernel (in process,
/tmp/h33b/probe.py, 2026-12-05 20:24, load 2-5). So a pure decode step one row short of
a plateau count runs that count (`SchedulerConfig.decode_pad_rows`): a dummy row in a
free slot (`SlotCache._padded`), whose logits are dropped, makes the 7-row step the
8-row exact kernel's call. A row further (5 or 6 to 8) is not padded by default: the
kernel alone at 5-6 rows on the family took 2.58-2.67 ms against 2.94 at 8 (interleaved,
/tmp/h33b/rows.py). The dummy reaches the other rows only through the call's row count
(attention reads each row's own slot), as any other row does; nothing it writes is
read: the next sequence in that slot writes its prompt over position 0.
"""

from __future__ import annotations

import time

from dynvm.cluster.protocol._generate import GenerationRequest


def warm_scheduler(scheduler, seconds: float) -> dict:
    """Note [Warm before ready]: the decode plateaus (Note [Decode plateaus before
    ready]), then rounds of synthetic sequences through `scheduler` until one runs
    specialized and the JIT settles, or `seconds`. Returns what it did: rounds, the
    plateaus' row counts, sequences, seconds, whether the last round ran specialized,
    and the JIT settled."""
    generator = scheduler.generator
    runtime = generator.step if generator.step is not None else generator.decode
    jit = getattr(runtime, "jit", None)
    if seconds <= 0 or jit is None or not jit.compiles_locally() or \
            scheduler.config.max_waiting < 1:
        return {"rounds": 0, "plateaus": [], "sequences": 0, "seconds": 0.0,
                "specialized": False,
                "settled": runtime.settled() if runtime is not None else True}
    started = time.monotonic()
    deadline = started + seconds
    metrics, scheduler.metrics = scheduler.metrics, None
    rounds = sequences = clean = 0
    specialized = False
    plateaus: list[int] = []
    try:
        plateaus = _plateaus(scheduler, deadline)
        sequences += sum(plateaus)
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
    return {"rounds": rounds, "plateaus": plateaus, "sequences": sequences,
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
        new = max(1, min(4 + (5 * i + 3 * index) % 29, scheduler.max_new_tokens,
                         scheduler.max_length - prompt))
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


PLATEAU_STEPS = 80
"""Steps each plateau of Note [Decode plateaus before ready] decodes its rows together
(two tier checks of 32 family hits, and the family's own promotion before them)."""


def plateau_counts(max_sequences: int, config) -> list[int]:
    """The row counts of Note [Decode plateaus before ready]: the powers of two up to the
    rows a step can run (`max_sequences`, and the waiting room that fills them)."""
    rows = max(1, min(max_sequences, config.max_waiting))
    return [1 << k for k in range(rows.bit_length()) if 1 << k <= rows]


def padded_rows(max_sequences: int, config) -> list[int]:
    """Note [Decode rows padded to a plateau]: for each count of running rows 0..
    `max_sequences`, the rows its pure decode step runs as (the next plateau count when
    at most `config.decode_pad_rows` more, else itself)."""
    counts = plateau_counts(max_sequences, config)
    table = []
    for rows in range(max_sequences + 1):
        above = [c for c in counts if c >= rows]
        table.append(above[0] if rows and above and
                     above[0] - rows <= config.decode_pad_rows else rows)
    return table


def _plateaus(scheduler, deadline: float) -> list[int]:
    """Note [Decode plateaus before ready]: for each power of two up to the step's rows,
    that many one-token prompts decoding together; the row counts held."""
    new = max(1, min(PLATEAU_STEPS, scheduler.max_new_tokens, scheduler.max_length - 1))
    held = []
    for count in plateau_counts(scheduler.max_sequences, scheduler.config):
        if time.monotonic() >= deadline:
            break
        for i in range(count):
            scheduler.submit(GenerationRequest((3 + i % 5,), new, stop_token_ids=()),
                             _ignore)
        held.append(count)
        scheduler.wait_idle(max(0.0, deadline - time.monotonic()))
    return held


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
