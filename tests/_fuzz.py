"""The property-based tests' settings: one fixed-seed profile for every run of the suite,
one of fresh seeds for a longer exploration started by hand.

Note [Fuzz profiles]
~~~~~~~~~~~~~~~~~~~~
A fuzzer that draws fresh examples on every run makes CI a lottery: a bug it can find
fails whichever change happens to land when the draw finds it (an invalid UTF-8 byte in
a request field failed three tests on one run in dozens). So the suite's Hypothesis runs
are derandomized ("ci", loaded by tests/conftest.py): the same examples every run, a
failure reproduced by running the test again. Fresh examples are still what finds new
bugs, so the "explore" profile draws them from a seed picked for the run and runs
EXPLORE_SCALE times as many examples per fuzzer:

    scripts/test --hypothesis-profile=explore tests/reliability tests/cluster/test_v2_protocol.py

The run's seed is printed in the session header and, under each failing test, the
command that replays the failure (`--hypothesis-seed=S` and the test's node id). A
failure that exploration finds becomes an explicit test case next to its fuzzer ("what
the fuzz found"), so the fixed-seed suite keeps checking it.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

CI = "ci"
EXPLORE = "explore"
EXPLORE_SCALE = 10
"""How many times more examples each fuzzer runs under the explore profile."""

settings.register_profile(CI, derandomize=True, database=None, print_blob=True)
settings.register_profile(EXPLORE, derandomize=False, database=None, print_blob=True)


def fuzz_settings(examples: int, **overrides) -> settings:
    """Settings of a fuzzer that runs `examples` examples in the suite (EXPLORE_SCALE
    times as many under the explore profile), without deadlines: a slow draw on a loaded
    host is not a failure. Called at import, after the profile is loaded."""
    scale = EXPLORE_SCALE if settings.get_current_profile_name() == EXPLORE else 1
    options = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow],
               **overrides}
    return settings(max_examples=examples * scale, **options)
