"""Note [Exit with a compile running]: a process that ends while a background compile is
in flight exits normally (before, torch aborted it: status 134, "terminate called
without an active exception")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{repo!r}]
    import torch
    from tests.jit import _jit_helpers as H
    import dynvm
    import dynvm.jit.engine as engine

    real = engine.specialize

    def slow(*args, **kwargs):  # still inside torch when the script ends
        a = torch.randn(384, 384)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            a = torch.tanh(a @ a)
        return real(*args, **kwargs)

    engine.specialize = slow
    program = H.compiled("transformer")
    runtime = dynvm.Runtime(program, "cpu", jit=H.eager_config(sync=False))
    for batch in (1, 2, 3):
        runtime(torch.randn(batch, 16, 64))
    assert len(runtime.jit.queue._running) + len(runtime.jit.queue) > 0
    print("leaving with a compile in flight")
""")


def test_exit_with_a_compile_in_flight_is_clean():
    script = SCRIPT.format(repo=str(REPO))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaving with a compile in flight" in done.stdout
    assert "terminate called" not in done.stderr
