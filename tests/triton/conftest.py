"""Triton's interpreter runs generated kernels on CPU tensors here; it must be switched on
before triton is first imported (Note [Loading generated kernels] in
dynvm.jit.backends.triton._loading). Pytest imports this conftest while collecting, before
any test runs, and no test module imports triton at import time, so this holds for the
whole session. Ahead-of-time compiles are unaffected: they run in a child process with the
variable removed.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
