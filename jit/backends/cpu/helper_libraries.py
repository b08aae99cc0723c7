"""The C libraries that start a helper thread of dynvm's own (column_halves.c,
chain_halves.c): each is loaded and bound to oneDNN's library and the process's OpenMP
runtime once per process, by whichever kernel asks first, since its helper thread and
the state it shares with the callers live in the library (one helper per library)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.native_linear import find_extension
from dynvm.jit.backends.cpu.one_thread import openmp_runtime

_BOUND: dict[Path, object] = {}
_LOCK = threading.Lock()


def bound_once(stem: str, bind: Callable[[Path, api.Library, object], object],
               library: api.Library | None, path: Path | None = None
               ) -> tuple[object | None, str]:
    """`bind(path, library, omp)` for the C library `stem` built beside the backend (or
    at `path`: tests point it at a missing file), made once per process and path and
    shared; or None and why not (no libdnnl, not built, no OpenMP runtime loaded, or
    it did not load)."""
    if library is None:
        return None, api.unavailable_reason()
    found = path if path is not None else find_extension(stem)
    if found is None or not found.exists():
        return None, (f"{stem} was not built (setup.py compiles it at install; "
                      "reinstall dynvm with a C compiler present)")
    with _LOCK:
        if found not in _BOUND:
            omp = openmp_runtime()
            if omp is None:
                return None, "no OpenMP runtime loaded"
            try:
                _BOUND[found] = bind(found, library, omp)
            except (OSError, AttributeError, api.OnednnError) as exc:
                return None, f"{found.name}: {exc}"
        return _BOUND[found], ""


def helper_stream(library: api.Library) -> ctypes.c_void_p:
    """A oneDNN stream of the helper thread's own, alive with the process (the caller's
    is `library.stream`)."""
    stream = ctypes.c_void_p()
    api.check(library.dll.dnnl_stream_create(ctypes.byref(stream), library.engine,
                                             api.STREAM_DEFAULT), "helper stream")
    return stream
