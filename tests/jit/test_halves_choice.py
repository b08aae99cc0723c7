"""The choice between halves and the team (Note [Halves chosen in rounds] in
jit/backends/cpu/halves_choice.py): rounds of timings taken in turn, only the round's
timings deciding, a margin for the halves, the team's verdict retaken sooner, and two
starved halves calls in a row holding the team."""

from __future__ import annotations

from dynvm.jit.backends.cpu import halves_choice
from dynvm.jit.backends.cpu.halves_choice import FIRST, HOLD, MARGIN, RECENT, RETRY, RoundChoice


def _calls(choice: RoundChoice, n: int, halves_s: float, team_s: float) -> list[bool]:
    picks = []
    for _ in range(n):
        halves = choice.next()
        picks.append(halves)
        choice.record(halves, halves_s if halves else team_s)
    return picks


def test_a_round_in_turn_decides_until_the_next_round():
    choice = RoundChoice()
    assert _calls(choice, 2 * FIRST, 1.0, 2.0) == [True, False] * FIRST and choice.halves
    assert all(_calls(choice, RECENT - 1, 3.0, 2.0))     # the load changed: no round yet
    picks = _calls(choice, 2 * FIRST + 4, 3.0, 2.0)       # the round, then its verdict
    assert picks == [True, False] * FIRST + [False] * 4 and not choice.halves
    # the team's verdict is retaken within RETRY calls: the halves are back
    picks = _calls(choice, RETRY + 2 * FIRST, 1.0, 2.0)
    assert not any(picks[:RETRY - 5]) and choice.halves
    assert picks.count(True) >= FIRST
    assert all(_calls(choice, 8, 1.0, 2.0))


def test_only_the_rounds_timings_count_so_a_slow_burst_passes():
    # the halves 2% faster; a slow stretch of the host over one round's halves timings
    # is forgotten at the next round
    choice = RoundChoice()
    slow = set(range(2 * FIRST, 2 * FIRST + 2 * FIRST))
    for call in range(400):
        use = choice.next()
        factor = 1.5 if call in slow and use else 1.0
        choice.record(use, factor * (0.98 if use else 1.0))
    assert choice.halves
    assert choice.runs[False] <= (400 // RECENT + 2) * FIRST + RETRY


def test_halves_within_the_margin_are_kept():
    choice = RoundChoice()
    _calls(choice, 2 * FIRST, 1.0 + MARGIN / 2, 1.0)
    assert choice.halves
    choice = RoundChoice()
    _calls(choice, 2 * FIRST, 1.0 + 2 * MARGIN, 1.0)
    assert not choice.halves


def test_two_starved_halves_calls_in_a_row_hold_the_team():
    choice = RoundChoice()
    _calls(choice, 2 * FIRST, 1.0, 2.0)
    assert choice.next() and choice.halves
    choice.record(True, 1.0, starved=True)          # once: a blip, the halves go on
    assert choice.next()
    choice.record(True, 1.0, starved=True)
    assert not any(choice.next() for _ in range(HOLD))
    assert choice.next() and choice.starved == 2
    assert halves_choice.HOLD == HOLD


def test_calls_beside_a_compile_worker_are_no_timings_and_the_retry_is_a_parameter():
    choice = RoundChoice(retry=4)
    for _ in range(4 * FIRST):                       # the worker had the other core
        choice.record(choice.next(), None)
    assert sum(choice.runs.values()) == 4 * FIRST and choice._samples == {True: [], False: []}
    picks = _calls(choice, 2 * FIRST, 3.0, 1.0)      # the round goes on, then decides
    assert picks == [True, False] * FIRST and not choice.halves
    assert not any(_calls(choice, 3, 3.0, 1.0)) and choice.next()   # retaken after 4
