"""Test-wide setup: the shared helper modules (tests/vm/_programs.py with its cached demo
programs, tests/jit/_jit_helpers.py) are importable by name from every test folder."""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _folder in ("vm", "jit"):
    _path = str(_TESTS / _folder)
    if _path not in sys.path:
        sys.path.insert(0, _path)
