"""Progress bars for long CLI work (tqdm): always on stderr, and only when stderr is a
terminal, so that pipes, files and tests see nothing of them.

    with call_bar(total=105) as bar:            # dynvm run: one tick a call
        ...; bar.update()
    with stage_bar("compile transformer", ["build model", "export + lower"]) as stage:
        stage("build model"); ...               # a long step: the elapsed time ticks
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from tqdm import tqdm

# A stage may be one long call (torch.export) that never updates the bar; the bar is
# redrawn this often so its elapsed time keeps moving.
_TICK_SECONDS = 0.5


def enabled(stream=None) -> bool:
    """Whether progress bars go to `stream` (default stderr): only to a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def call_bar(total: int, desc: str = "calls", stream=None, off: bool = False) -> tqdm:
    """A bar of `total` calls (a context manager); disabled when asked (`off`) or when
    `stream` (default stderr) is not a terminal. It vanishes when done: the report
    follows it."""
    stream = sys.stderr if stream is None else stream
    return tqdm(total=total, desc=desc, unit="call", file=stream, leave=False,
                disable=off or not enabled(stream), dynamic_ncols=True)


@contextlib.contextmanager
def stage_bar(desc: str, stages: Sequence[str], stream=None) -> Iterator[Callable[[str], None]]:
    """Yields `stage(name)`: finish the current stage and show `name` as running. The
    bar ticks on its own while a stage runs; it vanishes when the block ends."""
    stream = sys.stderr if stream is None else stream
    bar = tqdm(total=len(stages), desc=desc, unit="stage", file=stream, leave=False,
               disable=not enabled(stream), dynamic_ncols=True,
               bar_format="{desc} [{elapsed}]")
    numbers = iter(range(1, len(stages) + 1))

    def stage(name: str) -> None:
        bar.set_description_str(f"{desc}: {name} ({next(numbers, len(stages))}/{len(stages)})")

    stop = threading.Event()
    ticker = None
    if not bar.disable:
        ticker = threading.Thread(target=_tick, args=(bar, stop), daemon=True,
                                  name="dynvm-progress")
        ticker.start()
    try:
        yield stage
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        bar.close()


def _tick(bar: tqdm, stop: threading.Event) -> None:
    while not stop.wait(_TICK_SECONDS):
        bar.refresh()
