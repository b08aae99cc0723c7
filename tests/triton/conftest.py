"""Which Triton this test process gets (Note [Loading generated kernels] in
dynvm.jit.backends.triton._loading): the interpreter or the compiler, chosen once, before
triton is first imported. Pytest imports this conftest while collecting, before any test
runs, and no test module imports triton at import time, so the choice holds for the whole
session.

* No CUDA device: TRITON_INTERPRET=1, so generated kernels run on CPU tensors (the only
  way to run them here); ahead-of-time compiles are unaffected (a child process, the
  variable removed).
* A CUDA device: the variable is left alone, so Triton compiles and the gpu-marked tests
  launch real kernels; tests that need the interpreter carry the `interpreted` marker and
  are skipped, with the reason, unless the interpreter is on.
"""

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreted: runs generated kernels in Triton's "
                            "interpreter (TRITON_INTERPRET=1, set here without a GPU)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if item.get_closest_marker("interpreted") is not None:
        from dynvm.jit.backends.triton._loading import interpreter_ready

        if not interpreter_ready():
            pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before triton's "
                        "first import; left off on a machine with a GPU)")
