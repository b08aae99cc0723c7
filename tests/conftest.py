"""What every test shares: the Hypothesis profiles (Note [Fuzz profiles] in
tests/_fuzz.py), loaded before any test module builds its settings, the run's seed in the
session header and a replay command under each failing property-based test; and the zoo's
exports, started in a second process once the session's tests are known (Note [Zoo
exports ahead] in tests/zoo/_zoo_exports.py); the shared Serve's order and end below."""

from __future__ import annotations

import os

# Note [Passive OpenMP in tests]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's OpenMP workers spin between parallel regions by default. The suite runs several
# torch processes at once on a 2-core host (the zoo's exports ahead, Ray's replicas and
# compile service, `dynvm serve` children), and spinning workers of one starve the
# others: `test_bench_zoo_times_a_peer_beside_the_jit` took 82 s in the whole suite
# beside the zoo's export process and 11 s alone. Passive waits (the same finding as
# Note [OpenMP wait policy] in bench/_omp.py) make the suite's time its work's. Set
# here, before anything loads torch (libgomp reads it once), and inherited by every
# process the tests start; a value set by the caller is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import secrets  # noqa: E402
import shlex
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

from tests import _fuzz, _parallel
from tests.cluster import _shared_serve

# Loaded here, at the first conftest's import, so that test modules' settings inherit
# it; Hypothesis's own plugin loads a profile named on the command line after this.
settings.load_profile(_fuzz.CI)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Under the explore profile without a seed, pick one for the run, so that it can be
    printed and a failure replayed (Hypothesis reads the option after this hook); load
    the xdist groups' plugin."""
    if (config.getoption("--hypothesis-profile") == _fuzz.EXPLORE
            and config.getoption("--hypothesis-seed") is None):
        config.option.hypothesis_seed = str(secrets.randbelow(2**32))
    config.pluginmanager.register(_parallel, "tests._parallel")
    config.addinivalue_line("markers", f"{_shared_serve.MARK}: uses the local Ray + Serve "
                            "shared by such tests (Note [Shared Serve in tests])")


def _replay_options(config) -> list[str]:
    options = []
    profile = config.getoption("--hypothesis-profile")
    if profile:
        options.append(f"--hypothesis-profile={profile}")
    seed = config.getoption("--hypothesis-seed")
    if seed is not None:
        options.append(f"--hypothesis-seed={seed}")
    return options


def pytest_report_header(config):
    """The profile and seed of this run's property-based tests."""
    profile = config.getoption("--hypothesis-profile") or _fuzz.CI
    seed = config.getoption("--hypothesis-seed")
    return f"fuzz: hypothesis profile {profile!r}, " + (
        f"seed {seed}" if seed is not None else "fixed examples (derandomized)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing property-based test prints the command that runs it again with the same
    examples."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
        command = ["scripts/test", *_replay_options(item.config),
                   _parallel.without_group(item.nodeid)]
        report.sections.append(("replay", shlex.join(command)))


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(session, config, items):
    """Run the tests marked `shared_serve` one after another (Note [Shared Serve in
    tests]); start exporting the selected zoo models ahead, in the order the tests need
    them (Note [Zoo exports ahead]); not for a session that selects one model or none,
    nor in an xdist worker (Note [Two workers])."""
    _shared_serve.run_together(items)
    names: list[str] = []
    for item in items:
        name = getattr(getattr(item, "callspec", None), "params", {}).get("name")
        if name is not None and item.nodeid.split("::")[0] in _parallel.ZOO_EXPORTERS \
                and name not in names:
            names.append(name)
    if len(names) > 1 and not _parallel.under_xdist():
        from tests.zoo import _zoo_exports

        _zoo_exports.start(Path(tempfile.mkdtemp(prefix="dynvm-zoo-exports-")), names)


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """torch's thread count as the test found it: the bench's mains, run in-process by
    tests, set it for their run and leave it, and a later test in the same worker then
    ran at one thread (tests/jit/test_cpu_chain_halves.py's pieces ran the team's chain
    and failed two rehearsals). Nothing to do where torch is not loaded yet."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's own teardown (its module's fixtures' too): shut the shared Ray +
    Serve down unless the next test uses it (Note [Shared Serve in tests])."""
    yield
    _shared_serve.close_unless_needed(nextitem)


def pytest_sessionfinish(session, exitstatus):
    """Stop the zoo's export process if it is still running, and the shared Ray +
    Serve."""
    _shared_serve.close()
    if "tests.zoo._zoo_exports" in sys.modules:
        sys.modules["tests.zoo._zoo_exports"].stop()
