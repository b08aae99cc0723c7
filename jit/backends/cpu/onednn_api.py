"""oneDNN's C API through ctypes: the library of the optional `onednn` extra, its
functions' signatures and the enum values dynvm uses (Note [oneDNN primitives built
once] in onednn_conv says why dynvm calls oneDNN itself).

The values below are oneDNN 3.x's ABI (dnnl_types.h / dnnl_common_types.h of v3.2, the
version the extra pins); `load()` refuses another major version. Nothing here runs a
primitive: onednn_conv builds and runs them.

Note [oneDNN's reference implementation refused]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Where none of oneDNN's optimized implementations takes a primitive, its descriptor still
succeeds, on a reference one (`ref:any`, `ref:...`): plain C loops, hundreds of times
slower than torch's kernels. Which primitives fall there depends on the CPU: on a 2-core
AMD EPYC (Zen 5: AVX-512 with BF16 and VNNI, no AMX; 2026-12-06) oneDNN 3.2 takes a bf16
matmul with a sum post-op at runtime rows (a BERT layer's residual add in a family
kernel) only on `ref:any`, where the hosts with AMX had a brgemm. BERT-base width in
bf16 then took 6-54 s a call instead of 5-100 ms, and the probation's shadow samples of
those kernels ran for minutes. So matmul and convolution primitives ask
`implementation()`, which raises ReferenceOnly for a reference one: the caller keeps
torch's op for it, as for any primitive oneDNN refuses. Pooling keeps what oneDNN
offers: its dilated geometries are `ref:any` on every CPU, and a pooling is one pass over
its input, not a GEMM's hundreds.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import sys
from pathlib import Path

from dynvm.vm.errors import DynvmError

DISTRIBUTION = "onednn-cpu-gomp"
"""The wheel of the `onednn` extra: libdnnl.so.3 built on GNU OpenMP."""
_SONAME = "libdnnl.so.3"

# dnnl_status_t, dnnl_data_type_t, dnnl_format_tag_t
SUCCESS = 0
BF16, F32, S32, S8, U8 = 2, 3, 4, 5, 6
TAG_ANY, TAG_A, TAG_AB, TAG_ABC, TAG_OIHW, TAG_BA, TAG_ACB, TAG_NHWC = 1, 2, 3, 4, 5, 14, 15, 22
TAG_NCHW = TAG_OIHW        # dnnl_abcd under both names
# dnnl_engine_kind_t, dnnl_stream_flags_t, dnnl_prop_kind_t, dnnl_alg_kind_t
ENGINE_CPU = 1
STREAM_DEFAULT = 1
FORWARD_INFERENCE = 96
CONVOLUTION_DIRECT = 1
POOLING_MAX, POOLING_AVG_INCLUDE_PADDING, POOLING_AVG_EXCLUDE_PADDING = 0x1FF, 0x2FF, 0x3FF
BINARY_ADD, BINARY_MUL = 0x1FFF0, 0x1FFF1
# dnnl_fpmath_mode_t, dnnl_scratchpad_mode_t
FPMATH_STRICT, FPMATH_BF16 = 0, 1
SCRATCHPAD_LIBRARY, SCRATCHPAD_USER = 0, 1
ELTWISE = {"relu": 32, "tanh": 33, "logistic": 41, "gelu_tanh": 43, "swish": 44,
           "clip": 46, "gelu_erf": 49}
# dnnl_query_t
QUERY_IMPL_INFO_STR = 8
QUERY_SRC_MD, QUERY_WEIGHTS_MD, QUERY_DST_MD, QUERY_SCRATCHPAD_MD = 129, 131, 133, 136
# DNNL_ARG_*
ARG_SRC, ARG_SRC_1, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 2, 17, 33, 41
ARG_WORKSPACE, ARG_SCRATCHPAD = 64, 80
_ARG_POST_OP_BASE = 32768


def arg_post_op(index: int, arg: int) -> int:
    """DNNL_ARG_ATTR_MULTIPLE_POST_OP(index) | arg: an operand of post-op `index` (the
    second source of a binary post-op is `arg_post_op(i, ARG_SRC_1)`)."""
    return _ARG_POST_OP_BASE * (index + 1) | arg


RUNTIME_OMP = 2            # dnnl_version_t.cpu_runtime of a GNU/LLVM OpenMP build
MAX_NDIMS = 12

Dims = ctypes.c_int64 * MAX_NDIMS
_p = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)


class ExecArg(ctypes.Structure):
    """dnnl_exec_arg_t: an argument index and its memory object."""

    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


_SIGNATURES = {
    "dnnl_version": ([], ctypes.POINTER(_Version)),
    "dnnl_set_verbose": ([ctypes.c_int], ctypes.c_int),
    "dnnl_engine_create": ([_pp, ctypes.c_int, ctypes.c_size_t], ctypes.c_int),
    "dnnl_stream_create": ([_pp, _p, ctypes.c_uint], ctypes.c_int),
    "dnnl_memory_desc_create_with_tag": ([_pp, ctypes.c_int, Dims, ctypes.c_int,
                                          ctypes.c_int], ctypes.c_int),
    "dnnl_memory_desc_create_with_strides": ([_pp, ctypes.c_int, Dims, ctypes.c_int, Dims],
                                             ctypes.c_int),
    "dnnl_memory_desc_reshape": ([_pp, _p, ctypes.c_int, Dims], ctypes.c_int),
    "dnnl_memory_desc_destroy": ([_p], ctypes.c_int),
    "dnnl_memory_desc_get_size": ([_p], ctypes.c_size_t),
    "dnnl_memory_desc_equal": ([_p, _p], ctypes.c_int),
    "dnnl_primitive_attr_create": ([_pp], ctypes.c_int),
    "dnnl_primitive_attr_destroy": ([_p], ctypes.c_int),
    "dnnl_primitive_attr_set_post_ops": ([_p, _p], ctypes.c_int),
    "dnnl_primitive_attr_set_fpmath_mode": ([_p, ctypes.c_int], ctypes.c_int),
    "dnnl_primitive_attr_set_scratchpad_mode": ([_p, ctypes.c_int], ctypes.c_int),
    "dnnl_post_ops_create": ([_pp], ctypes.c_int),
    "dnnl_post_ops_destroy": ([_p], ctypes.c_int),
    "dnnl_post_ops_append_sum": ([_p, ctypes.c_float, ctypes.c_int32, ctypes.c_int],
                                 ctypes.c_int),
    "dnnl_post_ops_append_eltwise": ([_p, ctypes.c_int, ctypes.c_float, ctypes.c_float],
                                     ctypes.c_int),
    "dnnl_post_ops_append_binary": ([_p, ctypes.c_int, _p], ctypes.c_int),
    "dnnl_matmul_primitive_desc_create": ([_pp, _p, _p, _p, _p, _p, _p], ctypes.c_int),
    "dnnl_inner_product_forward_primitive_desc_create": ([_pp, _p, ctypes.c_int, _p, _p, _p,
                                                          _p, _p], ctypes.c_int),
    "dnnl_pooling_forward_primitive_desc_create": (
        [_pp, _p, ctypes.c_int, ctypes.c_int, _p, _p, Dims, Dims, Dims, Dims, Dims, _p],
        ctypes.c_int),
    "dnnl_convolution_forward_primitive_desc_create": (
        [_pp, _p, ctypes.c_int, ctypes.c_int, _p, _p, _p, _p, Dims, Dims, Dims, Dims, _p],
        ctypes.c_int),
    "dnnl_reorder_primitive_desc_create": ([_pp, _p, _p, _p, _p, _p], ctypes.c_int),
    "dnnl_primitive_desc_query": ([_p, ctypes.c_int, ctypes.c_int, _p], ctypes.c_int),
    "dnnl_primitive_desc_query_md": ([_p, ctypes.c_int, ctypes.c_int], _p),
    "dnnl_primitive_desc_destroy": ([_p], ctypes.c_int),
    "dnnl_primitive_create": ([_pp, _p], ctypes.c_int),
    "dnnl_primitive_destroy": ([_p], ctypes.c_int),
    "dnnl_memory_create": ([_pp, _p, _p, _p], ctypes.c_int),
    "dnnl_memory_destroy": ([_p], ctypes.c_int),
    "dnnl_memory_set_data_handle": ([_p, _p], ctypes.c_int),
    "dnnl_memory_get_memory_desc": ([_p, _pp], ctypes.c_int),
    "dnnl_primitive_execute": ([_p, _p, ctypes.c_int, _p], ctypes.c_int),
}


class OnednnError(DynvmError, RuntimeError):
    """A oneDNN call returned a status other than success."""


class ReferenceOnly(OnednnError):
    """oneDNN offers only its reference implementation for a primitive (Note [oneDNN's
    reference implementation refused])."""


def check(status: int, what: str) -> None:
    """Raise OnednnError unless `status` is dnnl_success."""
    if status != SUCCESS:
        raise OnednnError(f"oneDNN {what} failed (dnnl_status_t {status})")


def implementation(lib, pd, what: str) -> str:
    """The implementation oneDNN chose for the primitive descriptor `pd` ("brg:avx512_core",
    "gemm:jit:bf16", ...); ReferenceOnly where it is one of its reference ones (Note
    [oneDNN's reference implementation refused])."""
    impl = ctypes.c_char_p()
    lib.dnnl_primitive_desc_query(pd, QUERY_IMPL_INFO_STR, 0, ctypes.byref(impl))
    name = (impl.value or b"?").decode()
    if name.startswith("ref"):
        raise ReferenceOnly(f"oneDNN offers only {name} for this {what} on this CPU")
    return name


# A primitive's per-call functions, called holding the GIL (Note [oneDNN primitives
# built once]: as torch's oneDNN calls do).
_HOLDING_THE_GIL = ("dnnl_memory_set_data_handle", "dnnl_primitive_execute")


class Library:
    """The loaded library with its signatures set, one CPU engine and one stream; `dll`
    releases the GIL in each call (ctypes.CDLL), `calls` holds it (ctypes.PyDLL, the
    per-call functions only)."""

    def __init__(self, cdll: ctypes.CDLL, path: Path, version: str) -> None:
        self.dll = cdll
        self.calls = ctypes.PyDLL(str(path))    # the same loaded library
        self.path = path
        self.version = version
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(cdll, name)
            fn.argtypes, fn.restype = argtypes, restype
            if name in _HOLDING_THE_GIL:
                held = getattr(self.calls, name)
                held.argtypes, held.restype = argtypes, restype
        self.engine, self.stream = ctypes.c_void_p(), ctypes.c_void_p()
        check(cdll.dnnl_engine_create(ctypes.byref(self.engine), ENGINE_CPU, 0), "engine")
        check(cdll.dnnl_stream_create(ctypes.byref(self.stream), self.engine,
                                      STREAM_DEFAULT), "stream")


def _candidates() -> list[Path]:
    """Where the extra's wheel puts libdnnl (its data files land in <prefix>/lib)."""
    found = []
    try:
        for file in importlib.metadata.distribution(DISTRIBUTION).files or ():
            if file.name == _SONAME:
                found.append(Path(file.locate()).resolve())
    except importlib.metadata.PackageNotFoundError:
        pass
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        found.append(Path(prefix) / "lib" / _SONAME)
    return [p for p in dict.fromkeys(found) if p.exists()]


def installed() -> bool:
    """Whether the extra's distribution is installed (then it must load: a test fails
    where it is installed and the path is off)."""
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _openmp_runtimes() -> set[str]:
    """The GNU OpenMP libraries mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            return {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:
        return set()


@functools.cache
def _load() -> tuple[Library | None, str]:
    import torch  # noqa: F401  (torch's libgomp.so.1 first: libdnnl then shares it)

    paths = _candidates()
    if not paths:
        return None, (f"{_SONAME} not found: install dynvm's `onednn` extra "
                      f"({DISTRIBUTION})")
    before = _openmp_runtimes()
    try:
        cdll = ctypes.CDLL(str(paths[0]))
    except OSError as exc:
        return None, f"{paths[0]} did not load: {exc}"
    version = cdll.dnnl_version
    version.restype = ctypes.POINTER(_Version)
    v = version().contents
    text = f"{v.major}.{v.minor}.{v.patch}"
    if v.major != 3 or v.cpu_runtime != RUNTIME_OMP:
        return None, (f"{paths[0]} is oneDNN {text} with CPU runtime {v.cpu_runtime}; "
                      "dynvm calls oneDNN 3.x built on OpenMP")
    brought = _openmp_runtimes() - before
    if brought:
        # Note [oneDNN primitives built once]: one OpenMP team, torch's (a torch on
        # another OpenMP, or a libgomp of another soname, would leave two teams)
        return None, (f"{paths[0].name} brought an OpenMP runtime of its own "
                      f"({sorted(brought)}); its threads would compete with torch's")
    try:
        return Library(cdll, paths[0], text), ""
    except OnednnError as exc:
        return None, str(exc)


def library() -> Library | None:
    """The loaded library, or None where it does not load (`unavailable_reason()`)."""
    return _load()[0]


def unavailable_reason() -> str:
    """Why `library()` is None ("" when it loaded)."""
    return _load()[1]
