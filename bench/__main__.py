"""`python -m bench`: the side-by-side suite, same options as `dynvm bench`
(dynvm/_bench_cmd.py); the run itself is bench/suite.py."""

from __future__ import annotations

import argparse
import sys

from bench.suite import BenchUsageError, run
from dynvm._bench_cmd import DESCRIPTION, add_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except BenchUsageError as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
