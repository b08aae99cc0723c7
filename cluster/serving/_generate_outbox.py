"""A scheduler step's events for sequences read on event loops, handed to each loop in
one call after the step.

Note [One hop per step]
~~~~~~~~~~~~~~~~~~~~~~~
A served sequence's events are read on the replica's event loop. Handed over one by one
(`call_soon_threadsafe` per token), a step of 8 rows woke the loop up to 8 times, each
hop a write to the loop's self-pipe and a turn of the loop, on a 2-core host where the
loop, the model's thread and the HTTP writes share the cores and the GIL. A sequence
submitted with its loop has its events gathered for the whole step instead and handed
to that loop in one call after the step (`Outbox.flush`): a step's tokens reach the loop
together, as they were chosen together. Where the loop has closed (its client is
gone), the call fails and the step's sequences on it are cancelled, as a failing sink
cancels its sequence.
"""

from __future__ import annotations


class Outbox:
    """Events gathered during a step, by the loop of their sequence (Note [One hop per
    step]); used on the scheduler's thread only."""

    def __init__(self) -> None:
        self._by_loop: dict = {}

    def add(self, seq, event: tuple) -> None:
        """`event` for `seq` (whose `loop` is set), handed over at the next flush."""
        self._by_loop.setdefault(seq.loop, []).append((seq, event))

    def flush(self) -> None:
        """Hand each loop its events in one `call_soon_threadsafe`; a loop that has
        closed (nobody reads these any more) cancels their sequences."""
        if not self._by_loop:
            return
        by_loop, self._by_loop = self._by_loop, {}
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, events)
            except Exception:
                for seq, _ in events:
                    seq.cancelled = True


def deliver(events: list) -> None:
    """On a sequence's loop: a step's events, each to its sink (a failing sink cancels
    its sequence, as on the scheduler's thread)."""
    for seq, event in events:
        try:
            seq.sink(event)
        except Exception:
            seq.cancelled = True
