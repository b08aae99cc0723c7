"""The suite's groups for its two pytest-xdist workers (Note [Two workers]): a plugin that
tests/conftest.py loads; without xdist's `--dist loadgroup` the marks change nothing.

Note [Two workers]
~~~~~~~~~~~~~~~~~~
scripts/test runs the suite in two worker processes (pytest-xdist, `-n 2 --dist
loadgroup`). A serial run on a 2-core host kept one core idle most of the time: 978 s
of wall for 805 s of CPU (the rehearsal of 2026-12-06, nothing else running), much of
it waiting on Ray, `dynvm serve`, redis-server and fresh Pythons starting. Two workers
let one run those waits while the other runs the CPU-bound tests.

What must not run side by side is grouped, and a group runs whole, in its order, on one
worker:

* `stack`: every test of tests/cluster and tests/reliability. They start local Ray
  clusters, Serve, `dynvm serve` processes and redis-servers, and a driver joins one Ray
  cluster at a time; `ray.init()` without an address joins the newest cluster a `ray
  start` made on the host (test_multinode's), so two such tests at once could meet in
  one cluster. In one group they run one after another as in a serial run, the shared
  Ray + Serve's order and end included (Note [Shared Serve in tests]).
  The modules there that start none of these (in-process HTTP servers, redis-servers
  on free ports, child Pythons that start no Ray) are in WITHOUT_RAY and run as any
  other module; a new module is in `stack` until it is listed there.
* `zoo`: the tests that export the zoo's models (tests/zoo/test_zoo.py,
  tests/jit/test_abstract_zoo.py) share each export in one process
  (`_zoo_harness.compiled`); split over two workers, each would export the models again.
  Under xdist the exports-ahead process (Note [Zoo exports ahead]) is not started: each
  worker would start its own and export all 40 models twice; the other worker is what
  it gave the suite.
* `generation`: tests/generation's modules share each tiny model's export
  (`tests.generation._tiny.tiny_generator`, once per process).
* every other module is a group of its own, so that its module-scoped fixtures are made
  once, not once per worker.
"""

from __future__ import annotations

import contextlib
import os

import pytest

STACK_DIRECTORIES = ("tests/cluster/", "tests/reliability/")
WITHOUT_RAY = frozenset(f"tests/{name}.py" for name in (
    "cluster/test_batcher", "cluster/test_cluster_signed", "cluster/test_cluster_store_contract",
    "cluster/test_cluster_store_local", "cluster/test_cluster_store_redis",
    "cluster/test_counters", "cluster/test_deploy_network", "cluster/test_fleet_announce",
    "cluster/test_fleet_gpu", "cluster/test_fleet_link_announcements",
    "cluster/test_fleet_sharing", "cluster/test_fleet_tracing", "cluster/test_fleet_triton",
    "cluster/test_generate_delivery", "cluster/test_generate_events",
    "cluster/test_generate_http", "cluster/test_generate_padding",
    "cluster/test_generate_scheduler", "cluster/test_generate_slice",
    "cluster/test_generate_threads", "cluster/test_input_check", "cluster/test_kernel_keeper",
    "cluster/test_local_stack", "cluster/test_orphan_watch", "cluster/test_precompile",
    "cluster/test_replica_exec", "cluster/test_replica_tracing", "cluster/test_store_gc",
    "cluster/test_v2_protocol", "reliability/test_compile_faults",
    "reliability/test_concurrency", "reliability/test_decode_bombs",
    "reliability/test_hostile_store", "reliability/test_parser_fuzz",
    "reliability/test_runaway", "reliability/test_secrets_hidden", "reliability/test_soak",
    "reliability/test_store_entries", "reliability/test_store_secret"))
"""The modules of STACK_DIRECTORIES that start no Ray, Serve nor `dynvm serve`."""
ZOO_EXPORTERS = ("tests/zoo/test_zoo.py", "tests/jit/test_abstract_zoo.py")
"""The test files whose tests are parametrized by a zoo entry's name and export it."""


def under_xdist() -> bool:
    """Whether this process is a pytest-xdist worker."""
    return "PYTEST_XDIST_WORKER" in os.environ


def group_of(module: str) -> str:
    """The xdist group of the tests in `module` (a path relative to the root)."""
    if module.startswith(STACK_DIRECTORIES) and module not in WITHOUT_RAY:
        return "stack"
    if module in ZOO_EXPORTERS:
        return "zoo"
    if module.startswith("tests/generation/"):
        return "generation"
    return module


def without_group(nodeid: str) -> str:
    """A node id as given on a command line: without the `@group` that xdist appends."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid


@pytest.hookimpl(tryfirst=True)  # before xdist appends each group's name to node ids
def pytest_collection_modifyitems(session, config, items):
    """Mark every test with its group (Note [Two workers]), in an xdist worker only (the
    marks mean nothing elsewhere)."""
    if not under_xdist():
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item.nodeid.split("::")[0])))


# Note [Stack worker first]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# The `stack` group is the run's longest (Ray, Serve and `dynvm serve` starts, one after
# another) and mostly waits on processes that need a core in bursts: the other worker's
# CPU-bound tests (torch on both cores) slowed those starts two to three times in a run
# beside them (04:25-04:44 UTC, load 7-13 with other benchmarks). So a worker runs its
# `stack` tests at the priority it was started with, and every other test at a nice
# level NICE_OTHERS higher (all of its threads: Linux keeps a nice value per thread, and
# torch's OpenMP workers exist by then); what they start inherits it. NICE_OTHERS is past
# 15, the nice value Ray gives its worker processes (Serve's replicas, the compile
# service): at +10 the CPU-bound tests still outweighed a starting replica three to one.
# On an idle host the CPU-bound tests still take every cycle the stack leaves; only the
# order of who waits changes. Without the right to lower a nice value again (not root),
# the worker stays at the raised one: only the stack's priority is lost, not a test.
NICE_OTHERS = 19


def _renice(value: int) -> None:
    """Every thread of this process to nice `value`."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):  # a thread gone, or no right
            os.setpriority(os.PRIO_PROCESS, int(task), value)


_NICE: dict[str, int] = {}
"""The worker's own nice value ("base") and the one its threads were last set to."""


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start anything
def pytest_runtest_setup(item):
    """In an xdist worker: the stack's tests at the worker's own priority, the others'
    lower (Note [Stack worker first])."""
    if not under_xdist() or not hasattr(os, "setpriority"):
        return
    base = _NICE.setdefault("base", os.getpriority(os.PRIO_PROCESS, 0))
    stack = group_of(item.nodeid.split("::")[0]) == "stack"
    wanted = base if stack else base + NICE_OTHERS
    if _NICE.get("now") != wanted:
        _renice(wanted)
        _NICE["now"] = wanted
