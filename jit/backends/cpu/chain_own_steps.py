"""What a chain's steps of dynvm's own share (own_1x1.py, winograd.py): their functions
in the chain library, and the cold copies a calibration question cycles through.

A step of our own is a C function with dnnl_primitive_execute's signature (the chain's
loops call it as they call a primitive), exported by the chain library as
`dynvm_<name>_execute`, beside `dynvm_<name>_supported` (1 where this CPU runs it).
Its question against oneDNN's primitive is asked with the weight cycled over copies
(Note [The own 1x1 question asked with cold weights] in own_1x1.py): `ColdCopies` makes
oneDNN's side, a memory object and an argument array per copy of the primitive's weight,
and the source / destination arguments the own side is called with.
"""

from __future__ import annotations

import ctypes

from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.onednn_objects import destroy
from dynvm.jit.backends.cpu.onednn_objects import memory as new_memory


class StepKernel:
    """The chain library's `dynvm_<name>_execute` (`execute`: its address, for the
    chain's plan; `call`: through ctypes, for a calibration run) and oneDNN's
    dnnl_memory_get_data_handle, which the step reads its pointers with."""

    NAME = ""

    def __init__(self, dll: ctypes.CDLL, library: api.Library) -> None:
        function = getattr(dll, f"dynvm_{self.NAME}_execute")
        self.execute = ctypes.cast(function, ctypes.c_void_p)
        self.call = function
        self.call.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_void_p]
        self.call.restype = ctypes.c_int
        self.get_handle = ctypes.cast(library.dll.dnnl_memory_get_data_handle, ctypes.c_void_p)
        supported = getattr(dll, f"dynvm_{self.NAME}_supported")
        supported.restype = ctypes.c_int
        self.supported = bool(supported())

    @classmethod
    def bound(cls, dll: ctypes.CDLL, library: api.Library):
        """The step's functions in `dll`, or None (a library that predates them, or a
        CPU the step does not run on)."""
        try:
            found = cls(dll, library)
        except AttributeError:
            return None
        return found if found.supported else None


class ColdCopies:
    """oneDNN's side of a cold question: `n` copies of `primitive`'s weight, each with a
    memory object and an argument array naming it in place of the primitive's weight
    (`onednn_args`); `own_args`, the primitive's source and destination alone, for the
    own side's call. A subclass adds the own side's copies (`own_handles`), keeping
    what they point into alive in `_arrays`, `_memories` and its own lists."""

    def __init__(self, library: api.Library, primitive, n: int) -> None:
        self._lib = library.dll
        self._memories: list = []
        self._arrays: list = []        # the argument arrays the pointers point into
        weights = primitive.weights
        arguments = primitive.arguments()
        self._tensors = [weights.tensor.clone() for _ in range(n)]
        self.onednn_args = []
        for tensor in self._tensors:
            memory = new_memory(library, weights.md, tensor.data_ptr())
            self._memories.append(memory)
            array = (api.ExecArg * len(arguments))(*[
                api.ExecArg(a, memory if a == api.ARG_WEIGHTS else m) for a, m in arguments])
            self._arrays.append(array)
            self.onednn_args.append(ctypes.cast(array, ctypes.c_void_p))
        source_dst = [(a, m) for a, m in arguments if a in (api.ARG_SRC, api.ARG_DST)]
        own_array = (api.ExecArg * 2)(*[api.ExecArg(a, m) for a, m in source_dst])
        self._arrays.append(own_array)
        self.own_args = ctypes.cast(own_array, ctypes.c_void_p)
        self.own_handles: list = []

    def __del__(self) -> None:
        destroy(getattr(self, "_lib", None),
                [("dnnl_memory_destroy", m) for m in getattr(self, "_memories", ())])
