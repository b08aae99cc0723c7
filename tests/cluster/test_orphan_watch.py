"""The orphan watch (Note [Orphan watch]): real processes, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dynvm.cluster.serving import _orphan_watch
from tests.cluster._cluster_helpers import process_alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")

# A command that starts the watch, then a child that would outlive it (sleep in a
# session of its own, as Ray's agents end up), prints both pids and waits.
COMMAND = """
import os, subprocess, sys, time
from dynvm.cluster.serving import _orphan_watch
os.environ.update(_orphan_watch.new_marker())
watch = _orphan_watch.start(os.environ[_orphan_watch.RUN_MARKER])
child = subprocess.Popen(["sleep", "120"], start_new_session=True)
print(watch.pid, child.pid, flush=True)
time.sleep(120)
"""


def _wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if process_alive(p)]


def test_a_sigkilled_commands_children_are_killed_by_the_watch():
    command = subprocess.Popen([sys.executable, "-c", COMMAND], stdout=subprocess.PIPE,
                               text=True)
    watch = child = None
    try:
        watch, child = (int(p) for p in command.stdout.readline().split())
        time.sleep(1.5 * _orphan_watch.SNAPSHOT_S)  # the watch has listed the child
        assert process_alive(child)
        command.kill()
        command.wait(timeout=10)
        assert _wait_gone([child, watch], 10.0) == []
    finally:
        command.kill()
        for pid in (watch, child):
            if pid is not None and process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_reused_pid_is_left_alone():
    other = subprocess.Popen(["sleep", "60"])
    try:
        listed = _orphan_watch.tree(os.getpid())
        assert other.pid in listed
        # The same pid with another start time: not the process that was listed.
        assert _orphan_watch.kill_left("no-such-token", {other.pid: listed[other.pid] + 1}) \
            == 0
        assert other.poll() is None
        assert _orphan_watch.kill_left("no-such-token", {other.pid: listed[other.pid]}) == 1
        assert other.wait(timeout=5) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()


# A command whose child starts unmarked and unlisted (the environment cleared, as a Ray
# agent's is by its process title), then a forced stop's sweep, sparing the watch.
FORCED = """
import os, subprocess, sys, time
from dynvm.cluster.serving import _orphan_watch
os.environ.update(_orphan_watch.new_marker())
token = os.environ[_orphan_watch.RUN_MARKER]
watch = _orphan_watch.start(token)
child = subprocess.Popen(["sleep", "120"], env={}, start_new_session=True)
killed = _orphan_watch.kill_descendants_now(token, spare=frozenset({watch.pid}))
print(watch.pid, child.pid, killed, flush=True)
child.wait()
time.sleep(120)
"""


def test_a_forced_stop_sweeps_what_the_watch_has_not_listed_yet():
    command = subprocess.Popen([sys.executable, "-c", FORCED], stdout=subprocess.PIPE,
                               text=True)
    watch = child = None
    try:
        watch, child, killed = (int(p) for p in command.stdout.readline().split())
        # At once, before the watch's next list: the child went, the watch did not.
        assert killed == 1
        assert _wait_gone([child], 5.0) == []
        assert process_alive(watch)
    finally:
        command.kill()
        command.wait(timeout=10)
        for pid in (watch, child):
            if pid is not None and process_alive(pid):
                os.kill(pid, signal.SIGKILL)


# A process that starts a child after the watch's last list (as the raylet restarts an
# agent): the watch's list names only the parent.
_STARTS_LATER = """
import subprocess, time
child = subprocess.Popen(["sleep", "120"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_what_a_listed_process_started_after_the_list_is_killed_too():
    parent = subprocess.Popen([sys.executable, "-c", _STARTS_LATER], stdout=subprocess.PIPE,
                              text=True)
    child = None
    try:
        listed = {parent.pid: _orphan_watch._stat(parent.pid)[1]}
        child = int(parent.stdout.readline())
        assert child not in listed and process_alive(child)
        assert _orphan_watch.kill_left("no-such-run", listed) == 2
        assert _wait_gone([parent.pid, child], 10.0) == []
    finally:
        parent.kill()
        if child is not None and process_alive(child):
            os.kill(child, signal.SIGKILL)
