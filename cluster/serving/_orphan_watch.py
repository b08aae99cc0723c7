"""A watchdog that outlives `dynvm serve` by moments: when the command dies, however it
dies (SIGKILL included), it kills every process the command started, Ray's included.

Note [Orphan watch]
~~~~~~~~~~~~~~~~~~~
Ray starts its GCS and raylet with a parent-death signal, and its workers exit when
the raylet is gone; but after a SIGKILL of the driver, Ray's dashboard agent and
runtime-env agent first report the raylet's death to the GCS, which died with it, and
wait out a hard-coded 60 s RPC timeout (`publish_error_to_driver`, Ray 2.60):
measured, the last of them exited 61.7 s after the SIGKILL. So `dynvm serve` starts
this watchdog, in a session of its own, holding the read end of a pipe whose write end
only the command holds. While the command runs, the watchdog lists the command's
process tree every SNAPSHOT_S (pid and start time, from /proc); when the command exits,
the pipe reads EOF, and the watchdog SIGKILLs every process of its last list that is
still the same process (same start time: a reused pid is left alone), and every
process whose environment carries the run's token (RUN_MARKER, exported by the command
and inherited by what it starts: it finds a process started after the last list; Ray's
agents overwrite their environment with their process title, hence the list), then
exits. A graceful stop has already stopped everything: the watchdog finds nothing. A
forced stop (a second signal) sweeps the tree itself just before it exits
(kill_descendants_now), so what started since the watchdog's last list goes too.
Linux only (/proc); elsewhere `start` does nothing.

The list is at most SNAPSHOT_S old, and an agent Ray started within it (a restart
under load) is in no list and carries no marker: in the whole suite on a loaded 2-core
host (2026-12-06) Ray's two agents outlived a SIGKILL by 15 s, while the same test
alone passed four times in a row. So the watchdog lists twice a second (a /proc scan:
1.1 ms at 129 processes here), and on EOF it first adds what every listed process
still alive has started since (`with_descendants`): Ray's agents are the raylet's
children, and the raylet outlives the command by its parent-death signal's delivery.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys

RUN_MARKER = "DYNVM_SERVE_RUN"
SNAPSHOT_S = 0.5


def new_marker() -> dict[str, str]:
    """The variable that marks one run's processes: export it before starting any."""
    return {RUN_MARKER: secrets.token_hex(16)}


def marked(token: str, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Pids of the processes whose environment holds RUN_MARKER=token."""
    needle = f"{RUN_MARKER}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                variables = f.read()
        except OSError:  # gone, or another user's
            continue
        if needle in variables.split(b"\0"):
            found.append(int(entry))
    return found


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def _process_table() -> tuple[dict[int, list[int]], dict[int, int]]:
    """({parent pid: child pids}, {pid: start time}) of every process now."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry))
                started[int(entry)] = stat[1]
    return children, started


def _under(roots, children, started) -> dict[int, int]:
    found, todo = {}, list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = started[child]
            todo.append(child)
    return found


def tree(root: int) -> dict[int, int]:
    """{pid: start time} of every process under `root`."""
    return _under([root], *_process_table())


def with_descendants(listed: dict[int, int]) -> dict[int, int]:
    """`listed` and every process now under one of them that is still the same process
    (start time): what they started since they were listed (Note [Orphan watch])."""
    children, started = _process_table()
    alive = [pid for pid, start in listed.items() if started.get(pid) == start]
    return {**listed, **_under(alive, children, started)}


def kill_left(token: str, listed: dict[int, int]) -> int:
    """SIGKILL what is left of a run: the processes of `listed` that are still the same
    (start time), what they started since, and those marked with `token`, but this
    one; how many."""
    me = os.getpid()
    pids = {pid for pid, started in with_descendants(listed).items()
            if pid != me and (_stat(pid) or (0, None))[1] == started}
    pids.update(marked(token, exclude=frozenset({me})))
    return _kill_all(pids)


def kill_descendants_now(token: str, spare: frozenset[int] = frozenset()) -> int:
    """SIGKILL, from the command itself, every process under it and every process marked
    with `token`, but those in `spare` (the watchdog): a forced stop's last act. The
    watchdog's list is up to SNAPSHOT_S old, and a Ray agent started within it has
    already written its process title over its environment (no marker): listed now,
    it is caught (Note [Orphan watch])."""
    listed = {pid: started for pid, started in tree(os.getpid()).items()
              if pid not in spare}
    pids = set(listed) | (set(marked(token, exclude=frozenset({os.getpid()}))) - spare)
    return _kill_all(pids)


def _kill_all(pids: set[int]) -> int:
    """SIGKILL each of `pids` (one already gone is skipped); how many were asked."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
    return len(pids)


def start(token: str) -> subprocess.Popen | None:
    """Start the watchdog for the processes marked with `token`; keep the returned
    process referenced (its stdin is the pipe) until this process exits. None where
    there is no /proc."""
    if not sys.platform.startswith("linux"):
        return None
    # The file itself, not `-m dynvm.cluster.serving._orphan_watch`: importing the package would
    # load torch into a process that only waits (it imports the standard library only).
    return subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), token],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            start_new_session=True)


def main(argv: list[str]) -> int:
    """The watchdog: list the command's tree until EOF on stdin, then kill what is left
    of it (Note [Orphan watch])."""
    import select

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the command
    token, command = argv[1], os.getppid()
    listed: dict[int, int] = {}
    me = os.getpid()
    while True:
        readable, _, _ = select.select([sys.stdin.buffer], [], [], SNAPSHOT_S)
        if readable and not os.read(sys.stdin.buffer.fileno(), 4096):
            break
        listed = {pid: started for pid, started in tree(command).items() if pid != me}
    kill_left(token, listed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
