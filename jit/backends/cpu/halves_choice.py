"""Halves or the team: the choice an exact kernel's calls make between running its
linears as column pieces with dynvm's helper thread and running them on torch's OpenMP
team (Note [Column halves with a helper thread] in column_halves), and the one a chain's
arena makes between its pieces and its team chain (Note [A chain in halves, one wake a
call] in chain_halves).

Note [Halves chosen in rounds]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The first chooser kept each way's last seven timings and ran the other way one call in
sixteen. Timings taken while the kernel was seasoned, when the runtime's own compile
worker had the second core and the helper (at SCHED_IDLE) was starved, then stayed in
the window for a hundred calls and more: the way running got new timings, the other one
only every sixteenth call. In one process (the held-out encoder, batch 1 x seq 32, three
JIT runtimes built and seasoned one after another, then interleaved with eager, ONNX
Runtime and OpenVINO; 2-core AMD EPYC Zen 5, 2026-12-06 21:38 UTC, load 1.0-2.0) the
runtime seasoned last had run 97 of its 119 calls on the team, its halves' window
holding 1.99-4.41 ms timings against the team's 2.35-2.66, while in the timed loop its
halves took 1.41-1.59 ms; a runtime beside it held the team through a 30-round run at
1.54x the others' time. The chain's chooser had learnt the same lesson (Note [fp32
batch 4 in pieces and the chooser's held verdict] in chain_halves).

So the choice is taken in rounds: from the first call, and again every `RECENT` calls
while the halves run (`RETRY` while the team does), the two ways are timed in turn,
call by call, until each has `FIRST` timings, and only that round's timings decide
(a call run while a compile worker's task ran is no timing: the worker had the core):
the halves unless their median is over the team's by more than `MARGIN` (three timings
a way at load ~2 flip a 3% difference; the halves, where they lose, lose by more).
Two halves calls in a row whose helper ran under a quarter of the pieces (starved: its
core busy elsewhere) send the next `HOLD` calls to the team whatever the timings say (a
single one is a passing blip, Note [Column halves with a helper thread]); a round keeps
each way's latest `FIRST` timings, so the team's, taken while starved halves held it,
do not outlast that load.
"""

from __future__ import annotations

import statistics

FIRST = 3
"""Timings a way needs in a round before the round decides."""
RECENT = 48
"""Calls between two rounds while the halves run."""
RETRY = 16
"""Calls between two rounds while the team runs: a verdict for the team is retaken
sooner, as one taken beside a busy core should not outlive the load."""
HOLD = 16
"""Calls sent to the team after two starved halves calls in a row."""
MARGIN = 0.03
"""How much slower than the team a round's halves may time and still run."""


class RoundChoice:
    """Halves (True) or the team (False) for the next call of one kernel, by rounds of
    its calls' timings taken in turn (Note [Halves chosen in rounds]); `retry`: the
    calls between rounds after a verdict for the team."""

    def __init__(self, retry: int = RETRY) -> None:
        self._retry = retry
        self._samples: dict[bool, list[float]] = {True: [], False: []}
        self._asking = True        # a round of timings in turn is under way
        self._next_round = 0       # the call at which the next round starts
        self._calls = 0
        self._team_until = 0
        self._in_a_row = 0
        self.halves = True
        self.runs = {True: 0, False: 0}
        self.starved = 0

    def next(self) -> bool:
        self._calls += 1
        if self._calls <= self._team_until:
            return False
        if not self._asking and self._calls >= self._next_round:
            self._asking, self._samples = True, {True: [], False: []}
        if self._asking:             # the way with fewer timings: in turn
            return len(self._samples[True]) <= len(self._samples[False])
        return self.halves

    def record(self, halves: bool, seconds: float | None, starved: bool = False) -> None:
        """One call's way and time (None: run while a compile worker's task ran, which
        had the other core: not a timing, and its round goes on)."""
        self.runs[halves] += 1
        if halves:
            self._in_a_row = self._in_a_row + 1 if starved else 0
            self.starved += starved
            if self._in_a_row >= 2:
                self._team_until = self._calls + HOLD
        if not self._asking or seconds is None:
            return
        # a way's latest FIRST timings: the team's, piling up while starved halves
        # calls hold it, would otherwise reach back past the load that starved them
        self._samples[halves] = [*self._samples[halves][1 - FIRST:], seconds]
        mine, team = self._samples[True], self._samples[False]
        if len(mine) >= FIRST and len(team) >= FIRST:
            self.halves = statistics.median(mine) <= statistics.median(team) * (1 + MARGIN)
            self._asking = False
            self._next_round = self._calls + (RECENT if self.halves else self._retry)
