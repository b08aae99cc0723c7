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
# Ray runs its worker processes (Serve's replicas, the compile service, every actor and
# task) at nice 15, below the pytest process that started them. In a serial run nothing
# else competes, but beside the other xdist worker's CPU-bound tests (torch on both
# cores) a replica's start and its requests waited for every idle moment: the `stack`
# group's process starts took two to four times their serial times in a run beside them
# (04:25-04:44 UTC, load 7-13 with other sessions' benchmarks). So in a worker the Ray
# clusters that tests start (ray.init, `ray start`, `dynvm serve`: they inherit the
# environment) run their workers at the nice value of the rest (RAY_worker_niceness=0,
# set unless the caller set it). Lowering the other worker's priority instead (+10, +19
# for its tests) lost it every contest with other sessions' processes on a shared host:
# 1,122 s for the whole run at load 5-10 (04:46-05:05 UTC).
RAY_WORKER_NICENESS = "RAY_worker_niceness"


def pytest_configure(config):
    """In an xdist worker: Ray's workers at the tests' own priority.

    Note [Stack worker first]."""
    if under_xdist():
        os.environ.setdefault(RAY_WORKER_NICENESS, "0")
