"""OpenMP's wait policy for the benchmarks that time torch beside ONNX Runtime and
OpenVINO (bench/full_width.py, `dynvm bench zoo`). Imports nothing heavy: it must run
before torch loads.

Note [OpenMP wait policy]
~~~~~~~~~~~~~~~~~~~~~~~~~
torch's CPU build runs its intra-op threads on GNU OpenMP, whose idle workers spin
(OMP_WAIT_POLICY unset: active waiting for a while) between parallel regions, while the
ONNX peers run with spinning off (Note [ONNX peers] in bench.peers). On a shared 2-core
host the spinning workers of eager, the interpreter and the JIT compete with the very
thread that has work: ResNet-50 at batch 1 took 6.8 s a call in eager under load at the
default policy and 195 ms with OMP_WAIT_POLICY=PASSIVE, which made every x-eager ratio
measure the spinning, not the kernels. libgomp reads the variable once, when it loads
(with torch), so the benchmark's process sets it by starting itself again with it
(`reexec_passive`, before torch is imported) when it is not set; a value the user set is
kept. In-process callers (the tests call main() and run()) are never restarted: their
reports state the policy they ran under (`wait_policy`).
"""

from __future__ import annotations

import os
import sys

VARIABLE = "OMP_WAIT_POLICY"


def wait_policy() -> str:
    """The policy this process's OpenMP runs under, as the reports state it."""
    value = os.environ.get(VARIABLE)
    return f"{VARIABLE}={value}" if value else f"{VARIABLE} unset (OpenMP's default: spin)"


def reexec_passive(command: list[str]) -> None:
    """Start `command` (this process's own command line, [executable, ...]) again in its
    place with OMP_WAIT_POLICY=PASSIVE, unless the variable is set (Note [OpenMP wait
    policy]). Returns only when nothing was done."""
    if os.environ.get(VARIABLE):
        return
    env = dict(os.environ, **{VARIABLE: "PASSIVE"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)


def reexec_cli_passive() -> None:
    """reexec_passive for `dynvm bench zoo` when this process is that command line (the
    dynvm console script or `python -m dynvm`); an in-process call (tests) is left as
    it is."""
    argv = sys.argv
    script = os.path.basename(argv[0])
    if argv[1:3] == ["bench", "zoo"] and (script in ("dynvm", "dynvm.exe")
                                          or argv[0].endswith(os.path.join("dynvm",
                                                                           "__main__.py"))):
        reexec_passive([sys.executable, "-m", "dynvm", *argv[1:]])
