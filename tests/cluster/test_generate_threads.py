"""A generator replica leaves no thread of its own running: closing a scheduler, a
generator or a whole replica joins the threads it started (the scheduler's, the compile
workers and their watchdog), and at interpreter exit a scheduler that was never closed
is stopped before the interpreter finalizes (Note [Scheduler threads end before exit]
in dynvm.cluster.serving._generate_exit)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import dynvm
from dynvm.cluster.serving._generate_replica import GeneratorServer
from dynvm.cluster.serving._generate_scheduler import (
    GenerateScheduler,
    GenerationRequest,
    SchedulerConfig,
)
from dynvm.cluster.serving._generate_warm import warm_scheduler
from dynvm.cluster.serving.serving_config import ServingConfig
from dynvm.jit.config import JitConfig
from tests.cluster._generate_helpers import saved_generator, tiny_programs

REPO = Path(__file__).resolve().parents[2]

# Process-wide, stopped at exit by its own hook (Note [Collapser stopped at exit]).
SHARED = {"dynvm-huge-pages"}


def _ours(before: set) -> list[str]:
    """dynvm threads alive now that were not alive at `before` (a set of threads)."""
    return sorted(t.name for t in threading.enumerate()
                  if t not in before and t.name.startswith("dynvm-")
                  and t.name not in SHARED and t.is_alive())


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return saved_generator(tmp_path_factory.mktemp("generator") / "tiny")


def test_closing_a_scheduler_and_its_generator_joins_their_threads():
    """A warm-up that compiled (compile workers and their watchdog running), sequences
    still decoding at close: `close()` says the scheduler's thread ended, and after the
    generator's close no thread they started is alive."""
    before = set(threading.enumerate())
    generator = dynvm.Generator(tiny_programs(), compile_ahead=False)
    scheduler = GenerateScheduler(generator, SchedulerConfig(max_sequences=4))
    try:
        warm = warm_scheduler(scheduler, 3.0)
        assert warm["rounds"] >= 1, warm
        started = _ours(before)
        assert "dynvm-generate" in started and "dynvm-compile" in started, started
        for i in range(4):
            scheduler.submit(GenerationRequest((5 + i, 6, 7), 60, stop_token_ids=()),
                             lambda event: None)
    finally:
        assert scheduler.close() is True
        generator.close()
    assert _ours(before) == []


def test_closing_a_replica_leaves_none_of_its_threads(bundle):
    """A replica with the JIT and its warm-up, closed: its scheduler's and compile
    threads are all gone."""
    before = set(threading.enumerate())
    server = GeneratorServer("tiny", str(bundle),
                             ServingConfig(device="cpu", jit=JitConfig(compile_timeout_s=60)),
                             SchedulerConfig(max_sequences=4, warm_seconds=2.0),
                             metrics_to_ray=False)
    try:
        assert server.warm["rounds"] >= 1, server.warm
        assert "dynvm-generate" in _ours(before)
    finally:
        server.close()
    assert _ours(before) == []


EXITING = textwrap.dedent("""
    import atexit, os, sys, threading
    def last():   # registered first: atexit runs it after every other hook
        alive = sorted(t.name for t in threading.enumerate()
                       if t.name in ("dynvm-generate", "dynvm-compile",
                                     "dynvm-compile-watch") and t.is_alive())
        print("alive at exit:", alive, flush=True)
    atexit.register(last)
    import dynvm
    from dynvm._serve_generate_bundle import load_generator
    from dynvm.cluster.serving._generate_scheduler import (
        GenerateScheduler, GenerationRequest, SchedulerConfig)
    generator = dynvm.Generator(load_generator(sys.argv[1]).programs,
                                compile_ahead=False)
    scheduler = GenerateScheduler(generator, SchedulerConfig(max_sequences=4))
    ended = threading.Event()
    for i in range(4):
        scheduler.submit(GenerationRequest((5 + i, 6, 7), 56, stop_token_ids=()),
                         lambda event: event[0] == "token" or ended.set())
    while scheduler.counters["tokens"] < 8:
        threading.Event().wait(0.01)
    print("exiting with", scheduler.occupancy()["running"], "running", flush=True)
""")


def test_a_scheduler_never_closed_is_stopped_before_the_interpreter_finalizes(bundle):
    """A process that exits while its scheduler decodes (never closed): by the last atexit
    hook the scheduler's thread has ended, and the process exits cleanly."""
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", EXITING,
                           str(bundle)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("exiting with") and not line.startswith("exiting with 0")
               for line in lines), done.stdout
    assert "alive at exit: []" in lines, done.stdout
