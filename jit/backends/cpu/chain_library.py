"""The chain library (native/onednn_chain.c, with own_1x1.c and winograd.c: the
`_onednn_chain` extension) bound once to the libdnnl loaded: its loops' functions, the
steps of our own it exports, and the oneDNN functions the loops call as pointers
(Note [A chain of primitives in one call] in onednn_chain.py)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu import own_1x1, winograd
from dynvm.jit.backends.cpu.native_linear import find_extension

_LIBRARY_STEM = "_onednn_chain"


def _find_library() -> Path | None:
    return find_extension(_LIBRARY_STEM)


class ChainLibrary:
    """The chain library's function, called holding the GIL (ctypes.PyDLL), with the
    oneDNN functions it calls as pointers into the libdnnl `library` loaded."""

    def __init__(self, path: Path, library: api.Library) -> None:
        dll = ctypes.PyDLL(str(path))
        self.run = dll.dynvm_onednn_chain_run
        p, pp, i = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int
        self.run.argtypes = [p, p, p, p, i, pp, pp, i, pp, ctypes.POINTER(i), pp,
                             ctypes.c_longlong, ctypes.POINTER(i)]
        self.run.restype = i
        # each step by its own function (Note [A 1x1 convolution of our own at a few
        # rows]); None in a library built before it, whose chains run oneDNN's alone
        self.run_steps = getattr(dll, "dynvm_onednn_chain_run_steps", None)
        if self.run_steps is not None:
            self.run_steps.argtypes = [pp, *self.run.argtypes[1:]]
            self.run_steps.restype = i
        self.own = own_1x1.kernel(dll, library) if self.run_steps is not None else None
        # Note [Winograd F(2x2, 3x3) for the 3x3s]: None in a library built before it
        self.winograd = winograd.kernel(dll, library) if self.run_steps is not None \
            else None
        dll = library.dll
        wait = dll.dnnl_stream_wait      # declared here: onednn_api does not list it
        wait.argtypes, wait.restype = [p], i
        self.functions = [ctypes.cast(f, p) for f in (
            dll.dnnl_primitive_execute, dll.dnnl_memory_set_data_handle, wait)]
        self.stream = library.stream
        # the GIL let go between two primitives at most twice a switch interval
        self.yield_after_ns = int(sys.getswitchinterval() * 1e9 / 2)


def native(library: api.Library | None,
           path: Path | None = None) -> tuple[ChainLibrary | None, str]:
    """The chain library bound to `library`, or None and why not (`path` overrides
    where it is looked for: tests point it at a missing file)."""
    if library is None:
        return None, api.unavailable_reason()
    found = path if path is not None else _find_library()
    if found is None or not found.exists():
        return None, (f"{_LIBRARY_STEM} was not built (setup.py compiles it at install; "
                      "reinstall dynvm with a C compiler present)")
    try:
        return ChainLibrary(found, library), ""
    except (OSError, AttributeError) as exc:
        return None, f"{found.name} did not load: {exc}"
