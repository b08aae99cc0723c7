"""The zoo's exports, made ahead in a second process while the suite runs other tests.

Note [Zoo exports ahead]
~~~~~~~~~~~~~~~~~~~~~~~~
A zoo test's time is mostly its model's export (torch.export and its decompositions:
5-20 s for a CNN with batch norms on this project's 2-core machines), pure Python on one
core, and the suite needs every zoo model's export, 40 of them. Most of what runs before
the zoo tests (Ray, redis, HTTP servers) waits on processes and sockets with a core
idle. So when a session selects zoo tests, tests/conftest.py starts this module as a
process of its own that exports the selected models in the order the tests will ask for
them (one torch thread) and saves each as a .dvm; `_zoo_harness.compiled` loads the
file when a test first asks for a model, waiting for it if it is not there yet.

The test still checks the program it would have made itself: the .dvm is what
`dynvm.compile -> save` writes, read back by `dynvm.load` as in `compile_entry`, and the
module the test compares with is built in the test's process from the same seeded
config (a different weight would fail the comparison, not pass it). If the export
failed in the second process, or the process is gone, the test exports in its own
process, so a failure shows its traceback where it belongs.

    python -m tests.zoo._zoo_exports FOLDER NAME...
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

WAIT_S = 900.0
"""How long a test waits for its model's export before exporting it itself (the
process exports in order; a model far down the list on a loaded host can take this)."""


class ExportsAhead:
    """The second process and the folder it writes to."""

    def __init__(self, folder: Path, names: list[str]) -> None:
        self.folder = folder
        self.names = names
        folder.mkdir(parents=True, exist_ok=True)
        self._log = (folder / "exports.log").open("wb")
        root = Path(__file__).resolve().parents[2]
        # Inherits passive OpenMP waits: Note [Passive OpenMP in tests].
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.zoo._zoo_exports", str(folder), *names],
            cwd=root, stdout=self._log, stderr=subprocess.STDOUT)

    def take(self, name: str):
        """(program, compile seconds) of `name` once its export is saved, or None if it
        failed there, the process is gone, or WAIT_S passed (the caller exports it)."""
        import dynvm

        if name not in self.names:
            return None
        done = self.folder / f"{name}.json"
        deadline = time.monotonic() + WAIT_S
        while not done.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        record = json.loads(done.read_text())
        if record.get("error"):
            return None
        return dynvm.load(self.folder / f"{name}.dvm"), record["compile_seconds"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_RUNNING: ExportsAhead | None = None


def start(folder: Path, names: list[str]) -> None:
    """Start exporting `names` ahead into `folder` (Note [Zoo exports ahead])."""
    global _RUNNING
    _RUNNING = ExportsAhead(folder, names)


def running() -> ExportsAhead | None:
    return _RUNNING


def stop() -> None:
    global _RUNNING
    if _RUNNING is not None:
        _RUNNING.stop()
        _RUNNING = None


def _export_all(folder: Path, names: list[str]) -> None:
    import torch

    from tests.zoo._zoo import by_name
    from tests.zoo._zoo_harness import compile_entry

    torch.set_num_threads(1)  # the suite's own tests keep the other core
    for name in names:
        try:
            compiled = compile_entry(by_name(name), folder)
            record = {"compile_seconds": compiled.compile_seconds}
        except Exception as error:  # the test exports it again and shows the traceback
            record = {"error": f"{type(error).__name__}: {error}"}
        scratch = folder / f"{name}.json.part"
        scratch.write_text(json.dumps(record))
        os.replace(scratch, folder / f"{name}.json")  # the .dvm is complete before this
        print(f"{name}: {record}", flush=True)


if __name__ == "__main__":
    _export_all(Path(sys.argv[1]), sys.argv[2:])
